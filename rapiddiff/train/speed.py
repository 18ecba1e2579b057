"""Training speed-ups for a diffusers U-Net, applied from outside the model (STYLE.md #3).

Every one is a switch in :class:`SpeedConfig`; with all off the U-Net is diffusers' eager model.
Fused QKV changes the parameters (one ``to_qkv`` Linear replaces ``to_q``/``to_k``/``to_v``
while training), so :func:`unfuse_for_saving` copies the trained fused weights back into the
original projections before anything is saved in diffusers' format.

The switches below ``attention`` take host work off a small model's step (where a 7 M-parameter
U-Net at 16² latents waits on kernel launches and host syncs, not on arithmetic): latents and
captions resident on the GPU (``gpu_data``, ``cache_text``), an EMA update of one fused kernel
(``foreach_ema``) and the step's forward, loss and backward replayed as one CUDA graph
(:class:`GraphedLoss`, ``cuda_graph``). Each computes what the plain step computes, from the
same random draws in the same order; ``tests/train/test_train_speed.py`` compares their losses.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn


@dataclass(frozen=True)
class SpeedConfig:
    """How the U-Net runs while training (none of these change what it learns)."""

    gradient_checkpointing: bool = False
    """Recompute activations in backward: much less memory, ~30% slower."""
    channels_last: bool = False
    """NHWC memory format for the convolutions (faster on tensor cores)."""
    fuse_qkv: bool = False
    """One matmul for q, k, v (self-attention) and k, v (cross-attention) instead of three/two."""
    compile: bool = False
    """torch.compile the U-Net in place (nn.Module.compile: parameter names unchanged)."""
    attention: Literal["default", "sdpa", "math"] = "default"
    """Attention kernel: diffusers' default (SDPA on torch 2), SDPA explicitly, or plain math."""
    gpu_data: bool = False
    """With ``cache_latents``: the latent cache and the captions' tokens stay on the GPU and every
    batch is gathered there from the indices the (resumable) sampler draws: no image or caption
    crosses from the host per step, and the loader hands over indices only."""
    cache_text: bool = False
    """With ``gpu_data`` and a frozen text side (no ``fusion``/``text_encoder`` in ``trainable``):
    every distinct caption's hidden states are computed once and gathered per step."""
    foreach_ema: bool = False
    """EMA update as one ``torch._foreach_lerp_`` over a cached parameter list (same state format)."""
    sync_every: int = 1
    """Read the device's non-finite-loss flag (and, on several GPUs, agree on a Ctrl-C) every N steps
    instead of every step, so the host queues the next step while the GPU works. A non-finite loss
    still stops the run before any checkpoint or export holds it (the flag is read before every
    save), up to N - 1 steps after it happened; the error names the step. Above 1 the progress bar
    shows no per-step loss (reading it is a sync); it is in the logs every log_every_n_steps.
    1: read every step."""
    cuda_graph: bool = False
    """Capture the step's forward, loss and backward (the U-Net's, and the text side's when fusion or
    the tower trains) as one CUDA graph after a few eager steps and replay it every step (one GPU or
    DDP, which then all-reduces the gradients after the replay; no gradient accumulation, bf16 or
    fp32; not with ``compile``)."""


def apply_speedups(unet: nn.Module, cfg: SpeedConfig) -> nn.Module:
    """Apply ``cfg`` to ``unet`` in place; returns it."""
    from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0

    if cfg.attention == "sdpa":
        unet.set_attn_processor(AttnProcessor2_0())
    elif cfg.attention == "math":
        unet.set_attn_processor(AttnProcessor())
    if cfg.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    if cfg.fuse_qkv:
        unet.fuse_qkv_projections()
        # The unfused projections stay as (unused) parameters; freeze them so the optimizer and
        # EMA carry no state for them. unfuse_for_saving writes the trained values back.
        for module in unet.modules():
            if isinstance(module, Attention) and getattr(module, "fused_projections", False):
                fused = ("to_k", "to_v") if module.is_cross_attention else ("to_q", "to_k", "to_v")
                for name in fused:
                    getattr(module, name).requires_grad_(False)
    if cfg.channels_last:
        unet.to(memory_format=torch.channels_last)
    if cfg.compile:
        unet.compile()
    return unet


@torch.no_grad()
def unfuse_for_saving(unet: nn.Module) -> None:
    """Copy fused ``to_qkv``/``to_kv`` weights back into ``to_q``/``to_k``/``to_v``, unfuse,
    and return to the contiguous memory format (safetensors needs contiguous tensors)."""
    from diffusers.models.attention_processor import Attention

    fused = False
    for module in unet.modules():
        if not isinstance(module, Attention) or not getattr(module, "fused_projections", False):
            continue
        fused = True
        if not module.is_cross_attention:
            parts, source = ("to_q", "to_k", "to_v"), module.to_qkv
        else:
            parts, source = ("to_k", "to_v"), module.to_kv
        sizes = [getattr(module, n).weight.shape[0] for n in parts]
        for name, weight in zip(parts, source.weight.split(sizes), strict=True):
            getattr(module, name).weight.copy_(weight)
            getattr(module, name).requires_grad_(True)
        if source.bias is not None:
            for name, bias in zip(parts, source.bias.split(sizes), strict=True):
                getattr(module, name).bias.copy_(bias)
        module.fused_projections = False
        for attr in ("to_qkv", "to_kv"):
            if hasattr(module, attr):
                delattr(module, attr)
    if fused:
        unet.unfuse_qkv_projections()
    unet.to(memory_format=torch.contiguous_format)


