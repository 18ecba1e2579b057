"""RapidDiffusionPipeline: prompt → knowledge text encoder → U-Net sampling → VAE → (ESRGAN ×4).

The sampling loop is written out here, step by step, the way diffusers' StableDiffusionPipeline
runs it (``set_timesteps`` → for each t: ``scale_model_input`` → U-Net → guidance → ``step``),
so that (a) the KnowledgeTextEncoder's states plug straight into the U-Net's cross-attention and
(b) with knowledge off, a diffusers SD 1.x or Taiyi folder gives diffusers' own images — a test
compares them. Each stage is a public method, so the fast path (``rapiddiff.infer.accelerate``)
can replace one (``denoise`` above all) without touching the rest:

    encode_prompt → prepare_latents → denoise → decode_latents → (upscale) → images

Seeds: image ``i`` is drawn from its own CPU ``torch.Generator`` seeded with ``seeds[i]``, so an
image depends only on its seed and settings, never on the batch it was made in (nor on the
device's random number generator).
"""

from __future__ import annotations

import inspect
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rapiddiff.utils.logging import get_logger

if TYPE_CHECKING:
    import numpy as np
    import torch
    from PIL import Image

    from rapiddiff.models.bundle import ModelBundle

log = get_logger(__name__)

# Sampler name → diffusers scheduler class, each built from the model folder's scheduler config
# (the noise schedule it was trained with), as diffusers users swap them.
SCHEDULERS: dict[str, str] = {
    "pndm": "PNDMScheduler",
    "ddim": "DDIMScheduler",
    "dpm++": "DPMSolverMultistepScheduler",
}
_SCHEDULER_ALIASES = {"plms": "pndm", "dpmsolver++": "dpm++", "dpm-solver++": "dpm++", "dpmpp": "dpm++"}


def scheduler_choices() -> list[str]:
    return list(SCHEDULERS)


def make_scheduler(name: str, config: Any) -> Any:
    """A fresh diffusers scheduler of the named kind, on the noise schedule in ``config``."""
    import diffusers

    key = _SCHEDULER_ALIASES.get(name.lower(), name.lower())
    if key not in SCHEDULERS:
        raise ValueError(f"unknown scheduler '{name}'; choose one of: {', '.join(SCHEDULERS)}")
    return getattr(diffusers, SCHEDULERS[key]).from_config(config)


def canonical_scheduler_name(name: str) -> str:
    key = _SCHEDULER_ALIASES.get(name.lower(), name.lower())
    if key not in SCHEDULERS:
        raise ValueError(f"unknown scheduler '{name}'; choose one of: {', '.join(SCHEDULERS)}")
    return key


