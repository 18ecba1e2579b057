"""The upscaler's names that both the loader and the compact net need (no spandrel import here)."""

from __future__ import annotations

# What build_upscaler / the training config accept.
ARCHITECTURES = ("rrdb", "compact")
# The compact net's upsampled copy of its input, the residual is added to.
COMPACT_BASES = ("nearest", "bicubic")