GRAPH_WARMUP_STEPS = 3
"""Eager steps before the capture: cuDNN/cuBLAS pick their kernels and lazy state is built."""


class GraphedLoss:
    """``loss_fn(*inputs)`` and its backward, captured once as a CUDA graph and replayed per call.

    Inputs are copied into static buffers; the graph writes the gradients of ``params`` (their
    ``.grad`` tensors stay the same objects from the capture on, so nothing may set them to None)
    and, for inputs that require grad, :meth:`input_grad`. Random draws inside ``loss_fn`` come from
    the CUDA generator's state at each replay, as an eager call would draw them (PyTorch's
    graph-safe Philox offsets), so a replay after ``torch.manual_seed(s)`` gives the eager numbers.
    With ``capture=False`` (CPU, tests) the same buffers are filled by an eager call.
    ``buffers`` (BatchNorm running statistics) are put back after the untimed warm-up pass that
    precedes the capture, so the capture step updates them once, as an eager step does.
    """

    def __init__(
        self,
        loss_fn: Callable[..., torch.Tensor],
        params: Sequence[nn.Parameter],
        *,
        autocast_dtype: torch.dtype | None = None,
        capture: bool = True,
        buffers: Sequence[torch.Tensor] = (),
    ) -> None:
        self.loss_fn, self.params, self.buffers = loss_fn, list(params), list(buffers)
        self.param_ids = frozenset(map(id, self.params))  # whose .grad the graph owns
        self.autocast_dtype, self.capture = autocast_dtype, capture
        self.graph: Any = None
        self.static_inputs: list[torch.Tensor] = []
        self.static_loss: torch.Tensor | None = None

    def _autocast(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        # cache_enabled=False: autocast's weight-cast cache must not outlive a capture.
        return torch.autocast(device.type, dtype=self.autocast_dtype, cache_enabled=False)

    def _forward_backward(self) -> torch.Tensor:
        with self._autocast(self.static_inputs[0].device):
            loss = self.loss_fn(*self.static_inputs)
        loss.backward()
        return loss

    def _build(self, inputs: Sequence[torch.Tensor]) -> None:
        self.static_inputs = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
        if not self.capture:
            return
        device = self.static_inputs[0].device
        # One untimed pass on a side stream (handles, workspaces), with the RNG state put back so
        # the step that follows draws what the eager step would have drawn.
        rng = torch.cuda.get_rng_state(device)
        saved = [b.detach().clone() for b in self.buffers]
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self._forward_backward()
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.set_rng_state(rng, device)
        with torch.no_grad():
            for buffer, value in zip(self.buffers, saved, strict=True):
                buffer.copy_(value)
        self._clear_grads()
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: DataLoader threads may allocate pinned memory while this thread captures.
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.static_loss = self._forward_backward()

    def _clear_grads(self) -> None:
        # Gradients are then allocated inside the graph's pool and overwritten by every replay.
        for p in self.params:
            p.grad = None
        for x in self.static_inputs:
            x.grad = None

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        """The loss of ``inputs``; parameter and input gradients are written as a side effect."""
        if not self.static_inputs:
            self._build(inputs)
        for static, x in zip(self.static_inputs, inputs, strict=True):
            if static.shape != x.shape or static.dtype != x.dtype:
                raise ValueError(
                    f"speed.cuda_graph: an input changed from {tuple(static.shape)} {static.dtype} to "
                    f"{tuple(x.shape)} {x.dtype}; a captured step needs fixed shapes (drop_last batches)"
                )
            with torch.no_grad():
                static.copy_(x)
        if self.graph is None:
            self._clear_grads()
            self.static_loss = self._forward_backward()
        else:
            self.graph.replay()
        assert self.static_loss is not None
        return self.static_loss.detach().clone()  # the static buffer is overwritten by the next replay

    def input_grad(self, i: int) -> torch.Tensor | None:
        return self.static_inputs[i].grad


class LerpEMA:
    """diffusers' ``EMAModel`` step as one fused ``torch._foreach_lerp_`` (mixin: see :func:`lerp_ema`).

    ``s ← s - (1 - d)(s - p)`` is ``lerp(s, p, 1 - d)``; the parameter list is taken once (the
    optimizer's parameters do not change during training) and the state dict is EMAModel's.
    """

    _params: list[torch.Tensor] | None = None

    @torch.no_grad()
    def step(self, parameters: Any) -> None:
        if self._params is None:
            self._params = [p for p in parameters if p.requires_grad]
            if len(self._params) != len(self.shadow_params):  # type: ignore[attr-defined]
                raise ValueError(
                    "speed.foreach_ema: the EMA tracks frozen parameters; use foreach_ema: false"
                )
        self.optimization_step += 1  # type: ignore[attr-defined]
        decay = self.get_decay(self.optimization_step)  # type: ignore[attr-defined]
        self.cur_decay_value = decay
        torch._foreach_lerp_(self.shadow_params, self._params, 1.0 - decay)  # type: ignore[attr-defined]


def lerp_ema(*args: Any, **kwargs: Any) -> Any:
    """An ``EMAModel`` whose ``step`` is :class:`LerpEMA`'s (same arguments, same state dict)."""
    from diffusers.training_utils import EMAModel

    cls = type("LerpEMAModel", (LerpEMA, EMAModel), {})
    return cls(*args, **kwargs)