def check_size(height: int, width: int, multiple: int) -> None:
    """Both sides must be positive multiples of ``multiple``; the error names the nearest valid sizes."""
    bad = [
        (side, value)
        for side, value in (("height", height), ("width", width))
        if value % multiple or value <= 0
    ]
    if not bad:
        return
    hints = []
    for side, value in bad:
        lower = max(multiple, value // multiple * multiple)
        upper = lower if lower >= value else lower + multiple
        choices = sorted({lower, upper})
        hints.append(f"{side} {value} → nearest valid: {' or '.join(map(str, choices))}")
    raise ValueError(
        f"image size {height}x{width} does not fit the model: sides must be multiples of {multiple} "
        f"(VAE factor × U-Net downsampling); {'; '.join(hints)}"
    )


@dataclass
class GenerationOutput:
    """``images``: PIL images, an array [N, H, W, 3] in [0, 1], or latents; one entry per seed."""

    images: Any
    seeds: list[int]
    prompts: list[str]
    negative_prompts: list[str]
    metadata: list[dict[str, Any]] = field(default_factory=list)


class RapidDiffusionPipeline:
    """Text-to-image with a KnowledgeTextEncoder; ``unet``, ``vae``, ``scheduler``,
    ``text_encoder`` and ``upscaler`` are public and may be replaced."""

    def __init__(
        self,
        unet: torch.nn.Module,
        vae: torch.nn.Module,
        scheduler: Any,
        text_encoder: Any,
        upscaler: torch.nn.Module | None = None,
        *,
        model_name: str = "model",
        model_path: Path | None = None,
    ) -> None:
        self.unet = unet
        self.vae = vae
        self.scheduler = scheduler  # the folder's own; each call builds a fresh one from its config
        self.text_encoder = text_encoder
        self.upscaler = upscaler
        self.model_name = model_name
        self.model_path = model_path
        self.upscale_tile: int | None = 256  # input pixels per upscaler tile (bounded memory)
        self.fast: Any = None  # set by enable_fast(): the accelerated sampling + decoding runner

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_bundle(cls, bundle: ModelBundle) -> RapidDiffusionPipeline:
        return cls(
            bundle.unet,
            bundle.vae,
            bundle.scheduler,
            bundle.text_encoder,
            bundle.upscaler,
            model_name=bundle.name,
            model_path=bundle.path,
        )

    @classmethod
    def from_pretrained(
        cls,
        path_or_bundle: str | Path | ModelBundle,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        knowledge: bool = True,
        upscaler: str | Path | None = None,
    ) -> RapidDiffusionPipeline:
        """Load a model folder (rapiddiff, diffusers SD 1.x or Taiyi) or wrap a ModelBundle.

        ``upscaler`` loads the upscaler from that weights file or folder instead of the model's own.
        """
        from rapiddiff.models.bundle import ModelBundle, load_model_folder

        if isinstance(path_or_bundle, ModelBundle):
            bundle = path_or_bundle
        else:
            bundle = load_model_folder(
                path_or_bundle,
                device=device,
                dtype=dtype,
                knowledge=knowledge,
                load_upscaler=upscaler is None,
            )
        pipe = cls.from_bundle(bundle)
        if upscaler is not None:
            pipe.set_upscaler(upscaler)
        return pipe

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> RapidDiffusionPipeline:
        """Move the models (in place), as ``diffusers`` pipelines do; the upscaler keeps its dtype."""
        for module in (self.unet, self.vae, self.text_encoder):
            module.to(device=device, dtype=dtype)
        if self.upscaler is not None:
            self.upscaler.to(device=device)
        return self

    def set_upscaler(self, path: str | Path) -> None:
        from rapiddiff.models.upscaler import load_upscaler

        self.upscaler = load_upscaler(path, device=self.device)

    # ------------------------------------------------------------------ properties
    @property
    def device(self) -> torch.device:
        return next(self.unet.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.unet.parameters()).dtype

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def size_multiple(self) -> int:
        return self.vae_scale_factor * 2 ** (len(self.unet.config.block_out_channels) - 1)

    @property
    def default_size(self) -> int:
        return int(self.unet.config.sample_size) * self.vae_scale_factor

    # ------------------------------------------------------------------ stages
    def encode_prompt(
        self,
        prompts: Sequence[str],
        negative: str | Sequence[str] | None = None,
        *,
        do_classifier_free_guidance: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prompts (and negative prompts, default "") → cond, uncond states [B, L, D] in the U-Net's dtype."""
        prompts = list(prompts)
        cond = self.text_encoder.encode(prompts).to(device=self.device, dtype=self.dtype)  # (B, L, D)
        if not do_classifier_free_guidance:
            return cond, None
        negatives = _per_prompt(negative, len(prompts), "negative_prompt")
        uncond = self.text_encoder.encode(negatives).to(device=self.device, dtype=self.dtype)
        return cond, uncond

    def prepare_latents(
        self,
        seeds: Sequence[int],
        height: int,
        width: int,
        scheduler: Any,
        dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, list[torch.Generator]]:
        """Initial noise [N, C, h, w], one CPU generator per seed (as diffusers draws with a list of generators)."""
        import torch

        dtype = dtype or self.dtype
        shape = (
            1,
            self.unet.config.in_channels,
            height // self.vae_scale_factor,
            width // self.vae_scale_factor,
        )
        generators = [torch.Generator("cpu").manual_seed(int(s)) for s in seeds]
        noise = [torch.randn(shape, generator=g, dtype=dtype) for g in generators]
        latents = torch.cat(noise).to(self.device)  # (N, C, h, w)
        return latents * scheduler.init_noise_sigma, generators

    def denoise(
        self,
        latents: torch.Tensor,
        cond: torch.Tensor,
        uncond: torch.Tensor | None,
        timesteps: torch.Tensor,
        guidance_scale: float,
        *,
        scheduler: Any,
        step_kwargs: dict[str, Any] | None = None,
        progress: bool = True,
    ) -> torch.Tensor:
        """The sampling loop: for each t, ε = U-Net(x_t, t, text); CFG; x_{t-1} = scheduler.step.

        ``cond``/``uncond`` are [N, L, D] (one row per latent); ``uncond=None`` means no guidance.
        ``scheduler`` has had ``set_timesteps`` called and ``timesteps`` is its ``.timesteps``.
        """
        import torch
        from tqdm.auto import tqdm

        step_kwargs = step_kwargs or {}
        context = cond if uncond is None else torch.cat([uncond, cond])  # (2N, L, D) with guidance
        with torch.inference_mode():
            for t in tqdm(timesteps, desc="sampling", disable=not progress, leave=False):
                model_input = latents if uncond is None else torch.cat([latents] * 2)
                model_input = scheduler.scale_model_input(model_input, t)
                noise = self.unet(model_input, t, encoder_hidden_states=context, return_dict=False)[0]
                if uncond is not None:
                    noise_uncond, noise_text = noise.chunk(2)
                    noise = noise_uncond + guidance_scale * (noise_text - noise_uncond)
                latents = scheduler.step(noise, t, latents, **step_kwargs, return_dict=False)[0]
        return latents

    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents → images [N, 3, H, W] in [0, 1] (float32)."""
        import torch

        config = self.vae.config
        latents = latents / config.scaling_factor
        if getattr(config, "shift_factor", None) is not None:
            latents = latents + config.shift_factor
        with torch.inference_mode():
            images = self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0]
        return (images / 2 + 0.5).clamp(0, 1).float()

    def upscale(self, images: torch.Tensor) -> torch.Tensor:
        """Images [N, 3, H, W] in [0, 1] → ×scale through ``self.upscaler`` (tiled)."""
        from rapiddiff.models.upscaler import upscale

        self._require_upscaler()
        return upscale(self.upscaler, images, tile=self.upscale_tile).float()

    def _require_upscaler(self) -> None:
        if self.upscaler is None:
            raise ValueError(
                "upscale requested but this model has no upscaler/ folder; pass an upscaler weights "
                "file (--upscaler PATH) or turn upscaling off (--no-upscale)"
            )

    # ------------------------------------------------------------------ the whole run
    def __call__(
        self,
        prompt: str | Sequence[str],
        negative_prompt: str | Sequence[str] | None = None,
        *,
        num_inference_steps: int = 50,
        guidance_scale: float = 7.5,
        height: int | None = None,
        width: int | None = None,
        seed: int | Sequence[int] | None = None,
        num_images_per_prompt: int = 1,
        scheduler: str = "pndm",
        eta: float = 0.0,
        upscale: bool = False,
        knowledge: bool | None = None,
        output_type: Literal["pil", "np", "pt", "latent"] = "pil",
        progress: bool = True,
    ) -> GenerationOutput:
        """Generate ``len(prompts) × num_images_per_prompt`` images.

        ``seed``: an int ``s`` gives image ``k`` the seed ``s + k``; a list gives every image its
        own; ``None`` draws fresh seeds (returned in ``.seeds``, so any image can be remade).
        ``knowledge``: fuse the KnowledgeStore's facts into the text states (``None``: as loaded);
        ``False`` is the base text encoder exactly, the ablation switch.
        """
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        if not prompts:
            raise ValueError("no prompt given")
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be ≥ 1, got {num_inference_steps}")
        if num_images_per_prompt < 1:
            raise ValueError(f"num_images_per_prompt must be ≥ 1, got {num_images_per_prompt}")
        if output_type not in ("pil", "np", "pt", "latent"):
            raise ValueError(f"unknown output_type '{output_type}'; choose pil, np, pt or latent")
        if upscale:
            self._require_upscaler()  # before any sampling is done
        for p in prompts:
            if not p.strip():
                log.warning("empty prompt: the image is generated unconditionally (from noise alone)")
        height = height or self.default_size
        width = width or self.default_size
        check_size(height, width, self.size_multiple)
        sched_name = canonical_scheduler_name(scheduler)
        negatives = _per_prompt(negative_prompt, len(prompts), "negative_prompt")
        n = len(prompts) * num_images_per_prompt
        seeds = _seeds(seed, n)

        previous = getattr(self.text_encoder, "knowledge", None)
        if knowledge is None:
            knowledge = bool(previous)  # as the pipeline was loaded (on, unless loaded with knowledge=False)
        all_prompts = [p for p in prompts for _ in range(num_images_per_prompt)]
        all_negatives = [p for p in negatives for _ in range(num_images_per_prompt)]
        settings = {
            "steps": num_inference_steps,
            "guidance": guidance_scale,
            "scheduler": sched_name,
            "height": height,
            "width": width,
            "knowledge": bool(knowledge and getattr(self.text_encoder, "store", None) is not None),
            "upscale": bool(upscale),
            "model": self.model_name,
            # Absolute, so `rapiddiff generate --from-png` finds the model from any folder.
            "model_path": str(Path(self.model_path).resolve()) if self.model_path is not None else None,
        }
        if eta:
            settings["eta"] = eta
        metadata = [
            {"prompt": p, "negative_prompt": neg, "seed": s, **settings}
            for p, neg, s in zip(all_prompts, all_negatives, seeds, strict=True)
        ]

        try:
            if previous is not None:
                self.text_encoder.knowledge = knowledge
            if self.fast is not None and output_type != "latent" and not eta:
                images = self._fast_images(
                    prompts, negatives, sched_name, seeds, num_inference_steps, guidance_scale, height, width,
                    num_images_per_prompt,
                )  # fmt: skip
            else:
                latents = self._sample(
                    prompts, negatives, sched_name, seeds, num_inference_steps, guidance_scale, height, width,
                    num_images_per_prompt, eta, progress,
                )  # fmt: skip
                if output_type == "latent":
                    return GenerationOutput(latents, seeds, all_prompts, all_negatives, metadata)
                images = self.decode_latents(latents)  # (N, 3, H, W) in [0, 1]
        finally:
            if previous is not None:
                self.text_encoder.knowledge = previous
        if upscale:
            images = self.upscale(images)
        return GenerationOutput(_convert(images, output_type), seeds, all_prompts, all_negatives, metadata)

    def _sample(
        self,
        prompts: list[str],
        negatives: list[str],
        sched_name: str,
        seeds: list[int],
        steps: int,
        guidance_scale: float,
        height: int,
        width: int,
        per_prompt: int,
        eta: float,
        progress: bool,
    ) -> torch.Tensor:
        """The eager path: encode → noise → denoise; returns the final latents."""
        sched = make_scheduler(sched_name, self.scheduler.config)
        sched.set_timesteps(steps, device=self.device)
        do_cfg = guidance_scale > 1.0
        with _inference():
            cond, uncond = self.encode_prompt(prompts, negatives, do_classifier_free_guidance=do_cfg)
        # One row per image, prompt by prompt: p0 img0, p0 img1, ..., p1 img0, ... (as diffusers orders them)
        cond = cond.repeat_interleave(per_prompt, dim=0)
        uncond = uncond.repeat_interleave(per_prompt, dim=0) if uncond is not None else None
        latents, generators = self.prepare_latents(seeds, height, width, sched, dtype=cond.dtype)
        return self.denoise(
            latents,
            cond,
            uncond,
            sched.timesteps,
            guidance_scale,
            scheduler=sched,
            step_kwargs=_step_kwargs(sched, generators, eta),
            progress=progress,
        )

    # ------------------------------------------------------------------ the fast path
    def enable_fast(self, **switches: Any) -> Any:
        """Route sampling and decoding through ``rapiddiff.infer.accelerate`` (the GPU fast path).

        Everything else — prompts, seeds (the same CPU-generator noise), sampler choice, the
        knowledge switch, upscaling, metadata — stays here, so a call means the same on both paths.
        Returns the accelerated runner; ``pipe.fast = None`` goes back to the eager loop.
        """
        import importlib.util

        if importlib.util.find_spec("rapiddiff.infer.accelerate") is None:
            raise RuntimeError(
                "the fast path (rapiddiff.infer.accelerate) is not available in this installation"
            )
        from rapiddiff.infer.accelerate import accelerate

        self.fast = accelerate(self, **switches)
        return self.fast

    def _fast_images(
        self,
        prompts: list[str],
        negatives: list[str],
        sched_name: str,
        seeds: list[int],
        steps: int,
        guidance_scale: float,
        height: int,
        width: int,
        per_prompt: int,
    ) -> torch.Tensor:
        import numpy as np
        import torch

        base = self.scheduler
        # The runner samples with ``self.scheduler``: give it the requested sampler for this call.
        self.scheduler = make_scheduler(sched_name, base.config)
        try:
            out = self.fast(
                prompts,
                negatives,
                num_inference_steps=steps,
                guidance_scale=guidance_scale,
                height=height,
                width=width,
                generator=[torch.Generator("cpu").manual_seed(int(s)) for s in seeds],
                num_images_per_prompt=per_prompt,
                output_type="np",
            )
        finally:
            self.scheduler = base
        return torch.from_numpy(np.asarray(out.images)).permute(0, 3, 1, 2).float()  # (N, 3, H, W)


def _inference() -> Any:
    import torch

    return torch.inference_mode()


def _per_prompt(value: str | Sequence[str] | None, n: int, what: str) -> list[str]:
    if value is None:
        return [""] * n
    if isinstance(value, str):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"{what}: {len(values)} given for {n} prompts; give one, or one per prompt")
    return values


def _seeds(seed: int | Sequence[int] | None, n: int) -> list[int]:
    if seed is None:
        return [secrets.randbelow(2**31) for _ in range(n)]
    if isinstance(seed, int):
        return [seed + k for k in range(n)]
    seeds = [int(s) for s in seed]
    if len(seeds) != n:
        raise ValueError(f"seed: {len(seeds)} seeds given for {n} images; give one int, or one per image")
    return seeds


def _step_kwargs(scheduler: Any, generators: list[Any], eta: float) -> dict[str, Any]:
    """eta and generator, for the schedulers whose ``step`` takes them (diffusers' prepare_extra_step_kwargs)."""
    params = set(inspect.signature(scheduler.step).parameters)
    kwargs: dict[str, Any] = {}
    if "eta" in params:
        kwargs["eta"] = eta
    if "generator" in params:
        kwargs["generator"] = generators
    return kwargs


def _convert(images: torch.Tensor, output_type: str) -> Any:
    if output_type == "pt":
        return images.cpu()
    array = images.cpu().permute(0, 2, 3, 1).float().numpy()  # (N, H, W, 3)
    if output_type == "np":
        return array
    return to_pil(array)


def to_pil(array: np.ndarray) -> list[Image.Image]:
    """[N, H, W, 3] floats in [0, 1] → PIL images (rounded as diffusers' numpy_to_pil does)."""
    from PIL import Image

    return [Image.fromarray((a * 255).round().astype("uint8")) for a in array]
