"""``accelerate(pipe, ...)``: speed-ups applied from outside the model code, each one a switch.

It transforms *that* pipeline — a ``RapidDiffusionPipeline``, or a diffusers
``StableDiffusionPipeline``, which is wrapped into one sharing its modules — and returns it:
the model modules are changed in place (dtype, memory format, fused projections, attention
processors, fp8 layers, ``torch.compile``) and the pipeline's denoise stage (``pipe.denoiser``)
is swapped for :class:`GraphDenoiser`, the GPU-resident denoising loop (one CUDA graph for the
whole loop and the VAE decode). Prompts, seeds (one CPU generator per image), samplers,
knowledge, LoRA, img2img, upscaling and metadata stay the pipeline's own, so a call means the
same image on both paths.

Every switch reports what happened in ``pipe.report``: ``"on"``, ``"off"``, or
``"fallback: <reason>"`` (also logged) where it cannot apply here — no CUDA, an old GPU, LoRA
layers that are not merged. A run the graph loop cannot express (a scheduler whose update is
not linear, ``eta`` > 0, inpainting's per-pixel blending) runs the one eager loop of
:mod:`rapiddiff.models.sampling` on the transformed modules, with the reason logged once.
DeepCache (a job's ``deep_cache`` > 1) runs on the loop too: its full/cached pattern is fixed per
evaluation index, so the captured graph holds it (one captured loop per interval). Token merging
(a job's ``token_merge`` > 0, :mod:`rapiddiff.models.token_merge`) likewise: its destination
pattern is fixed per evaluation index and its shapes per ratio (one captured loop per ratio).
With ``aoti="load"`` the loop calls AOTInductor packages of the U-Net and the VAE decoder
(:mod:`rapiddiff.infer.fast_aoti`, built by ``rapiddiff accelerate export``) instead of the
torch.compile'd modules, so a new process skips Dynamo's tracing; everything else is the same loop.

    from rapiddiff.infer.accelerate import accelerate
    pipe = accelerate(pipe)                     # everything that pays, on this machine
    image = pipe("一只熊猫", seed=0).images[0]
    pipe.report                                 # {'attention': 'on (cudnn 4096×4096, ...)', ...}
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from rapiddiff.infer import fast_aoti, fast_attention
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
from rapiddiff.infer.pipeline import DenoiseJob, RapidDiffusionPipeline
from rapiddiff.models import sampling
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
AUTOTUNE_MODES = ("off", "convs", "gemm", "all", "pointwise")
LOOPS = ("graph", "resident", "eager")
# compile_regions: the U-Net's repeated blocks (diffusers' _repeated_blocks names only the first).
REGION_BLOCKS = ("BasicTransformerBlock", "ResnetBlock2D")


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
    compile_regions: bool = False
    """Regional compilation: compile_unet's mode applied to each repeated block of the U-Net
    (transformer and ResNet blocks) instead of the whole U-Net. Dynamo then traces each distinct
    block shape once, so a new process with the compile cache traces far less; the glue between
    blocks (time embedding, down/upsampling convolutions, conv_in/out) runs eager."""
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
    aoti: str = "off"
    """AOTInductor packages of the U-Net and VAE decoder in place of torch.compile in the GPU loop
    (:mod:`rapiddiff.infer.fast_aoti`): "off"; "load": use the package built for this GPU, torch,
    shape and switches, else torch.compile with the reason logged; "build": also export a missing or
    stale package (minutes), then load it — what ``rapiddiff accelerate export`` does."""
    aoti_dir: str | None = None
    """Folder of the packages; None: ``<the pipeline's model folder>/accelerated``."""
    cudnn_benchmark: bool = False
    """cuDNN picks each convolution's algorithm by timing (``torch.backends.cudnn.benchmark``)
    during the warm-up run before the loop graph is captured; the capture and the replays use
    the picked plans. The global flag is set only inside the fast path's calls (see
    :func:`cudnn_benchmark_flag`)."""
    fp16_accumulate: bool = False
    """cuBLAS float16 matrix products accumulate in float16
    (``torch.backends.cuda.matmul.allow_fp16_accumulation``) in the warm-up, the capture and the
    replays; the flag is set only inside the fast path's calls (:func:`fp16_accumulate_flag`). Off by
    default: it halves the accumulator width for a speed that depends on the GPU — none on an H100,
    whose tensor cores accumulate fp16 products in fp32 at the same rate (0.94×, BENCHMARKS.md). Only
    with a float16 U-Net on CUDA."""
    fuse_norm: bool = False
    """GroupNorm (+ the SiLU after it) of the U-Net and VAE as rapiddiff's own Triton kernels
    (:mod:`rapiddiff.infer.fast_norm`): three launches that each fill the GPU, where Inductor's fused
    kernels run 2–5× their bytes' time; a ResNet block's conv bias and time embedding enter its second
    norm directly. At 32² and above; CUDA with Triton only."""
    fuse_geglu: bool = False
    """The transformer blocks' GEGLU (projection, split, GELU, product) as one Triton kernel
    (:mod:`rapiddiff.infer.fast_geglu`): the (tokens × 2·inner) product never goes through memory.
    CUDA with Triton only; a LoRA-wrapped projection keeps the stock module."""
    batch_time_proj: bool = True
    """The ResNet blocks' time-embedding projections (22 matrix-vector products per SD 1.5
    evaluation) as one product over their stacked weights (:mod:`rapiddiff.infer.fast_time`); each
    block takes its columns. Any device; U-Nets whose time embedding feeds only ResNet blocks (others
    fall back with the reason). H100: 149.5 it/s against 147.6 and 146.4 without it in the same
    process, the same 63.3 dB (BENCHMARKS.md, issue 16, 2026-11-28)."""
    conv_1x1_as_mm: bool = False
    """1×1 convolutions (the transformers' proj_in/proj_out, the ResNet shortcuts: 46 per SD 1.5
    evaluation) lowered by Inductor as matrix products — cuBLAS with the bias in the epilogue — instead
    of cuDNN convolutions (Inductor's ``conv_1x1_as_mm``, a per-compile option like ``autotune``)."""
    autotune: str = "off"
    """Inductor max-autotune for the compiled U-Net and VAE decoder, restricted to: "convs"
    (Triton convolution templates vs cuDNN), "gemm" (Triton matrix-product templates vs cuBLAS),
    "all" (both), "pointwise" (no templates: Inductor's coordinate-descent tuning of its own Triton
    kernels' block sizes — the GroupNorm/SiLU/elementwise quarter of the GPU time), or "off". A
    per-compile config patch (:func:`autotune_options`), never Inductor's CUDA-graph modes. In the
    template modes Inductor lowers channels-last 1×1 convolutions as matrix products (tuned under
    "gemm"/"all", ATen's under "convs")."""

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
        if self.aoti not in fast_aoti.MODES:
            raise ValueError(f"aoti must be one of {', '.join(fast_aoti.MODES)}; got {self.aoti!r}")
        if self.autotune not in AUTOTUNE_MODES:
            raise ValueError(f"autotune must be one of {', '.join(AUTOTUNE_MODES)}; got {self.autotune!r}")
        for key in (
            "cudnn_benchmark",
            "fp16_accumulate",
            "fuse_norm",
            "fuse_geglu",
            "batch_time_proj",
            "conv_1x1_as_mm",
        ):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{key} must be true or false; got {getattr(self, key)!r}")

    @classmethod
    def off(cls, **overrides: Any) -> AccelerateConfig:
        """Every switch off (the eager reference), with ``overrides`` turned on."""
        base = cls(
            dtype=None,
            attention="default",
            channels_last=False,
            fuse_qkv=False,
            cross_kv_cache=False,
            batch_time_proj=False,
            compile_unet=None,
            compile_vae=None,
            loop="eager",
        )
        return cls(**{**asdict(base), **overrides})


