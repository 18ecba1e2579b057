"""``rapiddiff train controlnet``: a ControlNet (Zhang et al. 2023) on a frozen model folder.

The base model — U-Net, VAE and the knowledge-enhanced text encoder, knowledge as the folder has
it — stays frozen; only the ControlNet trains. It starts as diffusers' ``ControlNetModel.from_unet``
makes it, as examples/controlnet/train_controlnet.py does: a copy of the U-Net's encoder and
middle block, joined to the U-Net by zero-initialised 1×1 convolutions (and a conditioning
embedding whose last convolution is zero too), so before the first step the U-Net's output is
exactly the base model's (a test checks it). One step is that script's story: encode → noise →
ControlNet(noisy, t, text, control) → U-Net(noisy, t, text, + residuals) → loss. Captions are
dropped with probability ``loss.caption_dropout`` (the paper: 50 %, so the ControlNet learns to
read the control image without a prompt), and optionally the control image (``control_dropout``).

The export is a diffusers ControlNetModel folder (``config.json`` + safetensors) with
``rapiddiff_controlnet.json`` naming the base model and the conditioning type, which
``ControlNetModel.from_pretrained`` loads as it is.

    rapiddiff train controlnet --config configs/controlnet/kshapes.yaml [--trainer.max_steps=...]
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from rapiddiff.train.controlnet_data import ControlImageTextData
from rapiddiff.train.lightning_cli import RapidCLI, run_cli
from rapiddiff.train.optim import OptimConfig
from rapiddiff.train.speed import SpeedConfig, apply_speedups, unfuse_for_saving
from rapiddiff.train.unet import LatentDiffusion
from rapiddiff.train.unet_config import DiffusionLoss, EMAConfig, SamplingConfig
from rapiddiff.train.unet_parts import frozen_dtype
from rapiddiff.train.unet_samples import EMAWeights, draw
from rapiddiff.utils.io import atomic_folder
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)

CONTROLNET_INFO = "rapiddiff_controlnet.json"
"""The file beside a ControlNet's config.json that names its base model and conditioning type."""

_LOSS = DiffusionLoss(caption_dropout=0.5)
_OPTIM = OptimConfig(lr=1e-4, warmup_steps=100)
_SAMPLING = SamplingConfig(prompts=(), seeds=(0,))
_SPEED = SpeedConfig()


def conditioning_channels_for(vae_factor: int) -> tuple[int, ...]:
    """The ControlNet's conditioning-embedding widths for a VAE that scales by ``vae_factor``:
    diffusers' (16, 32, 96, 256) has three stride-2 convolutions (an 8× VAE, as SD's); a 2× or 4×
    VAE takes the first 2 or 3, so the embedded control lands at the latents' size."""
    steps = max(0, int(vae_factor).bit_length() - 1)
    if 2**steps != vae_factor or steps > 3:
        raise ValueError(f"a ControlNet needs a VAE factor of 1, 2, 4 or 8, got {vae_factor}")
    return (16, 32, 96, 256)[: steps + 1]


