"""Inpainting gives back the pixels outside the mask as they were: a half-image mask once moved the
kept half 28/255 (the VAE's round trip of a flat colour), with or without upscaling."""

from __future__ import annotations

import numpy as np
from PIL import Image


def test_the_kept_half_comes_back_unchanged(tiny_pipe, tmp_path):
    side = tiny_pipe.default_size
    init = np.zeros((side, side, 3), np.uint8)
    init[:, : side // 2] = (170, 200, 235)  # the kept half: light blue
    init[:, side // 2 :] = (232, 220, 188)
    mask = np.zeros((side, side), np.uint8)
    mask[:, side // 2 :] = 255  # repaint the right half
    Image.fromarray(init).save(tmp_path / "init.png")
    Image.fromarray(mask).save(tmp_path / "mask.png")
    out = tiny_pipe(
        "一个番茄", init_image=tmp_path / "init.png", mask_image=tmp_path / "mask.png",
        num_inference_steps=3, seed=1, progress=False,
    )  # fmt: skip
    drawn = np.asarray(out.images[0]).astype(int)
    assert np.abs(drawn[:, : side // 2] - init[:, : side // 2]).max() <= 1
    assert np.abs(drawn[:, side // 2 :] - init[:, side // 2 :]).mean() > 5  # the masked half is repainted
