"""GEGLU as one Triton kernel: the ``fuse_geglu`` switch.

diffusers' ``GEGLU`` is ``value, gate = proj(x).chunk(2); value * gelu(gate)``: a (tokens × 2·inner)
product written to memory, read back by a pointwise kernel, and half of it written again. At SD
1.5's 64² level (batch 2 for guidance) that is 42 MB out and 63 MB through the pointwise kernel
per transformer block. Here one kernel computes the value and gate tiles of the same output
columns side by side (two accumulators over the same ``x`` tile, the "dual GEMM" of CUTLASS and
xformers' SwiGLU) and writes only ``value · gelu(gate)`` — the (tokens × inner) result.

The op is ``rapiddiff::geglu`` (``torch.library.triton_op``), so ``torch.compile`` and AOTInductor
keep the kernel inside their graph; elsewhere (the CPU, a LoRA-wrapped projection, gradients on) the
module runs diffusers' own computation. :func:`fuse_geglu` swaps each plain ``GEGLU`` of a model to
a subclass whose forward calls the op, in place (same weights, keys and ``isinstance``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only torch without Triton: the module keeps diffusers' computation
    triton = None

# Tile shapes timed at first call, per (M, N, K): Hopper-friendly tiles with two accumulators each.
CONFIGS = [
    (128, 128, 64, 8, 3),
    (128, 64, 64, 4, 4),
    (64, 128, 64, 4, 4),
    (128, 128, 32, 8, 4),
    (64, 64, 64, 4, 4),
]

if triton is not None:

    @triton.jit
    def rapiddiff_geglu(
        x_ptr,
        w_ptr,
        b_ptr,
        y_ptr,
        M,
        N,
        K,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        """y[M, N] = (x W_v^T + b_v) * gelu(x W_g^T + b_g); W = [W_v; W_g] is (2N, K) row-major."""
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BM)
        num_n = tl.cdiv(N, BN)
        # Grouped order (Triton's matmul tutorial): programs that run together share x tiles in L2.
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % size_m
        pid_n = (pid % per_group) // size_m
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        x_ptrs = x_ptr + rm[:, None] * K + rk[None, :]
        wv_ptrs = w_ptr + rn[None, :] * K + rk[:, None]  # (BK, BN) tile of W_v^T
        wg_ptrs = wv_ptrs + N * K
        acc_v = tl.zeros([BM, BN], dtype=tl.float32)
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BK)):
            k_in = rk < K - k * BK
            x = tl.load(x_ptrs, mask=(rm < M)[:, None] & k_in[None, :], other=0.0)
            w_mask = k_in[:, None] & (rn < N)[None, :]
            acc_v = tl.dot(x, tl.load(wv_ptrs, mask=w_mask, other=0.0), acc_v)
            acc_g = tl.dot(x, tl.load(wg_ptrs, mask=w_mask, other=0.0), acc_g)
            x_ptrs += BK
            wv_ptrs += BK
            wg_ptrs += BK
        n_in = rn < N
        value = acc_v + tl.load(b_ptr + rn, mask=n_in, other=0.0).to(tl.float32)[None, :]
        gate = acc_g + tl.load(b_ptr + N + rn, mask=n_in, other=0.0).to(tl.float32)[None, :]
        y = value * (0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476)))
        mask = (rm < M)[:, None] & n_in[None, :]
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)

    _geglu_tuned = triton.autotune(
        configs=[
            triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8}, num_warps=w, num_stages=s)
            for bm, bn, bk, w, s in CONFIGS
        ],
        key=["M", "N", "K"],
    )(rapiddiff_geglu)


def launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    wrap: Any = None,
    config: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """``x`` (..., K) → (..., N) through the kernel; ``weight`` (2N, K), ``bias`` (2N,).

    ``wrap``: ``torch.library.wrap_triton`` inside the op; None calls the kernel directly.
    ``config``: one (BM, BN, BK, warps, stages) instead of timing them all (the CPU interpreter)."""
    if triton is None:
        raise RuntimeError("the fused GEGLU kernel needs Triton")
    k = x.shape[-1]
    n = weight.shape[0] // 2
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    call = wrap or (lambda kernel: kernel)
    if config is None:

        def grid(meta: dict[str, Any]) -> tuple[int]:
            return (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]),)

        call(_geglu_tuned)[grid](x2, weight, bias, y, m, n, k)
    else:
        bm, bn, bk, warps, stages = config
        grid1 = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
        call(rapiddiff_geglu)[grid1](
            x2, weight, bias, y, m, n, k, BM=bm, BN=bn, BK=bk, GROUP_M=8, num_warps=warps, num_stages=stages
        )
    return y.view(*x.shape[:-1], n)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """diffusers' GEGLU: ``value * gelu(gate)`` of ``F.linear(x, weight, bias)``'s two halves."""
    value, gate = F.linear(x, weight, bias).chunk(2, dim=-1)
    return value * F.gelu(gate)


@torch.library.triton_op("rapiddiff::geglu", mutates_args=())
def geglu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``value * gelu(gate)`` of the linear layer (weight (2N, K), bias (2N,)) on ``x`` (..., K)."""
    if triton is None or x.device.type != "cuda":
        return reference(x, weight, bias)
    return launch(x, weight, bias, wrap=torch.library.wrap_triton)


@functools.cache
def fused_class() -> type:
    """The GEGLU subclass (made on first use: diffusers is imported lazily)."""
    from diffusers.models.activations import GEGLU

    class FusedGEGLU(GEGLU):
        """diffusers' ``GEGLU`` (its ``proj`` kept) computed by :func:`geglu` where it can run."""

        def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            # No backward in the kernel; a projection wrapped since the swap (a LoRA) needs its own forward.
            if torch.is_grad_enabled() or not hidden_states.is_cuda or type(self.proj) is not nn.Linear:
                return super().forward(hidden_states, *args, **kwargs)
            return geglu(hidden_states, self.proj.weight, self.proj.bias)

    return FusedGEGLU


def fuse_geglu(model: nn.Module) -> int:
    """Swap every diffusers ``GEGLU`` with a plain ``nn.Linear`` projection for the fused subclass
    (in place); returns how many. A LoRA-wrapped projection keeps the stock module (its side branch
    would be skipped)."""
    from diffusers.models.activations import GEGLU

    fused = fused_class()
    count = 0
    for module in model.modules():
        if type(module) is GEGLU and type(module.proj) is nn.Linear and module.proj.bias is not None:
            module.__class__ = fused
            count += 1
    return count


__all__ = ["fuse_geglu", "fused_class", "geglu", "launch", "reference"]
