"""How an image is made, as plain functions: noise → denoise → decode (k-diffusion's habit).

Every image the project makes goes through these: ``RapidDiffusionPipeline`` (``rapiddiff
generate``, ``eval sample``, serving) composes them, and the training stage's sample grids call
them too, so a model's images cannot drift between the places that show them. The loop is the
one of diffusers' ``StableDiffusionPipeline`` (Rombach et al. 2022, classifier-free guidance of
Ho & Salimans 2022): for each ``t``: ``scale_model_input`` → ε = U-Net(x_t, t, text) → guidance →
``scheduler.step``; img2img starts part-way down the schedule from the noised image latents
(SDEdit, Meng et al. 2022) and inpainting blends the known region back after every step (as
``StableDiffusionInpaintPipeline`` does for a 4-channel U-Net) or feeds mask and masked image to a
9-channel inpainting U-Net.

Seeds: image ``k`` uses only its own CPU ``torch.Generator`` (its seed), for the VAE posterior
sample of its init image and for its noise, in that order — so an image depends on its seed and
settings, never on its batch, its device or the path (eager or fast) that made it.

Also here: the typed sampling defaults a model folder carries (``rapiddiff.json`` "sampling"),
the scheduler choices, and the size rules (the VAE factor is computed in :func:`vae_scale_factor`
and nowhere else).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from rapiddiff.models.controlnet import ControlConditioning

# Sampler name → diffusers scheduler class, each built from the model folder's scheduler config
# (the noise schedule it was trained with), as diffusers users swap them.
SCHEDULERS: dict[str, str] = {
    "pndm": "PNDMScheduler",
    "ddim": "DDIMScheduler",
    "dpm++": "DPMSolverMultistepScheduler",
    "unipc": "UniPCMultistepScheduler",
}
_SCHEDULER_ALIASES = {"plms": "pndm", "dpmsolver++": "dpm++", "dpm-solver++": "dpm++", "dpmpp": "dpm++"}

ModelFn = Callable[..., "torch.Tensor"]
"""(x_in [B, C, h, w], t, context [B, L, D], **unet_kwargs) → the U-Net's output [B, C', h, w].
``unet_kwargs`` are extra U-Net inputs (a ControlNet's residuals), given only when there are any."""


def scheduler_choices() -> list[str]:
    return list(SCHEDULERS)


def canonical_scheduler_name(name: str) -> str:
    key = _SCHEDULER_ALIASES.get(name.lower(), name.lower())
    if key not in SCHEDULERS:
        raise ValueError(f"unknown scheduler '{name}'; choose one of: {', '.join(SCHEDULERS)}")
    return key


# Samplers whose diffusers class reads ``rescale_betas_zero_snr`` (PNDM ignores the key, and its
# update divides by √ᾱ_t, which is 0 at the last timestep of a zero-terminal-SNR schedule).
ZERO_SNR_SAMPLERS = ("ddim", "dpm++")


def zero_terminal_snr(config: Any) -> bool:
    """Whether a scheduler config is a zero-terminal-SNR schedule (Lin et al. 2024: the betas
    rescaled so that ᾱ_T = 0, the last timestep pure noise; diffusers' ``rescale_betas_zero_snr``)."""
    return bool(dict(config).get("rescale_betas_zero_snr", False))


def zero_terminal_snr_config(config: Any) -> dict[str, Any]:
    """``config`` made a zero-terminal-SNR schedule as Lin et al. 2024 sample it: the betas rescaled
    (diffusers' ``rescale_zero_terminal_snr``, applied by the scheduler from the flag), timesteps
    spaced ``trailing`` so that sampling starts at t = T, where the image's mean is no longer
    leaked by the noise, and no x0 clipping (latents are not in [-1, 1]). Needs v-prediction:
    an ε-prediction gives no x0 at ᾱ_T = 0."""
    out = dict(config)
    # steps_offset stays: trailing spacing does not read it (and diffusers' pipeline warns on 0).
    out.update(rescale_betas_zero_snr=True, timestep_spacing="trailing", clip_sample=False)
    return out


def default_sampler(config: Any, name: str) -> str:
    """``name``, or DDIM where ``name`` is PNDM and the schedule has zero terminal SNR (PNDM cannot
    step from ᾱ_T = 0): the sampler a model folder's defaults name for its schedule."""
    name = canonical_scheduler_name(name)
    return "ddim" if name not in ZERO_SNR_SAMPLERS and zero_terminal_snr(config) else name


def make_scheduler(name: str, config: Any) -> Any:
    """A fresh diffusers scheduler of the named kind, on the noise schedule in ``config``."""
    import diffusers

    key = canonical_scheduler_name(name)
    if zero_terminal_snr(config) and key not in ZERO_SNR_SAMPLERS:
        raise ValueError(
            f"sampler {key!r} cannot sample this model: its noise schedule has zero terminal SNR "
            f"(scheduler config rescale_betas_zero_snr: true), which {SCHEDULERS[key]} ignores and "
            f"cannot step from; choose one of: {', '.join(ZERO_SNR_SAMPLERS)}"
        )
    if key == "ddim" and "clip_sample" not in dict(config):
        # SD 1.x's scheduler file says clip_sample: false; a PNDM file without the key (PNDM has no such
        # setting: every folder our stages write) would give DDIM diffusers' default, True, which clips
        # the predicted x0 to [-1, 1] in *latent* space: 14–16 dB against 50-step PNDM at any step count
        # on the built-in model, against 40+ dB for DPM-Solver++ (benchmarks/seconds_to_image.py, CPU).
        config = {**dict(config), "clip_sample": False}
    return getattr(diffusers, SCHEDULERS[key]).from_config(config)


# ------------------------------------------------------------------------------- the defaults
@dataclass(frozen=True)
class SamplingDefaults:
    """The sampling settings a model folder recommends (``rapiddiff.json`` "sampling").

    ``rapiddiff generate``, ``eval sample``, serving and the training sample grids read them;
    every model folder the project writes carries them (a fine-tune inherits its base's).
    """

    num_inference_steps: int = 50
    """Denoising steps."""
    guidance_scale: float = 7.5
    """Classifier-free guidance scale; ≤ 1 turns guidance off."""
    scheduler: str = "pndm"
    """Sampler: pndm, ddim, dpm++ or unipc."""
    guidance_rescale: float = 0.0
    """CFG rescale φ (Lin et al. 2024, §3.4): the guided output's std pulled back to the text
    branch's by this fraction; 0 is plain guidance. 0.7 is the paper's value for a zero-terminal-SNR
    model, whose strong guidance otherwise over-saturates."""

    def __post_init__(self) -> None:
        steps = self.num_inference_steps
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"num_inference_steps must be an integer ≥ 1, got {steps!r}")
        if isinstance(self.guidance_scale, bool) or not isinstance(self.guidance_scale, int | float):
            raise ValueError(f"guidance_scale must be a number, got {self.guidance_scale!r}")
        if not isinstance(self.scheduler, str):
            raise ValueError(f"scheduler must be a name ({', '.join(SCHEDULERS)}), got {self.scheduler!r}")
        rescale = self.guidance_rescale
        if isinstance(rescale, bool) or not isinstance(rescale, int | float) or not 0.0 <= rescale <= 1.0:
            raise ValueError(f"guidance_rescale must be a number in [0, 1], got {rescale!r}")
        object.__setattr__(self, "guidance_rescale", float(rescale))
        object.__setattr__(self, "guidance_scale", float(self.guidance_scale))
        object.__setattr__(self, "scheduler", canonical_scheduler_name(self.scheduler))

    @classmethod
    def from_dict(cls, data: Any, where: str = "sampling") -> SamplingDefaults:
        """From a JSON object; errors name ``where`` and the key. Other keys are ignored (logged)."""
        if not isinstance(data, dict):
            raise ValueError(f'{where} must be an object like {{"num_inference_steps": 25}}, got {data!r}')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            from rapiddiff.utils.logging import get_logger

            get_logger(__name__).warning(
                "%s: ignoring %s (a model folder sets only %s)",
                where,
                ", ".join(unknown),
                ", ".join(sorted(known)),
            )
            data = {k: v for k, v in data.items() if k in known}
        for key, value in data.items():
            try:
                cls(**{key: value})
            except ValueError as err:
                raise ValueError(f"{where}.{key}: {err}") from err
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SamplingPreset:
    """A named set of sampling settings chosen by measurement (``--preset NAME``): what it sets
    replaces the model's defaults; a flag given beside it wins."""

    num_inference_steps: int
    scheduler: str
    deep_cache: int
    """DeepCache interval (1: exact, every step runs the whole U-Net)."""
    summary: str
    """One line for ``--help``: what the preset is for and how it was chosen."""

    def __post_init__(self) -> None:
        SamplingDefaults(num_inference_steps=self.num_inference_steps, scheduler=self.scheduler)  # checks
        if not isinstance(self.deep_cache, int) or self.deep_cache < 1:
            raise ValueError(f"deep_cache must be an integer ≥ 1, got {self.deep_cache!r}")

    def settings(self) -> dict[str, Any]:
        """What it sets, as pipeline keyword arguments."""
        return {
            "num_inference_steps": self.num_inference_steps,
            "scheduler": self.scheduler,
            "deep_cache": self.deep_cache,
        }

    def describe(self) -> str:
        cache = f", DeepCache every {self.deep_cache}" if self.deep_cache > 1 else ""
        return f"{self.scheduler}, {self.num_inference_steps} steps{cache}: {self.summary}"


