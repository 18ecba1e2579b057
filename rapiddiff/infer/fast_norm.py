"""GroupNorm (+ SiLU) on channels-last activations as our own Triton kernels: the ``fuse_norm`` switch.

Why our own: in the H200 profile of the fast path (BENCHMARKS.md, "Where the batch-1 time goes")
Inductor's fused GroupNorm+SiLU kernels at SD 1.5's 64² level take 8–17 µs a call where the bytes
they move need ~3.5 µs at the H100's copy rate; if each (sample, group) pair is reduced by one
program — 64 at batch 2 — most of the 132 SMs sit idle. Whether these kernels do better, shape by shape, is what
``benchmarks/fast_kernels_check.py`` measures. Here one GroupNorm is three launches that each fill
the GPU:

1. ``rapiddiff_gn_partial``: every (row block, 64-channel block) tile of the NHWC tensor gives per-channel
   mean and M2 (sum of squared deviations) over its rows;
2. ``rapiddiff_gn_combine``: per (sample, group), Chan's parallel formula folds the tiles into mean and 1/std
   (exact in float32, no E[x²] − E[x]² cancellation);
3. ``rapiddiff_gn_apply``: ``y = act((x + addend) · scale + shift)`` with the per-channel scale and shift of the
   group, written once in the input's dtype.

``addend`` is an optional (N, C) term added before the statistics: a ResNet block's conv bias plus
its time embedding, so the convolution runs without its bias (as Inductor runs cuDNN anyway) and the
sum never goes through memory. The op is ``rapiddiff::group_norm_act`` (``torch.library.triton_op``),
so ``torch.compile`` and AOTInductor see the kernels and keep them inside the graph; on the CPU (and
for any shape the kernels do not take) it is the reference ``F.group_norm`` computation.

:func:`fuse_norms` installs it in a U-Net or VAE: each plain ``ResnetBlock2D`` gets
:class:`FusedNormResnetBlock2D` (norm1+SiLU and conv-bias+time+norm2+SiLU fused), each other
``GroupNorm`` whose channels the kernels take gets :class:`FusedGroupNorm` (a transformer's input
norm; ``conv_norm_out`` with the SiLU that follows it). The classes are swapped in place, so weights,
state-dict keys and ``isinstance`` stay as they were.
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
except ImportError:  # a CPU-only torch without Triton: the op runs its reference everywhere
    triton = None

BLOCK_C = 64  # channels per tile: every SD/VAE width (128 … 2560) is a multiple of it
BLOCK_HW = 64  # rows (pixels) per tile
MIN_PIXELS = 1024  # below 32×32 one program per group is already short: keep Inductor's kernel there


def supported(x: torch.Tensor, groups: int) -> bool:
    """Whether the Triton kernels take this input (else the op computes the reference)."""
    channels = x.shape[1]
    return x.dim() == 4 and channels % BLOCK_C == 0 and channels % groups == 0


if triton is not None:

    @triton.jit
    def rapiddiff_gn_partial(
        x_ptr,
        add_ptr,
        mean_ptr,
        m2_ptr,
        HW,
        C,
        NB,
        HAS_ADD: tl.constexpr,
        BLOCK_HW: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        """Per-channel mean and M2 of one (BLOCK_HW rows × BLOCK_C channels) tile of one sample."""
        pid = tl.program_id(0)
        n = pid // NB
        b = pid % NB
        rows = b * BLOCK_HW + tl.arange(0, BLOCK_HW)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        inside = (rows < HW)[:, None]
        x = tl.load(x_ptr + n * HW * C + rows[:, None] * C + cols[None, :], mask=inside, other=0.0)
        x = x.to(tl.float32)
        if HAS_ADD:
            x += tl.load(add_ptr + n * C + cols).to(tl.float32)[None, :]
        count = tl.minimum(HW - b * BLOCK_HW, BLOCK_HW).to(tl.float32)
        mean = tl.sum(tl.where(inside, x, 0.0), axis=0) / count
        dev = tl.where(inside, x - mean[None, :], 0.0)
        out = (n * NB + b) * C + cols
        tl.store(mean_ptr + out, mean)
        tl.store(m2_ptr + out, tl.sum(dev * dev, axis=0))

    @triton.jit
    def rapiddiff_gn_combine(
        mean_ptr,
        m2_ptr,
        stat_ptr,
        HW,
        C,
        NB,
        CPG,
        G,
        eps,
        BLOCK_HW: tl.constexpr,
        BLOCK_NB: tl.constexpr,
        BLOCK_CPG: tl.constexpr,
    ):
        """Mean and 1/std of one (sample, group) from its tiles (Chan et al.'s pairwise update)."""
        pid = tl.program_id(0)
        n = pid // G
        g = pid % G
        lanes = tl.arange(0, BLOCK_CPG)
        cols = g * CPG + lanes
        # A float, whether HW and CPG arrive as runtime values or as constants (older Inductor traces
        # user kernels with every scalar constant: ``(HW * CPG).to(...)`` fails there).
        total = HW * CPG * 1.0
        acc = tl.zeros([BLOCK_NB, BLOCK_CPG], dtype=tl.float32)
        for b0 in range(0, NB, BLOCK_NB):
            bs = b0 + tl.arange(0, BLOCK_NB)
            mask = (bs < NB)[:, None] & (lanes < CPG)[None, :]
            count = tl.minimum(HW - bs * BLOCK_HW, BLOCK_HW).to(tl.float32)[:, None]
            part = tl.load(mean_ptr + (n * NB + bs[:, None]) * C + cols[None, :], mask=mask, other=0.0)
            acc += tl.where(mask, part * count, 0.0)
        mean = tl.sum(tl.sum(acc, axis=1), axis=0) / total
        acc = tl.zeros([BLOCK_NB, BLOCK_CPG], dtype=tl.float32)
        for b0 in range(0, NB, BLOCK_NB):
            bs = b0 + tl.arange(0, BLOCK_NB)
            mask = (bs < NB)[:, None] & (lanes < CPG)[None, :]
            count = tl.minimum(HW - bs * BLOCK_HW, BLOCK_HW).to(tl.float32)[:, None]
            offs = (n * NB + bs[:, None]) * C + cols[None, :]
            part = tl.load(mean_ptr + offs, mask=mask, other=0.0)
            m2 = tl.load(m2_ptr + offs, mask=mask, other=0.0)
            dev = part - mean
            acc += tl.where(mask, m2 + count * dev * dev, 0.0)
        var = tl.sum(tl.sum(acc, axis=1), axis=0) / total
        tl.store(stat_ptr + pid * 2, mean)
        tl.store(stat_ptr + pid * 2 + 1, 1.0 / tl.sqrt(var + eps))

    @triton.jit
    def rapiddiff_gn_apply(
        x_ptr,
        add_ptr,
        w_ptr,
        b_ptr,
        stat_ptr,
        y_ptr,
        HW,
        C,
        CPG,
        G,
        NB,
        HAS_ADD: tl.constexpr,
        SILU: tl.constexpr,
        BLOCK_HW: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        """y = act((x + addend - mean) / std * weight + bias) for one tile."""
        pid = tl.program_id(0)
        n = pid // NB
        b = pid % NB
        rows = b * BLOCK_HW + tl.arange(0, BLOCK_HW)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        inside = (rows < HW)[:, None]
        offs = n * HW * C + rows[:, None] * C + cols[None, :]
        x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        if HAS_ADD:
            x += tl.load(add_ptr + n * C + cols).to(tl.float32)[None, :]
        stat = (n * G + cols // CPG) * 2
        mean = tl.load(stat_ptr + stat)
        rstd = tl.load(stat_ptr + stat + 1)
        scale = rstd * tl.load(w_ptr + cols).to(tl.float32)
        shift = tl.load(b_ptr + cols).to(tl.float32) - mean * scale
        y = x * scale[None, :] + shift[None, :]
        if SILU:
            y = y * tl.sigmoid(y)
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=inside)


def launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    addend: torch.Tensor | None,
    groups: int,
    eps: float,
    silu: bool,
    wrap: Any = None,
    block_hw: int = BLOCK_HW,
) -> torch.Tensor:
    """Run the three kernels on ``x`` (N, C, H, W) in channels-last memory → a new channels-last tensor.

    ``wrap``: ``torch.library.wrap_triton`` inside the op (so tracing sees the kernels); None calls
    them directly (tests run them this way under Triton's CPU interpreter)."""
    if triton is None:
        raise RuntimeError("the fused GroupNorm kernels need Triton")
    n, c, h, w = x.shape
    hw = h * w
    x = x.contiguous(memory_format=torch.channels_last)
    y = torch.empty_like(x, memory_format=torch.channels_last)
    nb = triton.cdiv(hw, block_hw)
    # Separate buffers, never views of one: Inductor clones the outputs of a user kernel and writes
    # them back, which has mishandled views (pytorch#184050) and repeated arguments (pytorch#196657).
    part_mean = torch.empty((n, nb, c), device=x.device, dtype=torch.float32)
    part_m2 = torch.empty((n, nb, c), device=x.device, dtype=torch.float32)
    stats = torch.empty((n, groups, 2), device=x.device, dtype=torch.float32)
    has_add = addend is not None
    add = addend.contiguous() if has_add else bias  # never read without HAS_ADD; not x (one tensor twice)
    call = wrap or (lambda kernel: kernel)
    cpg = c // groups
    call(rapiddiff_gn_partial)[(n * nb, c // BLOCK_C)](
        x, add, part_mean, part_m2, hw, c, nb, HAS_ADD=has_add, BLOCK_HW=block_hw, BLOCK_C=BLOCK_C
    )
    call(rapiddiff_gn_combine)[(n * groups,)](
        part_mean,
        part_m2,
        stats,
        hw,
        c,
        nb,
        cpg,
        groups,
        eps,
        BLOCK_HW=block_hw,
        BLOCK_NB=min(64, triton.next_power_of_2(nb)),
        BLOCK_CPG=triton.next_power_of_2(cpg),
    )
    call(rapiddiff_gn_apply)[(n * nb, c // BLOCK_C)](
        x,
        add,
        weight,
        bias,
        stats,
        y,
        hw,
        c,
        cpg,
        groups,
        nb,
        HAS_ADD=has_add,
        SILU=silu,
        BLOCK_HW=block_hw,
        BLOCK_C=BLOCK_C,
    )
    return y


def reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    addend: torch.Tensor | None,
    groups: int,
    eps: float,
    silu: bool,
) -> torch.Tensor:
    """What the op computes, in plain torch (the CPU kernel and the tests' reference)."""
    if addend is not None:
        x = x + addend[:, :, None, None].to(x.dtype)
    y = F.group_norm(x, groups, weight, bias, eps)
    return F.silu(y) if silu else y


@torch.library.triton_op("rapiddiff::group_norm_act", mutates_args=())
def group_norm_act(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    addend: torch.Tensor | None,
    groups: int,
    eps: float,
    silu: bool,
) -> torch.Tensor:
    """``act(group_norm(x + addend[:, :, None, None]))``, channels-last in and out."""
    if triton is None or x.device.type != "cuda" or not supported(x, groups):
        return reference(x, weight, bias, addend, groups, eps, silu).contiguous(
            memory_format=torch.channels_last
        )
    return launch(x, weight, bias, addend, groups, eps, silu, wrap=torch.library.wrap_triton)


def _fused_path(x: torch.Tensor, groups: int) -> bool:
    """Take the op here: inference (the kernels have no backward), CUDA, a shape the kernels take, and
    large enough to pay. All static under tracing."""
    return (
        not torch.is_grad_enabled()
        and x.is_cuda
        and supported(x, groups)
        and x.shape[-1] * x.shape[-2] >= MIN_PIXELS
    )


class FusedGroupNorm(nn.GroupNorm):
    """A ``GroupNorm`` that runs :func:`group_norm_act` (with ``silu`` the SiLU after it too)."""

    silu = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _fused_path(x, self.num_groups):
            y = super().forward(x)
            return F.silu(y) if self.silu else y
        return group_norm_act(x, self.weight, self.bias, None, self.num_groups, self.eps, self.silu)


def _plain_resnet(block: nn.Module) -> bool:
    """A ResnetBlock2D whose forward :class:`FusedNormResnetBlock2D` reproduces exactly."""
    act = getattr(block, "nonlinearity", None)
    # The VAE's blocks say "group" (diffusers passes the decoder's norm type there); without a time
    # projection their forward is the default one.
    time_norm = block.time_embedding_norm == "default" or (
        block.time_embedding_norm == "group" and block.time_emb_proj is None
    )
    return (
        block.upsample is None
        and block.downsample is None
        and time_norm
        and isinstance(act, nn.SiLU)
        and type(block.norm1) is nn.GroupNorm
        and type(block.norm2) is nn.GroupNorm
        and type(block.conv1) is nn.Conv2d
        and type(block.conv2) is nn.Conv2d
        and block.norm1.affine
        and block.norm2.affine
    )


@functools.cache
def fused_resnet_class() -> type:
    """The ResnetBlock2D subclass (made on first use: diffusers is imported lazily)."""
    from diffusers.models.resnet import ResnetBlock2D

    class FusedNormResnetBlock2D(ResnetBlock2D):
        """diffusers' ResnetBlock2D forward (default time embedding, SiLU) with both GroupNorm+SiLU
        pairs in :func:`group_norm_act`; conv1's bias and the time embedding enter norm2's op as its
        addend. Falls back to the stock forward where the op would not run (CPU, gradients on)."""

        def forward(self, input_tensor: torch.Tensor, temb: torch.Tensor | None, *args: Any, **kwargs: Any):
            # _plain_resnet again: layers wrapped since the swap (a LoRA loaded later) need their own forward.
            if not _fused_path(input_tensor, self.norm1.num_groups) or not _plain_resnet(self):
                return super().forward(input_tensor, temb, *args, **kwargs)
            n1, n2 = self.norm1, self.norm2
            h = group_norm_act(input_tensor, n1.weight, n1.bias, None, n1.num_groups, n1.eps, True)
            conv1 = self.conv1
            h = F.conv2d(h, conv1.weight, None, conv1.stride, conv1.padding, conv1.dilation, conv1.groups)
            addend = conv1.bias
            if self.time_emb_proj is not None and temb is not None:
                # skip_time_act: batch_time_proj already applied the SiLU (and the projection).
                time = self.time_emb_proj(temb if self.skip_time_act else self.nonlinearity(temb))  # (N, C)
                addend = time if addend is None else time + addend
            if addend is not None and addend.dim() == 1:
                addend = addend.expand(h.shape[0], -1)
            if not _fused_path(h, n2.num_groups):  # conv1 changed the channels to a width the kernels skip
                h = F.silu(n2(h + addend[:, :, None, None] if addend is not None else h))
            else:
                h = group_norm_act(h, n2.weight, n2.bias, addend, n2.num_groups, n2.eps, True)
            h = self.conv2(self.dropout(h))
            shortcut = self.conv_shortcut(input_tensor) if self.conv_shortcut is not None else input_tensor
            return (shortcut + h) / self.output_scale_factor

    return FusedNormResnetBlock2D


def fuse_norms(model: nn.Module) -> dict[str, int]:
    """Swap the GroupNorms of ``model`` (a U-Net or VAE) for the fused ones, in place.

    Returns counts: ``resnets`` (blocks whose two norms+SiLU are fused), ``norms`` (other
    GroupNorms), ``skipped`` (ResNet blocks of a kind the fused forward does not reproduce).
    A ``GroupNorm`` followed by the model's ``conv_act`` SiLU (``conv_norm_out``) takes the SiLU in.
    """
    from diffusers.models.resnet import ResnetBlock2D

    counts = {"resnets": 0, "norms": 0, "skipped": 0}
    resnet_norms: set[int] = set()
    fused = fused_resnet_class()
    for module in model.modules():
        if type(module) is ResnetBlock2D:
            if _plain_resnet(module):
                module.__class__ = fused
                counts["resnets"] += 1
                resnet_norms.update((id(module.norm1), id(module.norm2)))
            else:
                counts["skipped"] += 1
        elif type(module) is fused:
            resnet_norms.update((id(module.norm1), id(module.norm2)))
    for owner in model.modules():
        for name, child in owner.named_children():
            if type(child) is not nn.GroupNorm or id(child) in resnet_norms or not child.affine:
                continue
            child.__class__ = FusedGroupNorm
            counts["norms"] += 1
            act = getattr(owner, "conv_act", None)
            if name == "conv_norm_out" and isinstance(act, nn.SiLU):
                child.silu = True  # the SiLU moves into the norm's kernel
                owner.conv_act = nn.Identity()
    return counts


__all__ = [
    "FusedGroupNorm",
    "fuse_norms",
    "fused_resnet_class",
    "group_norm_act",
    "launch",
    "reference",
    "supported",
]
