"""The switches of the fast path (:func:`rapiddiff.infer.accelerate.accelerate`), typed and checked."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from rapiddiff.infer import fast_aoti, fast_attention

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
LOOPS = ("graph", "resident", "eager")


@dataclass
class AccelerateConfig:
    """The switches of :func:`accelerate`. Defaults: everything measured to pay."""

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
    (transformer and ResNet blocks) instead of the whole U-Net, so a new process with the compile
    cache traces each distinct block once; the glue between blocks runs eager."""
    compile_vae: str | None = "default"
    """torch.compile mode for the VAE decoder, or None."""
    loop: str = "graph"
    """"graph": GPU-resident loop captured as one CUDA graph (with the VAE decode); "resident": the
    same loop without the graph; "eager": the scheduler's own step() on the host."""
    compile_cache: str | None = None
    """File of torch.compile cache artifacts: loaded before compiling if it exists, written after
    the first compiled run if not, so a new process skips recompiling."""
    max_graphs: int = 2
    """How many captured loops (one per batch/size/steps) to keep; each holds its own memory pool."""
    aoti: str = "off"
    """AOTInductor packages of the U-Net and VAE decoder in place of torch.compile in the GPU loop
    (:mod:`rapiddiff.infer.fast_aoti`): "off"; "load": use the package built for this GPU, torch,
    shape and switches, else torch.compile with the reason logged; "build": also export a missing or
    stale package (minutes), then load it — what ``rapiddiff accelerate export`` does; "auto": as
    "load", and a missing or stale package is built by a background process for the next one
    (:mod:`rapiddiff.infer.fast_background`; on CUDA, else as "load") — what ``generate --fast``
    and ``serve --fast`` use. Off by default in the library: a call that starts processes is the
    commands' choice, not a side effect of ``accelerate(pipe)``."""
    aoti_dir: str | None = None
    """Folder of the packages; None: ``<the pipeline's model folder>/accelerated`` where it can be
    written, else a folder of the user cache (:func:`rapiddiff.infer.fast_packages.default_package_dir`)."""
    batch_time_proj: bool = True
    """The ResNet blocks' time-embedding projections as one product over their stacked weights
    (:mod:`rapiddiff.infer.fast_time`). U-Nets whose time embedding feeds only ResNet blocks
    (others fall back with the reason)."""

    def __post_init__(self) -> None:
        if self.dtype not in (None, "float16", "bfloat16", "float32"):
            raise ValueError(f"dtype must be float16, bfloat16, float32 or None, got {self.dtype!r}")
        if self.attention not in fast_attention.ATTENTION_CHOICES:
            choices = ", ".join(fast_attention.ATTENTION_CHOICES)
            raise ValueError(f"attention must be one of {choices}; got {self.attention!r}")
        for key in ("compile_unet", "compile_vae"):
            mode = getattr(self, key)
            if mode is not None and mode not in COMPILE_MODES:
                raise ValueError(f"{key} must be None or one of {', '.join(COMPILE_MODES)}; got {mode!r}")
        if self.loop not in LOOPS:
            raise ValueError(f"loop must be one of {', '.join(LOOPS)}; got {self.loop!r}")
        if self.aoti not in fast_aoti.MODES:
            raise ValueError(f"aoti must be one of {', '.join(fast_aoti.MODES)}; got {self.aoti!r}")
        for key in ("channels_last", "fuse_qkv", "cross_kv_cache", "compile_regions", "batch_time_proj"):
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
