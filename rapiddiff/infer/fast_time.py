"""The ResNet blocks' time-embedding projections as one matrix product: the ``batch_time_proj`` switch.

Every ``ResnetBlock2D`` of a Stable Diffusion U-Net projects the same time embedding with its own
``time_emb_proj`` (``linear(silu(emb))``): 22 matrix-vector products per SD 1.5 evaluation, each too
small to fill the GPU. Here the U-Net's ``time_embedding`` computes ``emb`` as before, then one
``linear(silu(emb), W, b)`` over every block's stacked weights; each block's ``time_emb_proj`` takes
its slice and skips its own SiLU (``skip_time_act``). Same arithmetic, one launch; done on the
modules (Inductor's ``batch_linear_lhs`` pass does not merge these), so every path sees it.

Only U-Nets whose time embedding feeds nothing but plain ResNet blocks are changed (SD 1.x/2.x and
the kshapes U-Net): no class or added embeddings, no activation after the embedding, plain
``nn.Linear`` projections (a LoRA-wrapped one would lose its side branch). Anything else is left as
it was, with the reason. The weights are copied at the swap: a LoRA on the time projections
must be merged before it (the project's own LoRA targets attention only).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class PackedTimeEmbedding(nn.Module):
    """``time_embedding`` followed by every ResNet block's projection of it, as one product.

    Returns ``(N, sum of the blocks' widths)``; each block's :class:`PackedTimeSlice` knows its columns.
    """

    def __init__(self, embedding: nn.Module, weight: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__()
        self.embedding = embedding
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False)

    def forward(self, sample: torch.Tensor, condition: torch.Tensor | None = None) -> torch.Tensor:
        emb = self.embedding(sample, condition)
        return F.linear(F.silu(emb), self.weight, self.bias)


class PackedTimeSlice(nn.Module):
    """A block's ``time_emb_proj`` after packing: its columns of :class:`PackedTimeEmbedding`'s output."""

    def __init__(self, offset: int, width: int) -> None:
        super().__init__()
        self.offset, self.width = offset, width

    def forward(self, packed: torch.Tensor) -> torch.Tensor:
        return packed[:, self.offset : self.offset + self.width]

    def extra_repr(self) -> str:
        return f"columns {self.offset}:{self.offset + self.width}"


def _projecting_blocks(unet: nn.Module) -> list[nn.Module]:
    """The modules of ``unet`` that project the time embedding, in module order."""
    return [m for m in unet.modules() if getattr(m, "time_emb_proj", None) is not None]


def _unsupported(unet: nn.Module, blocks: list[nn.Module]) -> str | None:
    """Why the time embedding of ``unet`` (projected by ``blocks``) cannot be packed, or None."""
    from diffusers.models.resnet import ResnetBlock2D

    config = getattr(unet, "config", {})
    for key in ("class_embed_type", "addition_embed_type", "time_embedding_act_fn"):
        if config.get(key) is not None:
            return f"the U-Net has {key}={config[key]!r}: its embedding is not only the time's"
    if is_packed(unet):
        return "already packed"
    if getattr(unet, "time_embed_act", None) is not None:
        return "the U-Net applies an activation after the time embedding"
    if not blocks:
        return "no block projects the time embedding"
    for block in blocks:
        if not isinstance(block, ResnetBlock2D):
            return f"{type(block).__name__} projects the time embedding (only ResnetBlock2D is packed)"
        if block.time_embedding_norm != "default" or block.skip_time_act:
            return "a ResNet block uses a time_embedding_norm other than 'default' or skips its activation"
        if not isinstance(block.nonlinearity, nn.SiLU):
            return f"a ResNet block's activation is {type(block.nonlinearity).__name__}, not SiLU"
        if type(block.time_emb_proj) is not nn.Linear or block.time_emb_proj.bias is None:
            return "a ResNet block's time projection is not a plain nn.Linear with a bias (LoRA-wrapped?)"
    return None


def batch_time_proj(unet: nn.Module) -> tuple[int, str | None]:
    """Pack the time-embedding projections of ``unet`` (in place); returns (blocks packed, reason
    it was not done or None). The packed U-Net gives the same outputs up to the GEMM's rounding."""
    blocks = _projecting_blocks(unet)
    why = _unsupported(unet, blocks)
    if why is not None:
        return 0, why
    weight = torch.cat([b.time_emb_proj.weight.detach() for b in blocks])
    bias = torch.cat([b.time_emb_proj.bias.detach() for b in blocks])
    offset = 0
    for block in blocks:
        width = block.time_emb_proj.out_features
        block.time_emb_proj = PackedTimeSlice(offset, width)
        block.skip_time_act = True  # the SiLU runs once, in PackedTimeEmbedding
        offset += width
    unet.time_embedding = PackedTimeEmbedding(unet.time_embedding, weight, bias)
    return len(blocks), None


def is_packed(unet: Any) -> bool:
    """Whether :func:`batch_time_proj` has packed ``unet``."""
    return isinstance(getattr(unet, "time_embedding", None), PackedTimeEmbedding)


__all__ = ["PackedTimeEmbedding", "PackedTimeSlice", "batch_time_proj", "is_packed"]
