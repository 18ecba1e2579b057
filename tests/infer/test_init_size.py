"""img2img / inpainting sizes: an init image of another size is sampled at the model's size (logged),
not at its own (a 512² photo into a 128² model sampled 2048² images of broken shapes); its own size
only when asked, and then it must fit the model."""

from __future__ import annotations

import logging

import pytest
from PIL import Image

GEN = {"num_inference_steps": 2, "seed": 1, "output_type": "np", "progress": False}


def _init(tmp_path, width: int, height: int):
    path = tmp_path / f"init-{width}x{height}.png"
    Image.new("RGB", (width, height), (170, 200, 235)).save(path)
    return path


def test_a_larger_init_image_is_resized_to_the_models_size(tiny_pipe, tmp_path, logs):
    side = tiny_pipe.default_size
    with logs.at_level(logging.INFO, logger="rapiddiff"):
        out = tiny_pipe("一个番茄", init_image=_init(tmp_path, 4 * side, 4 * side), **GEN)
    assert out.images.shape[1:3] == (side, side)
    assert (out.metadata[0]["height"], out.metadata[0]["width"]) == (side, side)
    assert f"init image {4 * side}x{4 * side} resized to {side}x{side}" in logs.text


def test_the_aspect_is_kept_with_the_longer_side_the_models(tiny_pipe, tmp_path):
    side, m = tiny_pipe.default_size, tiny_pipe.size_multiple
    out = tiny_pipe("一个番茄", init_image=_init(tmp_path, 4 * side, 2 * side), **GEN)
    assert out.images.shape[1:3] == (max(m, round(side / 2 / m) * m), side)  # (H, W)


def test_keep_samples_at_the_init_images_size_and_refuses_one_that_does_not_fit(tiny_pipe, tmp_path):
    m = tiny_pipe.size_multiple
    out = tiny_pipe("一个番茄", init_image=_init(tmp_path, 3 * m, 2 * m), init_size="keep", **GEN)
    assert out.images.shape[1:3] == (2 * m, 3 * m)
    with pytest.raises(
        ValueError, match=rf"init image {3 * m + 1}x{2 * m} kept at its size: .*multiples of {m}"
    ):
        tiny_pipe("一个番茄", init_image=_init(tmp_path, 3 * m + 1, 2 * m), init_size="keep", **GEN)


def test_cli_keep_init_size(tiny_model, tmp_path):
    from rapiddiff.cli import main
    from rapiddiff.infer.png import read_png_metadata
    from tests.infer.test_generate_cli import FAST

    m = 16
    init = _init(tmp_path, 3 * m, 2 * m)
    out = tmp_path / "out"
    args = ["generate", "x", "--model", str(tiny_model), "--init-image", str(init), "--out", str(out), *FAST]
    assert main([*args, "--keep-init-size"]) == 0
    meta = read_png_metadata(next(out.glob("*.png")))
    assert (meta["width"], meta["height"]) == (3 * m, 2 * m)
