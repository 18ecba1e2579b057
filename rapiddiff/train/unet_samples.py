"""The U-Net stage's images and artefact: sample grids through the one generation path, the
EMA weights swapped in for them, and the exported model folder."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from rapiddiff.models.sampling import ModelFn, SamplingDefaults, default_sampler
from rapiddiff.train.speed import (
    unfuse_for_saving,
)
from rapiddiff.utils.logging import get_logger

if TYPE_CHECKING:  # typed as the base class: unet.py imports this module
    from rapiddiff.train.module import RapidModule as LatentDiffusion

log = get_logger(__name__)


def sampling_defaults(module: LatentDiffusion) -> SamplingDefaults:
    """The sampling settings of the grids and of the exported folder: this config's, where it
    gives them, else the start model's (``pretrained``), else the library's."""
    from rapiddiff.models.bundle import read_sampling

    pretrained = module.hparams.get("pretrained")
    base = (read_sampling(pretrained) if pretrained else None) or SamplingDefaults()
    s = module.sampling
    return SamplingDefaults(
        num_inference_steps=s.num_inference_steps or base.num_inference_steps,
        guidance_scale=base.guidance_scale if s.guidance_scale is None else s.guidance_scale,
        # A base's PNDM becomes DDIM on a zero-terminal-SNR schedule (PNDM cannot sample it).
        scheduler=s.scheduler or default_sampler(module.scheduler_config, base.scheduler),
    )


@torch.no_grad()
def draw(
    module: LatentDiffusion, prompts: list[str], seeds: list[int], model: ModelFn | None = None
) -> torch.Tensor:
    """Images [N, 3, H, W] in [0, 1] through the one generation path (rapiddiff.models.sampling):
    image k from its own CPU generator seeded ``seeds[k]``, as ``rapiddiff generate`` makes it.
    ``model``: what denoises in place of the module's U-Net (a ControlNet stage's controlled U-Net)."""
    from rapiddiff.models import sampling

    s, d = module.sampling, sampling_defaults(module)
    scheduler = sampling.make_scheduler(d.scheduler, module.scheduler_config)
    scheduler.set_timesteps(d.num_inference_steps, device=module.device)
    side = s.size // sampling.vae_scale_factor(module.vae) if s.size else int(module.unet.config.sample_size)
    cond = module.text_encoder.encode(prompts).to(module.unet.dtype)  # (N, L, D)
    uncond = None
    if d.guidance_scale > 1.0:
        uncond = module.text_encoder.encode([s.negative_prompt] * len(prompts)).to(module.unet.dtype)
    shape = (int(module.vae.config.latent_channels), side, side)
    noise = sampling.draw_noise(sampling.generators(seeds), shape, torch.float32).to(module.device)
    latents = sampling.denoise(
        model or sampling.unet_model(module.unet),
        noise * scheduler.init_noise_sigma,  # (N, C, h, w)
        cond,
        uncond,
        scheduler,
        scheduler.timesteps,
        d.guidance_scale,
    )
    return sampling.decode(module.vae, latents)


class EMAWeights:
    """Context: the EMA weights in place of the trained ones (no-op without EMA)."""

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


def export_model_folder(module: LatentDiffusion, path: Path) -> Path:
    """The model folder (DESIGN.md layout, diffusers-loadable), EMA weights when EMA is on; the
    start model's (``pretrained``) upscaler and sampling defaults are carried forward."""
    from rapiddiff.models.bundle import ModelBundle, read_sampling, save_model_folder
    from rapiddiff.models.sampling import make_scheduler

    if module.ema is not None:
        module.ema.copy_to(module.trainable_parameters())
    unfuse_for_saving(module.unet)
    module.vae.to(dtype=torch.float32)
    module.text_encoder.text_model.to(dtype=torch.float32)
    unet = getattr(module.unet, "_orig_mod", module.unet)
    # A fine-tune keeps its base's defaults (tuned for it); a model trained from scratch gets the grids'.
    pretrained = module.hparams.get("pretrained")
    defaults = (read_sampling(pretrained) if pretrained else None) or sampling_defaults(module)
    sampler = default_sampler(module.scheduler_config, defaults.scheduler)
    if sampler != defaults.scheduler:
        log.info("export: sampler %s → %s (zero-terminal-SNR schedule)", defaults.scheduler, sampler)
        defaults = dataclasses.replace(defaults, scheduler=sampler)
    bundle = ModelBundle(
        unet,
        module.vae,
        # The folder's scheduler class: diffusers' pipelines sample with it as they find it.
        make_scheduler(
            default_sampler(module.scheduler_config, SamplingDefaults.scheduler), module.scheduler_config
        ),
        module.text_encoder,
        upscaler=base_upscaler(module),
        sampling=defaults,
    )
    return save_model_folder(bundle, path)


def base_upscaler(module: LatentDiffusion) -> nn.Module | None:
    """The start model's upscaler, carried into the export (logged when there is none)."""
    pretrained = module.hparams.get("pretrained")
    folder = Path(pretrained) / "upscaler" if pretrained else None
    if folder is None or not folder.is_dir():
        log.info(
            "export: no upscaler/ to carry over (%s); add one with `rapiddiff train upscaler`",
            f"{pretrained} has none" if pretrained else "trained from scratch",
        )
        return None
    from rapiddiff.models.upscaler import load_upscaler

    return load_upscaler(folder)
