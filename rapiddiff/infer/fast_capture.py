"""The captured loops of the fast path: one :class:`DenoiseLoop` per shape, plan and approximation,
built with the U-Net, decoder and packages it calls, the oldest dropped past ``max_graphs``."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from rapiddiff.infer.fast_attention import BackendTable, cross_attention_kv
from rapiddiff.infer.fast_loop import DenoiseLoop, LoopControl
from rapiddiff.infer.fast_packages import PackageParts, Plan
from rapiddiff.infer.fast_report import FastPathReport, fallback
from rapiddiff.models import sampling
from rapiddiff.models.deep_cache import DeepCache
from rapiddiff.models.token_merge import TokenMerge


@dataclass(frozen=True)
class LoopShape:
    """What one captured loop is specific to besides its plan."""

    noise: tuple[int, ...]  # (N, C, h, w)
    context: tuple[int, ...]  # (2N or N, L, D)
    guidance: bool
    deep_cache: int = 1
    guidance_rescale: float = 0.0
    token_merge: float = 0.0
    control: tuple[tuple[int, ...], ...] = ()  # the control images' shapes, one per net (none: no ControlNet)
    control_net: int = 0  # id() of the ControlNet module the loop calls


class LoopCache:
    """Builds and keeps the loops of one fast path (each graph holds its own memory pool)."""

    def __init__(
        self,
        unet: torch.nn.Module,
        vae: torch.nn.Module,
        *,
        graph: bool,
        cross_kv: bool,
        max_graphs: int,
        backends: BackendTable,
        packages: PackageParts | None,
        report: FastPathReport,
    ) -> None:
        self.unet, self.vae, self.graph, self.cross_kv = unet, vae, graph, cross_kv
        self.max_graphs, self.backends, self.packages, self.report = max_graphs, backends, packages, report
        self.device = next(unet.parameters()).device
        self.loops: dict[tuple, DenoiseLoop] = {}

    def unet_fn(
        self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor, kv: Any, **extra: Any
    ) -> torch.Tensor:
        """The U-Net on (x, t, context), with the cached cross-attention K/V and ``extra`` U-Net
        inputs (a ControlNet's residuals, on the eager loop) where given."""
        kwargs = {"cross_attention_kwargs": {"cross_kv": kv}} if kv is not None else {}
        return self.unet(x, t, encoder_hidden_states=context, return_dict=False, **kwargs, **extra)[0]

    def kv_fn(self, context: torch.Tensor) -> Any:
        return cross_attention_kv(self.unet, context)

    def get(
        self,
        plan: Plan,
        shape: LoopShape,
        control_net: torch.nn.Module | None = None,
        sampler: str | None = None,
    ) -> DenoiseLoop:
        """The loop of ``plan`` and ``shape``; ``sampler`` (its name) is what a background package
        build needs to make the same plan (the timesteps' dtype is part of a package's key)."""
        key = (shape, plan.num_evaluations, id(plan))
        if key not in self.loops:
            while len(self.loops) >= max(1, self.max_graphs):
                self.loops.pop(next(iter(self.loops)))  # oldest first; its graph pool is freed
            self.loops[key] = self._build(plan, shape, control_net, sampler)
        return self.loops[key]

    def _build(
        self,
        plan: Plan,
        shape: LoopShape,
        control_net: torch.nn.Module | None = None,
        sampler: str | None = None,
    ) -> DenoiseLoop:
        _, _, h, w = shape.noise
        exact = shape.deep_cache <= 1 and shape.token_merge <= 0
        # An exported U-Net package has no inputs for a ControlNet's residuals.
        packaged = exact and not shape.control
        if self.packages is not None and packaged:
            self.packages.adopt_backends(plan, shape.noise, shape.context)
        elif self.packages is not None:
            what = "DeepCache" if shape.deep_cache > 1 else "token merging" if not exact else "a ControlNet"
            reason = f"{what} rewires the U-Net's inputs or blocks per step"
            self.report.set("aoti_unet", fallback(reason, "torch.compile"))
        self.backends.ensure(shape.context[0], h, w, shape.context[1])
        unet_fn: Any = self.unet_fn
        decode_fn: Any = functools.partial(sampling.decode, self.vae)
        if shape.deep_cache > 1:
            # Each loop run makes exactly num_evaluations U-Net calls, in order.
            unet_fn = DeepCache.of(self.unet).stepped(unet_fn, shape.deep_cache, plan.num_evaluations)
        if shape.token_merge > 0:
            merger = TokenMerge.of(self.unet)
            # The merged self-attention's shape gets its backend timed too.
            self.backends.ensure_shapes(merger.attention_shapes((h, w), shape.token_merge), shape.context[0])
            unet_fn = merger.stepped(unet_fn, plan.num_evaluations)
        if self.packages is not None and packaged:
            unet_fn, decode_fn = self.packages.swap_in(
                plan, shape.noise, shape.context, unet_fn, decode_fn, self.cross_kv, sampler
            )
        return DenoiseLoop(
            unet_fn,
            plan,
            noise_shape=shape.noise,
            context_shape=shape.context,
            model_dtype=self.unet.dtype,
            device=self.device,
            guidance=shape.guidance,
            kv_fn=self.kv_fn if self.cross_kv else None,
            decode_fn=decode_fn,
            graph=self.graph,
            guidance_rescale=shape.guidance_rescale,
            control=LoopControl(control_net, shape.control, plan.num_evaluations, self.device)
            if control_net is not None and shape.control
            else None,
        )

    def clear(self) -> None:
        self.loops.clear()
        if self.packages is not None:
            self.packages.calls.clear()
