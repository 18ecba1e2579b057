"""AdamW and its learning-rate schedule, shared by every stage."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import pytorch_lightning as pl
import torch


@dataclass(frozen=True)
class OptimConfig:
    """AdamW and its learning-rate schedule."""

    lr: float = 1e-4
    """Peak learning rate (after warm-up)."""
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 1e-2
    eps: float = 1e-8
    schedule: Literal[
        "constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial"
    ] = "constant_with_warmup"
    """A diffusers.optimization.get_scheduler name; stepped every optimizer step."""
    warmup_steps: int = 500
    """Linear warm-up from 0 to ``lr`` over this many optimizer steps."""
    fused: bool | None = None
    """torch's fused AdamW kernel: one kernel per step instead of foreach passes over the tensors.
    None (default): fused when every trained parameter is on a CUDA GPU (faster at SD 1.5 size),
    else foreach; false: always foreach (fused rounds differently, ~1e-4 relative on a loss); true:
    fused, an error where torch has no fused kernel for a parameter."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"OptimConfig.lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"OptimConfig.warmup_steps must be >= 0, got {self.warmup_steps}")


def use_fused_adamw(params: Sequence[Any]) -> bool:
    """OptimConfig.fused's default: fused AdamW where every parameter is a floating CUDA tensor."""
    tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    return bool(tensors) and all(p.is_cuda and p.is_floating_point() for p in tensors)


def configure_adamw(module: pl.LightningModule, params: Sequence[Any], cfg: OptimConfig) -> dict[str, Any]:
    """``configure_optimizers``' return value: AdamW over ``params`` + a per-step LR schedule."""
    from diffusers.optimization import get_scheduler

    if not params:
        raise ValueError("nothing to train: every parameter is frozen (check the `train` setting)")
    optimizer = torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=cfg.betas,
        weight_decay=cfg.weight_decay,
        eps=cfg.eps,
        fused=use_fused_adamw(params) if cfg.fused is None else cfg.fused or None,
    )
    total = module.trainer.estimated_stepping_batches if module._trainer is not None else 1
    total = int(total) if math.isfinite(total) else 10**9
    scheduler = get_scheduler(
        cfg.schedule, optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=max(total, 1)
    )
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def psnr(prediction: torch.Tensor, target: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """Peak signal-to-noise ratio per image [N], in dB (images in [0, data_range])."""
    mse = ((prediction.float() - target.float()) ** 2).flatten(1).mean(1)
    return 10 * torch.log10(data_range**2 / mse.clamp_min(1e-12))
