"""Training transforms: resize + crop to the model's size, optional flip, scale to [-1, 1].

The same steps as diffusers' ``train_text_to_image.py`` (torchvision ``Resize`` — bicubic,
antialiased — then ``CenterCrop``/``RandomCrop``, ``ToTensor``, ``Normalize(0.5, 0.5)``), written
as one small callable on the PIL image: torchvision's composed modules cost ~1 ms of per-call
overhead and three passes over the pixels per image, the bulk of a 128² item's loading time
(measured: benchmarks/data_loader_throughput.py). The arithmetic is the same; a test checks it
against torchvision. Horizontal flips are off by default: Chinese captions say 左 and 右, and a
flip would make them lie.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from PIL import Image


class ImageTransform:
    """PIL RGB image → FloatTensor [3, size, size] in [-1, 1] (picklable, for DataLoader workers)."""

    def __init__(
        self, size: int, *, crop: Literal["center", "random"] = "center", hflip: bool = False
    ) -> None:
        if crop not in ("center", "random"):
            raise ValueError(f"crop must be 'center' or 'random', got {crop!r}")
        if size < 1:
            raise ValueError(f"size must be positive, got {size}")
        self.size, self.crop, self.hflip = size, crop, hflip

    def resize(self, image: Image.Image) -> Image.Image:
        """Shorter side to ``size`` (torchvision's rule for the longer side: truncate)."""
        w, h = image.size
        short, long = (w, h) if w <= h else (h, w)
        if short == self.size:
            return image
        new_long = int(self.size * long / short)
        new = (self.size, new_long) if w <= h else (new_long, self.size)
        return image.resize(new, Image.Resampling.BICUBIC)

    def __call__(self, image: Image.Image) -> torch.Tensor:
        image = self.resize(image)
        w, h = image.size
        s = self.size
        if self.crop == "center":
            left, top = round((w - s) / 2.0), round((h - s) / 2.0)  # as torchvision CenterCrop
        else:  # torch's RNG, so DataLoader's per-worker seeding makes crops reproducible
            left = int(torch.randint(0, w - s + 1, (1,)))
            top = int(torch.randint(0, h - s + 1, (1,)))
        if (left, top, w, h) != (0, 0, s, s):
            image = image.crop((left, top, left + s, top + s))
        if self.hflip and float(torch.rand(1)) < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        pixels = np.asarray(image, dtype=np.float32).transpose(2, 0, 1)  # (3, H, W), a view
        out = np.empty(pixels.shape, dtype=np.float32)  # contiguous (3, H, W)
        np.multiply(pixels, 1.0 / 127.5, out=out)
        out -= 1.0
        return torch.from_numpy(out)


def build_image_transform(
    size: int, *, crop: Literal["center", "random"] = "center", hflip: bool = False
) -> ImageTransform:
    """PIL RGB image → FloatTensor [3, size, size] in [-1, 1]."""
    return ImageTransform(size, crop=crop, hflip=hflip)