def autotune_options(mode: str) -> dict[str, Any]:
    """Inductor config entries for ``AccelerateConfig.autotune`` ({} for "off"): torch.compile's
    ``options`` for the U-Net and decoder (merged with the compile mode's own) and the AOTInductor
    build's ``inductor_configs``; a per-compile patch, nothing global.

    ``max_autotune_gemm`` turns on template autotuning (matrix products and convolutions) without
    ``max_autotune``'s pointwise/reduction tuning or CUDA graphs. Inductor offers its Triton
    convolution template only when TRITON is also a GEMM backend, so "convs" lists it there too and
    keeps the GEMMs on ATen with :func:`gemms_on_aten` around the compiling calls. That filter is not
    an Inductor config entry, so "convs" writes its convolution backends in the other order: the
    same choices, a different Inductor cache key, and "all"'s cached graphs are never reused for it.
    """
    if mode not in AUTOTUNE_MODES:
        raise ValueError(f"autotune must be one of {', '.join(AUTOTUNE_MODES)}; got {mode!r}")
    if mode == "off":
        return {}
    if mode == "pointwise":  # the fused norm/activation kernels' launch shapes, timed at compile
        return {"coordinate_descent_tuning": True}
    convs = {"convs": "TRITON,ATEN", "gemm": "ATEN", "all": "ATEN,TRITON"}[mode]
    return {
        "max_autotune_gemm": True,
        "max_autotune_gemm_backends": "ATEN,TRITON",
        "max_autotune_conv_backends": convs,
    }


@functools.cache
def _aten_gemm_choices() -> Any:
    """An InductorChoices that drops every template but ATen's from the matrix-product lowerings
    (mm, addmm, bmm, ...); None where this torch has no such hook."""
    try:
        from torch._inductor.choices import InductorChoices
        from torch._inductor.select_algorithm import ExternKernelChoice
        from torch._inductor.virtualized import V
    except ImportError:
        return None
    if not hasattr(InductorChoices, "get_template_configs") or not hasattr(V, "set_choices_handler"):
        return None

    class AtenGemms(InductorChoices):
        dropped = 0  # GEMM templates kept out so far (the report shows the filter at work)

        def get_template_configs(
            self, kernel_inputs: Any, templates: Any, op_name: str, *args: Any, **kw: Any
        ) -> Any:
            if "conv" not in op_name:
                # A lowering may ask for its ATen and its Triton choices in separate calls (addmm
                # does): drop every template, each call keeps only its ATen kernels.
                kept = [t for t in templates if isinstance(t, ExternKernelChoice)]
                type(self).dropped += len(templates) - len(kept)
                templates = kept
            return super().get_template_configs(kernel_inputs, templates, op_name, *args, **kw)

        def uuid(self) -> str:  # Inductor's cache-key hook for custom choices
            return "rapiddiff-aten-gemms-1"

    return AtenGemms


