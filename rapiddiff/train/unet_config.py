"""The U-Net stage's settings: the loss, EMA and the sample grids."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


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
    earlier steps leave them when sampling (exposure bias). 0: off (on kshapes 0.1 changed nothing
    beyond the seeds' spread)."""

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

    prompts: tuple[str, ...] = ("浅蓝色背景上有一个红色的圆形", "米色背景上有一个番茄")
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
