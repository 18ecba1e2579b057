"""Real-ESRGAN's compact net with a choice of the upsampled copy its output is added to.

Imported lazily (it imports spandrel) by :mod:`rapiddiff.models.upscaler`.

``SRVGGNetCompact`` adds a *nearest*-upsampled copy of the input to the output of its conv stack,
so the stack learns the residual over nearest-neighbour. On data where bicubic is already strong
(kshapes: flat colours, anti-aliased edges) a short training run spends its budget relearning what
bicubic gives; ``base="bicubic"`` makes the stack learn the residual over bicubic instead.

The weights are spandrel's ``Compact`` ones, key for key; only the forward's base differs, and
``base="nearest"`` computes exactly what spandrel's class computes (published Real-ESRGAN compact
files were trained with it). The base is recorded in the safetensors metadata (``"base"``); a file
without it is nearest-based.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from spandrel.architectures.Compact import Compact

from rapiddiff.models.upscaler_names import COMPACT_BASES


class CompactNet(Compact):
    """spandrel's ``Compact`` (same weights, same key names) whose skip is ``base``-upsampled."""

    def __init__(
        self,
        *,
        num_in_ch: int = 3,
        num_out_ch: int = 3,
        num_feat: int = 64,
        num_conv: int = 16,
        upscale: int = 4,
        base: str = "nearest",
    ) -> None:
        if base not in COMPACT_BASES:
            raise ValueError(
                f"base={base!r}: the compact upscaler's base is one of {', '.join(COMPACT_BASES)}"
            )
        super().__init__(
            num_in_ch=num_in_ch, num_out_ch=num_out_ch, num_feat=num_feat, num_conv=num_conv, upscale=upscale
        )
        self.base = base
        self.scale = upscale  # spandrel's class calls it ``upscale``; rapiddiff code reads ``scale``

    def upsample(self, x: torch.Tensor) -> torch.Tensor:
        """The copy of ``x`` the residual is added to (unclamped: bicubic may overshoot [0, 1])."""
        if self.base == "nearest":
            return F.interpolate(x, scale_factor=self.upscale, mode="nearest")
        return F.interpolate(x, scale_factor=self.upscale, mode="bicubic", align_corners=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x
        for layer in self.body:
            out = layer(out)
        return self.upsampler(out) + self.upsample(x)

    def extra_repr(self) -> str:
        return f"base={self.base}"