def gemms_on_aten() -> contextlib.AbstractContextManager[None]:
    """While active (in this thread), Inductor lowers matrix products to ATen kernels only: the GEMM
    half of autotune="convs". Raises RuntimeError where this torch lacks the hook."""
    cls = _aten_gemm_choices()
    if cls is None:
        raise RuntimeError("this torch has no InductorChoices.get_template_configs hook")
    from torch._inductor.virtualized import V

    return V.set_choices_handler(cls())


@contextlib.contextmanager
def cudnn_benchmark_flag(on: bool = True) -> Any:
    """``torch.backends.cudnn.benchmark = on`` for the block, the previous value restored after.

    Restoring is safe for what was chosen inside: cuDNN's v8 API (aten/src/ATen/native/cudnn/
    Conv_v8.cpp, ``run_single_conv``) looks a convolution up in its plan cache *before* it reads the
    flag, and the key is the convolution's parameters (shapes, strides, dtype, memory format,
    alignment, deterministic, allow_tf32) — not the flag. A plan picked by timing is therefore used
    by every later call with that key, benchmark on or off, the graph capture included (which must
    not time anything). Two consequences: the cache is thread-local, and a key already planned by
    heuristics in this thread keeps that plan (turning the flag on later times nothing).
    """
    with _flag_for_block(torch.backends.cudnn, "benchmark", on):
        yield


@contextlib.contextmanager
def fp16_accumulate_flag(on: bool = True) -> Any:
    """``torch.backends.cuda.matmul.allow_fp16_accumulation = on`` for the block, the previous value
    restored after. ATen reads it as it launches each float16 matrix product, so a CUDA graph
    captured inside replays fp16-accumulating kernels whatever the flag is later."""
    with _flag_for_block(torch.backends.cuda.matmul, "allow_fp16_accumulation", on):
        yield


@contextlib.contextmanager
def _flag_for_block(owner: Any, name: str, on: bool) -> Any:
    """``owner.name = on`` for the block, the previous value restored after. (Not
    unittest.mock.patch.object: torch's backend flags are class-level properties, and its exit tries
    to delete them: AttributeError __delete__.)"""
    before = getattr(owner, name)
    setattr(owner, name, on)
    try:
        yield
    finally:
        setattr(owner, name, before)


def compile_cache_file(path: str, config: AccelerateConfig) -> str:
    """The compile-cache file for ``config``: ``path`` itself with the graph-changing switches as
    they are by default, else with the differences in its name (``cache.bin`` →
    ``cache.autotune-convs.cudnn-benchmark.bin``, ``cache.no-batch-time-proj.bin``), so a process never
    takes a cache written under other switches for its own (it would load, miss, and never be rewritten)."""
    tags = [f"autotune-{config.autotune}"] if config.autotune != "off" else []
    if config.cudnn_benchmark:
        tags.append("cudnn-benchmark")
    if config.fp16_accumulate:  # not in Inductor's cache key: autotune's GEMM timings depend on it
        tags.append("fp16-accumulate")
    switches = ("fuse_norm", "fuse_geglu", "conv_1x1_as_mm")
    tags += [name.replace("_", "-") for name in switches if getattr(config, name)]
    if not config.batch_time_proj:  # on by default: its absence changes the graph
        tags.append("no-batch-time-proj")
    if not tags:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.{'.'.join(tags)}{p.suffix}"))


def accelerate(pipe: Any, config: AccelerateConfig | None = None, **switches: Any) -> RapidDiffusionPipeline:
    """Apply the fast path to ``pipe`` (in place) and return it, with ``.report``.

    ``switches`` override fields of ``config`` (see :class:`AccelerateConfig`), e.g.
    ``accelerate(pipe, fp8=True, compile_unet=None)``. A diffusers ``StableDiffusionPipeline``
    comes back as a ``RapidDiffusionPipeline`` over the same modules.
    """
    config = AccelerateConfig(**{**asdict(config or AccelerateConfig()), **switches})
    if not isinstance(pipe, RapidDiffusionPipeline):
        from diffusers import DiffusionPipeline

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


