"""What the denoise stage gets: :class:`DenoiseJob`, and its one eager loop.

The pipeline makes a job per call; the eager stage runs :meth:`DenoiseJob.run`, the fast path
(:mod:`rapiddiff.infer.fast_denoiser`) the same job on its GPU loop.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rapiddiff.models import sampling
from rapiddiff.models.deep_cache import DeepCache
from rapiddiff.models.token_merge import TokenMerge

if TYPE_CHECKING:
    import torch

    from rapiddiff.models.controlnet import ControlConditioning
    from rapiddiff.models.sampling import Inpaint, ModelFn


@dataclass
class DenoiseJob:
    """What the denoise stage gets: the start latents and everything the loop needs."""

    latents: torch.Tensor  # (N, C, h, w) the start: noise × init_noise_sigma, or the noised image
    noise: torch.Tensor  # (N, C, h, w) the unscaled noise (one CPU draw per seed)
    pure_noise: bool  # latents == noise × init_noise_sigma (txt2img, or inpainting at strength 1)
    cond: torch.Tensor  # (N, L, D)
    uncond: torch.Tensor | None  # (N, L, D); None: no guidance
    scheduler: Any  # set_timesteps (and set_begin_index) done
    steps: int  # num_inference_steps the schedule was made for
    timesteps: torch.Tensor  # the part of scheduler.timesteps this run walks
    start: int  # index of timesteps[0] in scheduler.timesteps (img2img strength)
    guidance_scale: float
    step_kwargs: dict[str, Any]  # eta / generators for stochastic schedulers
    inpaint: Inpaint | None = None
    progress: bool = False
    deep_cache: int = 1  # DeepCache interval: the whole U-Net every N evaluations (1 = exact)
    guidance_rescale: float = 0.0  # CFG rescale φ (sampling.rescale_guidance); 0 = plain guidance
    token_merge: float = 0.0  # ToMe ratio in the highest-resolution self-attention (0 = exact)
    control: ControlConditioning | None = None  # ControlNet residuals for every step (None: no control)

    def run(
        self,
        model: ModelFn,
        vae: Any,
        *,
        decode: bool,
        dtype: torch.dtype | None = None,
        unet: torch.nn.Module | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The one eager loop (:func:`rapiddiff.models.sampling.denoise`) on this job with ``model``
        (the text rows cast to ``dtype`` if given), then the VAE decode if ``decode``. ``unet``:
        the U-Net ``model`` calls, which ``deep_cache`` > 1 and ``token_merge`` > 0 need."""
        cond, uncond = self.cond, self.uncond
        if dtype is not None:
            cond, uncond = cond.to(dtype), uncond.to(dtype) if uncond is not None else None
        if (self.deep_cache > 1 or self.token_merge > 0) and unet is None:
            raise ValueError(
                "deep_cache > 1 and token_merge > 0 need the U-Net the model calls (DenoiseJob.run(unet=...))"
            )
        with contextlib.ExitStack() as stack:
            hooks: list[Any] = []  # each approximation's step(i), called before evaluation i
            if self.deep_cache > 1:
                hooks.append(stack.enter_context(DeepCache.of(unet).active(self.deep_cache)))
            if self.token_merge > 0:
                size = tuple(self.latents.shape[-2:])
                hooks.append(
                    stack.enter_context(
                        TokenMerge.of(unet).active(self.token_merge, size, self.latents.device)
                    )
                )
            latents = sampling.denoise(
                model,
                self.latents,
                cond,
                uncond,
                self.scheduler,
                self.timesteps,
                self.guidance_scale,
                extra_step_kwargs=self.step_kwargs,
                inpaint=self.inpaint,
                progress=self.progress,
                on_step=_chained(hooks),
                guidance_rescale=self.guidance_rescale,
                control=self.control,
            )
        return latents, sampling.decode(vae, latents) if decode else None


def _chained(hooks: list[Any]) -> Any:
    """One ``on_step(i)`` that calls each hook in order (None when there are none)."""
    if not hooks:
        return None

    def on_step(index: int) -> None:
        for hook in hooks:
            hook(index)

    return on_step
