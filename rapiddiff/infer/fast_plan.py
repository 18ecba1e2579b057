"""A scheduler's whole sampling run as a table of coefficients, for a loop that never leaves the GPU.

PNDM (PLMS), DDIM (eta 0, no clipping) and DPM-Solver++ (multistep, no thresholding) with
epsilon or v prediction all update the latents *linearly*: every latent ``x_i`` the U-Net sees is
a fixed combination of the first noise ``x_T`` and the model outputs ``out_0 .. out_{i-1}``,
with weights that depend only on the timesteps. Instead of re-deriving each scheduler's formulas
(and drifting from them), :func:`linear_plan` runs the scheduler's own ``step`` once on
*coefficient vectors*: the noise is the basis vector ``e_0`` and output ``i`` is ``e_{i+1}``, so
whatever arithmetic ``step`` does, the vector that comes out is row ``i`` of the table. A second
run on random tensors checks that the table reproduces ``step`` exactly; a scheduler that is not
linear (clipping, thresholding, injected noise) fails that check and the caller falls back to the
eager loop with the reason.

The GPU loop then needs no scheduler state at all: ``x_i = coefs[i, :i+1] @ basis[:i+1]`` where
``basis`` is a static buffer holding ``x_T`` and each step's guided output (PNDM's ``ets``
history, kept whole), and the U-Net input is ``input_scale[i] * x_i``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch


class PlanUnsupported(RuntimeError):
    """The scheduler cannot run as a coefficient table; the message says why."""


@dataclass(frozen=True)
class LinearPlan:
    """One sampling run: U-Net timesteps, input scales and the latent-combination table."""

    timesteps: (
        torch.Tensor
    )  # (n,) the ``t`` passed to the U-Net at each evaluation, as the scheduler gives it
    input_scales: torch.Tensor  # (n,) float64: scale_model_input's factor per evaluation
    coefs: (
        torch.Tensor
    )  # (n + 1, n + 1) float64: row i = x_i over (x_T, out_0, ..., out_{n-1}); row n = result

    @property
    def num_evaluations(self) -> int:
        return int(self.timesteps.numel())


def _as_vector(value: Any, dim: int) -> torch.Tensor:
    if not torch.is_tensor(value):
        value = torch.tensor(float(value), dtype=torch.float64)
    return value.to(torch.float64).expand(dim) if value.dim() == 0 else value.to(torch.float64)


def _step(scheduler: Any, output: torch.Tensor, t: Any, sample: torch.Tensor) -> torch.Tensor:
    return scheduler.step(output, t, sample, return_dict=False)[0]


def linear_plan(scheduler: Any, num_inference_steps: int, *, check: bool = True) -> LinearPlan:
    """Derive the coefficient table of ``scheduler`` for ``num_inference_steps`` (on the CPU).

    Raises :class:`PlanUnsupported` when the scheduler's update is not linear in (sample, output).
    The scheduler passed in is not touched (a deep copy runs).
    """
    if num_inference_steps < 1:
        raise ValueError(f"num_inference_steps must be ≥ 1, got {num_inference_steps}")
    config = getattr(scheduler, "config", {})
    for key in ("thresholding", "clip_sample"):
        if config.get(key, False):
            raise PlanUnsupported(f"{type(scheduler).__name__} has {key}=True, which is not a linear update")
    if str(config.get("algorithm_type", "")).startswith("sde"):
        raise PlanUnsupported(
            f"{type(scheduler).__name__} algorithm_type={config['algorithm_type']} injects noise"
        )

    probe = copy.deepcopy(scheduler)
    probe.set_timesteps(num_inference_steps, device="cpu")
    timesteps = probe.timesteps.clone()
    n = int(timesteps.numel())
    eye = torch.eye(n + 1, dtype=torch.float64)
    x = _as_vector(probe.init_noise_sigma, n + 1) * eye[0]
    rows, scales = [x], []
    try:
        for i, t in enumerate(timesteps):
            scaled = probe.scale_model_input(x, t)
            scale = _input_scale(x, _as_vector(scaled, n + 1))
            scales.append(scale)
            x = _step(probe, eye[i + 1].clone(), t, x).to(torch.float64)
            rows.append(x)
    except PlanUnsupported:
        raise
    except Exception as err:  # a scheduler that needs real tensor shapes cannot be probed this way
        raise PlanUnsupported(
            f"{type(scheduler).__name__}.step cannot run on coefficient vectors: {err}"
        ) from err
    plan = LinearPlan(
        timesteps=timesteps,
        input_scales=torch.tensor(scales, dtype=torch.float64),
        coefs=torch.stack(rows),
    )
    if check:
        _check_linear(scheduler, plan, num_inference_steps)
    return plan


def _input_scale(x: torch.Tensor, scaled: torch.Tensor) -> float:
    """scale_model_input must multiply by one number; return it."""
    idx = int(torch.argmax(x.abs()))
    scale = float(scaled[idx] / x[idx]) if x[idx] != 0 else 1.0
    if not torch.allclose(scaled, x * scale, rtol=1e-6, atol=1e-9):
        raise PlanUnsupported("scale_model_input is not a plain rescaling of the latents")
    return scale


def _check_linear(scheduler: Any, plan: LinearPlan, num_inference_steps: int) -> None:
    """Replay the real scheduler on random tensors and compare with the table (float64)."""
    gen = torch.Generator().manual_seed(1234)
    real = copy.deepcopy(scheduler)
    real.set_timesteps(num_inference_steps, device="cpu")
    noise = torch.randn(2, 3, generator=gen, dtype=torch.float64)
    outputs = torch.randn(plan.num_evaluations, 2, 3, generator=gen, dtype=torch.float64)
    basis = torch.cat([noise.reshape(1, -1), outputs.reshape(plan.num_evaluations, -1)])
    x = noise * real.init_noise_sigma
    for i, t in enumerate(real.timesteps):
        real.scale_model_input(x, t)  # some schedulers track their step index here
        x = _step(real, outputs[i], t, x).to(torch.float64)
        predicted = (plan.coefs[i + 1] @ basis).reshape(2, 3)
        err = float((x - predicted).norm() / x.norm().clamp_min(1e-12))
        # DPM-Solver upcasts to float32 inside step: allow its rounding, nothing more.
        if not err < 1e-5:
            raise PlanUnsupported(
                f"{type(scheduler).__name__}'s update is not linear in (sample, model output): "
                f"step {i} differs by {err:.2e} (stochastic or clipped update?)"
            )
