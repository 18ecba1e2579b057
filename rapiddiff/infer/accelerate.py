"""``accelerate(pipe, ...)``: speed-ups applied from outside the model code, each one a switch.

It transforms the modules of *that* pipeline in place and swaps its denoise stage
(``pipe.denoiser``) for :class:`~rapiddiff.infer.fast_denoiser.GraphDenoiser`, the GPU-resident
loop captured as one CUDA graph with the VAE decode; prompts, seeds, samplers and metadata stay the
pipeline's, so a call means the same image on both paths. ``pipe.report`` says, switch by switch,
what applied here ("on", "off" or "fallback: <reason>").

    pipe = accelerate(pipe)                     # everything that pays, on this machine
    image = pipe("一只熊猫", seed=0).images[0]
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from rapiddiff.infer.fast_cache import compile_cache_file
from rapiddiff.infer.fast_config import AccelerateConfig
from rapiddiff.infer.fast_denoiser import GraphDenoiser
from rapiddiff.infer.fast_report import FastPathReport, SwitchStatus
from rapiddiff.infer.pipeline import RapidDiffusionPipeline


def accelerate(pipe: Any, config: AccelerateConfig | None = None, **switches: Any) -> RapidDiffusionPipeline:
    """Apply the fast path to ``pipe`` (in place) and return it, with ``.report``.

    ``switches`` override fields of ``config`` (see :class:`AccelerateConfig`), e.g.
    ``accelerate(pipe, attention="flash", compile_unet=None)``. A diffusers
    ``StableDiffusionPipeline`` comes back as a ``RapidDiffusionPipeline`` over the same modules.
    """
    config = AccelerateConfig(**{**asdict(config or AccelerateConfig()), **switches})
    if not isinstance(pipe, RapidDiffusionPipeline):
        from diffusers import DiffusionPipeline  # deferred: diffusers is slow to import

        if not isinstance(pipe, DiffusionPipeline):
            raise TypeError(
                f"accelerate: expected a RapidDiffusionPipeline or a diffusers StableDiffusionPipeline, "
                f"got {type(pipe).__name__}"
            )
        pipe = RapidDiffusionPipeline.from_diffusers(pipe)
    denoiser = GraphDenoiser(pipe, config)
    pipe.denoiser = denoiser
    pipe.report = denoiser.report
    return pipe


__all__ = [
    "AccelerateConfig",
    "FastPathReport",
    "GraphDenoiser",
    "SwitchStatus",
    "accelerate",
    "compile_cache_file",
]
