"""RapidDiffusionPipeline: prompt → knowledge text encoder → U-Net sampling → VAE → (ESRGAN ×4).

One way an image is made, in stages (the stage functions live in :mod:`rapiddiff.models.sampling`):
encode_prompt → prepare_latents → denoise → decode → (upscale). txt2img, img2img and inpainting
differ only in how the latents are prepared and masked; with knowledge off a diffusers SD 1.x folder
gives diffusers' own images. Image ``k`` draws from its own CPU generator seeded ``seeds[k]``, so an
image depends only on its seed and settings, never on its batch, device or path.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rapiddiff.infer.job import DenoiseJob
from rapiddiff.models.geometry import ImageGeometry
from rapiddiff.models.sampling import (  # re-exported: the names users of this module know
    SCHEDULERS,
    SamplingDefaults,
    canonical_scheduler_name,
    check_size,
    make_scheduler,
    scheduler_choices,
)
from rapiddiff.utils.io import file_sha256
from rapiddiff.utils.logging import get_logger

if TYPE_CHECKING:
    import numpy as np
    import torch
    from PIL import Image

    from rapiddiff.models.bundle import ModelBundle
    from rapiddiff.models.controlnet import ControlConditioning, ControlSpec
    from rapiddiff.models.sampling import Inpaint

log = get_logger(__name__)


@dataclass
class GenerationOutput:
    """``images``: PIL images, an array [N, H, W, 3] in [0, 1], or latents; one entry per seed."""

    images: Any
    seeds: list[int]
    prompts: list[str]
    negative_prompts: list[str]
    metadata: list[dict[str, Any]] = field(default_factory=list)
    latents: Any = None
    """The final latents [N, C, h, w] (float32), before decoding."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Host wall time of each stage (encode, denoise_decode, upscale, total)."""


@dataclass
class _Source:
    """An init image or mask: the pixels and where they came from (for the PNG metadata)."""

    image: Image.Image
    path: str | None
    sha256: str