class GraphDenoiser:
    """The fast denoise stage: applies the module transforms on creation, then runs each
    :class:`~rapiddiff.infer.pipeline.DenoiseJob` on the GPU-resident loop (graph-captured on CUDA)."""

    fixed_batch = True  # one captured loop per shape: callers that can (eval) keep batches full

    def __init__(self, pipe: RapidDiffusionPipeline, config: AccelerateConfig) -> None:
        self.pipe, self.config = pipe, config
        self.unet, self.vae = pipe.unet, pipe.vae
        self.device = next(self.unet.parameters()).device
        self.report: dict[str, str] = {}
        self._backends: dict[fast_attention.ShapeKey, str] = {}
        self._loops: dict[tuple, DenoiseLoop] = {}
        self._plans: dict[tuple, LinearPlan | ClippedDDIMPlan | str] = {}
        self._eager_reasons: set[str] = set()
        self._cache_state = "none"
        self._cache_path = compile_cache_file(config.compile_cache, config) if config.compile_cache else None
        self._cudnn_benchmark = False  # on where it applies (CUDA with cuDNN's plan cache)
        self._fp16_accumulate = False  # on where it applies (CUDA, a torch with the flag, float16)
        # Inductor options the U-Net/decoder compile with (autotune's patch, conv_1x1_as_mm)
        self._inductor_options: dict[str, Any] = {}
        self._autotune_mode = "off"  # the autotune mode as applied (a fallback builds what off builds)
        self._gemm_filter = False  # autotune="convs": GEMMs kept on ATen while compiling
        self._gemm_dropped = 0
        self._aoti: fast_aoti.PackageStore | None = None
        self._aoti_calls: dict[str, Any] = {}  # part + key fields → loaded package (or None: fall back)
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
        if self._cache_path:
            self._cache_state = load_compile_cache(self._cache_path)
            # The attention backends are part of the traced graph: reuse the ones the cache was
            # compiled with, or a re-timed (noisy) choice would change the graph and miss the cache.
            self._backends.update(load_backend_table(self._cache_path))
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
        self._install_kernels(lora)
        self._install_time_proj()

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

        self._setup_tuning()
        self._compile()

        if cfg.loop == "graph" and not cuda:
            self._set(
                "loop", f"fallback: resident (CUDA graphs need a CUDA device, this is {self.device.type})"
            )
            self._loop_kind = "resident"
        else:
            self._loop_kind = cfg.loop
            self._set("loop", cfg.loop)
        self._setup_aoti()

    def _install_kernels(self, lora: bool) -> None:
        """fuse_norm and fuse_geglu: rapiddiff's Triton kernels swapped into the U-Net and VAE."""
        cfg = self.config
        why = _triton_kernels_missing(self.device)
        if not cfg.fuse_norm:
            self._set("fuse_norm", "off")
        elif why:
            self._set("fuse_norm", f"fallback: off ({why})")
        else:
            from rapiddiff.infer.fast_norm import fuse_norms

            unet, vae = fuse_norms(self.unet), fuse_norms(self.vae)
            skipped = unet["skipped"] + vae["skipped"]
            self._set(
                "fuse_norm",
                f"on (U-Net: {unet['resnets']} ResNet blocks, {unet['norms']} other norms; "
                f"VAE: {vae['resnets']} and {vae['norms']}"
                + (f"; {skipped} blocks of another kind kept stock" if skipped else "")
                + ")",
            )
        if not cfg.fuse_geglu:
            self._set("fuse_geglu", "off")
        elif why:
            self._set("fuse_geglu", f"fallback: off ({why})")
        else:
            from rapiddiff.infer.fast_geglu import fuse_geglu

            count = fuse_geglu(self.unet)
            kept = " (LoRA-wrapped projections kept stock)" if lora else ""
            self._set("fuse_geglu", f"on ({count} GEGLU layers){kept}")

    def _install_time_proj(self) -> None:
        if not self.config.batch_time_proj:
            self._set("batch_time_proj", "off")
            return
        from rapiddiff.infer.fast_time import batch_time_proj

        count, why = batch_time_proj(self.unet)
        if why is not None:
            self._set("batch_time_proj", f"fallback: off ({why})")
        else:
            self._set("batch_time_proj", f"on ({count} ResNet blocks' projections in one product)")

    def _setup_aoti(self) -> None:
        cfg = self.config
        if cfg.aoti == "off":
            self._set("aoti", "off")
            return
        model_path = getattr(self.pipe, "model_path", None)
        folder = cfg.aoti_dir or (str(Path(model_path) / fast_aoti.PACKAGE_DIR) if model_path else None)
        if folder is None:
            self._set(
                "aoti", "fallback: torch.compile (no model folder to keep packages beside; pass aoti_dir)"
            )
        elif self._loop_kind == "eager":
            self._set("aoti", "fallback: torch.compile (packages serve the GPU loop; loop=eager)")
        else:
            weights_root = Path(model_path) if model_path else None
            self._aoti = fast_aoti.PackageStore(Path(folder), weights_root, cfg.aoti)
            self._set("aoti", f"{cfg.aoti} ({folder}; per shape at first use)")

    def _setup_tuning(self) -> None:
        """cudnn_benchmark, fp16_accumulate, autotune and conv_1x1_as_mm: decide what applies here (all
        act at first call)."""
        cfg = self.config
        lru = os.environ.get("TORCH_CUDNN_V8_API_LRU_CACHE_LIMIT", "").strip()
        if not cfg.cudnn_benchmark:
            self._set("cudnn_benchmark", "off")
        elif self.device.type != "cuda" or not torch.backends.cudnn.is_available():
            self._set(
                "cudnn_benchmark", f"fallback: off (cuDNN needs a CUDA device; this is {self.device.type})"
            )
        elif lru.lstrip("-").isdigit() and int(lru) < 0:
            # No plan cache: every call would re-time its convolution, inside the graph capture too.
            self._set(
                "cudnn_benchmark",
                f"fallback: off (TORCH_CUDNN_V8_API_LRU_CACHE_LIMIT={lru} disables cuDNN's plan cache)",
            )
        else:
            self._cudnn_benchmark = True
            self._set(
                "cudnn_benchmark",
                "on (convolutions timed in the warm-up before the capture; the flag is set only inside the fast path's calls)",
            )
        if not cfg.fp16_accumulate:
            self._set("fp16_accumulate", "off")
        elif not hasattr(torch.backends.cuda.matmul, "allow_fp16_accumulation"):  # torch < 2.7
            self._set(
                "fp16_accumulate",
                f"fallback: off (torch {torch.__version__} has no torch.backends.cuda.matmul.allow_fp16_accumulation)",
            )
        elif self.device.type != "cuda":
            self._set(
                "fp16_accumulate",
                f"fallback: off (cuBLAS fp16 accumulation needs a CUDA device; this is {self.device.type})",
            )
        elif self.unet.dtype != torch.float16:
            self._set(
                "fp16_accumulate",
                f"fallback: off (the flag only affects float16 matrix products; the U-Net is {self.unet.dtype})",
            )
        else:
            self._fp16_accumulate = True
            self._set(
                "fp16_accumulate",
                "on (cuBLAS fp16 GEMMs accumulate in fp16; the flag is set only inside the fast path's calls)",
            )
        self._setup_autotune()
        if not cfg.conv_1x1_as_mm:
            self._set("conv_1x1_as_mm", "off")
        elif not (cfg.compile_unet or cfg.compile_vae):
            self._set("conv_1x1_as_mm", "fallback: off (nothing is compiled: it is an Inductor lowering)")
        else:
            self._inductor_options = {**self._inductor_options, "conv_1x1_as_mm": True}
            self._set("conv_1x1_as_mm", "on (Inductor lowers 1×1 convolutions as matrix products)")

    def _setup_autotune(self) -> None:
        cfg = self.config
        mode = cfg.autotune
        if mode == "off":
            self._set("autotune", "off")
            return
        import torch._inductor.config as inductor_config

        options = autotune_options(mode)
        missing = [k for k in options if not hasattr(inductor_config, k)]
        if not (cfg.compile_unet or cfg.compile_vae):
            self._set(
                "autotune", "fallback: off (compile_unet and compile_vae are None: nothing is compiled)"
            )
        elif missing:
            self._set("autotune", f"fallback: off (this torch's Inductor has no {', '.join(missing)})")
        elif mode == "convs" and _aten_gemm_choices() is None:
            self._set(
                "autotune",
                "fallback: off (this torch has no hook to keep the GEMMs on ATen for convs-only tuning)",
            )
        else:
            self._inductor_options, self._gemm_filter, self._autotune_mode = options, mode == "convs", mode
            what = {
                "convs": "Triton convolution templates vs cuDNN; GEMMs on ATen",
                "gemm": "Triton GEMM templates vs cuBLAS (1×1 convolutions included); k×k convolutions on cuDNN",
                "all": "Triton convolution and GEMM templates vs cuDNN/cuBLAS",
                "pointwise": "coordinate-descent tuning of Inductor's Triton norm/elementwise kernels",
            }[mode]
            if self.device.type != "cuda":  # Inductor's templates are Triton (GPU) kernels
                what = f"no Triton templates on {self.device.type}: the same ATen kernels as off"
            parts = [n for n, m in (("U-Net", cfg.compile_unet), ("decoder", cfg.compile_vae)) if m]
            self._set("autotune", f"{mode} (Inductor max-autotune at first call: {what}; {', '.join(parts)})")

    def _compile_kwargs(self, mode: str) -> dict[str, Any]:
        """torch.compile's mode, or with autotune the mode's options plus the autotune patch."""
        if not self._inductor_options:
            return {"mode": mode}
        import torch._inductor

        return {"options": {**torch._inductor.list_mode_options(mode), **self._inductor_options}}

    @contextlib.contextmanager
    def _tuning(self) -> Any:
        """Around every call that may compile, time or capture: the cuDNN and cuBLAS flags and the GEMM filter."""
        with contextlib.ExitStack() as stack:
            if self._cudnn_benchmark:
                stack.enter_context(cudnn_benchmark_flag(True))
            if self._fp16_accumulate:
                stack.enter_context(fp16_accumulate_flag(True))
            if self._gemm_filter:
                stack.enter_context(gemms_on_aten())
                before = _aten_gemm_choices().dropped
                stack.callback(self._count_dropped, before)
            yield

    def _count_dropped(self, before: int) -> None:
        dropped = _aten_gemm_choices().dropped - before
        if dropped:
            self._gemm_dropped += dropped
            head = self.report["autotune"].split("; GEMM templates dropped")[0]
            self.report["autotune"] = f"{head}; GEMM templates dropped: {self._gemm_dropped}"

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
        if unet_mode and cfg.compile_regions:
            # By the class or a base of it: a block fuse_norm swapped to its subclass is still one.
            blocks = [
                m for m in self.unet.modules() if any(c.__name__ in REGION_BLOCKS for c in type(m).__mro__)
            ]
            # Blocks of one class share a forward, and each distinct shape is a recompile of it:
            # SD 1.5 has more than Dynamo's default limit of 8, which fullgraph=True turns into a hard
            # failure (FailOnRecompileLimitHit, H100 2026-11-23). One graph per block at most.
            _raise_recompile_limit(len(blocks))
            for block in blocks:
                block.compile(fullgraph=True, dynamic=False, **self._compile_kwargs(unet_mode))
            self._set("compile_unet", f"{unet_mode}, regional ({len(blocks)} blocks)")
        elif unet_mode:
            self.unet.compile(fullgraph=True, dynamic=False, **self._compile_kwargs(unet_mode))
            self.report.setdefault("compile_unet", unet_mode)
        else:
            self._set("compile_unet", "off")
        vae_mode = cfg.compile_vae
        if vae_mode in ("reduce-overhead", "max-autotune") and graphs:
            vae_mode = "default"
            self._set("compile_vae", "fallback: default (the loop graph captures the decode)")
        if vae_mode:
            self.vae.decode = torch.compile(
                self.vae.decode, fullgraph=True, dynamic=False, **self._compile_kwargs(vae_mode)
            )
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
    def plan_for(
        self, scheduler: Any, steps: int, start: int = 0, scaled_start: bool = False
    ) -> LinearPlan | ClippedDDIMPlan | str:
        """The GPU loop's plan for this scheduler and schedule, or the reason there is none."""
        key = (type(scheduler).__name__, str(dict(scheduler.config)), steps, start, scaled_start)
        if key not in self._plans:
            self._plans[key] = _make_plan(scheduler, steps, start, scaled_start)
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

    def _why_eager(self, job: DenoiseJob) -> str | None:
        """Why this job cannot run on the GPU loop (None: it can)."""
        if self._loop_kind == "eager":
            return None  # asked for: not a fallback
        if job.inpaint is not None:
            return "inpainting blends a per-pixel mask into every step, which the loop's coefficient table cannot express"
        if job.step_kwargs.get("eta"):
            return f"eta={job.step_kwargs['eta']} injects fresh noise at every step"
        plan = self.plan_for(job.scheduler, job.steps, job.start, not job.pure_noise)
        if isinstance(plan, str):
            return f"{type(job.scheduler).__name__}: {plan}"
        return None

    def __call__(self, job: DenoiseJob, *, decode: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run one denoise (and decode) job → (latents [N, C, h, w] float32, images [N, 3, H, W] or None)."""
        guidance = job.uncond is not None
        context = torch.cat([job.uncond, job.cond]) if guidance else job.cond  # (2N or N, L, D)
        context = context.to(self.unet.dtype)
        reason = self._why_eager(job)
        with torch.no_grad(), self._tuning():
            if reason is not None or self._loop_kind == "eager":
                if reason is not None and reason not in self._eager_reasons:
                    self._eager_reasons.add(reason)
                    log.warning("accelerate: eager loop (the transformed modules, no loop graph): %s", reason)
                return self._eager(job, context, decode)
            plan = self.plan_for(job.scheduler, job.steps, job.start, not job.pure_noise)
            assert not isinstance(plan, str)
            start = job.noise if job.pure_noise else job.latents  # what row 0 of the plan's basis holds
            loop = self._get_loop(
                plan,
                tuple(start.shape),
                tuple(context.shape),
                guidance,
                job.deep_cache,
                job.guidance_rescale,
                job.token_merge,
            )

            def attempt() -> tuple[torch.Tensor, torch.Tensor | None]:
                with self._deep_cache(job.deep_cache), self._token_merge(job.token_merge, start):
                    return loop(start, context, job.guidance_scale)

            try:
                latents, images = attempt()
            except RuntimeError as err:
                if not loop.use_graph:
                    raise
                # Something in the loop is not capturable here: keep the speed we can, say why.
                self._set("loop", f"fallback: resident (CUDA graph capture failed: {str(err)[:200]})")
                self._loop_kind, loop.use_graph, loop.graph = "resident", False, None
                torch.cuda.synchronize()
                latents, images = attempt()
        self._maybe_save_cache()
        return latents, images if decode else None

    def _eager(
        self, job: DenoiseJob, context: torch.Tensor, decode: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The one eager loop (rapiddiff.models.sampling.denoise) on the transformed modules."""
        _, _, h, w = job.latents.shape
        self._ensure_backends(context.shape[0], h, w, context.shape[1])
        kv = self._kv_fn(context) if self.config.cross_kv_cache else None

        def model(x: torch.Tensor, t: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
            return self._unet_fn(x, t, ctx, kv)

        latents, images = job.run(model, self.vae, decode=decode, dtype=self.unet.dtype, unet=self.unet)
        return latents.float(), images

    def _deep_cache(self, interval: int) -> Any:
        """DeepCache's wrappers installed around one loop run (a graph replay never calls them;
        the capture and a resident run do, in evaluation order)."""
        if interval <= 1:
            import contextlib

            return contextlib.nullcontext()
        from rapiddiff.models.deep_cache import DeepCache

        return DeepCache.of(self.unet).active(interval)

    def _token_merge(self, ratio: float, latents: torch.Tensor) -> Any:
        """Token merging's wrappers installed around one loop run (like :meth:`_deep_cache`)."""
        if ratio <= 0:
            return contextlib.nullcontext()
        from rapiddiff.models.token_merge import TokenMerge

        return TokenMerge.of(self.unet).active(ratio, tuple(latents.shape[-2:]), latents.device)

    def _get_loop(
        self,
        plan: LinearPlan | ClippedDDIMPlan,
        noise_shape: tuple,
        context_shape: tuple,
        guidance: bool,
        deep_cache: int = 1,
        guidance_rescale: float = 0.0,
        token_merge: float = 0.0,
    ) -> DenoiseLoop:
        key = (
            noise_shape,
            context_shape,
            guidance,
            plan.num_evaluations,
            id(plan),
            deep_cache,
            guidance_rescale,
            token_merge,
        )
        if key not in self._loops:
            while len(self._loops) >= max(1, self.config.max_graphs):
                self._loops.pop(next(iter(self._loops)))  # oldest first; its graph pool is freed
            _, _, h, w = noise_shape
            aoti = self._aoti is not None and deep_cache <= 1 and token_merge <= 0
            if aoti:
                self._adopt_package_backends(plan, noise_shape, context_shape)
            elif self._aoti is not None:
                what = "DeepCache" if deep_cache > 1 else "token merging"
                self._set(
                    "aoti_unet", f"fallback: torch.compile ({what} rewires the U-Net's blocks per step)"
                )
            self._ensure_backends(context_shape[0], h, w, context_shape[1])
            graph = self._loop_kind == "graph"
            unet_fn: Any = self._unet_fn
            decode_fn: Any = functools.partial(sampling.decode, self.vae)
            if deep_cache > 1:
                from rapiddiff.models.deep_cache import DeepCache

                # Each loop run makes exactly num_evaluations U-Net calls, in order.
                unet_fn = DeepCache.of(self.unet).stepped(self._unet_fn, deep_cache, plan.num_evaluations)
            if token_merge > 0:
                from rapiddiff.models.token_merge import TokenMerge

                merger = TokenMerge.of(self.unet)
                if self._auto_attention:  # the merged self-attention's shape gets its backend timed too
                    shapes = merger.attention_shapes((h, w), token_merge)
                    missing = {s for s in shapes if (s[0], s[1], s[3]) not in self._backends}
                    if missing:
                        self._backends.update(
                            fast_attention.choose_backends(
                                missing, context_shape[0], self.unet.dtype, self.device
                            )
                        )
                unet_fn = merger.stepped(unet_fn, plan.num_evaluations)
            if aoti:
                unet_fn, decode_fn = self._aoti_parts(plan, noise_shape, context_shape, unet_fn, decode_fn)
            self._loops[key] = DenoiseLoop(
                unet_fn,
                plan,
                noise_shape=noise_shape,
                context_shape=context_shape,
                model_dtype=self.unet.dtype,
                device=self.device,
                guidance=guidance,
                kv_fn=self._kv_fn if self.config.cross_kv_cache else None,
                decode_fn=decode_fn,
                graph=graph,
                guidance_rescale=guidance_rescale,
            )
        return self._loops[key]

    # ---- AOTInductor packages ---------------------------------------------------------------------
    def _aoti_fields(
        self, plan: LinearPlan | ClippedDDIMPlan, noise_shape: tuple, context_shape: tuple
    ) -> dict[str, dict[str, Any]]:
        """The shapes and switches part of each package's key (see fast_aoti.package_key)."""
        cfg = self.config
        attention = cfg.attention if cfg.attention != "auto" or self._auto_attention else "default"
        t_dtype = str(plan.timesteps.dtype).removeprefix("torch.")
        # The tuning switches as applied (a fallback to off builds what off builds).
        tuning = {
            "cudnn_benchmark": self._cudnn_benchmark,
            "fp16_accumulate": self._fp16_accumulate,
            "autotune": self._autotune_mode,
        }
        kernels = {k: self.report.get(k, "off").startswith("on") for k in ("fuse_norm", "fuse_geglu")}
        if self.report.get("batch_time_proj", "off").startswith("on"):
            # Only when on: a package built unpacked (every one from before the switch) keeps its key.
            kernels["batch_time_proj"] = True
        return {
            "unet": {
                "shapes": {
                    "x": [context_shape[0], *noise_shape[1:]],
                    "context": list(context_shape),
                    "t": t_dtype,
                },
                "switches": {
                    "channels_last": cfg.channels_last,
                    "fuse_qkv": self.report.get("fuse_qkv", "off").startswith("on"),
                    "attention": attention,
                    "cross_kv_cache": cfg.cross_kv_cache,
                    "fp8": self.report.get("fp8", "off").startswith("on"),
                    **kernels,
                    **tuning,
                },
                "inductor": self._inductor_options,
            },
            "decoder": {
                "shapes": {"latents": list(noise_shape)},
                "switches": {"channels_last": cfg.channels_last, "fuse_norm": kernels["fuse_norm"], **tuning},
                "inductor": self._inductor_options,
            },
        }

    def _adopt_package_backends(
        self, plan: LinearPlan | ClippedDDIMPlan, noise_shape: tuple, context_shape: tuple
    ) -> None:
        """With attention="auto", take the backends the U-Net package was traced with instead of
        re-timing them (a noisy re-pick would make the package look stale)."""
        if not self._auto_attention or self._aoti is None:
            return
        fields = self._aoti_fields(plan, noise_shape, context_shape)["unet"]
        probe = fast_aoti.package_key("unet", device=self.device, dtype=self.unet.dtype, weights="", **fields)
        try:
            rows = fast_aoti.read_manifest(fast_aoti.package_path(self._aoti.folder, probe)).get(
                "backends", []
            )
        except fast_aoti.PackageError:
            return
        for row in rows:
            self._backends.setdefault((int(row[0]), int(row[1]), int(row[2])), str(row[3]))

    def _aoti_parts(
        self,
        plan: LinearPlan | ClippedDDIMPlan,
        noise_shape: tuple,
        context_shape: tuple,
        unet_fn: Any,
        decode_fn: Any,
    ) -> tuple[Any, Any]:
        """The loaded (or built) packages in place of the compiled U-Net and decoder, part by part."""
        assert self._aoti is not None
        fields = self._aoti_fields(plan, noise_shape, context_shape)
        dtype, device = self.unet.dtype, self.device
        context = torch.zeros(context_shape, dtype=dtype, device=device)
        # Example inputs made as the loop makes them (same strides: the kernels assume them).
        kv = self._kv_fn(context) if self.config.cross_kv_cache else {}
        unet_args = (
            torch.zeros(fields["unet"]["shapes"]["x"], dtype=dtype, device=device),
            plan.timesteps.to(device)[0],
            context,
            kv,
        )
        latents = torch.zeros(noise_shape, dtype=torch.float32, device=device)
        parts = {
            "unet": (fast_aoti.UNetCall(self.unet), unet_args),
            "decoder": (fast_aoti.DecodeCall(self.vae), (latents,)),
        }
        loaded = {}
        with self._eager_modules(), torch.no_grad():
            for part, (module, args) in parts.items():
                memo = part + json.dumps(fields[part], sort_keys=True)
                if memo not in self._aoti_calls:  # once per process: a new loop of the same shape reuses it
                    backends = [[*k, b] for k, b in sorted(self._backends.items())] if part == "unet" else []
                    call, status, _ = self._aoti.resolve(
                        part, module, args, fields[part], device, dtype, extra={"backends": backends}
                    )
                    self._set(f"aoti_{part}", status)
                    self._aoti_calls[memo] = call
                loaded[part] = self._aoti_calls[memo]
        if loaded["unet"] is not None:
            unet_call = loaded["unet"]

            def unet_fn(x: torch.Tensor, t: torch.Tensor, ctx: torch.Tensor, kv: Any) -> torch.Tensor:
                # t is timesteps[i], a view at an 8-byte offset: a fresh copy keeps the 16-byte
                # alignment the compiled kernels may assume (torch.compile would guard on it).
                return unet_call(x, t.clone(), ctx, kv if kv is not None else {})

        if loaded["decoder"] is not None:
            decode_fn = loaded["decoder"]
        return unet_fn, decode_fn

    @contextlib.contextmanager
    def _eager_modules(self) -> Any:
        """The U-Net and decoder without their torch.compile wrappers (torch.export traces the modules)."""
        compiled = [
            (m, m._compiled_call_impl) for m in self.unet.modules() if m._compiled_call_impl is not None
        ]
        compiled_decode = self.vae.__dict__.pop("decode", None)
        for module, _ in compiled:
            module._compiled_call_impl = None
        try:
            yield
        finally:
            for module, call in compiled:
                module._compiled_call_impl = call
            if compiled_decode is not None:
                self.vae.decode = compiled_decode

    def _maybe_save_cache(self) -> None:
        path = self._cache_path
        if path and self._cache_state.startswith("missing") and self.config.compile_unet:
            self._cache_state = save_compile_cache(path)
            save_backend_table(path, self._backends)
            self.report["compile_cache"] = self._cache_state

    def clear(self) -> None:
        """Drop the captured loops (and their memory pools) and the loaded packages: the next loop
        checks its packages again (after a change to the modules, e.g. new LoRA layers)."""
        self._loops.clear()
        self._aoti_calls.clear()


def _make_plan(
    scheduler: Any, steps: int, start: int = 0, scaled_start: bool = False
) -> LinearPlan | ClippedDDIMPlan | str:
    try:
        return linear_plan(scheduler, steps, start=start, scaled_start=scaled_start)
    except PlanUnsupported as err:
        reason = str(err)
    try:  # DDIM with clip_sample (diffusers' default for DDIM): its own GPU formula
        return clipped_ddim_plan(scheduler, steps, start=start)
    except PlanUnsupported:
        return reason


def _triton_kernels_missing(device: torch.device) -> str | None:
    """Why rapiddiff's Triton kernels cannot run here (None: they can)."""
    if device.type != "cuda":
        return f"the kernels are Triton GPU kernels; this is {device.type}"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    return None


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


def describe(report: dict[str, str]) -> str:
    """The report as one line a log or a table can carry."""
    return "; ".join(f"{k}: {v}" for k, v in report.items())


def _raise_recompile_limit(limit: int) -> None:
    """Let Dynamo keep ``limit`` graphs per code object (never lowers a larger setting)."""
    config = torch._dynamo.config
    for name in ("recompile_limit", "accumulated_recompile_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), limit))


__all__ = [
    "AUTOTUNE_MODES",
    "AccelerateConfig",
    "GraphDenoiser",
    "accelerate",
    "autotune_options",
    "compile_cache_file",
    "cudnn_benchmark_flag",
    "describe",
    "fp16_accumulate_flag",
    "gemms_on_aten",
]
