"""``rapiddiff train upscaler``: train an ESRGAN RRDB or a Real-ESRGAN compact network on image pairs.

L1 first (ESRGAN's PSNR-oriented stage); the PatchGAN term is optional (``gan.weight > 0``,
usually with ``gan.start_step`` after the L1 stage). ``model.network.arch`` picks the network:
``rrdb`` (:func:`rapiddiff.models.upscaler.build_rrdb`, the default: what ESRGAN / Real-ESRGAN
x4plus checkpoints are) or ``compact`` (:func:`~rapiddiff.models.upscaler.build_compact`,
SRVGGNetCompact: a global skip, so it only learns the residual over an upsampled input — nearest
as Real-ESRGAN, or bicubic with ``model.network.base: bicubic``; small and fast on CPU). Either is saved with ``save_upscaler``, so spandrel (and every ESRGAN tool) loads it
back; ``model.pretrained`` fine-tunes any file spandrel loads (ESRGAN, Real-ESRGAN, compact).
Validation logs ``val/psnr`` and ``val/psnr_bicubic`` (and their difference ``val/psnr_gain``).

    rapiddiff train upscaler --config configs/upscaler/kshapes.yaml
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from rapiddiff.models.upscaler_names import ARCHITECTURES, COMPACT_BASES
from rapiddiff.train.data import PairedImageData
from rapiddiff.train.gan import GanConfig, PatchDiscriminator, adversarial_losses
from rapiddiff.train.lightning_cli import RapidCLI, run_cli
from rapiddiff.train.module import RapidModule
from rapiddiff.train.optim import OptimConfig, configure_adamw, psnr
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)

# Per-architecture defaults of the options left ``None`` (``num_feat``) and the options that belong
# to one architecture only. Rule: an option of the other architecture is ignored with a warning
# (so one config can switch ``arch`` without deleting lines); a wrong value type or an unknown
# ``arch`` is an error.
_DEFAULTS: dict[str, dict[str, int | str]] = {
    "rrdb": {"num_feat": 32, "num_blocks": 6},
    "compact": {"num_feat": 64, "num_conv": 16, "base": "nearest"},
}
_ONLY: dict[str, str] = {"num_blocks": "rrdb", "num_conv": "compact", "base": "compact"}


@dataclass(frozen=True)
class NetworkConfig:
    """The upscaler network built when ``pretrained`` is None."""

    arch: Literal["rrdb", "compact"] = "rrdb"
    """``rrdb``: ESRGAN's RRDBNet (what ESRGAN / Real-ESRGAN x4plus files are). ``compact``: Real-ESRGAN's
    SRVGGNetCompact — adds an upsampled input (``base``) to its output (learns only the residual), small, fast on CPU."""
    num_feat: int | None = None
    """Feature width; None = 32 for rrdb, 64 for compact (ESRGAN and the Real-ESRGAN compact models use 64)."""
    num_blocks: int | None = None
    """rrdb only: RRDB blocks; None = 6 (ESRGAN uses 23). Ignored, with a warning, for compact."""
    num_conv: int | None = None
    """compact only: 3×3 convs in the body; None = 16 (realesr-general-x4v3 uses 32). Ignored, with a warning, for rrdb."""
    base: Literal["nearest", "bicubic"] | None = None
    """compact only: the upsampled input the net's output is added to; None = nearest (Real-ESRGAN's).
    bicubic: the net learns only what bicubic misses and starts exactly at bicubic. Ignored, with a
    warning, for rrdb; a ``pretrained`` file brings its own (recorded in its metadata)."""
    scale: int = 4
    """Upscaling factor."""

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(
                f"model.network.arch={self.arch!r} is not an upscaler architecture; valid: {', '.join(ARCHITECTURES)}"
            )
        if self.base is not None and self.base not in COMPACT_BASES:
            raise ValueError(f"model.network.base={self.base!r}; valid: {', '.join(COMPACT_BASES)}")

    def build_kwargs(self) -> dict[str, int | str]:
        """Arguments for ``build_upscaler(self.arch, ...)``: this arch's options, defaults filled in."""
        kwargs = dict(_DEFAULTS[self.arch], scale=self.scale)
        for name in ("num_feat", "num_blocks", "num_conv", "base"):
            value = getattr(self, name)
            if value is None:
                continue
            if _ONLY.get(name, self.arch) != self.arch:
                log.warning(
                    "model.network.%s=%s is a %s option; ignored for arch %s",
                    name,
                    value,
                    _ONLY[name],
                    self.arch,
                )
                continue
            kwargs[name] = value
        return kwargs


# The name before the compact architecture was added (keeps ``RRDBConfig(num_blocks=..., ...)`` working).
RRDBConfig = NetworkConfig

_NET, _OPTIM, _GAN = NetworkConfig(), OptimConfig(lr=2e-4, warmup_steps=0, schedule="constant"), GanConfig()


class UpscalerTraining(RapidModule):
    """Super-resolution with an RRDB or compact network.

    Args:
        network: architecture and size (used when ``pretrained`` is None).
        pretrained: weights file spandrel loads (ESRGAN, Real-ESRGAN x4plus or compact, or an
            ``upscaler/`` folder) to fine-tune; its architecture and size come from the file.
        gan: the PatchGAN term (weight 0 = the pixel loss only).
        pixel_loss: ``l1`` (ESRGAN's PSNR stage) or ``mse``. On mostly flat images L1 pulls the
            residual to its median, zero (every flat pixel's gradient counts as much as an edge's),
            so a small net can sit at its skip for hundreds of steps; MSE weighs the edges' larger
            errors more (and is what PSNR measures).
        optim: AdamW and its learning-rate schedule.
        num_samples: validation pairs shown (bicubic | network | ground truth) in the grid.
        seed: seed (reseeded every batch).
    """

    def __init__(
        self,
        network: NetworkConfig = _NET,
        pretrained: str | None = None,
        gan: GanConfig = _GAN,
        optim: OptimConfig = _OPTIM,
        num_samples: int = 4,
        seed: int = 0,
        pixel_loss: Literal["l1", "mse"] = "l1",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        from rapiddiff.models.upscaler import build_upscaler, load_upscaler

        if pretrained is not None:
            self.net = load_upscaler(pretrained)
            log.info(
                "fine-tuning %s from %s (model.network is not used)", type(self.net).__name__, pretrained
            )
        else:
            self.net = build_upscaler(network.arch, **network.build_kwargs())
        self.net.requires_grad_(True).train()
        self.scale = int(getattr(self.net, "scale", network.scale))
        self.gan_cfg, self.optim_cfg, self.num_samples, self.seed = gan, optim, num_samples, seed
        losses = {"l1": F.l1_loss, "mse": F.mse_loss}
        if pixel_loss not in losses:
            raise ValueError(f"model.pixel_loss={pixel_loss!r}; valid: {', '.join(losses)}")
        self.pixel_loss = losses[pixel_loss]
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
        loss = self.pixel_loss(upscaled.float(), high.float())
        if self.critic is not None and self.global_step >= self.gan_cfg.start_step:
            generator_term, critic_loss = adversarial_losses(self.critic, high.float(), upscaled.float())
            self.log("train/critic", critic_loss)
            loss = loss + self.gan_cfg.weight * generator_term + critic_loss
        self.check_finite(loss)
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
        """``path/upscaler.safetensors`` (ESRGAN or Real-ESRGAN compact key names; spandrel loads it)."""
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
        description=(
            "Train an upscaler (ESRGAN RRDB or Real-ESRGAN compact, model.network.arch) on "
            "low/high-resolution pairs (L1, optional PatchGAN)."
        ),
    )
