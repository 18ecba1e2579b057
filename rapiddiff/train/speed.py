"""Training speed-ups for a diffusers U-Net, applied from outside the model (STYLE.md #3).

Every one is a switch in :class:`SpeedConfig`; with all off the U-Net is diffusers' eager model.
Fused QKV changes the parameters (one ``to_qkv`` Linear replaces ``to_q``/``to_k``/``to_v``
while training), so :func:`unfuse_for_saving` copies the trained fused weights back into the
original projections before anything is saved in diffusers' format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn


@dataclass(frozen=True)
class SpeedConfig:
    """How the U-Net runs while training (none of these change what it learns)."""

    gradient_checkpointing: bool = False
    """Recompute activations in backward: much less memory, ~30% slower."""
    channels_last: bool = False
    """NHWC memory format for the convolutions (faster on tensor cores)."""
    fuse_qkv: bool = False
    """One matmul for q, k, v (self-attention) and k, v (cross-attention) instead of three/two."""
    compile: bool = False
    """torch.compile the U-Net in place (nn.Module.compile: parameter names unchanged)."""
    attention: Literal["default", "sdpa", "math"] = "default"
    """Attention kernel: diffusers' default (SDPA on torch 2), SDPA explicitly, or plain math."""


def apply_speedups(unet: nn.Module, cfg: SpeedConfig) -> nn.Module:
    """Apply ``cfg`` to ``unet`` in place; returns it."""
    from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0

    if cfg.attention == "sdpa":
        unet.set_attn_processor(AttnProcessor2_0())
    elif cfg.attention == "math":
        unet.set_attn_processor(AttnProcessor())
    if cfg.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    if cfg.fuse_qkv:
        unet.fuse_qkv_projections()
        # The unfused projections stay as (unused) parameters; freeze them so the optimizer and
        # EMA carry no state for them. unfuse_for_saving writes the trained values back.
        for module in unet.modules():
            if isinstance(module, Attention) and getattr(module, "fused_projections", False):
                fused = ("to_k", "to_v") if module.is_cross_attention else ("to_q", "to_k", "to_v")
                for name in fused:
                    getattr(module, name).requires_grad_(False)
    if cfg.channels_last:
        unet.to(memory_format=torch.channels_last)
    if cfg.compile:
        unet.compile()
    return unet


@torch.no_grad()
def unfuse_for_saving(unet: nn.Module) -> None:
    """Copy fused ``to_qkv``/``to_kv`` weights back into ``to_q``/``to_k``/``to_v``, unfuse,
    and return to the contiguous memory format (safetensors needs contiguous tensors)."""
    from diffusers.models.attention_processor import Attention

    fused = False
    for module in unet.modules():
        if not isinstance(module, Attention) or not getattr(module, "fused_projections", False):
            continue
        fused = True
        if not module.is_cross_attention:
            parts, source = ("to_q", "to_k", "to_v"), module.to_qkv
        else:
            parts, source = ("to_k", "to_v"), module.to_kv
        sizes = [getattr(module, n).weight.shape[0] for n in parts]
        for name, weight in zip(parts, source.weight.split(sizes), strict=True):
            getattr(module, name).weight.copy_(weight)
            getattr(module, name).requires_grad_(True)
        if source.bias is not None:
            for name, bias in zip(parts, source.bias.split(sizes), strict=True):
                getattr(module, name).bias.copy_(bias)
        module.fused_projections = False
        for attr in ("to_qkv", "to_kv"):
            if hasattr(module, attr):
                delattr(module, attr)
    if fused:
        unet.unfuse_qkv_projections()
    unet.to(memory_format=torch.contiguous_format)