def controlled_model(
    unet: torch.nn.Module, controlnet: torch.nn.Module, control: torch.Tensor, scale: float = 1.0
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The U-Net with the ControlNet's residuals added, as a plain ``model(x, t, context)`` for
    :func:`rapiddiff.models.sampling.denoise`. ``control`` [N, 3, H, W] in [0, 1] is repeated for a
    guided batch of k·N latents (the unconditional half sees the control too, as in diffusers'
    ControlNet pipeline without guess mode)."""

    def model(x: torch.Tensor, t: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        cond = control.to(x.device, x.dtype)
        if x.shape[0] != cond.shape[0]:
            cond = cond.repeat(x.shape[0] // cond.shape[0], 1, 1, 1)  # (k·N, 3, H, W)
        down, mid = controlnet(
            x, t, encoder_hidden_states=context, controlnet_cond=cond, conditioning_scale=scale,
            return_dict=False,
        )  # fmt: skip
        return unet(
            x, t, encoder_hidden_states=context, down_block_additional_residuals=down,
            mid_block_additional_residual=mid, return_dict=False,
        )[0]  # fmt: skip

    return model


def _resolve(pretrained: str | None) -> str:
    from rapiddiff.models.builtin import resolve_model

    if pretrained is None:
        raise ValueError(
            "model.pretrained is required: the base model folder the ControlNet steers (a rapiddiff or "
            "SD 1.x model folder, builtin or builtin:NAME)"
        )
    return str(resolve_model(pretrained))


class ControlNetTraining(LatentDiffusion):
    """A ControlNet on a frozen model folder.

    Args:
        pretrained: the base model folder (rapiddiff, Taiyi or SD 1.x diffusers layout; its text
            encoder keeps its knowledge store); ``builtin``: the model shipped with rapiddiff.
        controlnet: a ControlNetModel folder to go on from; null: ``ControlNetModel.from_unet`` of
            the base U-Net (zero convolutions at zero).
        conditioning_channels: channels of the conditioning image (3: an RGB image, as the data's).
        control_dropout: probability of training an item with a black (all-zero) control image:
            the ControlNet learns to leave the U-Net alone without one. 0: off.
        conditioning_scale: the residuals' scale in the sample grids.
        grid_images: rows of the sample grid, each ``control | with control | without``: the first
            N validation items (training items without validation data), with their captions
            (or ``sampling.prompts`` in turn, where given) and seeds ``sampling.seeds`` in turn.
        loss: prediction type, caption dropout (the paper's 50 %), min-SNR, noise offset.
        optim: AdamW and its learning-rate schedule.
        ema: EMA of the ControlNet's weights (used for the grids and the export); null = off.
        sampling: the grids' sampler settings (steps, guidance, scheduler; prompts: see grid_images).
        speed: gradient checkpointing, channels_last, attention, torch.compile (applied to both
            networks); ``sync_every``. Not: fuse_qkv, gpu_data, cache_text, cuda_graph.
        cache_latents: encode every training image once at the start (the VAE is frozen).
        seed: seed for noise, timesteps and the dropouts (reseeded every batch: exact resume).
    """

    def __init__(
        self,
        pretrained: str | None = "builtin",
        controlnet: str | None = None,
        conditioning_channels: int = 3,
        control_dropout: float = 0.0,
        conditioning_scale: float = 1.0,
        grid_images: int = 4,
        loss: DiffusionLoss = _LOSS,
        optim: OptimConfig = _OPTIM,
        ema: EMAConfig | None = None,
        sampling: SamplingConfig = _SAMPLING,
        speed: SpeedConfig = _SPEED,
        cache_latents: bool = False,
        seed: int = 0,
    ) -> None:
        _check_speed(speed)
        if not 0.0 <= control_dropout <= 1.0:
            raise ValueError(f"control_dropout must be in [0, 1], got {control_dropout}")
        base = _resolve(pretrained)
        super().__init__(
            pretrained=base,
            trainable=(),
            loss=loss,
            optim=optim,
            ema=None,
            sampling=sampling,
            speed=speed,
            cache_latents=cache_latents,
            seed=seed,
        )
        # This class's arguments, and only they (and LightningCLI's "_instantiator"): load_from_checkpoint
        # rebuilds the module from them, and the base class's own (unet, vae, ...) are not ours.
        self.save_hyperparameters()
        self.remove_ignored_hparams(
            [k for k in list(self.hparams) if k not in _ARGUMENTS and not k.startswith("_")]
        )
        self.hparams["pretrained"] = base  # the folder: grids and export read its sampling defaults
        self.base_model = pretrained
        self.control_dropout, self.conditioning_scale, self.grid_images = (
            control_dropout,
            conditioning_scale,
            grid_images,
        )
        self.controlnet = self._make_controlnet(controlnet, conditioning_channels)
        self.controlnet.train().requires_grad_(True)
        apply_speedups(self.controlnet, speed)
        self.trained = ["controlnet"]
        self.ema = self._make_ema(ema)
        self.conditioning = "unknown"  # the data's control.type, read at fit start
        self.train()  # the base model's parts in eval mode (LatentDiffusion.train), the ControlNet not

    def _make_controlnet(self, folder: str | None, channels: int) -> torch.nn.Module:
        from diffusers import ControlNetModel

        from rapiddiff.models.sampling import vae_scale_factor

        if folder is not None:
            return ControlNetModel.from_pretrained(folder)
        return ControlNetModel.from_unet(
            self.unet,
            conditioning_embedding_out_channels=conditioning_channels_for(vae_scale_factor(self.vae)),
            conditioning_channels=channels,
        )

    def setup(self, stage: str) -> None:
        super().setup(stage)  # VAE and text tower in the training dtype
        self.unet.to(dtype=frozen_dtype(str(self.trainer.precision)))  # frozen here too

    def on_fit_start(self) -> None:
        super().on_fit_start()
        control = getattr(self.trainer.datamodule, "control", None)
        self.conditioning = getattr(control, "type", "unknown")

    # ------------------------------------------------------------------ one step
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        latents = self.encode_images(batch)  # (B, C, h, w), scaled
        captions = self.drop_captions(batch["text"])
        context = self.encode_text(captions)  # (B, L, D), frozen
        control = self.drop_control(batch["control"].to(self.device, non_blocking=True))  # (B, 3, H, W)
        noise = self.sample_noise(latents)
        timesteps = torch.randint(
            0, self.noise_scheduler.config.num_train_timesteps, (latents.shape[0],), device=latents.device
        )
        noised_with = noise
        if self.loss_cfg.input_perturbation:
            extra = torch.randn(noise.shape, device=noise.device, dtype=noise.dtype)
            noised_with = noise + self.loss_cfg.input_perturbation * extra
        noisy = self.noise_scheduler.add_noise(latents, noised_with, timesteps)
        prediction = controlled_model(self.unet, self.controlnet, control)(noisy, timesteps, context)
        loss = self.diffusion_loss(prediction, self.target(latents, noise, timesteps), timesteps)
        self.check_finite(loss)
        self.log("train/loss", loss, prog_bar=self.sync_every == 1)
        return loss

    def drop_control(self, control: torch.Tensor) -> torch.Tensor:
        """Each item's control image set to black with probability ``control_dropout``."""
        if not self.control_dropout:
            return control
        keep = (torch.rand(control.shape[0]) >= self.control_dropout).to(control.device, control.dtype)
        return control * keep.view(-1, 1, 1, 1)

    def validation_prediction(
        self, noisy: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor, batch: dict[str, Any]
    ) -> torch.Tensor:
        """The validation loss (LatentDiffusion.validation_step's) through the ControlNet, no dropout."""
        return controlled_model(self.unet, self.controlnet, batch["control"].to(self.device))(
            noisy, timesteps, context
        )

    def fsdp_units(self) -> list[torch.nn.Module]:
        return [*self.controlnet.down_blocks, self.controlnet.mid_block, self.controlnet]

    # ------------------------------------------------------------------ grids and export
    def sample_images(self) -> torch.Tensor | None:
        """Rows ``control | with control | without`` ([N, 3, H, 3·W] in [0, 1]), same seed per row."""
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if not self.grid_images or not self.sampling.seeds or not hasattr(datamodule, "grid_items"):
            return None
        control, captions = datamodule.grid_items(self.grid_images)
        prompts = list(self.sampling.prompts) or captions
        prompts = [prompts[k % len(prompts)] for k in range(len(captions))]
        seeds = [self.sampling.seeds[k % len(self.sampling.seeds)] for k in range(len(captions))]
        control = control.to(self.device)
        with EMAWeights(self):
            model = controlled_model(self.unet, self.controlnet, control, self.conditioning_scale)
            with_control = draw(self, prompts, seeds, model=model)
        without = draw(self, prompts, seeds)
        if control.shape[-2:] != without.shape[-2:]:  # sampling.size other than the data's
            control = F.interpolate(control, size=without.shape[-2:], mode="nearest")
        return torch.cat([control.float(), with_control.float(), without.float()], dim=-1)

    def export(self, path: Path) -> Path:
        """A diffusers ControlNetModel folder (EMA weights when EMA is on), with
        ``rapiddiff_controlnet.json``; written beside ``path`` and moved into place."""
        from rapiddiff import __version__

        if self.ema is not None:
            self.ema.copy_to(self.trainable_parameters())
        controlnet = getattr(self.controlnet, "_orig_mod", self.controlnet)
        unfuse_for_saving(controlnet)  # contiguous again after channels_last
        controlnet.to(dtype=torch.float32)
        info = {
            "base_model": self.base_model,
            "base_model_path": str(self.hparams["pretrained"]),
            "conditioning": self.conditioning,
            "conditioning_channels": int(controlnet.config.conditioning_channels),
            "conditioning_range": [0.0, 1.0],
            "image_size": int(self.unet.config.sample_size) * _vae_factor(self.vae),
            "rapiddiff_version": __version__,
        }
        path = Path(path)
        with atomic_folder(path) as tmp:
            controlnet.save_pretrained(tmp, safe_serialization=True)
            (tmp / CONTROLNET_INFO).write_text(json.dumps(info, indent=2, ensure_ascii=False) + "\n", "utf-8")
        return path


_ARGUMENTS = set(inspect.signature(ControlNetTraining.__init__).parameters) - {"self"}


def _vae_factor(vae: torch.nn.Module) -> int:
    from rapiddiff.models.sampling import vae_scale_factor

    return vae_scale_factor(vae)


def _check_speed(speed: SpeedConfig) -> None:
    refused = [name for name in ("fuse_qkv", "gpu_data", "cache_text", "cuda_graph") if getattr(speed, name)]
    if refused:
        raise ValueError(
            f"speed.{refused[0]} is not supported when training a ControlNet (the step has two networks "
            "and a control image per item): set it to false"
        )


def read_controlnet_info(folder: str | Path) -> dict[str, Any]:
    """The ``rapiddiff_controlnet.json`` of an exported ControlNet folder ({} when it has none)."""
    file = Path(folder) / CONTROLNET_INFO
    return json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}


def cli_main(args: list[str] | None = None) -> RapidCLI:
    """``rapiddiff train controlnet``: LightningCLI over ControlNetTraining + ControlImageTextData."""
    return run_cli(
        ControlNetTraining,
        ControlImageTextData,
        args,
        prog="rapiddiff train controlnet",
        description="Train a ControlNet (mask, canny or a data column) on a frozen model folder.",
    )
