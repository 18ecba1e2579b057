"""Shared by the inference tests of the opt-in approximations (DeepCache, token merging)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np


def psnr(a: Any, b: Any) -> float:
    """PSNR in dB of two image arrays in [0, 1]; inf when they are equal."""
    mse = float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(1 / mse)


def task_inputs(folder: Path) -> dict[str, dict[str, Any]]:
    """The pipeline's keyword arguments per task (txt2img, img2img, inpaint), with a random 16² init
    image and a right-half mask written into ``folder``."""
    from PIL import Image

    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(folder / "init.png")
    mask = np.zeros((16, 16), np.uint8)
    mask[:, 8:] = 255
    Image.fromarray(mask, "L").save(folder / "mask.png")
    return {
        "txt2img": {},
        "img2img": {"init_image": folder / "init.png", "strength": 0.6},
        "inpaint": {"init_image": folder / "init.png", "mask_image": folder / "mask.png"},
    }
