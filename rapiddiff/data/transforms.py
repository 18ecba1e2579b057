"""Training transforms: resize + crop to the model's size, optional flip, scale to [-1, 1].

torchvision's transforms, arranged as diffusers' ``train_text_to_image.py`` does (Resize with
antialiasing, CenterCrop or RandomCrop, ToTensor, Normalize(0.5, 0.5)), except that horizontal
flips are off by default: Chinese captions say 左 and 右, and a flip would make them lie.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch


def build_image_transform(
    size: int, *, crop: Literal["center", "random"] = "center", hflip: bool = False
) -> Callable[[Any], torch.Tensor]:
    """PIL RGB image → FloatTensor [3, size, size] in [-1, 1]."""
    from torchvision import transforms

    if crop not in ("center", "random"):
        raise ValueError(f"crop must be 'center' or 'random', got {crop!r}")
    steps: list[Any] = [
        transforms.Resize(size, interpolation=transforms.InterpolationMode.BICUBIC, antialias=True),
        transforms.CenterCrop(size) if crop == "center" else transforms.RandomCrop(size),
    ]
    if hflip:
        steps.append(transforms.RandomHorizontalFlip())
    steps += [transforms.ToTensor(), transforms.Normalize([0.5], [0.5])]
    return transforms.Compose(steps)
