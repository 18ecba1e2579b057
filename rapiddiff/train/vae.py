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
from torch.utils.data import Dataset

from rapiddiff.train.data import ImageTextData
from rapiddiff.train.gan import GanConfig, PatchDiscriminator, adversarial_losses
from rapiddiff.train.lightning_cli import RapidCLI, run_cli
from rapiddiff.train.module import RapidModule
from rapiddiff.train.optim import OptimConfig, configure_adamw, psnr
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
        architecture: AutoencoderKL config entries that replace the preset's (e.g.
            ``{latent_channels: 8, block_out_channels: [64, 128, 128, 128]}``); presets only.
        loss: reconstruction, KL and perceptual terms.
        gan: the PatchGAN term (weight 0 = off).
        optim: AdamW and its learning-rate schedule.
        num_samples: images shown (original | reconstruction) in the validation grid.
        seed: seed for the posterior samples (reseeded every batch).
        latent_scaling: the exported ``scaling_factor``. "auto": measured on the training data
            (1 / std of its latents, the LDM recipe) for a VAE trained from a preset, kept for a
            folder being fine-tuned (a U-Net may already depend on it); "data": always measured;
            "keep": the preset's or folder's value.
        calibration_images: training images the factor is measured on (evenly spaced).
    """

    def __init__(
        self,
        vae: str = "kshapes",
        architecture: dict[str, Any] | None = None,
        loss: VAELoss = _LOSS,
        gan: GanConfig = _GAN,
        optim: OptimConfig = _OPTIM,
        num_samples: int = 8,
        seed: int = 0,
        latent_scaling: Literal["auto", "data", "keep"] = "auto",
        calibration_images: int = 2048,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if latent_scaling not in ("auto", "data", "keep"):
            raise ValueError(f"latent_scaling={latent_scaling!r}: use 'auto', 'data' or 'keep'")
        self.loss_cfg, self.gan_cfg, self.optim_cfg = loss, gan, optim
        self.num_samples, self.seed = num_samples, seed
        from rapiddiff.models.presets import PRESETS

        from_preset = vae in PRESETS and not Path(vae).exists()
        self.calibrate = latent_scaling == "data" or (latent_scaling == "auto" and from_preset)
        self.calibration_images = calibration_images
        if architecture and not from_preset:
            raise ValueError(f"architecture= changes a preset; {vae!r} is a folder (its config.json decides)")
        # from_pretrained returns modules in eval mode; training wants train mode.
        self.vae = load_vae(vae, architecture).train()
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
        self.check_finite(loss)
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
        """A diffusers AutoencoderKL folder, its scaling_factor measured on the training data."""
        self.vae.to(dtype=torch.float32)
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        dataset = getattr(datamodule, "train_set", None)
        if self.calibrate and dataset is not None:
            # Lightning's teardown has moved the model back to the CPU; the encoder passes are
            # minutes there and seconds on a GPU.
            device = "cuda" if torch.cuda.is_available() else "cpu"
            stats = set_scaling_factor(self.vae.to(device), dataset, self.calibration_images, seed=self.seed)
            self.vae.to("cpu")
            log.info("VAE scaling_factor = 1 / latent std = %.5f (%s)", self.vae.config.scaling_factor, stats)
        self.vae.save_pretrained(path, safe_serialization=True)
        return Path(path)


@torch.no_grad()
def latent_statistics(
    vae: Any, dataset: Dataset, max_images: int = 2048, *, batch_size: int = 32, seed: int = 0
) -> dict[str, float]:
    """Std and mean of the VAE's posterior samples over up to ``max_images`` evenly spaced items of
    ``dataset`` (items ``{"pixel_values": [3, H, W] in [-1, 1]}``): the latents a U-Net trains on."""
    count = len(dataset)  # type: ignore[arg-type]
    if count == 0:
        raise ValueError("no images to measure the latents on: the dataset is empty")
    picks = torch.linspace(0, count - 1, min(count, max_images)).round().long().unique().tolist()
    device = next(vae.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    total = total_sq = 0.0
    n = 0
    channel_sq: torch.Tensor | None = None
    was_training = vae.training
    vae.eval()
    for start in range(0, len(picks), batch_size):
        images = torch.stack([dataset[i]["pixel_values"] for i in picks[start : start + batch_size]])
        dist = vae.encode(images.to(device=device, dtype=vae.dtype)).latent_dist
        z = dist.sample(generator=generator).double()  # (B, C, h, w)
        total, total_sq, n = total + float(z.sum()), total_sq + float((z * z).sum()), n + z.numel()
        sq = (z * z).sum((0, 2, 3))  # (C,)
        channel_sq = sq if channel_sq is None else channel_sq + sq
    vae.train(was_training)
    mean = total / n
    assert channel_sq is not None
    rms = (channel_sq * channel_sq.numel() / n).sqrt()  # per-channel root mean square
    return {
        "std": (total_sq / n - mean * mean) ** 0.5,
        "mean": mean,
        "images": float(len(picks)),
        "channel_rms_ratio": float(rms.max() / rms.min().clamp_min(1e-12)),
    }


def set_scaling_factor(
    vae: Any, dataset: Dataset, max_images: int = 2048, *, seed: int = 0
) -> dict[str, float]:
    """Set ``vae.config.scaling_factor`` to 1 / std of the data's latents (Rombach et al. 2022, §4.3.2
    and their ``scale_by_std``); returns the statistics it was set from."""
    stats = latent_statistics(vae, dataset, max_images, seed=seed)
    if not stats["std"] > 0:
        raise ValueError(f"the latents have std {stats['std']}: cannot scale them to unit std")
    vae.register_to_config(scaling_factor=round(1.0 / stats["std"], 6))
    if stats["channel_rms_ratio"] > 10:
        # One factor for all channels: a channel far larger than the rest sets it, and the others
        # reach the U-Net nearly silent. Seen on a briefly trained VAE with kl_weight 1e-6.
        log.warning(
            "latent channels differ %.0f× in scale: one scaling_factor (%.4g) leaves the small ones near "
            "zero; train the VAE longer or with a larger loss.kl_weight",
            stats["channel_rms_ratio"],
            vae.config.scaling_factor,
        )
    return stats


def load_vae(source: str, architecture: dict[str, Any] | None = None) -> Any:
    """An AutoencoderKL from a preset name (random init, ``architecture`` overriding its entries) or
    a folder (``vae/`` inside is found)."""
    from diffusers import AutoencoderKL

    from rapiddiff.models.presets import PRESETS, vae_config

    if source in PRESETS and not Path(source).exists():
        return AutoencoderKL(**{**vae_config(source), **(architecture or {})})
    path = Path(source)
    for folder in (path / "vae", path):
        if (folder / "config.json").is_file():
            return AutoencoderKL.from_pretrained(str(folder))
    raise FileNotFoundError(
        f"{path}: no vae/config.json or config.json; give a VAE preset ({', '.join(PRESETS)}), an "
        "AutoencoderKL folder or a model folder"
    )


def calibrate_main(args: list[str]) -> int:
    """``rapiddiff train vae calibrate``: set a VAE folder's scaling_factor from data."""
    import argparse
    import json

    from rapiddiff.train.data import open_image_text_dataset

    parser = argparse.ArgumentParser(
        prog="rapiddiff train vae calibrate",
        description="Set a VAE folder's scaling_factor to 1 / std of its latents on DATA (the LDM recipe) "
        "and rewrite its config.json. Do it before training a U-Net on the VAE: a U-Net trained with "
        "the old factor needs the old factor.",
    )
    parser.add_argument(
        "--vae", required=True, type=Path, help="AutoencoderKL folder (or a model folder's vae/)"
    )
    parser.add_argument(
        "--data", required=True, help="image data: an imagefolder with metadata.jsonl or a table"
    )
    parser.add_argument("--images", type=int, default=2048, help="images to measure on (evenly spaced)")
    parser.add_argument(
        "--image-size", type=int, default=None, help="resize to this size (default: the VAE's sample_size)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the posterior samples")
    parser.add_argument("--dry-run", action="store_true", help="print the factor, change nothing")
    opts = parser.parse_args(args)
    folder = opts.vae / "vae" if (opts.vae / "vae" / "config.json").is_file() else opts.vae
    vae = load_vae(str(folder)).eval()
    dataset = open_image_text_dataset(opts.data, opts.image_size or int(vae.config.sample_size))
    old = float(vae.config.scaling_factor)
    stats = set_scaling_factor(vae, dataset, opts.images, seed=opts.seed)
    new = float(vae.config.scaling_factor)
    report = {"vae": str(folder), "old_scaling_factor": old, "scaling_factor": new, **stats}
    if not opts.dry_run:
        # Only the config changes: the weights are untouched, so rewrite config.json alone.
        config_path = folder / "config.json"
        config = json.loads(config_path.read_text(encoding="utf-8"))
        config["scaling_factor"] = new
        from rapiddiff.utils.io import atomic_write_text

        atomic_write_text(config_path, json.dumps(config, indent=2, sort_keys=True) + "\n")
    print(json.dumps(report, indent=1))
    return 0


def cli_main(args: list[str] | None = None) -> RapidCLI | int:
    """``rapiddiff train vae``: LightningCLI over VAETraining + ImageTextData (``calibrate``: see above)."""
    if args and args[0] == "calibrate":
        return calibrate_main(list(args[1:]))
    return run_cli(
        VAETraining,
        ImageTextData,
        args,
        prog="rapiddiff train vae",
        description="Train or fine-tune an AutoencoderKL (reconstruction + KL, optional SSIM and PatchGAN).",
    )
