"""``accelerate(pipe, ...)``: speed-ups applied from outside the model code, each one a switch.

Works on a diffusers ``StableDiffusionPipeline`` and on rapiddiff's ``RapidDiffusionPipeline``
(anything with ``unet``, ``vae``, ``scheduler``, ``text_encoder`` and an ``encode_prompt``). The
model modules are changed in place (dtype, memory format, fused projections, attention
processors, fp8 layers, ``torch.compile``); the returned :class:`FastPipeline` runs the
GPU-resident denoising loop (one CUDA graph for the whole loop and the VAE decode) on top.

Every switch reports what happened in ``FastPipeline.report``: ``"on"``, ``"off"``, or
``"fallback: <reason>"`` (also logged) where it cannot apply here — no CUDA, an old GPU, a
scheduler whose update is not linear, LoRA layers that are not merged.

    from rapiddiff.infer.accelerate import accelerate
    fast = accelerate(pipe)                     # everything that pays, on this machine
    image = fast("一只熊猫", seed=0).images[0]
    fast.report                                 # {'attention': 'on (cudnn 4096×4096, ...)', ...}
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from rapiddiff.infer import fast_attention
from rapiddiff.infer.fast_cache import (
    load_backend_table,
    load_compile_cache,
    save_backend_table,
    save_compile_cache,
)
from rapiddiff.infer.fast_fp8 import fp8_supported, quantize_linears
from rapiddiff.infer.fast_loop import DenoiseLoop
from rapiddiff.infer.fast_plan import (
    ClippedDDIMPlan,
    LinearPlan,
    PlanUnsupported,
    clipped_ddim_plan,
    linear_plan,
)
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
LOOPS = ("graph", "resident", "eager")


@dataclass
class AccelerateConfig:
    """The switches of :func:`accelerate`. Defaults: everything measured to pay on an H200."""

    dtype: str | None = "float16"
    """Weights and activations: "float16", "bfloat16", or None to keep the pipeline's."""
    attention: str = "auto"
    """SDPA backend: "auto" (time flash/cudnn/efficient per attention shape, keep the fastest),
    "default" (PyTorch's own pick), or one of "flash", "cudnn", "efficient", "math"."""
    channels_last: bool = True
    """U-Net and VAE weights in channels-last (NHWC) memory format, as cuDNN's fast convolutions want."""
    fuse_qkv: bool = True
    """One matrix product for Q, K and V (self-attention) and for K, V (cross-attention)."""
    cross_kv_cache: bool = True
    """Compute the cross-attention K/V of every layer once per image (they depend only on the prompt)."""
    compile_unet: str | None = "default"
    """torch.compile mode for the U-Net (one of COMPILE_MODES), or None for eager."""
    compile_vae: str | None = "default"
    """torch.compile mode for the VAE decoder, or None."""
    compile_text_encoder: str | None = None
    """torch.compile mode for the text encoder, or None (it runs once per image)."""
    loop: str = "graph"
    """"graph": GPU-resident loop captured as one CUDA graph (with the VAE decode); "resident": the
    same loop without the graph; "eager": the scheduler's own step() on the host."""
    fp8: bool = False
    """fp8 (e4m3) linear layers in the U-Net's transformer blocks via torch._scaled_mm (Hopper)."""
    compile_cache: str | None = None
    """File of torch.compile cache artifacts: loaded before compiling if it exists, written after
    the first compiled run if not, so a new process skips recompiling."""
    max_graphs: int = 2
    """How many captured loops (one per batch/size/steps) to keep; each holds its own memory pool."""

    def __post_init__(self) -> None:
        if self.dtype not in (None, "float16", "bfloat16", "float32"):
            raise ValueError(f"dtype must be float16, bfloat16, float32 or None, got {self.dtype!r}")
        if self.attention not in fast_attention.ATTENTION_CHOICES:
            choices = ", ".join(fast_attention.ATTENTION_CHOICES)
            raise ValueError(f"attention must be one of {choices}; got {self.attention!r}")
        for key in ("compile_unet", "compile_vae", "compile_text_encoder"):
            mode = getattr(self, key)
            if mode is not None and mode not in COMPILE_MODES:
                raise ValueError(f"{key} must be None or one of {', '.join(COMPILE_MODES)}; got {mode!r}")
        if self.loop not in LOOPS:
            raise ValueError(f"loop must be one of {', '.join(LOOPS)}; got {self.loop!r}")

    @classmethod
    def off(cls, **overrides: Any) -> AccelerateConfig:
        """Every switch off (the eager reference), with ``overrides`` turned on."""
        base = cls(
            dtype=None,
            attention="default",
            channels_last=False,
            fuse_qkv=False,
            cross_kv_cache=False,
            compile_unet=None,
            compile_vae=None,
            loop="eager",
        )
        return cls(**{**asdict(base), **overrides})