class RapidDiffusionPipeline(ImageGeometry):
    """Text-to-image, img2img and inpainting with a KnowledgeTextEncoder; ``unet``, ``vae``,
    ``scheduler``, ``text_encoder``, ``upscaler`` and ``denoiser`` are public and may be replaced."""

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
        sampling: SamplingDefaults | None = None,
    ) -> None:
        self.unet = unet
        self.vae = vae
        self.scheduler = scheduler  # the folder's own; each call builds a fresh one from its config
        self.text_encoder = text_encoder
        self.upscaler = upscaler
        self.upscaler_path: str | None = None  # set when the upscaler came from a file, not the folder
        self.model_name = model_name
        self.model_path = model_path
        self.sampling = sampling or SamplingDefaults()
        self.upscale_tile: int | None = 256  # input pixels per upscaler tile (bounded memory)
        self.denoiser: Any = None  # the denoise stage: None = eager; accelerate() sets the graph loop
        self.report: dict[str, str] = {}  # what accelerate() did, switch by switch
        self.loras: list[Any] = []  # LoRAs applied by load_lora, in order
        self.controlnet: torch.nn.Module | None = None  # set by load_controlnet (one net or diffusers' Multi)
        self.controlnet_paths: list[str] = []  # where each net came from, in order (for the PNG metadata)

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
            sampling=bundle.sampling,
        )

    @classmethod
    def from_diffusers(cls, pipe: Any) -> RapidDiffusionPipeline:
        """Wrap a diffusers ``StableDiffusionPipeline`` (its modules, shared, not copied)."""
        from rapiddiff.models.text_encoder import KnowledgeTextEncoder

        encoder = KnowledgeTextEncoder(pipe.text_encoder, pipe.tokenizer)
        name = getattr(pipe, "name_or_path", None) or "diffusers"
        # The pipeline's scheduler class becomes the default sampler (its config, clipping etc., is kept).
        kinds = {cls_name: key for key, cls_name in SCHEDULERS.items()}
        kind = kinds.get(type(pipe.scheduler).__name__)
        if kind is None:
            log.warning(
                "%s is not one of rapiddiff's samplers (%s): pndm on its noise schedule is used",
                type(pipe.scheduler).__name__,
                ", ".join(SCHEDULERS),
            )
        sampling = SamplingDefaults(scheduler=kind or SamplingDefaults().scheduler)
        return cls(
            pipe.unet, pipe.vae, pipe.scheduler, encoder, model_name=Path(str(name)).name, sampling=sampling
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
        for module in (self.unet, self.vae, self.text_encoder, self.controlnet):
            if module is not None:
                module.to(device=device, dtype=dtype)
        if self.upscaler is not None:
            self.upscaler.to(device=device)
        return self

    def set_upscaler(self, path: str | Path) -> None:
        from rapiddiff.models.upscaler import load_upscaler

        self.upscaler = load_upscaler(path, device=self.device)
        self.upscaler_path = str(Path(path).resolve())

    # ------------------------------------------------------------------ LoRA
    def load_lora(self, path: str | Path, scale: float = 1.0) -> None:
        """Apply a LoRA (a ``train finetune`` LoRA folder or a diffusers-format LoRA file/folder)
        at ``scale``, merged into the weights so every fast-path switch keeps working;
        :meth:`unload_lora` restores the weights it changed."""
        from rapiddiff.models.lora import apply_lora, read_lora

        lora = read_lora(path)
        self.loras.append(apply_lora(lora, self.unet, self.text_encoder, scale=scale))

    def unload_lora(self) -> None:
        """Undo every :meth:`load_lora`, last first: the weights are the model's own again."""
        while self.loras:
            self.loras.pop().restore()

    # ------------------------------------------------------------------ ControlNet
    def load_controlnet(self, *paths: str | Path) -> None:
        """Load the ControlNet(s) every controlled call uses, in this order (replacing any loaded
        before): diffusers folders or ``.safetensors`` files, on the U-Net's device and dtype.
        Several act together as diffusers' ``MultiControlNetModel``: a call gives one
        :class:`~rapiddiff.models.controlnet.ControlSpec` per net, in the same order."""
        from rapiddiff.models.controlnet import combine, load_controlnet

        if not paths:
            raise ValueError("load_controlnet: give at least one ControlNet folder or .safetensors file")
        nets = [load_controlnet(p, device=self.device, dtype=self.dtype) for p in paths]
        self.controlnet = combine(nets)
        self.controlnet_paths = [str(Path(p).resolve()) for p in paths]

    def _require_controlnet(self, count: int) -> None:
        """A controlled call needs its nets: loaded, else the model folder's controlnet/ (loaded now)."""
        from rapiddiff.models.controlnet import CONTROLNET_FOLDER, net_count

        own = Path(self.model_path) / CONTROLNET_FOLDER if self.model_path is not None else None
        if self.controlnet is None and own is not None and (own / "config.json").is_file():
            log.info("loading the model folder's ControlNet %s", own)
            self.load_controlnet(own)
        loaded = net_count(self.controlnet)
        if loaded == 0:
            raise ValueError(
                "control given, but this pipeline has no ControlNet: load one with "
                "pipe.load_controlnet(FOLDER) (rapiddiff generate --controlnet FOLDER)"
            )
        if count != loaded:
            raise ValueError(
                f"control: {count} control image(s) given for {loaded} loaded ControlNet(s); give one "
                "per net, in the order they were loaded"
            )

    # ------------------------------------------------------------------ properties
    @property
    def device(self) -> torch.device:
        return next(self.unet.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.unet.parameters()).dtype

    @property
    def fixed_batch(self) -> bool:
        """Whether batches should keep one shape (a graph-captured loop per shape): eval pads them."""
        return bool(getattr(self.denoiser, "fixed_batch", False))

    # ------------------------------------------------------------------ stages
    def encode_prompt(
        self,
        prompts: Sequence[str],
        negative: str | Sequence[str] | None = None,
        *,
        do_classifier_free_guidance: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prompts (and negative prompts, default "") → cond, uncond states [B, L, D] in the U-Net's dtype."""
        import torch

        prompts = list(prompts)
        texts = prompts
        if do_classifier_free_guidance:
            texts = prompts + _per_prompt(negative, len(prompts), "negative_prompt")
        with torch.inference_mode():
            # One pass for prompts and negatives (diffusers makes two): half the tower's kernel launches.
            states = self.text_encoder.encode(texts).to(device=self.device, dtype=self.dtype)  # (2B, L, D)
        if not do_classifier_free_guidance:
            return states, None
        return states[: len(prompts)], states[len(prompts) :]

    def prepare_latents(
        self,
        seeds: Sequence[int],
        height: int,
        width: int,
        scheduler: Any,
        steps: int,
        *,
        dtype: torch.dtype,
        init: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        strength: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, list[torch.Generator], Inpaint | None]:
        """The start of the loop → (latents, noise, timesteps, start, generators, inpaint).

        ``init``: the init image [1, 3, H, W] in [-1, 1] (img2img / inpainting); ``mask``
        [1, 1, H, W] in {0, 1} (1 = repaint). Image ``k``'s generator draws its init image's VAE
        sample, then its noise, then (a 9-channel inpainting U-Net) its masked image's VAE sample —
        diffusers' order; a 9-channel U-Net at strength 1 skips the first, as diffusers does.
        """
        import torch

        from rapiddiff.models import sampling

        gens = sampling.generators(seeds)
        n, device = len(gens), self.device
        factor = self.vae_scale_factor
        channels = int(self.vae.config.latent_channels)
        shape = (channels, height // factor, width // factor)
        scheduler.set_timesteps(steps, device=device)
        if init is None:
            noise = sampling.draw_noise(gens, shape, dtype).to(device)  # (N, C, h, w)
            return noise * scheduler.init_noise_sigma, noise, scheduler.timesteps, 0, gens, None
        timesteps, start = sampling.timesteps_for_strength(scheduler, steps, strength)
        pure = mask is not None and strength == 1.0  # inpainting from pure noise, as diffusers does
        concat = mask is not None and int(self.unet.config.in_channels) == 2 * channels + 1
        image_latents = None
        if not (pure and concat):  # a 9-channel U-Net from pure noise never needs the image's latents
            pixels = init.to(device=device, dtype=self.vae.dtype).expand(n, -1, -1, -1)
            with torch.inference_mode():
                image_latents = sampling.encode_images(self.vae, pixels, gens).to(dtype)  # (N, C, h, w)
        noise = sampling.draw_noise(gens, shape, dtype).to(device)
        if pure:
            latents = noise * scheduler.init_noise_sigma
        else:
            latents = scheduler.add_noise(image_latents, noise, timesteps[:1].repeat(n))
        inpaint = None
        if mask is not None:
            latent_mask = torch.nn.functional.interpolate(mask, size=shape[1:]).to(device=device, dtype=dtype)
            masked_latents = None
            if concat:  # a 9-channel inpainting U-Net also sees the masked image
                masked = (init * (mask < 0.5)).to(device=device, dtype=self.vae.dtype).expand(n, -1, -1, -1)
                with torch.inference_mode():
                    masked_latents = sampling.encode_images(self.vae, masked, gens).to(dtype)
            inpaint = sampling.Inpaint(
                mask=latent_mask.expand(n, -1, -1, -1),
                image_latents=image_latents,
                noise=noise,
                masked_image_latents=masked_latents,
                concat=concat,
            )
        return latents, noise, timesteps, start, gens, inpaint

    def denoise(self, job: DenoiseJob, *, decode: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The denoise stage (and the decode, which the graph loop captures with it) →
        (latents [N, C, h, w], images [N, 3, H, W] in [0, 1] or None)."""
        if self.denoiser is not None:
            return self.denoiser(job, decode=decode)
        return eager_denoise(self, job, decode=decode)

    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents → images [N, 3, H, W] in [0, 1] (float32)."""
        import torch

        from rapiddiff.models.sampling import decode

        with torch.inference_mode():
            return decode(self.vae, latents)

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
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        height: int | None = None,
        width: int | None = None,
        seed: int | Sequence[int] | None = None,
        num_images_per_prompt: int = 1,
        scheduler: str | None = None,
        eta: float = 0.0,
        upscale: bool | None = False,
        knowledge: bool | str | None = None,
        init_image: str | Path | Image.Image | None = None,
        strength: float | None = None,
        mask_image: str | Path | Image.Image | None = None,
        output_type: Literal["pil", "np", "pt", "latent"] = "pil",
        progress: bool = True,
        deep_cache: int = 1,
        guidance_rescale: float | None = None,
        token_merge: float = 0.0,
        init_size: Literal["model", "keep"] = "model",
        control: ControlSpec | Sequence[ControlSpec] | None = None,
    ) -> GenerationOutput:
        """Generate ``len(prompts) × num_images_per_prompt`` images.

        ``num_inference_steps``, ``guidance_scale``, ``scheduler``, ``guidance_rescale`` (CFG
        rescale, :func:`rapiddiff.models.sampling.rescale_guidance`): ``None`` takes the model
        folder's sampling defaults (``self.sampling``). ``seed``: an int ``s`` gives image ``k``
        the seed ``s + k``; a list gives every image its own; ``None`` draws fresh seeds (returned
        in ``.seeds``). ``knowledge``: fuse the KnowledgeStore's facts into the text states
        (``None``: as loaded); ``False`` (or "off") is the base text encoder exactly, the ablation
        switch; "embed", "text" (the KG facts spelled into the prompt) or "both" choose the mode.
        ``upscale``: ``None`` upscales when the model has an upscaler.

        img2img: ``init_image`` (a path or PIL image) and ``strength`` (default 0.8: how far down
        the schedule the image is noised). Inpainting: also ``mask_image`` (white = repaint;
        ``strength`` default 1.0). Without ``height``/``width`` the init image is resized to the
        model's size (its longer side the model's, its aspect kept; logged) — ``init_size="keep"``
        samples at its own size instead, which must be a multiple of :attr:`size_multiple`.

        ``deep_cache=N`` (opt-in, approximate): the whole U-Net runs every N evaluations and the
        steps between reuse its deep features (DeepCache, :mod:`rapiddiff.models.deep_cache`);
        1 is the exact path. Recorded in the metadata when > 1.

        ``token_merge=R`` (opt-in, approximate): ToMe merges ``R`` of the tokens entering the
        highest-resolution self-attention (R in [0, 0.75]; 0.5 is ToMe's default;
        :mod:`rapiddiff.models.token_merge`); 0 is the exact path. Recorded in the metadata when > 0.

        ``control``: ControlNet guidance, one :class:`~rapiddiff.models.controlnet.ControlSpec` per
        loaded net (:meth:`load_controlnet`), in their order — its ``image`` (path or PIL; a bare
        image means ``ControlSpec(image)``), ``controlnet_conditioning_scale``,
        ``control_guidance_start`` and ``control_guidance_end`` as diffusers'
        ``StableDiffusionControlNetPipeline`` names them. The control image is resized to the
        generation size; without ``height``/``width`` (and no init image) that size is chosen from the
        first control image as from an init image. Works with txt2img, img2img and inpainting.
        """
        import time

        from rapiddiff.models import sampling

        started = time.perf_counter()
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        if not prompts:
            raise ValueError("no prompt given")
        steps, guidance, rescale, sched_name = self._sampling_settings(
            num_inference_steps, guidance_scale, guidance_rescale, scheduler
        )
        token_merge = self._check_options(deep_cache, token_merge, num_images_per_prompt, output_type)
        if upscale is None:
            upscale = self.upscaler is not None
        if upscale:
            self._require_upscaler()  # before any sampling is done
        if mask_image is not None and init_image is None:
            raise ValueError("mask_image needs init_image: the mask says which part of that image to repaint")
        if strength is not None and init_image is None:
            raise ValueError("strength needs init_image (img2img or inpainting)")
        for p in prompts:
            if not p.strip():
                log.warning("empty prompt: the image is generated unconditionally (from noise alone)")
        init = _source(init_image, "init_image", "RGB") if init_image is not None else None
        mask = _source(mask_image, "mask_image", "L") if mask_image is not None else None
        specs, controls = self._control_sources(control, deep_cache)
        if init is not None:
            strength = (1.0 if mask is not None else 0.8) if strength is None else float(strength)
        sizer = init or (controls[0] if controls else None)  # the image whose size sets the default
        if sizer is not None:
            height, width = self._size_for_init(sizer.image.size, height, width, init_size)
        height = height or self.default_size
        width = width or self.default_size
        check_size(height, width, self.size_multiple)
        negatives = _per_prompt(negative_prompt, len(prompts), "negative_prompt")
        n = len(prompts) * num_images_per_prompt
        seeds = _seeds(seed, n)

        knowledge_on, knowledge_mode = _knowledge_setting(self.text_encoder, knowledge)
        all_prompts = [p for p in prompts for _ in range(num_images_per_prompt)]
        all_negatives = [p for p in negatives for _ in range(num_images_per_prompt)]
        settings = self._settings(
            steps, guidance, sched_name, height, width, knowledge_on, bool(upscale), eta, init, mask, strength
        )
        mode = knowledge_mode if settings["knowledge"] else "embed"  # no mode to record when off
        settings.update(_approximate_settings(mode, deep_cache, token_merge, guidance, rescale))
        if specs:
            settings["control"] = self._control_settings(specs, controls)
        metadata = [
            {"prompt": p, "negative_prompt": neg, "seed": s, **settings}
            for p, neg, s in zip(all_prompts, all_negatives, seeds, strict=True)
        ]

        times: dict[str, float] = {}
        with _knowledge_as(self.text_encoder, knowledge):
            do_cfg = guidance > 1.0
            cond, uncond = self.encode_prompt(prompts, negatives, do_classifier_free_guidance=do_cfg)
        # One row per image, prompt by prompt: p0 img0, p0 img1, ..., p1 img0, ... (as diffusers orders them)
        cond = cond.repeat_interleave(num_images_per_prompt, dim=0)  # (N, L, D)
        uncond = uncond.repeat_interleave(num_images_per_prompt, dim=0) if uncond is not None else None
        times["encode"] = time.perf_counter() - started

        t0 = time.perf_counter()
        sched = make_scheduler(sched_name, self.scheduler.config)
        init_pixels, mask_pixels = self._preprocess(init, mask, height, width)
        latents, noise, timesteps, start, gens, inpaint = self.prepare_latents(
            seeds, height, width, sched, steps, dtype=cond.dtype, init=init_pixels, mask=mask_pixels,
            strength=strength or 1.0,
        )  # fmt: skip
        job = DenoiseJob(
            latents=latents,
            noise=noise,
            pure_noise=init is None or (mask is not None and strength == 1.0),
            cond=cond,
            uncond=uncond,
            scheduler=sched,
            steps=steps,
            timesteps=timesteps,
            start=start,
            guidance_scale=guidance,
            step_kwargs=sampling.step_kwargs(sched, gens, eta),
            inpaint=inpaint,
            progress=progress,
            deep_cache=deep_cache,
            guidance_rescale=rescale,
            token_merge=token_merge,
            control=self._control_conditioning(specs, controls, height, width, n, do_cfg),
        )
        latents, images = self.denoise(job, decode=output_type != "latent")
        images = keep_unmasked(images, init_pixels, mask_pixels)
        times["denoise_decode"] = time.perf_counter() - t0
        latents = latents.float()
        if output_type == "latent":
            times["total"] = time.perf_counter() - started
            return GenerationOutput(latents, seeds, all_prompts, all_negatives, metadata, latents, times)
        assert images is not None
        if upscale:
            t0 = time.perf_counter()
            images = self.upscale(images)
            times["upscale"] = time.perf_counter() - t0
        out = _convert(images, output_type)
        times["total"] = time.perf_counter() - started
        return GenerationOutput(out, seeds, all_prompts, all_negatives, metadata, latents, times)

    def _sampling_settings(
        self, steps: int | None, guidance: float | None, rescale: float | None, scheduler: str | None
    ) -> tuple[int, float, float, str]:
        """A call's steps, guidance, CFG rescale and sampler: the arguments given, else the model
        folder's defaults (``self.sampling``); checked."""
        defaults = self.sampling
        steps = defaults.num_inference_steps if steps is None else int(steps)
        guidance = defaults.guidance_scale if guidance is None else float(guidance)
        rescale = defaults.guidance_rescale if rescale is None else float(rescale)
        if not math.isfinite(guidance):  # NaN would sample silently to a black image
            raise ValueError(f"guidance_scale must be a finite number, got {guidance}")
        if not 0.0 <= rescale <= 1.0:
            raise ValueError(f"guidance_rescale must be in [0, 1], got {rescale}")
        sched_name = canonical_scheduler_name(scheduler or defaults.scheduler)
        if steps < 1:
            raise ValueError(f"num_inference_steps must be ≥ 1, got {steps}")
        return steps, guidance, rescale, sched_name

    def _check_options(self, deep_cache: int, token_merge: float, per_prompt: int, output_type: str) -> float:
        """Check a call's approximations, image count and output type; returns the ToMe ratio."""
        from rapiddiff.models.deep_cache import check_interval
        from rapiddiff.models.token_merge import TokenMerge, check_ratio

        check_interval(deep_cache)
        token_merge = check_ratio(token_merge)
        if token_merge > 0:
            TokenMerge.of(self.unet)  # a U-Net with nothing to merge is refused before sampling
        if per_prompt < 1:
            raise ValueError(f"num_images_per_prompt must be ≥ 1, got {per_prompt}")
        if output_type not in ("pil", "np", "pt", "latent"):
            raise ValueError(f"unknown output_type '{output_type}'; choose pil, np, pt or latent")
        return token_merge

    def _size_for_init(
        self, size: tuple[int, int], height: int | None, width: int | None, init_size: str
    ) -> tuple[int | None, int | None]:
        """(height, width) to sample an init image of ``size`` (W, H) at, where none was given: the
        model's size by default (a model samples badly, and slowly, far from the size it learnt)."""
        if height is not None or width is not None:
            return height, width
        w0, h0 = size
        if init_size == "keep":
            try:
                check_size(h0, w0, self.size_multiple)
            except ValueError as err:
                raise ValueError(f"init image {w0}x{h0} kept at its size: {err}") from err
            return h0, w0
        if init_size != "model":
            raise ValueError(f"init_size must be 'model' or 'keep', got {init_size!r}")
        side, m = self.default_size, self.size_multiple
        scale = side / max(w0, h0)
        height, width = max(m, round(h0 * scale / m) * m), max(m, round(w0 * scale / m) * m)
        if (width, height) != (w0, h0):
            log.info(
                "init image %dx%d resized to %dx%d (WxH), the model's size; give a size or keep its own "
                "(--keep-init-size, init_size='keep')",
                w0, h0, width, height,
            )  # fmt: skip
        return height, width

    def _settings(
        self,
        steps: int,
        guidance: float,
        sched_name: str,
        height: int,
        width: int,
        knowledge: bool,
        upscale: bool,
        eta: float,
        init: _Source | None,
        mask: _Source | None,
        strength: float | None,
    ) -> dict[str, Any]:
        """The settings every image of a call shares, as its PNG records them (--from-png remakes it)."""
        settings: dict[str, Any] = {
            "steps": steps,
            "guidance": guidance,
            "scheduler": sched_name,
            "height": height,
            "width": width,
            "knowledge": bool(knowledge and getattr(self.text_encoder, "store", None) is not None),
            "upscale": upscale,
            "model": self.model_name,
            # Absolute, so `rapiddiff generate --from-png` finds the model from any folder.
            "model_path": str(Path(self.model_path).resolve()) if self.model_path is not None else None,
        }
        if upscale and self.upscaler_path is not None:
            settings["upscaler"] = self.upscaler_path
        if eta:
            settings["eta"] = eta
        if init is not None:
            settings["task"] = "inpaint" if mask is not None else "img2img"
            settings["strength"] = strength
            settings["init_image"] = init.path
            settings["init_image_sha256"] = init.sha256
        if mask is not None:
            settings["mask"] = mask.path
            settings["mask_sha256"] = mask.sha256
        if self.loras:
            settings["lora"] = [{"path": lo.path, "scale": lo.scale} for lo in self.loras]
        return settings

    def _control_sources(self, control: Any, deep_cache: int) -> tuple[list[ControlSpec], list[_Source]]:
        """A call's ``control`` → its specs and their images (read now, so a bad file fails before sampling)."""
        from rapiddiff.models.controlnet import control_specs

        specs = control_specs(control)
        if not specs:
            return [], []
        self._require_controlnet(len(specs))
        if deep_cache > 1:
            raise ValueError(
                "deep_cache > 1 with a ControlNet: DeepCache skips the U-Net blocks the ControlNet's "
                "residuals enter; use one or the other"
            )
        return specs, [_source(s.image, f"control image {k + 1}", "RGB") for k, s in enumerate(specs)]

    def _control_settings(self, specs: list[ControlSpec], sources: list[_Source]) -> list[dict[str, Any]]:
        """What a PNG records of a call's control, net by net (--from-png remakes the image from it)."""
        return [
            {
                "image": src.path,
                "image_sha256": src.sha256,
                "controlnet": path,
                "scale": spec.controlnet_conditioning_scale,
                "start": spec.control_guidance_start,
                "end": spec.control_guidance_end,
            }
            for spec, src, path in zip(specs, sources, self.controlnet_paths, strict=True)
        ]

    def _control_conditioning(
        self, specs: list[ControlSpec], sources: list[_Source], height: int, width: int, n: int, guided: bool
    ) -> ControlConditioning | None:
        """The loop's ControlNet inputs: each control image prepared as diffusers prepares it."""
        if not specs:
            return None
        from rapiddiff.models.controlnet import ControlConditioning, prepare_control_image

        assert self.controlnet is not None
        images = [
            prepare_control_image(
                src.image,
                height,
                width,
                vae_scale_factor=self.vae_scale_factor,
                count=n,
                guided=guided,
                device=self.device,
                dtype=self.controlnet.dtype,
            )
            for src in sources
        ]
        return ControlConditioning(
            self.controlnet,
            images,
            scales=[s.controlnet_conditioning_scale for s in specs],
            starts=[s.control_guidance_start for s in specs],
            ends=[s.control_guidance_end for s in specs],
        )

    def _preprocess(
        self, init: _Source | None, mask: _Source | None, height: int, width: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """PIL → init [1, 3, H, W] in [-1, 1] and mask [1, 1, H, W] in {0, 1}, resized as diffusers does."""
        if init is None:
            return None, None
        from diffusers.image_processor import VaeImageProcessor

        factor = self.vae_scale_factor
        pixels = VaeImageProcessor(vae_scale_factor=factor).preprocess(init.image, height=height, width=width)
        if mask is None:
            return pixels, None
        masker = VaeImageProcessor(
            vae_scale_factor=factor, do_normalize=False, do_binarize=True, do_convert_grayscale=True
        )
        return pixels, masker.preprocess(mask.image, height=height, width=width)


def _approximate_settings(
    knowledge_mode: str, deep_cache: int, token_merge: float, guidance: float, rescale: float
) -> dict[str, Any]:
    """The settings a PNG records only when they differ from the exact default, so --from-png
    remakes the image."""
    settings: dict[str, Any] = {}
    if knowledge_mode != "embed":
        settings["knowledge_mode"] = knowledge_mode  # "text" / "both"
    if deep_cache > 1:
        settings["deep_cache"] = deep_cache  # an approximation
    if token_merge > 0:
        settings["token_merge"] = token_merge  # likewise
    if rescale and guidance > 1.0:
        settings["guidance_rescale"] = rescale
    return settings


def eager_denoise(
    pipe: RapidDiffusionPipeline, job: DenoiseJob, *, decode: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The eager denoise stage: the one loop of :mod:`rapiddiff.models.sampling` with the pipeline's U-Net."""
    import torch

    from rapiddiff.models import sampling

    with torch.inference_mode():
        return job.run(sampling.unet_model(pipe.unet), pipe.vae, decode=decode, unet=pipe.unet)


def keep_unmasked(
    images: torch.Tensor | None, init: torch.Tensor | None, mask: torch.Tensor | None
) -> torch.Tensor | None:
    """Inpainting: the init image's own pixels where the mask keeps them. The latent blend at each
    step keeps the known region only up to the VAE's round trip, which shifts flat colours visibly;
    diffusers pastes the original back the same way (``VaeImageProcessor.apply_overlay``).

    ``images`` [N, 3, H, W] in [0, 1]; ``init`` [1, 3, H, W] in [-1, 1]; ``mask`` [1, 1, H, W], 1 = repaint.
    """
    if images is None or mask is None or init is None:
        return images
    init = (init.to(images.device, images.dtype) / 2 + 0.5).clamp(0, 1)
    mask = mask.to(images.device, images.dtype)
    return images * mask + init * (1 - mask)


def _source(value: Any, what: str, mode: str) -> _Source:
    """An init image or mask from a path or a PIL image, with its provenance."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, str | Path):
        path = Path(value)
        if not path.is_file():
            raise FileNotFoundError(f"{what}: file not found: {path}")
        try:
            with Image.open(path) as opened:
                image = opened.convert(mode)
        except (UnidentifiedImageError, OSError) as err:
            raise ValueError(f"{what}: {path} is not an image file PIL can read ({err})") from err
        return _Source(image, str(path.resolve()), file_sha256(path))
    if isinstance(value, Image.Image):
        filename = getattr(value, "filename", "") or None
        if filename and Path(filename).is_file():
            return _Source(value.convert(mode), str(Path(filename).resolve()), file_sha256(filename))
        image = value.convert(mode)
        return _Source(image, None, hashlib.sha256(image.tobytes()).hexdigest())
    raise TypeError(f"{what}: expected a file path or a PIL image, got {type(value).__name__}")


def _knowledge_setting(encoder: Any, knowledge: bool | str | None) -> tuple[bool, str]:
    """What a call's ``knowledge`` argument means for this encoder: (on?, mode). None: as loaded;
    True/False: on/off in the encoder's mode; "off"; or a mode ("embed", "text", "both"), which is on."""
    on = bool(getattr(encoder, "knowledge", False))
    mode = getattr(encoder, "knowledge_mode", "embed")
    if isinstance(knowledge, bool):
        return knowledge, mode
    if knowledge is None:
        return on, mode
    if knowledge == "off":
        return False, mode
    from rapiddiff.models.expansion import check_mode

    mode = check_mode(knowledge)
    if getattr(encoder, "store", None) is None:
        log.warning(
            "knowledge %r asked for, but this model has no knowledge graph (no knowledge/ folder): "
            "its plain text encoder is used",
            mode,
        )
    return True, mode


def _knowledge_as(encoder: Any, knowledge: bool | str | None) -> Any:
    """The encoder's knowledge set as the call asks, for the block (a text tower without knowledge: as it is)."""
    import contextlib

    if not hasattr(encoder, "knowledge_as"):
        return contextlib.nullcontext(encoder)
    return encoder.knowledge_as(knowledge)


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


__all__ = [
    "SCHEDULERS",
    "DenoiseJob",
    "GenerationOutput",
    "RapidDiffusionPipeline",
    "SamplingDefaults",
    "canonical_scheduler_name",
    "check_size",
    "eager_denoise",
    "make_scheduler",
    "scheduler_choices",
    "to_pil",
]
