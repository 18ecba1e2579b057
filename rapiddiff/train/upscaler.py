"""``rapiddiff train upscaler``: train an ESRGAN RRDB network on low/high-resolution image pairs.

L1 first (ESRGAN's PSNR-oriented stage); the PatchGAN term is optional (``gan.weight > 0``,
usually with ``gan.start_step`` after the L1 stage). The network is
:func:`rapiddiff.models.upscaler.build_rrdb` and is saved with ``save_upscaler``, so spandrel
(and every ESRGAN tool) loads it back. Validation reports PSNR against bicubic upscaling.

    rapiddiff train upscaler --config configs/upscaler/kshapes.yaml
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from rapiddiff.train.common import (
    OptimConfig,
    RapidCLI,
    RapidModule,
    configure_adamw,
    ensure_finite,
    psnr,
    run_cli,
)
from rapiddiff.train.data import PairedImageData
from rapiddiff.train.gan import GanConfig, PatchDiscriminator, adversarial_losses


@dataclass(frozen=True)
class RRDBConfig:
    """ESRGAN's RRDBNet size (23 blocks × 64 features is ESRGAN's and Real-ESRGAN x4plus')."""

    num_blocks: int = 6
    num_feat: int = 32
    scale: int = 4


_NET, _OPTIM, _GAN = RRDBConfig(), OptimConfig(lr=2e-4, warmup_steps=0, schedule="constant"), GanConfig()


class UpscalerTraining(RapidModule):
    """Super-resolution with an RRDB network.

    Args:
        network: RRDB size (used when ``pretrained`` is None).
        pretrained: an ESRGAN/Real-ESRGAN weights file (or an ``upscaler/`` folder) to fine-tune.
        gan: the PatchGAN term (weight 0 = L1 only).
        optim: AdamW and its learning-rate schedule.
        num_samples: validation pairs shown (bicubic | network | ground truth) in the grid.
        seed: seed (reseeded every batch).
    """

    def __init__(
        self,
        network: RRDBConfig = _NET,
        pretrained: str | None = None,
        gan: GanConfig = _GAN,
        optim: OptimConfig = _OPTIM,
        num_samples: int = 4,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        from rapiddiff.models.upscaler import build_rrdb, load_upscaler

        if pretrained is not None:
            self.net = load_upscaler(pretrained)
        else:
            self.net = build_rrdb(
                num_blocks=network.num_blocks, num_feat=network.num_feat, scale=network.scale
            )
        self.net.requires_grad_(True).train()
        self.scale = int(getattr(self.net, "scale", network.scale))
        self.gan_cfg, self.optim_cfg, self.num_samples, self.seed = gan, optim, num_samples, seed
        self.critic = PatchDiscriminator(3, gan.channels, gan.layers) if gan.weight > 0 else None
        self._grid: tuple[torch.Tensor, torch.Tensor] | None = None

    def configure_optimizers(self) -> dict[str, Any]:
        groups: list[dict[str, Any]] = [{"params": list(self.net.parameters())}]
        if self.critic is not None:
            groups.append(
                {"params": list(self.critic.parameters()), "lr": self.optim_cfg.lr * self.gan_cfg.lr_scale}
            )
        return configure_adamw(self, groups, self.optim_cfg)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        low, high = batch["lr"], batch["hr"]  # (B, 3, h, w), (B, 3, h·s, w·s) in [0, 1]
        upscaled = self.net(low)
        loss = F.l1_loss(upscaled.float(), high.float())
        if self.critic is not None and self.global_step >= self.gan_cfg.start_step:
            generator_term, critic_loss = adversarial_losses(self.critic, high.float(), upscaled.float())
            self.log("train/critic", critic_loss)
            loss = loss + self.gan_cfg.weight * generator_term + critic_loss
        ensure_finite(loss, self._trainer)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def bicubic(self, low: torch.Tensor) -> torch.Tensor:
        return F.interpolate(low, scale_factor=self.scale, mode="bicubic", align_corners=False).clamp(0, 1)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        low, high = batch["lr"], batch["hr"]
        ours = psnr(self.net(low).float().clamp(0, 1), high).mean()
        baseline = psnr(self.bicubic(low.float()), high).mean()
        self.log("val/psnr", ours, prog_bar=True, sync_dist=True)
        self.log("val/psnr_bicubic", baseline, sync_dist=True)
        self.log("val/psnr_gain", ours - baseline, prog_bar=True, sync_dist=True)

    def on_fit_start(self) -> None:
        datamodule = self.trainer.datamodule
        dataset = getattr(datamodule, "val_set", None) or getattr(datamodule, "train_set", None)
        if dataset is not None and self.num_samples > 0:
            items = [dataset[i] for i in range(min(self.num_samples, len(dataset)))]
            shapes = {tuple(item["lr"].shape) for item in items}
            if len(shapes) == 1:  # a grid needs one size
                self._grid = (torch.stack([i["lr"] for i in items]), torch.stack([i["hr"] for i in items]))

    def sample_images(self) -> torch.Tensor | None:
        """Bicubic, network and ground truth, side by side."""
        if self._grid is None:
            return None
        low, high = (t.to(self.device) for t in self._grid)
        rows = torch.stack([self.bicubic(low), self.net(low).float().clamp(0, 1), high], dim=1)
        return rows.flatten(0, 1)  # (3N, 3, H, W)

    def export(self, path: Path) -> Path:
        """``path/upscaler.safetensors`` (ESRGAN key names; spandrel loads it)."""
        from rapiddiff.models.upscaler import save_upscaler

        save_upscaler(self.net.float(), path)
        return Path(path)


def cli_main(args: list[str] | None = None) -> RapidCLI:
    """``rapiddiff train upscaler``: LightningCLI over UpscalerTraining + PairedImageData."""
    return run_cli(
        UpscalerTraining,
        PairedImageData,
        args,
        prog="rapiddiff train upscaler",
        description="Train an ESRGAN RRDB upscaler on low/high-resolution pairs (L1, optional PatchGAN).",
    )