# The presets, in one table (the one home of sampling defaults, as SamplingDefaults). "fast" is the
# candidate until benchmarks/seconds_to_image.py measures the choice: the fewest seconds per image
# whose quality stays within reach of 50 PNDM steps (DPM-Solver++ 2M at 20 steps is the common
# choice for SD 1.x; Lu et al. 2022 report converged samples in 15–20 steps).
PRESETS: dict[str, SamplingPreset] = {
    "fast": SamplingPreset(
        # The fewest steps that stayed ≥ 40 dB against 50-step PNDM on the built-in model (43.4 and
        # 43.8 dB, SSIM 0.999, in two CPU runs of benchmarks/seconds_to_image.py; 10 steps: 40.0 dB;
        # DeepCache 3 on top: 33.6 dB). BENCHMARKS.md, "Seconds to a good image".
        num_inference_steps=15,
        scheduler="dpm++",
        deep_cache=1,
        summary="DPM-Solver++ at 15 steps: within 43 dB of 50-step PNDM on the built-in model",
    ),
}


def preset(name: str) -> SamplingPreset:
    """The preset called ``name``; an error listing them otherwise."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]


def presets_help() -> str:
    """Every preset and what it sets, one a line (for ``--help``)."""
    return "; ".join(f"{name}: {p.describe()}" for name, p in PRESETS.items())


# ------------------------------------------------------------------------------- sizes
def vae_scale_factor(vae: Any) -> int:
    """Image pixels per latent pixel (8 for SD's VAE): 2^(VAE blocks − 1), as diffusers computes it."""
    return 2 ** (len(vae.config.block_out_channels) - 1)


def size_multiple(unet: Any, vae: Any) -> int:
    """Image sides must be multiples of this: the VAE factor × the U-Net's downsampling."""
    return vae_scale_factor(vae) * 2 ** (len(unet.config.block_out_channels) - 1)


def default_size(unet: Any, vae: Any) -> int:
    """The side the model was trained at: the U-Net's sample_size × the VAE factor."""
    return int(unet.config.sample_size) * vae_scale_factor(vae)


def check_size(height: int, width: int, multiple: int) -> None:
    """Both sides must be positive multiples of ``multiple``; the error names the nearest valid sizes."""
    bad = [(side, v) for side, v in (("height", height), ("width", width)) if v % multiple or v <= 0]
    if not bad:
        return
    hints = []
    for side, value in bad:
        lower = max(multiple, value // multiple * multiple)
        upper = lower if lower >= value else lower + multiple
        hints.append(f"{side} {value} → nearest valid: {' or '.join(map(str, sorted({lower, upper})))}")
    raise ValueError(
        f"image size {width}x{height} (WxH) does not fit the model: sides must be multiples of {multiple} "
        f"(VAE factor × U-Net downsampling); {'; '.join(hints)}"
    )


# ------------------------------------------------------------------------------- the stages
def generators(seeds: Sequence[int]) -> list[torch.Generator]:
    """One CPU generator per image, seeded with its seed: the one seed rule."""
    import torch

    return [torch.Generator("cpu").manual_seed(int(s)) for s in seeds]


def draw_noise(gens: Sequence[torch.Generator], shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """One draw of ``shape`` ([C, h, w]) per generator, on the CPU → [N, C, h, w] in ``dtype``
    (what diffusers' ``randn_tensor`` draws with a list of generators).

    Always drawn in float32, then cast: a CPU draw in float16 gives other numbers, and the seed
    rule says an image depends on its seed, not on the dtype the model runs in. (diffusers draws
    in the model's dtype: equal for float32 models.)"""
    import torch

    return torch.cat([torch.randn((1, *shape), generator=g, dtype=torch.float32) for g in gens]).to(dtype)


def timesteps_for_strength(scheduler: Any, steps: int, strength: float) -> tuple[torch.Tensor, int]:
    """The schedule an img2img run walks, and where it starts (diffusers' ``get_timesteps``).

    ``scheduler`` has had ``set_timesteps(steps)``; ``strength`` 1 walks all of it, 0.5 the last
    half. The scheduler is told where it begins (``set_begin_index``) as diffusers tells it.
    """
    if not 0.0 < strength <= 1.0:
        raise ValueError(f"strength must be in (0, 1], got {strength}")
    init = min(int(steps * strength), steps)
    start = max(steps - init, 0) * scheduler.order
    if start >= len(scheduler.timesteps):
        raise ValueError(
            f"strength {strength} with {steps} steps leaves no denoising step; raise --strength or --steps"
        )
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(start)
    return scheduler.timesteps[start:], start


def encode_images(vae: nn.Module, pixels: torch.Tensor, gens: Sequence[torch.Generator]) -> torch.Tensor:
    """Pixels [N, 3, H, W] in [-1, 1] → latents × scaling_factor [N, C, h, w]; image ``k``'s
    posterior sample is drawn with generator ``k`` (diffusers' ``retrieve_latents``)."""
    import torch

    out = []
    for k, gen in enumerate(gens):
        dist = vae.encode(pixels[k : k + 1].to(vae.dtype)).latent_dist
        sample = torch.randn(dist.mean.shape, generator=gen, dtype=torch.float32)  # float32: see draw_noise
        out.append(dist.mean + dist.std * sample.to(dist.mean.device, dist.mean.dtype))  # (1, C, h, w)
    latents = torch.cat(out)
    shift = getattr(vae.config, "shift_factor", None)
    if shift is not None:
        latents = latents - shift
    return latents * vae.config.scaling_factor


@dataclass
class Inpaint:
    """What inpainting adds to the loop (tensors [N, ...] in the latent space)."""

    mask: torch.Tensor  # (N, 1, h, w): 1 where the image is repainted, 0 where it is kept
    image_latents: torch.Tensor | None  # (N, C, h, w): the init image's latents (None: 9-channel from noise)
    noise: torch.Tensor  # (N, C, h, w): the noise the start latents were made with
    masked_image_latents: torch.Tensor | None = None  # (N, C, h, w): for a 9-channel U-Net
    concat: bool = False  # 9-channel U-Net: mask and masked image go into its input, no blending


def unet_model(unet: nn.Module) -> ModelFn:
    """A diffusers U-Net as a plain ``model(x, t, context)``."""

    def model(x: torch.Tensor, t: torch.Tensor, context: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return unet(x, t, encoder_hidden_states=context, return_dict=False, **kwargs)[0]

    return model


def step_kwargs(scheduler: Any, gens: Sequence[torch.Generator], eta: float) -> dict[str, Any]:
    """eta and generators, for the schedulers whose ``step`` takes them (diffusers' prepare_extra_step_kwargs)."""
    params = set(inspect.signature(scheduler.step).parameters)
    kwargs: dict[str, Any] = {}
    if "eta" in params:
        kwargs["eta"] = eta
    if "generator" in params:
        kwargs["generator"] = list(gens)
    return kwargs


def rescale_guidance(guided: torch.Tensor, text: torch.Tensor, phi: float) -> torch.Tensor:
    """CFG rescale (Lin et al. 2024, Alg. 2): scale each guided output [N, C, h, w] to the std of its
    text-conditioned output, then mix ``phi`` of that with ``1 - phi`` of the plain guided output.
    diffusers' own ``rescale_noise_cfg``, imported from its module alone (the ``diffusers.guiders``
    package ``__init__`` imports every guider)."""
    from rapiddiff.utils.imports import import_module

    utils = import_module("diffusers.guiders.guider_utils", defer=("diffusers.guiders",))
    return utils.rescale_noise_cfg(guided, text, guidance_rescale=phi)


def denoise(
    model: ModelFn,
    latents: torch.Tensor,
    cond: torch.Tensor,
    uncond: torch.Tensor | None,
    scheduler: Any,
    timesteps: torch.Tensor,
    guidance_scale: float,
    *,
    extra_step_kwargs: dict[str, Any] | None = None,
    inpaint: Inpaint | None = None,
    progress: bool = False,
    on_step: Callable[[int], None] | None = None,
    guidance_rescale: float = 0.0,
    control: ControlConditioning | None = None,
) -> torch.Tensor:
    """The denoising loop: for each t, ε = model(x_t, t, text); CFG (and its rescale
    :func:`rescale_guidance` when ``guidance_rescale`` > 0); x_{t-1} = scheduler.step.

    ``latents`` [N, C, h, w] are the start (noise × init_noise_sigma, or the noised image);
    ``cond``/``uncond`` [N, L, D] one row per latent, ``uncond=None`` means no guidance;
    ``scheduler`` has had ``set_timesteps`` and ``timesteps`` is (the tail of) its ``.timesteps``.
    ``on_step(i)`` runs before the model's i-th evaluation (DeepCache's full/cached choice:
    :mod:`rapiddiff.models.deep_cache`). ``control``: ControlNet residuals added to the U-Net at
    every step (:mod:`rapiddiff.models.controlnet`), computed from the same input and context.
    """
    import torch
    from tqdm.auto import tqdm

    kwargs = extra_step_kwargs or {}
    guided = uncond is not None
    context = torch.cat([uncond, cond]) if guided else cond  # (2N or N, L, D)
    extra = None
    if inpaint is not None and inpaint.concat:
        assert inpaint.masked_image_latents is not None
        extra = torch.cat([inpaint.mask, inpaint.masked_image_latents], dim=1)  # (N, 1 + C, h, w)
        extra = torch.cat([extra] * 2) if guided else extra
    for i, t in enumerate(tqdm(timesteps, desc="sampling", disable=not progress, leave=False)):
        x_in = torch.cat([latents] * 2) if guided else latents  # (2N or N, C, h, w)
        x_in = scheduler.scale_model_input(x_in, t)
        # The ControlNet sees the latents without inpainting channels (as diffusers' pipelines feed it).
        unet_kwargs = control.residuals(x_in, t, context, i, len(timesteps)) if control is not None else {}
        if extra is not None:
            x_in = torch.cat([x_in, extra.to(x_in.dtype)], dim=1)  # (.., 2C + 1, h, w)
        if on_step is not None:
            on_step(i)
        out = model(x_in, t, context, **unet_kwargs)
        if guided:
            out_uncond, out_text = out.chunk(2)
            out = out_uncond + guidance_scale * (out_text - out_uncond)
            if guidance_rescale > 0:
                out = rescale_guidance(out, out_text, guidance_rescale)
        latents = scheduler.step(out, t, latents, **kwargs, return_dict=False)[0]
        if inpaint is not None and not inpaint.concat:
            # Keep the known region: the init image noised to the next step's level.
            known = inpaint.image_latents
            if i < len(timesteps) - 1:
                known = scheduler.add_noise(known, inpaint.noise, timesteps[i + 1 : i + 2])
            latents = (1 - inpaint.mask) * known + inpaint.mask * latents
    return latents


def decode(vae: nn.Module, latents: torch.Tensor) -> torch.Tensor:
    """Latents [N, C, h, w] → images [N, 3, H, W] in [0, 1] (float32)."""
    config = vae.config
    scaled = latents / config.scaling_factor
    if getattr(config, "shift_factor", None) is not None:
        scaled = scaled + config.shift_factor
    images = vae.decode(scaled.to(vae.dtype), return_dict=False)[0]
    return (images.float() / 2 + 0.5).clamp(0, 1)


__all__ = [
    "PRESETS",
    "SCHEDULERS",
    "ZERO_SNR_SAMPLERS",
    "Inpaint",
    "SamplingDefaults",
    "SamplingPreset",
    "canonical_scheduler_name",
    "check_size",
    "decode",
    "default_sampler",
    "default_size",
    "denoise",
    "draw_noise",
    "encode_images",
    "generators",
    "make_scheduler",
    "preset",
    "presets_help",
    "rescale_guidance",
    "scheduler_choices",
    "size_multiple",
    "step_kwargs",
    "timesteps_for_strength",
    "unet_model",
    "vae_scale_factor",
    "zero_terminal_snr",
    "zero_terminal_snr_config",
]
