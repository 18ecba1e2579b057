"""The denoising loop on the GPU: static buffers, no host synchronisation, optionally one CUDA graph.

:class:`DenoiseLoop` runs a :class:`~rapiddiff.infer.fast_plan.LinearPlan` for one shape
(batch, latent size, steps, guidance on/off). Everything it touches lives in buffers allocated
once: the noise and each step's guided output (``basis``, the scheduler history), the prompt
embeddings, the guidance scale, the timesteps and the coefficient table. One ``run()`` is a fixed
sequence of GPU work with no ``.item()``, no host branch on data and no allocation the host
waits for, so the whole loop (and, if given, the VAE decode) can be captured as ONE CUDA graph
and replayed: a 50-step image is then a single launch instead of ~50 × 1,000 kernel launches
and 50 scheduler steps on the host.

On a CPU (or with ``graph=False``) the same ``run()`` executes eagerly: that is how the tests
check it against the diffusers scheduler loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from rapiddiff.infer.fast_plan import ClippedDDIMPlan, LinearPlan, ddim_step
from rapiddiff.models.sampling import rescale_guidance

if TYPE_CHECKING:
    from rapiddiff.models.controlnet import ControlConditioning

UNetFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]


class DenoiseLoop:
    """Static-buffer sampling loop for one shape; ``graph=True`` captures it on first use."""

    def __init__(
        self,
        unet_fn: UNetFn,
        plan: LinearPlan | ClippedDDIMPlan,
        *,
        noise_shape: tuple[int, ...],
        context_shape: tuple[int, ...],
        model_dtype: torch.dtype,
        device: torch.device,
        guidance: bool,
        kv_fn: Callable[[torch.Tensor], Any] | None = None,
        decode_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
        graph: bool = False,
        guidance_rescale: float = 0.0,
        control: LoopControl | None = None,
    ) -> None:
        if graph and device.type != "cuda":
            raise ValueError("graph=True needs a CUDA device")
        self.unet_fn, self.kv_fn, self.decode_fn = unet_fn, kv_fn, decode_fn
        self.noise_shape, self.guidance, self.model_dtype = noise_shape, guidance, model_dtype
        self.plan = plan
        self.guidance_rescale = float(guidance_rescale)  # fixed per loop (a graph captures the branch)
        self.n = plan.num_evaluations
        numel = int(torch.Size(noise_shape).numel())
        f32 = torch.float32
        self.timesteps = plan.timesteps.to(device)  # (n,)
        if isinstance(plan, LinearPlan):
            self.coefs = plan.coefs.to(device=device, dtype=f32)  # (n+1, n+1)
            self.scales = plan.input_scales.to(device=device, dtype=f32)  # (n,)
            self.basis = torch.zeros(self.n + 1, numel, device=device, dtype=f32)  # x_T, out_0 .. out_{n-1}
        else:  # clipped DDIM: the state is the latent itself; row 0 of basis holds the noise
            self.consts = plan.consts.to(device=device, dtype=f32)  # (n, 4)
            self.basis = torch.zeros(1, numel, device=device, dtype=f32)
        self.context = torch.zeros(context_shape, device=device, dtype=model_dtype)  # (2B or B, L, D)
        self.scale = torch.ones((), device=device, dtype=f32)
        self.latents = torch.zeros(noise_shape, device=device, dtype=f32)
        self.images: torch.Tensor | None = None
        self.use_graph = graph
        self.graph: torch.cuda.CUDAGraph | None = None
        self.control = control  # a ControlNet evaluated before each U-Net call, on its own static buffers

    def run(self) -> None:
        """All steps (and the decode), reading and writing only the static buffers."""
        kv = self.kv_fn(self.context) if self.kv_fn is not None else None
        linear = isinstance(self.plan, LinearPlan)
        x = self.basis[0].view(self.noise_shape)
        for i in range(self.n):
            if linear:
                # x_i as the scheduler would have it: a fixed combination of the noise and past outputs.
                x = (self.coefs[i, : i + 1] @ self.basis[: i + 1]).view(self.noise_shape)
                x_in = (x * self.scales[i]).to(self.model_dtype)
            else:
                x_in = x.to(self.model_dtype)
            out = self._guided(x_in, i, kv)
            if linear:
                self.basis[i + 1].copy_(out.reshape(-1))
            else:
                x = ddim_step(self.plan, self.consts[i], x, out)
        if linear:
            x = (self.coefs[self.n] @ self.basis).view(self.noise_shape)
        self.latents.copy_(x)
        if self.decode_fn is not None:
            images = self.decode_fn(self.latents)
            if self.images is None:
                self.images = torch.empty_like(images)
            self.images.copy_(images)

    def _guided(self, x_in: torch.Tensor, i: int, kv: Any) -> torch.Tensor:
        if self.guidance:
            x_in = torch.cat([x_in, x_in])
        t = self.timesteps[i]
        extra = self.control.residuals(x_in, t, self.context, i) if self.control is not None else {}
        out = self.unet_fn(x_in, t, self.context, kv, **extra).float()
        if self.guidance:
            uncond, cond = out.chunk(2)
            out = uncond + self.scale * (cond - uncond)
            if self.guidance_rescale > 0:
                out = rescale_guidance(out, cond, self.guidance_rescale)
        return out

    def capture(self) -> None:
        """Warm up on a side stream (compilation, cuBLAS/cuDNN handles), then record one graph."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.run()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.run()
        self.graph = graph

    def __call__(
        self, noise: torch.Tensor, context: torch.Tensor, guidance_scale: float
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sample from ``noise`` (the unscaled initial latents); returns (latents, images or None)."""
        if tuple(noise.shape) != self.noise_shape or tuple(context.shape) != tuple(self.context.shape):
            raise ValueError(
                f"this loop was built for noise {self.noise_shape} and context {tuple(self.context.shape)}, "
                f"got {tuple(noise.shape)} and {tuple(context.shape)}"
            )
        self.basis[0].copy_(noise.reshape(-1))
        self.context.copy_(context)
        self.scale.fill_(float(guidance_scale))
        if self.use_graph:
            if self.graph is None:
                self.capture()
            else:
                self.graph.replay()
        else:
            self.run()
        images = self.images.clone() if self.images is not None else None
        return self.latents.clone(), images


class LoopControl:
    """The ControlNet(s) of a captured loop: the control images and a (step, net) table of each
    net's scale × keep live in static buffers, so a replay reads a new call's images, scales and
    windows without recapturing. The net's residuals are the eager loop's
    (:meth:`rapiddiff.models.controlnet.ControlConditioning.residuals`), the scale a 0-d tensor."""

    def __init__(
        self,
        net: torch.nn.Module,
        image_shapes: tuple[tuple[int, ...], ...],
        evaluations: int,
        device: torch.device,
    ) -> None:
        self.net = net
        dtype = net.dtype
        self.images = [
            torch.zeros(shape, device=device, dtype=dtype) for shape in image_shapes
        ]  # (2N or N, 3, H, W)
        self.table = torch.zeros(
            evaluations, len(image_shapes), device=device, dtype=torch.float32
        )  # (n, nets)

    def load(self, control: ControlConditioning) -> None:
        """Copy one call's control images and per-step scales into the buffers."""
        n = self.table.shape[0]
        rows = [[s * k for s, k in zip(control.scales, control.keep(i, n), strict=True)] for i in range(n)]
        self.table.copy_(torch.tensor(rows, dtype=torch.float32))
        for buffer, image in zip(self.images, control.images, strict=True):
            buffer.copy_(image)

    def residuals(self, x_in: torch.Tensor, t: torch.Tensor, context: torch.Tensor, i: int) -> dict[str, Any]:
        from rapiddiff.models.controlnet import ControlConditioning

        scales = [self.table[i, k] for k in range(self.table.shape[1])]  # 0-d tensors: no host sync
        conditioning = ControlConditioning(
            self.net, self.images, scales, [0.0] * len(scales), [1.0] * len(scales)
        )
        return conditioning.residuals(x_in, t, context, 0, 1)  # the window is in the table already
