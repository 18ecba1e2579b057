"""Attention for the fast path: per-shape SDPA backend, fused projections, cached cross-attention K/V.

:class:`FastAttnProcessor` is a diffusers attention processor (the model code stays stock; the
processor is the documented extension point). Compared with ``AttnProcessor2_0`` it

- runs ``scaled_dot_product_attention`` under the backend chosen for its shape
  (``torch.nn.attention.sdpa_kernel``), e.g. cuDNN for the 4,096-token self-attention and
  flash for the 77-token cross-attention, whichever :func:`choose_backends` measured faster;
- uses the fused ``to_qkv`` / ``to_kv`` projections when ``fuse_projections`` made them;
- takes the cross-attention keys and values from ``cross_kv`` (a dict passed through the U-Net's
  ``cross_attention_kwargs``) when given. They depend only on the prompt, so
  :func:`cross_attention_kv` computes them once per image instead of once per step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)

BACKENDS: dict[str, SDPBackend] = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
ATTENTION_CHOICES = ("auto", "default", *BACKENDS)

ShapeKey = tuple[int, int, int]  # (query tokens, key tokens, head width)


class FastAttnProcessor:
    """SDPA processor with a per-shape backend table, fused projections and cached cross K/V."""

    def __init__(
        self, name: str, backends: dict[ShapeKey, str] | None = None, default: str | None = None
    ) -> None:
        self.name = name
        self.backends = backends if backends is not None else {}  # shared by all processors of a model
        self.default = default  # backend name used for shapes not in the table; None = PyTorch's choice

    def backend_for(self, key: ShapeKey) -> str | None:
        return self.backends.get(key, self.default)

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        temb: torch.Tensor | None = None,
        cross_kv: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch, channel, height * width).transpose(1, 2)
        batch = hidden_states.shape[0]
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)

        cross = encoder_hidden_states is not None
        heads = attn.heads
        if not cross and getattr(attn, "fused_projections", False) and hasattr(attn, "to_qkv"):
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
            key, value = _heads(key, heads), _heads(value, heads)
        else:
            query = attn.to_q(hidden_states)
            if cross and cross_kv is not None and self.name in cross_kv:
                key, value = cross_kv[self.name]  # (B, heads, L, d), computed once per image
            else:
                context = hidden_states if not cross else encoder_hidden_states
                if cross and attn.norm_cross:
                    context = attn.norm_encoder_hidden_states(context)
                key, value = project_kv(attn, context)
        query = _heads(query, heads)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, key.shape[2], batch)
            attention_mask = attention_mask.view(batch, heads, -1, attention_mask.shape[-1])
        backend = self.backend_for((query.shape[2], key.shape[2], query.shape[3]))
        if backend is None:
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask)
        else:
            with sdpa_kernel([BACKENDS[backend]]):
                out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask)
        out = out.transpose(1, 2).reshape(batch, -1, heads * query.shape[-1]).to(query.dtype)
        out = attn.to_out[1](attn.to_out[0](out))
        if input_ndim == 4:
            out = out.transpose(-1, -2).reshape(batch, channel, height, width)
        if attn.residual_connection:
            out = out + residual
        return out / attn.rescale_output_factor


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, L, heads·d) → (B, heads, L, d)."""
    return x.view(x.shape[0], -1, heads, x.shape[-1] // heads).transpose(1, 2)


def project_kv(attn: Any, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of ``context`` in (B, heads, L, d), through ``to_kv`` when fused."""
    if getattr(attn, "fused_projections", False) and hasattr(attn, "to_kv"):
        key, value = attn.to_kv(context).chunk(2, dim=-1)
    else:
        key, value = attn.to_k(context), attn.to_v(context)
    return _heads(key, attn.heads), _heads(value, attn.heads)


def attention_modules(model: torch.nn.Module) -> Iterable[tuple[str, Any]]:
    from diffusers.models.attention_processor import Attention

    for name, module in model.named_modules():
        if isinstance(module, Attention):
            yield name, module


def install(model: torch.nn.Module, backends: dict[ShapeKey, str], default: str | None) -> int:
    """Give every attention layer of ``model`` a :class:`FastAttnProcessor`; returns how many."""
    count = 0
    for name, module in attention_modules(model):
        module.set_processor(FastAttnProcessor(name, backends, default))
        count += 1
    return count


def cross_attention_kv(
    model: torch.nn.Module, context: torch.Tensor
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """K/V of every cross-attention layer for ``context`` (B, L, D): what each step would recompute."""
    kv = {}
    for name, module in attention_modules(model):
        if (
            module.is_cross_attention
            and not module.norm_cross
            and isinstance(module.processor, FastAttnProcessor)
        ):
            kv[name] = project_kv(module, context)
    return kv


def fuse_qkv(model: torch.nn.Module) -> int:
    """``model.fuse_qkv_projections()``, then point the unfused weights into the fused ones.

    diffusers keeps ``to_q/to_k/to_v`` next to the new ``to_qkv``; making them views of it means
    fusing costs no memory (and the unfused layers, still used by other processors, stay right).
    """
    model.fuse_qkv_projections()
    count = 0
    with torch.no_grad():
        for _, module in attention_modules(model):
            if not getattr(module, "fused_projections", False):
                continue
            fused, parts = (
                (module.to_kv, [module.to_k, module.to_v])
                if module.is_cross_attention
                else (module.to_qkv, [module.to_q, module.to_k, module.to_v])
            )
            start = 0
            for part in parts:
                part = getattr(part, "base_layer", part)  # a (merged) PEFT LoRA wrapper: its base Linear
                rows = part.weight.shape[0]
                part.weight = torch.nn.Parameter(fused.weight[start : start + rows], requires_grad=False)
                if part.bias is not None:
                    part.bias = torch.nn.Parameter(fused.bias[start : start + rows], requires_grad=False)
                start += rows
            count += 1
    return count


def attention_shapes(
    model: torch.nn.Module, height: int, width: int, cross_len: int = 77
) -> set[tuple[int, int, int, int]]:
    """(query tokens, key tokens, heads, head width) of the U-Net's attention layers at a latent size."""
    shapes = set()
    blocks = list(model.config.block_out_channels)
    for name, module in attention_modules(model):
        level = _level_of(name, len(blocks))
        tokens = (height >> level) * (width >> level)
        inner = module.inner_dim if hasattr(module, "inner_dim") else module.to_q.out_features
        heads = module.heads
        keys = cross_len if module.is_cross_attention else tokens
        shapes.add((tokens, keys, heads, inner // heads))
    return shapes


def _level_of(name: str, n_levels: int) -> int:
    """Resolution level of a U-Net attention layer from its module path (down/mid/up blocks)."""
    parts = name.split(".")
    if parts[0] == "down_blocks":
        return int(parts[1])
    if parts[0] == "up_blocks":
        return n_levels - 1 - int(parts[1])
    return n_levels - 1  # mid block


def choose_backends(
    shapes: Iterable[tuple[int, int, int, int]],
    batch: int,
    dtype: torch.dtype,
    device: torch.device,
    candidates: Iterable[str] = ("flash", "cudnn", "efficient"),
) -> dict[ShapeKey, str]:
    """Time each SDPA backend on each attention shape (a CUDA graph's replays, :func:`_median_ms`) and
    keep the fastest."""
    table: dict[ShapeKey, str] = {}
    for tokens, keys, heads, width in sorted(shapes):
        q = torch.randn(batch, heads, tokens, width, device=device, dtype=dtype)
        k = torch.randn(batch, heads, keys, width, device=device, dtype=dtype)
        v = torch.randn_like(k)
        timings = {}
        for name in candidates:
            try:
                with sdpa_kernel([BACKENDS[name]]):
                    timings[name] = _median_ms(lambda: F.scaled_dot_product_attention(q, k, v))  # noqa: B023
            except RuntimeError as err:  # backend does not support this shape/device
                log.debug("SDPA backend %s unavailable for %s: %s", name, (tokens, keys, width), err)
        if timings:
            best = min(timings, key=timings.__getitem__)
            table[(tokens, keys, width)] = best
            log.info(
                "attention %d×%d tokens, %d heads of %d: %s",
                tokens,
                keys,
                heads,
                width,
                ", ".join(f"{n} {t * 1e3:.0f} µs" for n, t in sorted(timings.items(), key=lambda kv: kv[1])),
            )
    return table


def _median_ms(fn: Any, repeats: int = 20) -> float:
    """The GPU time of one ``fn()``: Triton's ``do_bench_cudagraph`` (the median over replays of a CUDA
    graph of the calls) times the kernels alone, as the captured loop runs them; events around each
    call would time a busy host too and pick the wrong backend. Per-call events remain the fallback
    without Triton or for a backend that cannot be captured."""
    try:
        from triton.testing import do_bench_cudagraph  # optional: not every install has Triton

        # rep: a graph of about 2 ms of calls, replayed 10 times: some 25 ms per backend and shape
        return float(do_bench_cudagraph(fn, rep=2, return_mode="median"))
    except (ImportError, RuntimeError) as err:
        log.debug("timing without a CUDA graph: %s", err)
    for _ in range(3):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for start, end in zip(starts, ends, strict=True):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))
    return times[len(times) // 2]


class BackendTable:
    """The per-shape SDPA backends of one U-Net, timed at first use of each shape (``auto`` on
    CUDA) and shared with its processors; the report's "attention" line lists the picks."""

    def __init__(self, unet: torch.nn.Module, auto: bool, on_pick: Any) -> None:
        self.unet, self.auto, self.on_pick = unet, auto, on_pick
        self.table: dict[ShapeKey, str] = {}

    def ensure(self, batch: int, height: int, width: int, context_len: int) -> None:
        """Time the backends of the U-Net's attention shapes at this latent size not yet in the table."""
        self.ensure_shapes(attention_shapes(self.unet, height, width, context_len), batch)

    def ensure_shapes(self, shapes: Iterable[tuple[int, int, int, int]], batch: int) -> None:
        if not self.auto:
            return
        missing = {s for s in shapes if (s[0], s[1], s[3]) not in self.table}
        if missing:
            device = next(self.unet.parameters()).device
            self.table.update(choose_backends(missing, batch, self.unet.dtype, device))
            self.on_pick(sorted({f"{q}×{k}/{d}: {b}" for (q, k, d), b in self.table.items()}))
