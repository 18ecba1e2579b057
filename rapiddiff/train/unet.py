"""``rapiddiff train unet``: train a latent-diffusion U-Net on the knowledge-enhanced text encoder.

The U-Net (diffusers ``UNet2DConditionModel``) is built from a preset or loaded from a folder;
images become latents through a trained ``AutoencoderKL``; captions become hidden states through
the :class:`~rapiddiff.models.text_encoder.KnowledgeTextEncoder`. One training step is the story
of diffusers' train_text_to_image.py: encode → noise → target → loss. Options: caption dropout
(classifier-free guidance), EMA, min-SNR weighting, noise offset, epsilon or v prediction, which
modules train, latent caching, and the speed switches of :mod:`rapiddiff.train.speed`.

    rapiddiff train unet --config configs/unet/kshapes.yaml [--trainer.max_steps=...]
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from rapiddiff.models.sampling import SamplingDefaults, default_sampler, zero_terminal_snr_config
from rapiddiff.train.callbacks import FrozenGC
from rapiddiff.train.data import ImageTextData, TokenMemo
from rapiddiff.train.lightning_cli import RapidCLI, run_cli
from rapiddiff.train.module import RapidModule
from rapiddiff.train.optim import OptimConfig, configure_adamw
from rapiddiff.train.speed import (
    GRAPH_WARMUP_STEPS,
    GraphedLoss,
    SpeedConfig,
    apply_speedups,
    lerp_ema,
    unfuse_for_saving,
)
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)

TrainableName = Literal["unet", "fusion", "text_encoder"]


@dataclass(frozen=True)
class DiffusionLoss:
    """What the U-Net is asked to predict, and how errors are weighted."""

    prediction_type: Literal["epsilon", "v_prediction"] | None = None
    """None: the scheduler config's (epsilon for SD 1.x)."""
    caption_dropout: float = 0.1
    """Probability of training on the empty caption "" (classifier-free guidance needs it)."""
    snr_gamma: float | None = None
    """Min-SNR weighting (Hang et al. 2023), 5.0 is the paper's value; None = plain MSE."""
    noise_offset: float = 0.0
    """Add offset × N(0, 1) per image and channel to the noise: darker/brighter images (~0.05)."""
    zero_terminal_snr: bool = False
    """Rescale the noise schedule to zero terminal SNR (Lin et al. 2024): the last timestep is pure
    noise, so the model learns to set an image's overall colour (its background) from the text
    instead of from what the noise leaks. Needs prediction_type v_prediction. The model folder's
    scheduler becomes DDIM with trailing timesteps (PNDM cannot step from ᾱ_T = 0). False keeps
    the start model's schedule (a zero-SNR model stays one)."""
    input_perturbation: float = 0.0
    """Input perturbation (Ning et al. 2023; diffusers' train_text_to_image.py --input_perturbation,
    0.1 there): the noisy latents are made with noise + gamma * N(0, 1) while the target stays the
    noise, so the model learns to correct inputs a little off the training distribution, as its own
    earlier steps leave them when sampling (exposure bias). 0: off (kshapes, 3 seeds: 0.1 changed
    nothing beyond the seeds' spread; BENCHMARKS.md, issue 18)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.caption_dropout <= 1.0:
            raise ValueError(f"caption_dropout must be in [0, 1], got {self.caption_dropout}")
        if self.input_perturbation < 0:
            raise ValueError(f"input_perturbation must be >= 0, got {self.input_perturbation}")
        if self.snr_gamma is not None and self.snr_gamma <= 0:
            raise ValueError(f"snr_gamma must be > 0 (or null), got {self.snr_gamma}")


@dataclass(frozen=True)
class EMAConfig:
    """Exponential moving average of the trained weights (diffusers' EMAModel)."""

    decay: float = 0.9999
    """Maximum decay."""
    warmup: bool = True
    """Ramp the decay up from 0 (diffusers' use_ema_warmup): early averages are not stuck at init."""
    power: float = 2 / 3
    """Warm-up curve: decay = 1 - (1 + step)^-power."""
    update_after_step: int = 0


@dataclass(frozen=True)
class SamplingConfig:
    """Validation images: every prompt with every seed, through rapiddiff.models.sampling (the
    loop every generation path runs). Steps, guidance and sampler are also the sampling defaults
    the exported model folder carries."""

    prompts: tuple[str, ...] = ("蓝色背景上有一个红色的圆形", "白色背景上有一个番茄")
    seeds: tuple[int, ...] = (0, 1)
    negative_prompt: str = ""
    num_inference_steps: int | None = None
    """None: the start model's (``pretrained``'s rapiddiff.json), else SamplingDefaults'."""
    guidance_scale: float | None = None
    """None: the start model's, else SamplingDefaults'."""
    scheduler: str | None = None
    """pndm, ddim or dpm++; None: the start model's, else SamplingDefaults'."""
    size: int | None = None
    """Image side in pixels; None = the U-Net's sample_size × the VAE factor."""


_LOSS, _OPTIM, _EMA, _SAMPLING, _SPEED = (
    DiffusionLoss(),
    OptimConfig(),
    EMAConfig(),
    SamplingConfig(),
    SpeedConfig(),
)


class LatentDiffusion(RapidModule):
    """A latent-diffusion U-Net conditioned on the KnowledgeTextEncoder.

    Args:
        pretrained: a model folder (rapiddiff, Taiyi or SD 1.x) to start from; when set, the U-Net,
            VAE, text encoder and scheduler come from it and the four arguments below are ignored.
        unet: a U-Net preset ("kshapes", "sd15", "tiny") or a diffusers ``config.json`` file for
            random init, or a folder to start from (``unet/`` of a model folder, or the folder itself).
        vae: a trained AutoencoderKL folder (``rapiddiff train vae`` output, or ``vae/`` of a model
            folder); a preset name gives a random VAE (tests and benchmarks only).
        text_encoder: a folder with ``text_encoder/`` + ``tokenizer/`` (a model folder or the CLIP
            stage's output), or a BERT preset name for a fresh Chinese BERT tower.
        scheduler: a folder with ``scheduler_config.json`` (or ``scheduler/`` inside); None: SD 1.x.
        knowledge: a KnowledgeStore folder to attach (when the text encoder has none).
        fusion_layers: encoder layers that receive knowledge (fresh text encoders only).
        trainable: which parts train: "unet", "fusion" (knowledge fusion), "text_encoder" (the tower).
        text_encoder_lr: the tower's peak learning rate when ``trainable`` has "text_encoder" (its own
            AdamW group, on the same schedule); None: ``optim.lr``. The tower arrives trained by the
            CLIP stage, and at the U-Net's rate it forgets what that stage taught it (BENCHMARKS.md,
            issue 18): kohya's ``text_encoder_lr`` and DreamBooth practice give it a smaller one.
        loss: prediction type, caption dropout, min-SNR, noise offset.
        optim: AdamW and its learning-rate schedule.
        ema: EMA of the trained weights (used for sampling and export); null = off.
        sampling: validation prompts, seeds and sampler settings.
        speed: gradient checkpointing, channels_last, fused QKV, torch.compile, and the small-model
            switches (GPU-resident data and caption states, fused EMA, a CUDA-graph step).
        cache_latents: encode every training image once at the start (the VAE is frozen): faster
            steps when the data fits in memory.
        seed: seed for noise, timesteps and caption dropout (reseeded every batch).
    """

    def __init__(
        self,
        pretrained: str | None = None,
        unet: str = "kshapes",
        vae: str = "runs/vae/kshapes/model",
        text_encoder: str = "kshapes",
        scheduler: str | None = None,
        knowledge: str | None = None,
        fusion_layers: Sequence[int] = (0,),
        trainable: Sequence[TrainableName] = ("unet",),
        text_encoder_lr: float | None = None,
        loss: DiffusionLoss = _LOSS,
        optim: OptimConfig = _OPTIM,
        ema: EMAConfig | None = _EMA,
        sampling: SamplingConfig = _SAMPLING,
        speed: SpeedConfig = _SPEED,
        cache_latents: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.loss_cfg, self.optim_cfg, self.sampling, self.seed = loss, optim, sampling, seed
        self.cache_latents, self.speed = cache_latents, speed
        self.sync_every = speed.sync_every
        _check_speed(speed, cache_latents, list(trainable))
        parts = load_components(
            pretrained=pretrained,
            unet=unet,
            vae=vae,
            text_encoder=text_encoder,
            scheduler=scheduler,
            knowledge=knowledge,
            fusion_layers=list(fusion_layers),
        )
        self.unet, self.vae, self.text_encoder = parts["unet"], parts["vae"], parts["text_encoder"]
        self.scheduler_config = training_schedule(parts["scheduler_config"], loss)
        from diffusers import DDPMScheduler

        # The forward process of training: the model folder's betas (rescaled to zero terminal
        # SNR when the config says so: DDPMScheduler reads the flag), DDPM's add_noise/get_velocity.
        self.noise_scheduler = DDPMScheduler.from_config(self.scheduler_config)
        self.prediction_type = self.noise_scheduler.config.prediction_type
        self._check_widths()
        self.trained = self._select_trainable(list(trainable))
        if text_encoder_lr is not None and (text_encoder_lr <= 0 or "text_encoder" not in self.trained):
            raise ValueError(
                f"text_encoder_lr={text_encoder_lr}: needs a value > 0 and 'text_encoder' in model.trainable "
                f"(trainable: {self.trained}); leave it null otherwise"
            )
        self.text_encoder_lr = text_encoder_lr
        apply_speedups(self.unet, speed)
        if speed.gradient_checkpointing and "text_encoder" in self.trained:
            self.text_encoder.text_model.gradient_checkpointing_enable()
        self.ema = self._make_ema(ema)
        self._latents: torch.Tensor | None = None  # (N, 2·C, h, w) latent mean ‖ logvar when cached
        self._tokenize = TokenMemo(self.text_encoder.tokenize)  # caption → its tokenize() row
        self._resident: ResidentData | None = None  # speed.gpu_data: the training set on the device
        self._graphed: GraphedLoss | None = None  # speed.cuda_graph, from step GRAPH_WARMUP_STEPS on
        self.strict_loading = False  # checkpoints hold trained weights only (see on_save_checkpoint)
        self.train()  # frozen parts to eval mode now: Lightning keeps submodule modes as it finds them

    # ------------------------------------------------------------------ set-up
    def _check_widths(self) -> None:
        from rapiddiff.models.bundle import check_parts

        check_parts(self.unet, self.vae, self.text_encoder)

    def _select_trainable(self, train: list[str]) -> list[str]:
        allowed = {"unet", "fusion", "text_encoder"}
        unknown = sorted(set(train) - allowed)
        if unknown:
            raise ValueError(f"trainable: unknown part(s) {unknown}; choose from {sorted(allowed)}")
        if "fusion" in train and self.text_encoder.fusion is None:
            raise ValueError(
                "trainable: 'fusion' needs a knowledge store: set model.knowledge to a KnowledgeStore folder "
                "or start from a text encoder saved with one"
            )
        self.requires_grad_(False)
        for name in train:
            self._part(name).requires_grad_(True)
        return train

    def _part(self, name: str) -> nn.Module:
        if name == "unet":
            return self.unet
        if name == "fusion":
            assert self.text_encoder.fusion is not None
            return self.text_encoder.fusion
        modules = nn.ModuleList([self.text_encoder.text_model])
        if self.text_encoder.output_projection is not None:
            modules.append(self.text_encoder.output_projection)
        return modules

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def _make_ema(self, cfg: EMAConfig | None) -> Any:
        if cfg is None:
            return None
        from diffusers.training_utils import EMAModel

        return (lerp_ema if self.speed.foreach_ema else EMAModel)(
            self.trainable_parameters(),
            decay=cfg.decay,
            use_ema_warmup=cfg.warmup,
            power=cfg.power,
            update_after_step=cfg.update_after_step,
            foreach=True,
        )

    def train(self, mode: bool = True) -> LatentDiffusion:
        """Frozen parts stay in eval mode (no dropout) while the rest trains."""
        super().train(mode)
        if mode:
            self.vae.eval()
            for name in ("unet", "fusion", "text_encoder"):
                if name not in self.trained and (name != "fusion" or self.text_encoder.fusion is not None):
                    self._part(name).eval()
        return self

    def setup(self, stage: str) -> None:
        # Frozen parts run in the training precision's dtype, as train_text_to_image.py casts
        # vae/text_encoder to weight_dtype: half the memory, no per-op casts.
        if self.ema is not None and "FSDP" in type(self.trainer.strategy).__name__:
            # diffusers' EMAModel keeps full copies of parameters that FSDP shards: not supported.
            raise ValueError(
                "model.ema cannot be combined with the FSDP strategy: set `model.ema: null` or use ddp"
            )
        if self.speed.cuda_graph:
            self._check_graph_trainer()
        dtype = frozen_dtype(str(self.trainer.precision))
        self.vae.to(dtype=dtype)
        if "text_encoder" not in self.trained:
            self.text_encoder.text_model.to(dtype=dtype)

    def configure_optimizers(self) -> dict[str, Any]:
        return configure_adamw(self, self.parameter_groups(), self.optim_cfg)

    def parameter_groups(self) -> list[Any]:
        """What AdamW trains: every trainable parameter, or with ``text_encoder_lr`` two groups (the
        tower at its own rate; the schedule scales both alike)."""
        if self.text_encoder_lr is None:
            return self.trainable_parameters()
        tower = {id(p) for p in self._part("text_encoder").parameters() if p.requires_grad}
        trained = self.trainable_parameters()
        return [
            {"params": [p for p in trained if id(p) not in tower]},
            {"params": [p for p in trained if id(p) in tower], "lr": self.text_encoder_lr},
        ]

    # ------------------------------------------------------------------ one step
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        if self._resident is not None:  # speed.gpu_data: the same draws, gathered on the device
            latents, text = self._resident.batch(self, batch["position"])
        else:
            latents = self.encode_images(batch)  # (B, C, h, w), scaled
            captions = self.drop_captions(batch["text"])
            # non_blocking: a blocking host-to-device copy waits for the GPU to drain (the previous
            # step's backward and optimizer, this step's VAE encode) before the text encoder and
            # U-Net are even queued. From pageable memory the driver stages the bytes at the call,
            # so the fresh tensors may be dropped at once.
            text = {k: v.to(self.device, non_blocking=True) for k, v in self._tokenize(captions).items()}
        if self.speed.cuda_graph and self.global_step >= GRAPH_WARMUP_STEPS:
            loss = self._graph_step(latents, text)
        else:
            context = text if isinstance(text, torch.Tensor) else self.text_forward(text)  # (B, L, D)
            loss = self.denoising_loss(latents, context)
        self.check_finite(loss)
        # Lightning turns every prog_bar value into a Python number at every batch end (a host
        # sync, progress bar shown or not): with sync_every > 1 the loss goes to the loggers
        # and the plain progress lines on logging steps only.
        self.log("train/loss", loss, prog_bar=self.sync_every == 1)
        return loss

    def denoising_loss(self, latents: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """Noise → noisy latents → U-Net → loss (the part of a step speed.cuda_graph captures)."""
        noise = self.sample_noise(latents)
        timesteps = torch.randint(
            0, self.noise_scheduler.config.num_train_timesteps, (latents.shape[0],), device=latents.device
        )
        noised_with = noise
        if self.loss_cfg.input_perturbation:  # by shape, not randn_like: see sample_noise
            extra = torch.randn(noise.shape, device=noise.device, dtype=noise.dtype)
            noised_with = noise + self.loss_cfg.input_perturbation * extra
        noisy = self.noise_scheduler.add_noise(latents, noised_with, timesteps)
        target = self.target(latents, noise, timesteps)
        prediction = self.unet(noisy, timesteps, encoder_hidden_states=context).sample
        return self.diffusion_loss(prediction, target, timesteps)

    # ------------------------------------------------------------------ the captured step
    @property
    def text_trains(self) -> bool:
        return bool({"fusion", "text_encoder"} & set(self.trained))

    def _check_graph_trainer(self) -> None:
        trainer = self.trainer
        if trainer.world_size > 1 and not self._plain_ddp():
            raise ValueError(
                f"speed.cuda_graph runs on one GPU or under DDP, not {type(trainer.strategy).__name__}: "
                "set speed.cuda_graph: false or trainer.strategy: ddp"
            )
        super()._check_graph_trainer()

    def _plain_ddp(self) -> bool:
        from pytorch_lightning.strategies import DDPStrategy

        return isinstance(self.trainer.strategy, DDPStrategy)

    def _graph_step(
        self, latents: torch.Tensor, text: torch.Tensor | dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """One step replayed as a CUDA graph. A frozen text side runs before it (no grad, its
        states are an input); a trained one (fusion, tower) is captured with the U-Net, so its
        gradients come out of the same replay."""
        captured = isinstance(text, dict) and self.text_trains
        if isinstance(text, dict) and not captured:
            text = self.text_forward(text)
        names = list(text) if isinstance(text, dict) else []
        if self._graphed is None:
            precision = str(self.trainer.precision) if self._trainer is not None else "32-true"

            def text_and_denoising_loss(latents: torch.Tensor, *tokens: torch.Tensor) -> torch.Tensor:
                context = self.text_forward(dict(zip(names, tokens, strict=True)))
                return self.denoising_loss(latents, context)

            self._graphed = GraphedLoss(
                text_and_denoising_loss if captured else self.denoising_loss,
                self.trainable_parameters()
                if captured
                else [p for p in self.unet.parameters() if p.requires_grad],
                autocast_dtype=frozen_dtype(precision) if "mixed" in precision else None,
                capture=latents.device.type == "cuda",
            )
        inputs = [text[k] for k in names] if isinstance(text, dict) else [text]
        return self._graphed(latents, *inputs)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        super().backward(loss, *args, **kwargs)  # RapidModule's: skipped once the graph replays
        if self.speed.cuda_graph and self._trainer is not None and self.trainer.world_size > 1:
            self._all_reduce_grads()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.speed.cuda_graph and self._trainer is not None and self.trainer.world_size > 1:
            # DDP's reducer all-reduces from autograd hooks, which a replay does not run: keep it
            # idle (as no_sync() does) and average the gradients in _all_reduce_grads instead.
            ddp = self.trainer.strategy.model
            if hasattr(ddp, "require_backward_grad_sync"):
                ddp.require_backward_grad_sync = False

    @torch.no_grad()
    def _all_reduce_grads(self) -> None:
        """Average the trained gradients over the ranks: one all-reduce over a flat copy per dtype."""
        import torch.distributed as dist

        grads = [p.grad for p in self.trainable_parameters() if p.grad is not None]
        for dtype in {g.dtype for g in grads}:
            same = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in same])
            dist.all_reduce(flat)
            flat.div_(self.trainer.world_size)
            torch._foreach_copy_(
                same, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in same]), same, strict=True)]
            )

    def configure_gradient_clipping(
        self,
        optimizer: Any,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        if gradient_clip_val and self._fsdp():
            # A shard's norm is not the model's: the root FSDP unit reduces it over the ranks.
            if gradient_clip_algorithm in (None, "norm"):
                self.trainer.strategy.model.clip_grad_norm_(gradient_clip_val)
            else:
                torch.nn.utils.clip_grad_value_(self.trainable_parameters(), gradient_clip_val)
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        """The same loss with noise and timesteps fixed per batch, so curves are comparable."""
        generator = torch.Generator().manual_seed(10_000 + batch_idx)
        latents = self.encode_images(batch, sample=False)
        context = self.encode_text(list(batch["text"]))
        noise = torch.randn(latents.shape, generator=generator).to(latents)
        timesteps = torch.randint(
            0, self.noise_scheduler.config.num_train_timesteps, (latents.shape[0],), generator=generator
        ).to(latents.device)
        noisy = self.noise_scheduler.add_noise(latents, noise, timesteps)
        prediction = self.unet(noisy, timesteps, encoder_hidden_states=context).sample
        loss = F.mse_loss(prediction.float(), self.target(latents, noise, timesteps).float())
        self.log("val/loss", loss, sync_dist=True)
        return loss

    def encode_images(self, batch: dict[str, Any], sample: bool = True) -> torch.Tensor:
        """Pixels [-1, 1] → VAE latents × scaling_factor (from the cache when it is filled)."""
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        if self._latents is not None and sample:
            params = self._latents[batch["index"].cpu()].to(self.device)
        else:
            # Outside autocast: the frozen VAE runs in its own (training-precision) dtype, as
            # train_text_to_image.py runs it; autocast would redo its GroupNorms in float32.
            with torch.no_grad(), torch.autocast(self.device.type, enabled=False):
                params = self.vae.encode(batch["pixel_values"].to(self.vae.dtype)).latent_dist.parameters
        dist = DiagonalGaussianDistribution(params.float())
        latents = dist.sample() if sample else dist.mode()
        return latents * self.vae.config.scaling_factor

    def drop_captions(self, captions: Sequence[str]) -> list[str]:
        """Replace each caption by "" with probability caption_dropout (for guidance)."""
        drop = torch.rand(len(captions)) < self.loss_cfg.caption_dropout
        return ["" if d else c for c, d in zip(captions, drop.tolist(), strict=True)]

    def encode_text(self, captions: Sequence[str]) -> torch.Tensor:
        tokens = {k: v.to(self.device) for k, v in self._tokenize(list(captions)).items()}
        return self.text_forward(tokens)

    def text_forward(self, tokens: dict[str, torch.Tensor]) -> torch.Tensor:
        """Tokens on the device → hidden states (with grad when a text part trains)."""
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.text_trains):
            return self.text_encoder(**tokens)

    def sample_noise(self, latents: torch.Tensor) -> torch.Tensor:
        # By shape, not randn_like: the draw must not depend on the latents' memory layout (a VAE's
        # output can be channels-last, the latent cache's is contiguous).
        noise = torch.randn(latents.shape, device=latents.device, dtype=latents.dtype)
        if self.loss_cfg.noise_offset:
            # Per image and channel: lets the model shift overall brightness (Guttenberg 2023).
            noise = noise + self.loss_cfg.noise_offset * torch.randn(
                latents.shape[0], latents.shape[1], 1, 1, device=latents.device, dtype=latents.dtype
            )
        return noise

    def target(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        if self.prediction_type == "v_prediction":
            return self.noise_scheduler.get_velocity(latents, noise, timesteps)
        return noise

    def diffusion_loss(
        self, prediction: torch.Tensor, target: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor:
        """MSE, optionally min-SNR weighted (as diffusers' train_text_to_image.py computes it)."""
        if self.loss_cfg.snr_gamma is None:
            return F.mse_loss(prediction.float(), target.float())
        from diffusers.training_utils import compute_snr

        snr = compute_snr(self.noise_scheduler, timesteps)
        if self.prediction_type != "v_prediction":
            weights = snr.clamp(max=self.loss_cfg.snr_gamma) / snr
        elif self.noise_scheduler.config.get("rescale_betas_zero_snr", False):
            # min(SNR + 1, γ) / (SNR + 1), diffusers' earlier v form: the terminal step (SNR 0,
            # where v = -x0 must come from the text alone) keeps weight 1. The form below gives it
            # min(0, γ) / 1 = 0, leaving the very step sampling starts from untrained.
            weights = (snr + 1).clamp(max=self.loss_cfg.snr_gamma) / (snr + 1)
        else:
            weights = snr.clamp(max=self.loss_cfg.snr_gamma) / (snr + 1)
        per_image = F.mse_loss(prediction.float(), target.float(), reduction="none").mean(dim=(1, 2, 3))
        return (per_image * weights).mean()

    # ------------------------------------------------------------------ EMA and checkpoints
    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(epoch, batch_idx, optimizer, *args, **kwargs)
        if self._graphed is None:
            # Free the gradients now, not at the next step's zero_grad (Lightning's comes after the
            # forward): they would otherwise sit beside the next forward's activations.
            optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.step(p for p in self.parameters() if p.requires_grad)  # LerpEMA reads it once

    def on_fit_start(self) -> None:
        if self.ema is not None:
            self.ema.to(self.device)

    def configure_callbacks(self) -> list[Any]:
        return [FrozenGC()]  # no full GC pauses in a host-bound step

    def on_train_start(self) -> None:
        if self.cache_latents and self._latents is None:
            self._latents = self._encode_dataset(self.trainer.train_dataloader)
        if self.speed.gpu_data:
            dataset = getattr(self.trainer.train_dataloader, "dataset", None)
            self._resident = ResidentData.build(self, getattr(dataset, "source", dataset))
            return
        if self._latents is not None:
            # Workers start after this hook: from now on they skip decoding images (latents are cached).
            dataset = getattr(self.trainer.train_dataloader, "dataset", None)
            if hasattr(dataset, "decode_images"):
                dataset.decode_images = False

    # ------------------------------------------------------------------ FSDP
    def _fsdp(self) -> bool:
        from pytorch_lightning.strategies import FSDPStrategy

        return self._trainer is not None and isinstance(self.trainer.strategy, FSDPStrategy)

    def fsdp_units(self) -> list[nn.Module]:
        """The trained parts as FSDP units: the U-Net's down/mid/up blocks and the U-Net itself (its
        stem and head), the fusion, the text tower and its projection."""
        units: list[nn.Module] = []
        if "unet" in self.trained:
            unet = getattr(self.unet, "_orig_mod", self.unet)
            units += [
                *unet.down_blocks,
                *([unet.mid_block] if unet.mid_block is not None else []),
                *unet.up_blocks,
            ]
            units.append(self.unet)
        for name in ("fusion", "text_encoder"):
            if name in self.trained:
                units.extend(self._part(name) if name == "text_encoder" else [self._part(name)])
        return units

    def fsdp_ignored(self) -> list[nn.Module]:
        """Frozen parts stay whole on every rank (in the training dtype, outside the flat parameters)."""
        ignored: list[nn.Module] = [self.vae]
        for name in ("unet", "fusion", "text_encoder"):
            if name not in self.trained and (name != "fusion" or self.text_encoder.fusion is not None):
                part = self._part(name)
                ignored.extend(part if isinstance(part, nn.ModuleList) else [part])
        return ignored

    def _trained_names(self) -> set[str]:
        # Under FSDP the wrapped submodules' names carry "_fsdp_wrapped_module."; checkpoints don't.
        return {_plain_name(n) for n, p in self.named_parameters() if p.requires_grad}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)  # a deferred non-finite check stops the save first
        # Only what training changes: frozen weights come back from the config's sources.
        trained = self._trained_names()
        frozen = {_plain_name(n) for n, _ in self.named_parameters()} - trained
        state = checkpoint["state_dict"]
        for name in frozen & set(state):
            del state[name]
        if self.ema is not None:
            checkpoint["ema"] = self.ema.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        trained = self._trained_names()
        # FSDP's loader has already taken the weights out ("state_dict" popped) and loaded them.
        missing = sorted(trained - set(checkpoint["state_dict"])) if "state_dict" in checkpoint else []
        if missing:
            raise ValueError(
                f"the checkpoint lacks {len(missing)} trained weights (e.g. {missing[0]}): it was written "
                "with other `trainable` parts, LoRA or speed.fuse_qkv settings; resume with the same model config"
            )
        if self.ema is not None:
            if "ema" not in checkpoint:
                raise ValueError(
                    "the checkpoint has no EMA state but model.ema is set; resume with ema: null"
                )
            self.ema.load_state_dict(checkpoint["ema"])

    @torch.no_grad()
    def _encode_dataset(self, loader: Any) -> torch.Tensor:
        from torch.utils.data import DataLoader
        from tqdm.auto import tqdm

        dataset = getattr(loader.dataset, "source", loader.dataset)  # an index loader's dataset
        workers = getattr(self.trainer.datamodule, "num_workers", loader.num_workers) if self._trainer else 0
        plain = DataLoader(dataset, batch_size=loader.batch_size, num_workers=workers, shuffle=False)
        # Items are indexed by their row in the source table (skipped rows leave gaps).
        positions = getattr(dataset, "indices", None)
        rows = max(positions) + 1 if positions else len(dataset)
        cache: torch.Tensor | None = None
        filled = torch.zeros(rows, dtype=torch.bool)
        quiet = self._trainer is not None and not self.trainer.is_global_zero
        for batch in tqdm(plain, desc="caching latents", disable=quiet):
            params = self.vae.encode(
                batch["pixel_values"].to(self.device, self.vae.dtype)
            ).latent_dist.parameters
            if cache is None:
                cache = torch.empty((rows, *params.shape[1:]), dtype=torch.float32)
            cache[batch["index"]] = params.float().cpu()
            filled[batch["index"]] = True
        assert cache is not None
        if positions is not None and hasattr(dataset, "mark_failed"):
            # Items that failed to decode in the workers were replaced there by the next good one,
            # leaving their cache rows empty: skip them for the rest of training too.
            dataset.mark_failed(j for j, row in enumerate(positions) if not filled[row])
        self._filled = filled
        return cache

    # ------------------------------------------------------------------ sampling and export
    def sample_images(self) -> torch.Tensor | None:
        s = self.sampling
        if not s.prompts or not s.seeds:  # `--model.sampling.prompts=[]`: no grid, not a tokenizer error
            return None
        prompts = [p for p in s.prompts for _ in s.seeds]
        seeds = [seed for _ in s.prompts for seed in s.seeds]
        with self.ema_weights():
            return self.generate(prompts, seeds)

    def sampling_defaults(self) -> SamplingDefaults:
        """The sampling settings of the grids and of the exported folder: this config's, where it
        gives them, else the start model's (``pretrained``), else the library's."""
        from rapiddiff.models.bundle import read_sampling

        pretrained = self.hparams.get("pretrained")
        base = (read_sampling(pretrained) if pretrained else None) or SamplingDefaults()
        s = self.sampling
        return SamplingDefaults(
            num_inference_steps=s.num_inference_steps or base.num_inference_steps,
            guidance_scale=base.guidance_scale if s.guidance_scale is None else s.guidance_scale,
            # A base's PNDM becomes DDIM on a zero-terminal-SNR schedule (PNDM cannot sample it).
            scheduler=s.scheduler or default_sampler(self.scheduler_config, base.scheduler),
        )

    @torch.no_grad()
    def generate(self, prompts: list[str], seeds: list[int]) -> torch.Tensor:
        """Images [N, 3, H, W] in [0, 1] through the one generation path (rapiddiff.models.sampling):
        image k from its own CPU generator seeded ``seeds[k]``, as ``rapiddiff generate`` makes it."""
        from rapiddiff.models import sampling

        s, d = self.sampling, self.sampling_defaults()
        scheduler = sampling.make_scheduler(d.scheduler, self.scheduler_config)
        scheduler.set_timesteps(d.num_inference_steps, device=self.device)
        side = s.size // sampling.vae_scale_factor(self.vae) if s.size else int(self.unet.config.sample_size)
        cond = self.text_encoder.encode(prompts).to(self.unet.dtype)  # (N, L, D)
        uncond = None
        if d.guidance_scale > 1.0:
            uncond = self.text_encoder.encode([s.negative_prompt] * len(prompts)).to(self.unet.dtype)
        shape = (int(self.vae.config.latent_channels), side, side)
        noise = sampling.draw_noise(sampling.generators(seeds), shape, torch.float32).to(self.device)
        latents = sampling.denoise(
            sampling.unet_model(self.unet),
            noise * scheduler.init_noise_sigma,  # (N, C, h, w)
            cond,
            uncond,
            scheduler,
            scheduler.timesteps,
            d.guidance_scale,
        )
        return sampling.decode(self.vae, latents)

    class _EMASwap:
        def __init__(self, module: LatentDiffusion) -> None:
            self.module = module

        def __enter__(self) -> None:
            ema = self.module.ema
            if ema is not None:
                params = self.module.trainable_parameters()
                ema.store(params)
                ema.copy_to(params)

        def __exit__(self, *exc: Any) -> None:
            if self.module.ema is not None:
                self.module.ema.restore(self.module.trainable_parameters())

    def ema_weights(self) -> LatentDiffusion._EMASwap:
        """Context: the EMA weights in place of the trained ones (no-op without EMA)."""
        return LatentDiffusion._EMASwap(self)

    def export(self, path: Path) -> Path:
        """The model folder (DESIGN.md layout, diffusers-loadable), EMA weights when EMA is on; the
        start model's (``pretrained``) upscaler and sampling defaults are carried forward."""
        from rapiddiff.models.bundle import ModelBundle, read_sampling, save_model_folder
        from rapiddiff.models.sampling import make_scheduler

        if self.ema is not None:
            self.ema.copy_to(self.trainable_parameters())
        unfuse_for_saving(self.unet)
        self.vae.to(dtype=torch.float32)
        self.text_encoder.text_model.to(dtype=torch.float32)
        unet = getattr(self.unet, "_orig_mod", self.unet)
        # A fine-tune keeps its base's defaults (tuned for it); a model trained from scratch gets the grids'.
        pretrained = self.hparams.get("pretrained")
        defaults = (read_sampling(pretrained) if pretrained else None) or self.sampling_defaults()
        sampler = default_sampler(self.scheduler_config, defaults.scheduler)
        if sampler != defaults.scheduler:
            log.info("export: sampler %s → %s (zero-terminal-SNR schedule)", defaults.scheduler, sampler)
            defaults = dataclasses.replace(defaults, scheduler=sampler)
        bundle = ModelBundle(
            unet,
            self.vae,
            # The folder's scheduler class: diffusers' pipelines sample with it as they find it.
            make_scheduler(
                default_sampler(self.scheduler_config, SamplingDefaults.scheduler), self.scheduler_config
            ),
            self.text_encoder,
            upscaler=self._base_upscaler(),
            sampling=defaults,
        )
        return save_model_folder(bundle, path)

    def _base_upscaler(self) -> nn.Module | None:
        """The start model's upscaler, carried into the export (logged when there is none)."""
        pretrained = self.hparams.get("pretrained")
        folder = Path(pretrained) / "upscaler" if pretrained else None
        if folder is None or not folder.is_dir():
            log.info(
                "export: no upscaler/ to carry over (%s); add one with `rapiddiff train upscaler`",
                f"{pretrained} has none" if pretrained else "trained from scratch",
            )
            return None
        from rapiddiff.models.upscaler import load_upscaler

        return load_upscaler(folder)


def training_schedule(config: Any, loss: DiffusionLoss) -> dict[str, Any]:
    """The start model's scheduler config with the loss's prediction type and schedule applied;
    raises when the two do not fit (ε-prediction on a zero-terminal-SNR schedule)."""
    from rapiddiff.models.sampling import zero_terminal_snr

    out = dict(config)
    if loss.prediction_type is not None:
        out["prediction_type"] = loss.prediction_type
    if loss.zero_terminal_snr:
        out = zero_terminal_snr_config(out)
    prediction = out.get("prediction_type", "epsilon")
    if prediction not in ("epsilon", "v_prediction"):
        raise ValueError(f"prediction_type {prediction!r}: use epsilon or v_prediction")
    if zero_terminal_snr(out) and prediction != "v_prediction":
        raise ValueError(
            "a zero-terminal-SNR schedule (model.loss.zero_terminal_snr, or a start model trained with "
            "one) needs model.loss.prediction_type: v_prediction — at the last timestep x_T is pure "
            "noise, so an ε-prediction says nothing about the image (and min-SNR weights divide by 0)"
        )
    return out


def _plain_name(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "")


def _check_speed(speed: SpeedConfig, cache_latents: bool, trainable: list[str]) -> None:
    if speed.gpu_data and not cache_latents:
        raise ValueError("speed.gpu_data keeps the latent cache on the GPU: set model.cache_latents: true")
    if speed.cache_text and not speed.gpu_data:
        raise ValueError("speed.cache_text needs speed.gpu_data: true (the states live beside the latents)")
    if speed.cache_text and {"fusion", "text_encoder"} & set(trainable):
        raise ValueError(
            "speed.cache_text needs a frozen text side, but model.trainable has "
            f"{sorted({'fusion', 'text_encoder'} & set(trainable))}: set cache_text: false"
        )
    if speed.cuda_graph and speed.compile:
        raise ValueError(
            "speed.cuda_graph and speed.compile: choose one (a compiled U-Net is not captured here)"
        )
    if speed.sync_every < 1:
        raise ValueError(
            f"speed.sync_every is a number of steps >= 1 (1: every step), got {speed.sync_every}"
        )


class ResidentData:
    """The training set on the device (``speed.gpu_data``): latent parameters, tokens per caption,
    and with ``speed.cache_text`` the caption hidden states. A batch is gathered from the sampler's
    positions with the plain step's random draws, in its order (latent sample on the device,
    caption dropout from the host generator)."""

    def __init__(
        self,
        latents: torch.Tensor,
        rows: torch.Tensor,
        captions: torch.Tensor,
        empty: int,
        tokens: dict[str, torch.Tensor],
        states: torch.Tensor | None,
    ) -> None:
        self.latents = latents  # (N_rows, 2·C, h, w) mean ‖ logvar, float32
        self.rows = rows  # (N,) position → source row (failed items → the next good one)
        self.captions = captions  # (N,) position → distinct-caption id
        self.empty = empty  # the id of "" (caption dropout)
        self.tokens = tokens  # {name: (U, L)} per distinct caption
        self.states = states  # (U, L, D) or None

    @classmethod
    @torch.no_grad()
    def build(cls, module: LatentDiffusion, dataset: Any) -> ResidentData:
        if module._latents is None or not hasattr(dataset, "texts") or not hasattr(dataset, "indices"):
            raise ValueError(
                "speed.gpu_data needs cached latents and an ImageTextDataset (with .texts and .indices); "
                f"got {type(dataset).__name__}"
            )
        filled = getattr(module, "_filled", None)
        rows: list[int] = list(dataset.indices)
        good = [j for j, r in enumerate(rows) if filled is None or bool(filled[r])]
        if not good:
            raise RuntimeError("speed.gpu_data: no training image could be encoded")
        # As ImageTextDataset.__getitem__ does: a failed item is replaced by the next good one.
        nxt, redirect = good[0], [0] * len(rows)
        for j in reversed(range(len(rows))):
            if filled is None or bool(filled[rows[j]]):
                nxt = j
            redirect[j] = nxt
        texts = [dataset.texts[redirect[j]] for j in range(len(rows))]
        distinct = list(dict.fromkeys(["", *texts]))
        ids = {c: i for i, c in enumerate(distinct)}
        device = module.device
        tokens = {k: v.to(device) for k, v in module._tokenize(distinct).items()}
        states = None
        if module.speed.cache_text:
            chunks = []
            context = module.trainer.precision_plugin.forward_context() if module._trainer else None
            with context or contextlib.nullcontext():
                for start in range(0, len(distinct), 256):
                    part = {k: v[start : start + 256] for k, v in tokens.items()}
                    chunks.append(module.text_forward(part))
            states = torch.cat(chunks)
        return cls(
            latents=module._latents.to(device),
            rows=torch.tensor([rows[redirect[j]] for j in range(len(rows))], device=device),
            captions=torch.tensor([ids[t] for t in texts], device=device),
            empty=ids[""],
            tokens=tokens,
            states=states,
        )

    def batch(
        self, module: LatentDiffusion, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | dict[str, torch.Tensor]]:
        """Latents (B, C, h, w) scaled, and the cached context (B, L, D) or the captions' tokens
        (B, L) for these sampler positions."""
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        positions = positions.to(self.rows.device, non_blocking=True)
        params = self.latents[self.rows[positions]]  # (B, 2·C, h, w)
        latents = DiagonalGaussianDistribution(params).sample() * module.vae.config.scaling_factor
        drop = torch.rand(len(positions)) < module.loss_cfg.caption_dropout  # as drop_captions draws it
        if drop.device != positions.device:
            drop = drop.pin_memory().to(positions.device, non_blocking=True)
        caption = torch.where(drop, self.empty, self.captions[positions])  # (B,)
        if self.states is not None:
            return latents, self.states[caption]
        return latents, {k: v[caption] for k, v in self.tokens.items()}


def frozen_dtype(precision: str) -> torch.dtype:
    """dtype for frozen modules under a Trainer precision ("bf16-mixed" → bfloat16, ...)."""
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return torch.float32


# ----------------------------------------------------------------------------- loading parts
def _is_preset(value: str, names: Sequence[str]) -> bool:
    return value in names and not Path(value).exists()


def _subfolder(path: Path, name: str, marker: str = "config.json") -> Path:
    """``path/name`` when it holds the component, else ``path`` itself (a bare component folder)."""
    if (path / name / marker).is_file():
        return path / name
    if (path / marker).is_file():
        return path
    raise FileNotFoundError(
        f"{path}: no {name}/{marker} or {marker}; expected a {name} folder or a model folder"
    )


def load_components(
    *,
    pretrained: str | None,
    unet: str,
    vae: str,
    text_encoder: str,
    scheduler: str | None,
    knowledge: str | None,
    fusion_layers: list[int],
) -> dict[str, Any]:
    """U-Net, VAE, KnowledgeTextEncoder and the scheduler config, from presets or folders."""
    import json

    from diffusers import AutoencoderKL, UNet2DConditionModel

    from rapiddiff.models import presets
    from rapiddiff.models.text_encoder import KnowledgeTextEncoder

    if pretrained is not None:
        from rapiddiff.models.bundle import load_model_folder

        bundle = load_model_folder(pretrained, load_upscaler=False)
        parts: dict[str, Any] = {
            "unet": bundle.unet,
            "vae": bundle.vae,
            "text_encoder": bundle.text_encoder,
            "scheduler_config": dict(bundle.scheduler.config),
        }
    else:
        if _is_preset(unet, presets.PRESETS):
            unet_model = UNet2DConditionModel(**presets.unet_config(unet))
        elif Path(unet).is_file():  # a config.json alone: another architecture, random init
            unet_model = UNet2DConditionModel.from_config(presets.read_unet_config(unet))
        else:
            unet_model = UNet2DConditionModel.from_pretrained(str(_subfolder(Path(unet), "unet")))
        if _is_preset(vae, presets.PRESETS):
            log.warning("VAE preset %r: random weights — only for tests and benchmarks", vae)
            vae_model = AutoencoderKL(**presets.vae_config(vae))
        else:
            vae_model = AutoencoderKL.from_pretrained(str(_subfolder(Path(vae), "vae")))
        if _is_preset(text_encoder, presets.PRESETS):
            from transformers import BertConfig, BertModel

            from rapiddiff.models.text_encoder import chinese_bert_tokenizer

            tower = BertModel(BertConfig(**presets.bert_text_config(text_encoder)), add_pooling_layer=False)
            encoder = KnowledgeTextEncoder(
                tower,
                chinese_bert_tokenizer(),
                fusion_layers=fusion_layers,
                out_dim=unet_model.config.cross_attention_dim,
            )
        else:
            encoder = KnowledgeTextEncoder.from_pretrained(text_encoder)
        config = presets.scheduler_config()
        if scheduler is not None:
            file = _subfolder(Path(scheduler), "scheduler", "scheduler_config.json") / "scheduler_config.json"
            config = json.loads(file.read_text(encoding="utf-8"))
        parts = {"unet": unet_model, "vae": vae_model, "text_encoder": encoder, "scheduler_config": config}
    if knowledge is not None:
        from rapiddiff.kg.store import KnowledgeStore

        if parts["text_encoder"].store is not None:
            log.warning(
                "replacing the text encoder's KnowledgeStore with %s (fusion weights restart at zero)",
                knowledge,
            )
        parts["text_encoder"].set_store(KnowledgeStore.load(knowledge))
    for name in ("unet", "vae", "text_encoder"):
        parts[name].train().requires_grad_(True)
    return parts


def cli_main(args: list[str] | None = None) -> RapidCLI:
    """``rapiddiff train unet``: LightningCLI over LatentDiffusion + ImageTextData."""
    return run_cli(
        LatentDiffusion,
        ImageTextData,
        args,
        prog="rapiddiff train unet",
        description="Train a latent-diffusion U-Net on the knowledge-enhanced text encoder.",
    )
