"""The module transforms of the fast path, applied once when it is created, each reporting its status.

dtype, channels-last, fused projections, the attention processors, the batched time projections
and ``torch.compile``; then which loop runs. Each sets its :class:`SwitchStatus` in the report.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from rapiddiff.infer import fast_attention
from rapiddiff.infer.fast_report import OFF, ON, FastPathReport, SwitchStatus, fallback
from rapiddiff.infer.fast_time import batch_time_proj

if TYPE_CHECKING:
    from rapiddiff.infer.fast_config import AccelerateConfig

# compile_regions: the U-Net's repeated blocks (diffusers' _repeated_blocks names only the first).
REGION_BLOCKS = ("BasicTransformerBlock", "ResnetBlock2D")
# Inductor's own CUDA graphs cannot live inside the captured loop: the mode each becomes there.
NO_CUDAGRAPH_MODES = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}


def apply_transforms(
    pipe: Any, cfg: AccelerateConfig, report: FastPathReport, backends: dict[fast_attention.ShapeKey, str]
) -> str:
    """Transform ``pipe``'s modules in place as ``cfg`` asks; returns the loop kind that runs here."""
    unet, vae = pipe.unet, pipe.vae
    device = next(unet.parameters()).device
    report.set("dtype", _cast(pipe, cfg.dtype, device))
    if cfg.channels_last:
        unet.to(memory_format=torch.channels_last)
        vae.to(memory_format=torch.channels_last)
    report.set("channels_last", ON if cfg.channels_last else OFF)
    report.set("fuse_qkv", _fuse_qkv(unet, cfg.fuse_qkv))
    _install_attention(unet, cfg, device, report, backends)
    report.set("batch_time_proj", _time_proj(unet, cfg.batch_time_proj))
    graphs = cfg.loop == "graph" and device.type == "cuda"
    report.set("compile_unet", _compile_unet(unet, cfg.compile_unet, cfg.compile_regions, graphs))
    report.set("compile_vae", _compile_vae(vae, cfg.compile_vae, graphs))
    if cfg.loop == "graph" and device.type != "cuda":
        reason = f"CUDA graphs need a CUDA device, this is {device.type}"
        report.set("loop", fallback(reason, "resident"))
        return "resident"
    report.set("loop", SwitchStatus("on", cfg.loop))
    return cfg.loop


def _cast(pipe: Any, name: str | None, device: torch.device) -> SwitchStatus:
    if name is None:
        return SwitchStatus("off", reason=f"kept {pipe.unet.dtype}")
    if device.type != "cuda" and name != "float32":
        return fallback(f"{name} on {device.type} is slow", f"kept {pipe.unet.dtype}")
    dtype = getattr(torch, name)
    for module in (pipe.unet, pipe.vae, pipe.text_encoder, getattr(pipe, "controlnet", None)):
        if (
            module is not None and next(module.parameters()).dtype != dtype
        ):  # skip no-op casts (diffusers warns on each)
            module.to(dtype=dtype)
    return SwitchStatus("on", name)


def _fuse_qkv(unet: torch.nn.Module, wanted: bool) -> SwitchStatus:
    if not wanted:
        return OFF
    if unmerged_lora(unet):
        return fallback("the U-Net has unmerged LoRA layers; merge them first (fuse_lora)")
    return SwitchStatus("on", reason=f"{fast_attention.fuse_qkv(unet)} attention layers")


def _install_attention(
    unet: torch.nn.Module,
    cfg: AccelerateConfig,
    device: torch.device,
    report: FastPathReport,
    backends: dict[fast_attention.ShapeKey, str],
) -> None:
    wanted = cfg.attention
    if wanted == "auto" and device.type != "cuda":
        reason = f"backend timing needs CUDA; device is {device.type}"
        report.set("attention", fallback(reason, "default"))
    if wanted != "default" or cfg.cross_kv_cache or cfg.fuse_qkv:
        default = wanted if wanted in fast_attention.BACKENDS else None
        count = fast_attention.install(unet, backends, default)
        if "attention" not in report:
            detail = "per shape, chosen at first call" if wanted == "auto" else wanted
            report.set("attention", SwitchStatus("on", detail, f"{count} layers"))
    else:
        report.set("attention", SwitchStatus("on", "default"))
    report.set("cross_kv_cache", ON if cfg.cross_kv_cache else OFF)


def _time_proj(unet: torch.nn.Module, wanted: bool) -> SwitchStatus:
    if not wanted:
        return OFF
    count, why = batch_time_proj(unet)
    if why is not None:
        return fallback(why, "off")
    return SwitchStatus("on", reason=f"{count} ResNet blocks' projections in one product")


def _compile_unet(unet: torch.nn.Module, mode: str | None, regions: bool, graphs: bool) -> SwitchStatus:
    if not mode:
        return OFF
    status = SwitchStatus("on", mode)
    if graphs and mode in NO_CUDAGRAPH_MODES:
        mode = NO_CUDAGRAPH_MODES[mode]
        status = fallback("the loop graph already captures the U-Net", mode)
    if not regions:
        unet.compile(fullgraph=True, dynamic=False, mode=mode)
        return status
    blocks = [m for m in unet.modules() if any(c.__name__ in REGION_BLOCKS for c in type(m).__mro__)]
    # Blocks of one class share a forward and each distinct shape recompiles it: SD 1.5 has more
    # than Dynamo's default limit of 8, a hard failure under fullgraph=True. One graph per block.
    _raise_recompile_limit(len(blocks))
    for block in blocks:
        block.compile(fullgraph=True, dynamic=False, mode=mode)
    return SwitchStatus("on", f"{mode}, regional", f"{len(blocks)} blocks")


def _compile_vae(vae: torch.nn.Module, mode: str | None, graphs: bool) -> SwitchStatus:
    if not mode:
        return OFF
    status = SwitchStatus("on", mode)
    if graphs and mode in NO_CUDAGRAPH_MODES:
        mode = "default"
        status = fallback("the loop graph captures the decode", mode)
    vae.decode = torch.compile(vae.decode, fullgraph=True, dynamic=False, mode=mode)
    return status


def unmerged_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds PEFT LoRA layers not merged into their base weights: their side
    branch is what fused projections would silently drop (merged LoRA is plain weights)."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer  # optional dependency
    except ImportError:  # no peft, no adapters
        return False
    return any(isinstance(m, BaseTunerLayer) and not m.merged for m in model.modules())


def _raise_recompile_limit(limit: int) -> None:
    """Let Dynamo keep ``limit`` graphs per code object (never lowers a larger setting)."""
    config = torch._dynamo.config
    for name in ("recompile_limit", "accumulated_recompile_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), limit))
