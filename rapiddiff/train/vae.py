"""``rapiddiff train vae``: train or fine-tune an AutoencoderKL for a domain without a pretrained VAE.

Loss = reconstruction (L1 or L2) + kl_weight · KL + optional SSIM term + optional PatchGAN term,
as in latent diffusion's autoencoder (Rombach et al. 2022) with one change: LPIPS needs
pretrained VGG weights, which cannot be fetched here, so the perceptual option is SSIM (no
weights). Validation reports reconstruction PSNR. The output is a diffusers AutoencoderKL folder
that ``rapiddiff train unet --model.vae`` and ``AutoencoderKL.from_pretrained`` read.

    rapiddiff train vae --config configs/vae/kshapes.yaml
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

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
from rapiddiff.train.data import ImageTextData
from rapiddiff.train.gan import GanConfig, PatchDiscriminator, adversarial_losses
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class VAELoss:
    """Terms of the autoencoder loss."""

    reconstruction: Literal["l1", "l2"] = "l1"
    kl_weight: float = 1e-6
    """KL weight in LDM's convention (both terms per image); 1e-6 keeps the latent nearly deterministic."""
    perceptual: Literal["none", "ssim"] = "none"
    """"ssim": add (1 − SSIM). LPIPS is not offered: it needs VGG weights that cannot be downloaded here."""
    perceptual_weight: float = 0.1

    def __post_init__(self) -> None:
        if self.perceptual not in ("none", "ssim"):
            raise ValueError(
                f"perceptual={self.perceptual!r}: LPIPS needs pretrained VGG weights, which rapiddiff does not "
                "download; use 'ssim' (no weights) or 'none'"
            )
        if self.reconstruction not in ("l1", "l2"):
            raise ValueError(f"reconstruction={self.reconstruction!r}: use 'l1' or 'l2'")


_LOSS, _OPTIM, _GAN = VAELoss(), OptimConfig(lr=1e-4, warmup_steps=0, schedule="constant"), GanConfig()


class VAETraining(RapidModule):
    """An AutoencoderKL trained to reconstruct images through its latent.

    Args:
        vae: a VAE preset ("kshapes", "sd15", "tiny") for random init, or a folder to fine-tune
            (a diffusers AutoencoderKL folder or a model folder's ``vae/``).
        loss: reconstruction, KL and perceptual terms.
        gan: the PatchGAN term (weight 0 = off).
        optim: AdamW and its learning-rate schedule.
        num_samples: images shown (original | reconstruction) in the validation grid.
        seed: seed for the posterior samples (reseeded every batch).
    """

    def __init__(
        self,
        vae: str = "kshapes",
        loss: VAELoss = _LOSS,
        gan: GanConfig = _GAN,
        optim: OptimConfig = _OPTIM,
        num_samples: int = 8,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.loss_cfg, self.gan_cfg, self.optim_cfg = loss, gan, optim
        self.num_samples, self.seed = num_samples, seed
        self.vae = load_vae(vae)
        self.critic = (
            PatchDiscriminator(self.vae.config.in_channels, gan.channels, gan.layers)
            if gan.weight > 0
            else None
        )
        self._grid_images: torch.Tensor | None = None

    def configure_optimizers(self) -> dict[str, Any]:
        groups: list[dict[str, Any]] = [{"params": list(self.vae.parameters())}]
        if self.critic is not None:
            groups.append(
                {"params": list(self.critic.parameters()), "lr": self.optim_cfg.lr * self.gan_cfg.lr_scale}
            )
        return configure_adamw(self, groups, self.optim_cfg)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        images = batch["pixel_values"]  # (B, 3, H, W) in [-1, 1]
        posterior = self.vae.encode(images).latent_dist
        reconstruction = self.vae.decode(posterior.sample()).sample
        loss = self.reconstruction_loss(reconstruction, images)
        loss = loss + self.loss_cfg.kl_weight * posterior.kl().mean() / images[0].numel()
        loss = loss + self.adversarial_loss(images, reconstruction)
        ensure_finite(loss, self._trainer)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def reconstruction_loss(self, reconstruction: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        rec, target = reconstruction.float(), images.float()
        loss = F.l1_loss(rec, target) if self.loss_cfg.reconstruction == "l1" else F.mse_loss(rec, target)
        if self.loss_cfg.perceptual == "ssim":
            from torchmetrics.functional import structural_similarity_index_measure as ssim

            loss = loss + self.loss_cfg.perceptual_weight * (1 - ssim(rec, target, data_range=2.0))
        return loss

    def adversarial_loss(self, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
        """Generator term + critic loss (zero before gan.start_step or without a critic)."""
        if self.critic is None or self.global_step < self.gan_cfg.start_step:
            return fake.new_zeros(())
        generator_term, critic_loss = adversarial_losses(self.critic, real.float(), fake.float())
        self.log("train/critic", critic_loss)
        return self.gan_cfg.weight * generator_term + critic_loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        images = batch["pixel_values"]
        reconstruction = self.vae.decode(self.vae.encode(images).latent_dist.mode()).sample
        quality = psnr((reconstruction.float().clamp(-1, 1) + 1) / 2, (images.float() + 1) / 2)
        self.log("val/psnr", quality.mean(), prog_bar=True, sync_dist=True)

    def on_fit_start(self) -> None:
        datamodule = self.trainer.datamodule
        dataset = getattr(datamodule, "val_set", None) or getattr(datamodule, "train_set", None)
        if dataset is not None and self.num_samples > 0:
            count = min(self.num_samples, len(dataset))
            self._grid_images = torch.stack([dataset[i]["pixel_values"] for i in range(count)])

    def sample_images(self) -> torch.Tensor | None:
        """Originals and reconstructions, side by side."""
        if self._grid_images is None:
            return None
        images = self._grid_images.to(self.device)
        reconstruction = self.vae.decode(self.vae.encode(images).latent_dist.mode()).sample
        pairs = torch.stack([images, reconstruction.float()], dim=1).flatten(0, 1)  # (2N, 3, H, W)
        return ((pairs + 1) / 2).clamp(0, 1)

    def export(self, path: Path) -> Path:
        """A diffusers AutoencoderKL folder."""
        self.vae.to(dtype=torch.float32).save_pretrained(path, safe_serialization=True)
        return Path(path)


def load_vae(source: str) -> Any:
    """An AutoencoderKL from a preset name (random init) or a folder (``vae/`` inside is found)."""
    from diffusers import AutoencoderKL

    from rapiddiff.models.presets import PRESETS, vae_config

    if source in PRESETS and not Path(source).exists():
        return AutoencoderKL(**vae_config(source))
    path = Path(source)
    for folder in (path / "vae", path):
        if (folder / "config.json").is_file():
            return AutoencoderKL.from_pretrained(str(folder))
    raise FileNotFoundError(
        f"{path}: no vae/config.json or config.json; give a VAE preset ({', '.join(PRESETS)}), an "
        "AutoencoderKL folder or a model folder"
    )


def cli_main(args: list[str] | None = None) -> RapidCLI:
    """``rapiddiff train vae``: LightningCLI over VAETraining + ImageTextData."""
    return run_cli(
        VAETraining,
        ImageTextData,
        args,
        prog="rapiddiff train vae",
        description="Train or fine-tune an AutoencoderKL (reconstruction + KL, optional SSIM and PatchGAN).",
    )
