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

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

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
)
from rapiddiff.train.unet_config import DiffusionLoss, EMAConfig, SamplingConfig
from rapiddiff.train.unet_data import ResidentData, encode_dataset
from rapiddiff.train.unet_parts import (
    check_speed,
    frozen_dtype,
    load_components,
    plain_name,
    training_schedule,
)
from rapiddiff.train.unet_samples import EMAWeights, draw, export_model_folder
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)

TrainableName = Literal["unet", "fusion", "text_encoder"]


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
            CLIP stage, and at the U-Net's rate it forgets what that stage taught it: kohya's
            ``text_encoder_lr`` and DreamBooth practice give it a smaller one.
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
        check_speed(speed, cache_latents, list(trainable))
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
        prediction = self.validation_prediction(noisy, timesteps, context, batch)
        loss = F.mse_loss(prediction.float(), self.target(latents, noise, timesteps).float())
        self.log("val/loss", loss, sync_dist=True)
        return loss

    def validation_prediction(
        self, noisy: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor, batch: dict[str, Any]
    ) -> torch.Tensor:
        """The model's prediction in :meth:`validation_step` (a subclass adds its own inputs, e.g. the
        ControlNet stage's control images from ``batch``)."""
        return self.unet(noisy, timesteps, encoder_hidden_states=context).sample

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
            self._latents, self._filled = encode_dataset(self, self.trainer.train_dataloader)
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
        return {plain_name(n) for n, p in self.named_parameters() if p.requires_grad}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)  # a deferred non-finite check stops the save first
        # Only what training changes: frozen weights come back from the config's sources.
        trained = self._trained_names()
        frozen = {plain_name(n) for n, _ in self.named_parameters()} - trained
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

    # ------------------------------------------------------------------ sampling and export
    def sample_images(self) -> torch.Tensor | None:
        s = self.sampling
        if not s.prompts or not s.seeds:  # `--model.sampling.prompts=[]`: no grid, not a tokenizer error
            return None
        prompts = [p for p in s.prompts for _ in s.seeds]
        seeds = [seed for _ in s.prompts for seed in s.seeds]
        with EMAWeights(self):
            return draw(self, prompts, seeds)

    def export(self, path: Path) -> Path:
        """The model folder (DESIGN.md layout, diffusers-loadable), EMA weights when EMA is on; the
        start model's (``pretrained``) upscaler and sampling defaults are carried forward."""
        return export_model_folder(self, path)


# ----------------------------------------------------------------------------- loading parts


def cli_main(args: list[str] | None = None) -> RapidCLI:
    """``rapiddiff train unet``: LightningCLI over LatentDiffusion + ImageTextData."""
    return run_cli(
        LatentDiffusion,
        ImageTextData,
        args,
        prog="rapiddiff train unet",
        description="Train a latent-diffusion U-Net on the knowledge-enhanced text encoder.",
    )