@dataclass
class FastOutput:
    images: Any  # list of PIL images, or a float array (N, H, W, 3) in [0, 1] for output_type="np"
    latents: torch.Tensor  # final latents (N, 4, h, w), float32
    seconds: dict[str, float] = field(default_factory=dict)  # host wall time of each stage


class _Adapter:
    """The four things the fast path needs from a pipeline, for diffusers' and rapiddiff's."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        from diffusers import DiffusionPipeline

        self.diffusers = isinstance(pipe, DiffusionPipeline)

    @property
    def vae_scale_factor(self) -> int:
        if hasattr(self.pipe, "vae_scale_factor"):
            return int(self.pipe.vae_scale_factor)
        return 2 ** (len(self.pipe.vae.config.block_out_channels) - 1)

    def encode(
        self,
        prompts: list[str],
        negative: list[str] | None,
        per_prompt: int,
        guidance: bool,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        with torch.no_grad():
            if self.diffusers:
                cond, uncond = self.pipe.encode_prompt(prompts, device, per_prompt, guidance, negative)
                return cond, uncond if guidance else None
            cond, uncond = self.pipe.encode_prompt(prompts, negative, do_classifier_free_guidance=guidance)
        cond = cond.repeat_interleave(per_prompt, dim=0)
        uncond = uncond.repeat_interleave(per_prompt, dim=0) if guidance and uncond is not None else None
        return cond, uncond

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents → images (N, 3, H, W) in [0, 1], on the GPU, inside the graph if there is one."""
        vae = self.pipe.vae
        scaled = latents / vae.config.scaling_factor
        if getattr(vae.config, "shift_factor", None) is not None:
            scaled = scaled + vae.config.shift_factor
        scaled = scaled.to(vae.dtype)
        image = vae.decode(scaled, return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)


def accelerate(pipe: Any, config: AccelerateConfig | None = None, **switches: Any) -> FastPipeline:
    """Apply the fast path to ``pipe`` (in place) and return a :class:`FastPipeline` that runs it.

    ``switches`` override fields of ``config`` (see :class:`AccelerateConfig`), e.g.
    ``accelerate(pipe, fp8=True, compile_unet=None)``.
    """
    config = AccelerateConfig(**{**asdict(config or AccelerateConfig()), **switches})
    return FastPipeline(pipe, config)


class FastPipeline:
    """A pipeline with the fast path applied; call it like the pipeline."""

    def __init__(self, pipe: Any, config: AccelerateConfig) -> None:
        self.pipe, self.config = pipe, config
        self.adapter = _Adapter(pipe)
        self.unet, self.vae = pipe.unet, pipe.vae
        self.device = next(self.unet.parameters()).device
        self.report: dict[str, str] = {}
        self._backends: dict[fast_attention.ShapeKey, str] = {}
        self._loops: dict[tuple, DenoiseLoop] = {}
        self._plans: dict[tuple, LinearPlan | ClippedDDIMPlan | str] = {}
        self._cache_state = "none"
        self._apply()

    # ---- switches -------------------------------------------------------------------------------
    def _set(self, name: str, status: str) -> None:
        self.report[name] = status
        if status.startswith("fallback"):
            log.warning("accelerate: %s → %s", name, status)
        else:
            log.info("accelerate: %s → %s", name, status)

    def _apply(self) -> None:
        cfg, cuda = self.config, self.device.type == "cuda"
        if cfg.compile_cache:
            self._cache_state = load_compile_cache(cfg.compile_cache)
            # The attention backends are part of the traced graph: reuse the ones the cache was
            # compiled with, or a re-timed (noisy) choice would change the graph and miss the cache.
            self._backends.update(load_backend_table(cfg.compile_cache))
            self._set("compile_cache", self._cache_state)
        if cfg.dtype is not None and not cuda and cfg.dtype != "float32":
            self._set(
                "dtype", f"fallback: kept {self.unet.dtype} ({cfg.dtype} on {self.device.type} is slow)"
            )
        elif cfg.dtype is not None:
            dtype = getattr(torch, cfg.dtype)
            for module in (self.unet, self.vae, self.pipe.text_encoder):
                if next(module.parameters()).dtype != dtype:  # skip no-op casts (diffusers warns on each)
                    module.to(dtype=dtype)
            self._set("dtype", cfg.dtype)
        else:
            self._set("dtype", f"off (kept {self.unet.dtype})")

        if cfg.channels_last:
            self.unet.to(memory_format=torch.channels_last)
            self.vae.to(memory_format=torch.channels_last)
        self._set("channels_last", "on" if cfg.channels_last else "off")

        lora = _unmerged_lora(self.unet)
        if cfg.fuse_qkv and lora:
            self._set(
                "fuse_qkv", "fallback: the U-Net has unmerged LoRA layers; merge them first (fuse_lora)"
            )
        elif cfg.fuse_qkv:
            self._set("fuse_qkv", f"on ({fast_attention.fuse_qkv(self.unet)} attention layers)")
        else:
            self._set("fuse_qkv", "off")

        self._install_attention()

        if cfg.fp8:
            ok, why = fp8_supported(self.device)
            if not ok:
                self._set("fp8", f"fallback: {why}")
            elif lora:
                self._set("fp8", "fallback: the U-Net has unmerged LoRA layers; merge them first")
            else:
                self._set("fp8", f"on ({quantize_linears(self.unet)} linear layers in e4m3)")
        else:
            self._set("fp8", "off")

        self._compile()

        if cfg.loop == "graph" and not cuda:
            self._set(
                "loop", f"fallback: resident (CUDA graphs need a CUDA device, this is {self.device.type})"
            )
            self._loop_kind = "resident"
        else:
            self._loop_kind = cfg.loop
            self._set("loop", cfg.loop)

    def _install_attention(self) -> None:
        cfg = self.config
        wanted = cfg.attention
        default: str | None = None
        if wanted == "auto" and self.device.type != "cuda":
            self._set(
                "attention", f"fallback: default (backend timing needs CUDA; device is {self.device.type})"
            )
        elif wanted in fast_attention.BACKENDS:
            default = wanted
        needs_processor = wanted != "default" or cfg.cross_kv_cache or cfg.fuse_qkv
        if needs_processor:
            count = fast_attention.install(self.unet, self._backends, default)
            if "attention" not in self.report:
                detail = "per shape, chosen at first call" if wanted == "auto" else wanted
                self._set("attention", f"{detail} ({count} layers)")
        else:
            self._set("attention", "default")
        self._set("cross_kv_cache", "on" if cfg.cross_kv_cache else "off")
        self._auto_attention = wanted == "auto" and self.device.type == "cuda"

    def _compile(self) -> None:
        cfg = self.config
        graphs = cfg.loop == "graph" and self.device.type == "cuda"
        unet_mode = cfg.compile_unet
        if unet_mode in ("reduce-overhead", "max-autotune") and graphs:
            # Inductor's own CUDA graphs cannot live inside the captured loop.
            unet_mode = "default" if unet_mode == "reduce-overhead" else "max-autotune-no-cudagraphs"
            self._set("compile_unet", f"fallback: {unet_mode} (the loop graph already captures the U-Net)")
        if unet_mode:
            self.unet.compile(mode=unet_mode, fullgraph=True, dynamic=False)
            self.report.setdefault("compile_unet", unet_mode)
        else:
            self._set("compile_unet", "off")
        vae_mode = cfg.compile_vae
        if vae_mode in ("reduce-overhead", "max-autotune") and graphs:
            vae_mode = "default"
            self._set("compile_vae", "fallback: default (the loop graph captures the decode)")
        if vae_mode:
            self.vae.decode = torch.compile(self.vae.decode, mode=vae_mode, fullgraph=True, dynamic=False)
            self.report.setdefault("compile_vae", vae_mode)
        else:
            self._set("compile_vae", "off")
        if cfg.compile_text_encoder:
            # fullgraph=False: a knowledge encoder may branch on its entity ids; graph breaks are fine there.
            self.pipe.text_encoder.compile(mode=cfg.compile_text_encoder, dynamic=False)
            self._set("compile_text_encoder", cfg.compile_text_encoder)
        else:
            self._set("compile_text_encoder", "off")

    # ---- running --------------------------------------------------------------------------------
    def _plan(self, steps: int) -> LinearPlan | ClippedDDIMPlan | str:
        """The GPU loop's plan for the pipeline's scheduler, or the reason there is none."""
        scheduler = self.pipe.scheduler
        key = (type(scheduler).__name__, str(dict(scheduler.config)), steps)
        if key not in self._plans:
            self._plans[key] = _make_plan(scheduler, steps)
            if isinstance(self._plans[key], str):
                log.warning("accelerate: eager loop for %s: %s", type(scheduler).__name__, self._plans[key])
        return self._plans[key]

    def _unet_fn(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor, kv: Any) -> torch.Tensor:
        kwargs = {"cross_attention_kwargs": {"cross_kv": kv}} if kv is not None else {}
        return self.unet(x, t, encoder_hidden_states=context, return_dict=False, **kwargs)[0]

    def _kv_fn(self, context: torch.Tensor) -> Any:
        return fast_attention.cross_attention_kv(self.unet, context)

    def _ensure_backends(self, batch: int, h: int, w: int, context_len: int) -> None:
        if not self._auto_attention:
            return
        shapes = fast_attention.attention_shapes(self.unet, h, w, context_len)
        missing = {s for s in shapes if (s[0], s[1], s[3]) not in self._backends}
        if missing:
            self._backends.update(
                fast_attention.choose_backends(missing, batch, self.unet.dtype, self.device)
            )
            picks = sorted({f"{q}×{k}/{d}: {b}" for (q, k, d), b in self._backends.items()})
            self.report["attention"] = "on, per shape (" + ", ".join(picks) + ")"

    def __call__(
        self,
        prompt: str | list[str],
        negative_prompt: str | list[str] | None = None,
        *,
        num_inference_steps: int = 50,
        guidance_scale: float = 7.5,
        height: int | None = None,
        width: int | None = None,
        seed: int | list[int] | None = None,
        generator: torch.Generator | list[torch.Generator] | None = None,
        num_images_per_prompt: int = 1,
        output_type: str = "pil",
    ) -> FastOutput:
        times: dict[str, float] = {}
        t0 = time.perf_counter()
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        negative = [negative_prompt] * len(prompts) if isinstance(negative_prompt, str) else negative_prompt
        guidance = guidance_scale > 1.0
        sample_size = int(self.unet.config.sample_size) * self.adapter.vae_scale_factor
        height, width = height or sample_size, width or sample_size
        factor = self.adapter.vae_scale_factor
        if height % factor or width % factor:
            raise ValueError(f"height and width must be multiples of {factor}, got {height}×{width}")
        batch = len(prompts) * num_images_per_prompt

        cond, uncond = self.adapter.encode(prompts, negative, num_images_per_prompt, guidance, self.device)
        context = torch.cat([uncond, cond]) if guidance else cond
        context = context.to(self.unet.dtype)
        times["encode"] = time.perf_counter() - t0

        noise_shape = (batch, int(self.unet.config.in_channels), height // factor, width // factor)
        generator = _generators(generator, seed, batch, self.device)
        from diffusers.utils.torch_utils import randn_tensor

        noise = randn_tensor(noise_shape, generator=generator, device=self.device, dtype=self.unet.dtype)

        t1 = time.perf_counter()
        plan = self._plan(num_inference_steps)
        with torch.no_grad():
            if isinstance(plan, str) or self._loop_kind == "eager":
                latents = self._eager_loop(noise, context, guidance_scale, num_inference_steps, guidance)
                images = self.adapter.decode(latents)
            else:
                loop = self._get_loop(plan, noise_shape, tuple(context.shape), guidance)
                try:
                    latents, images = loop(noise, context, guidance_scale)
                except RuntimeError as err:
                    if not loop.use_graph:
                        raise
                    # Something in the loop is not capturable here: keep the speed we can, say why.
                    self._set("loop", f"fallback: resident (CUDA graph capture failed: {str(err)[:200]})")
                    self._loop_kind, loop.use_graph, loop.graph = "resident", False, None
                    torch.cuda.synchronize()
                    latents, images = loop(noise, context, guidance_scale)
        self._maybe_save_cache()
        images = images.permute(0, 2, 3, 1).cpu().numpy()  # the one host synchronisation
        times["denoise_decode"] = time.perf_counter() - t1
        if output_type == "pil":
            from diffusers.utils import numpy_to_pil

            images = numpy_to_pil(images)
        elif output_type != "np":
            raise ValueError(f"output_type must be 'pil' or 'np', got {output_type!r}")
        times["total"] = time.perf_counter() - t0
        return FastOutput(images=images, latents=latents, seconds=times)

    def _get_loop(
        self, plan: LinearPlan, noise_shape: tuple, context_shape: tuple, guidance: bool
    ) -> DenoiseLoop:
        key = (noise_shape, context_shape, guidance, plan.num_evaluations, id(plan))
        if key not in self._loops:
            while len(self._loops) >= max(1, self.config.max_graphs):
                self._loops.pop(next(iter(self._loops)))  # oldest first; its graph pool is freed
            _, _, h, w = noise_shape
            self._ensure_backends(context_shape[0], h, w, context_shape[1])
            graph = self._loop_kind == "graph"
            self._loops[key] = DenoiseLoop(
                self._unet_fn,
                plan,
                noise_shape=noise_shape,
                context_shape=context_shape,
                model_dtype=self.unet.dtype,
                device=self.device,
                guidance=guidance,
                kv_fn=self._kv_fn if self.config.cross_kv_cache else None,
                decode_fn=self.adapter.decode,
                graph=graph,
            )
        return self._loops[key]

    def _eager_loop(
        self, noise: torch.Tensor, context: torch.Tensor, scale: float, steps: int, guidance: bool
    ) -> torch.Tensor:
        """The scheduler's own loop on the host (the fallback for schedulers without a plan)."""
        scheduler = copy.deepcopy(self.pipe.scheduler)
        scheduler.set_timesteps(steps, device=self.device)
        _, _, h, w = noise.shape
        self._ensure_backends(context.shape[0], h, w, context.shape[1])
        kv = self._kv_fn(context) if self.config.cross_kv_cache else None
        latents = noise * scheduler.init_noise_sigma
        for t in scheduler.timesteps:
            x_in = torch.cat([latents] * 2) if guidance else latents
            x_in = scheduler.scale_model_input(x_in, t)
            out = self._unet_fn(x_in, t, context, kv)
            if guidance:
                uncond, cond = out.chunk(2)
                out = uncond + scale * (cond - uncond)
            latents = scheduler.step(out, t, latents, return_dict=False)[0]
        return latents.float()

    def _maybe_save_cache(self) -> None:
        path = self.config.compile_cache
        if path and self._cache_state.startswith("missing") and self.config.compile_unet:
            self._cache_state = save_compile_cache(path)
            save_backend_table(path, self._backends)
            self.report["compile_cache"] = self._cache_state

    def clear(self) -> None:
        """Drop the captured loops (and their memory pools)."""
        self._loops.clear()


def _make_plan(scheduler: Any, steps: int) -> LinearPlan | ClippedDDIMPlan | str:
    try:
        return linear_plan(scheduler, steps)
    except PlanUnsupported as err:
        reason = str(err)
    try:  # DDIM with clip_sample (diffusers' default for DDIM): its own GPU formula
        return clipped_ddim_plan(scheduler, steps)
    except PlanUnsupported:
        return reason


def _unmerged_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds PEFT LoRA layers that are not merged into their base weights.

    Merged LoRA (``fuse_lora``) is plain weights to every switch; unmerged adapters add a side
    branch that fused projections and fp8 layers would silently drop.
    """
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # no peft, no adapters
        return False
    return any(isinstance(m, BaseTunerLayer) and not m.merged for m in model.modules())


def _generators(
    generator: torch.Generator | list[torch.Generator] | None,
    seed: int | list[int] | None,
    batch: int,
    device: torch.device,
) -> torch.Generator | list[torch.Generator] | None:
    if generator is not None:
        return generator
    if seed is None:
        return None
    if isinstance(seed, int):
        return torch.Generator(device).manual_seed(seed)
    if len(seed) != batch:
        raise ValueError(f"got {len(seed)} seeds for {batch} images; give one seed or one per image")
    return [torch.Generator(device).manual_seed(s) for s in seed]


def describe(report: dict[str, str]) -> str:
    """The report as one line a log or a table can carry."""
    return "; ".join(f"{k}: {v}" for k, v in report.items())


__all__ = ["AccelerateConfig", "FastOutput", "FastPipeline", "accelerate", "describe"]
