"""A scheduler's whole sampling run as a table of coefficients, for a loop that never leaves the GPU.

PNDM, DDIM (eta 0) and DPM-Solver++ update the latents linearly: each latent the U-Net sees is a fixed
combination of the first noise and the past model outputs. :func:`linear_plan` runs the scheduler's
own ``step`` once on basis vectors to read that table off (no re-derived formulas), then checks it
against ``step`` on random tensors; a scheduler that is not linear fails the check, with the reason.
Clipping DDIM has its own per-step formula (:func:`clipped_ddim_plan`).
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


def linear_plan(
    scheduler: Any,
    num_inference_steps: int,
    *,
    start: int = 0,
    scaled_start: bool = False,
    check: bool = True,
) -> LinearPlan:
    """Derive the coefficient table of ``scheduler`` for ``num_inference_steps`` (on the CPU).

    ``start``: the run begins at ``timesteps[start]`` (img2img's strength), the scheduler told so
    through ``set_begin_index`` as diffusers does. ``scaled_start``: row 0 of the basis is the
    start latents themselves (a noised image) instead of unit noise to be scaled by
    ``init_noise_sigma``. Raises :class:`PlanUnsupported` when the scheduler's update is not
    linear in (sample, output). The scheduler passed in is not touched (a deep copy runs).
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

    probe = _fresh(scheduler, num_inference_steps, start)
    timesteps = probe.timesteps[start:].clone()
    n = int(timesteps.numel())
    eye = torch.eye(n + 1, dtype=torch.float64)
    x = eye[0] if scaled_start else _as_vector(probe.init_noise_sigma, n + 1) * eye[0]
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
        _check_linear(scheduler, plan, num_inference_steps, start, scaled_start)
    return plan


def _fresh(scheduler: Any, num_inference_steps: int, start: int) -> Any:
    """A deep copy of ``scheduler`` with its timesteps set, told to begin at ``start``."""
    probe = copy.deepcopy(scheduler)
    probe.set_timesteps(num_inference_steps, device="cpu")
    if start and hasattr(probe, "set_begin_index"):
        probe.set_begin_index(start)
    return probe


def _input_scale(x: torch.Tensor, scaled: torch.Tensor) -> float:
    """scale_model_input must multiply by one number; return it."""
    idx = int(torch.argmax(x.abs()))
    scale = float(scaled[idx] / x[idx]) if x[idx] != 0 else 1.0
    if not torch.allclose(scaled, x * scale, rtol=1e-6, atol=1e-9):
        raise PlanUnsupported("scale_model_input is not a plain rescaling of the latents")
    return scale


def _check_linear(
    scheduler: Any, plan: LinearPlan, num_inference_steps: int, start: int = 0, scaled_start: bool = False
) -> None:
    """Replay the real scheduler on random tensors and compare with the table (float64)."""
    gen = torch.Generator().manual_seed(1234)
    real = _fresh(scheduler, num_inference_steps, start)
    noise = torch.randn(2, 3, generator=gen, dtype=torch.float64)
    outputs = torch.randn(plan.num_evaluations, 2, 3, generator=gen, dtype=torch.float64)
    basis = torch.cat([noise.reshape(1, -1), outputs.reshape(plan.num_evaluations, -1)])
    x = noise if scaled_start else noise * real.init_noise_sigma
    for i, t in enumerate(real.timesteps[start:]):
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


@dataclass(frozen=True)
class ClippedDDIMPlan:
    """DDIM (eta 0) with ``clip_sample``: x0 is clamped each step, so no coefficient table exists.

    Each step is still a fixed formula with per-step constants:
    ``x0 = clamp((x - √(1-ᾱ_t)·ε) / √ᾱ_t)``, ``x_prev = √ᾱ_prev·x0 + √(1-ᾱ_prev)·ε``
    (v-prediction converts first). The constants live on the GPU like the table does.
    """

    timesteps: torch.Tensor  # (n,)
    consts: torch.Tensor  # (n, 4) float64: √ᾱ_t, √(1-ᾱ_t), √ᾱ_prev, √(1-ᾱ_prev)
    clip: float
    v_prediction: bool

    @property
    def num_evaluations(self) -> int:
        return int(self.timesteps.numel())


def clipped_ddim_plan(scheduler: Any, num_inference_steps: int, *, start: int = 0) -> ClippedDDIMPlan:
    """The per-step constants of a clipping DDIM scheduler from ``timesteps[start]`` on (DDIM's
    init_noise_sigma is 1: the start latents are used as they are); raises :class:`PlanUnsupported` otherwise."""
    name = type(scheduler).__name__
    config = getattr(scheduler, "config", {})
    if name != "DDIMScheduler" or not config.get("clip_sample", False):
        raise PlanUnsupported(f"{name} is not a clipping DDIM scheduler")
    if config.get("thresholding", False):
        raise PlanUnsupported("DDIMScheduler with thresholding=True (a per-sample quantile) has no GPU loop")
    if config.get("prediction_type", "epsilon") not in ("epsilon", "v_prediction"):
        raise PlanUnsupported(f"DDIMScheduler prediction_type={config['prediction_type']} has no GPU loop")
    probe = copy.deepcopy(scheduler)
    probe.set_timesteps(num_inference_steps, device="cpu")
    alphas = probe.alphas_cumprod.to(torch.float64)
    final = float(probe.final_alpha_cumprod)
    ratio = probe.config.num_train_timesteps // probe.num_inference_steps
    rows = []
    for t in probe.timesteps[start:].tolist():
        a_t = float(alphas[t])
        prev = t - ratio
        a_prev = float(alphas[prev]) if prev >= 0 else final
        rows.append([a_t**0.5, (1 - a_t) ** 0.5, a_prev**0.5, (1 - a_prev) ** 0.5])
    plan = ClippedDDIMPlan(
        timesteps=probe.timesteps[start:].clone(),
        consts=torch.tensor(rows, dtype=torch.float64),
        clip=float(config.get("clip_sample_range", 1.0)),
        v_prediction=config.get("prediction_type") == "v_prediction",
    )
    _check_ddim(scheduler, plan, num_inference_steps, start)
    return plan


def ddim_step(
    plan: ClippedDDIMPlan, consts: torch.Tensor, x: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """One clipped DDIM step with this step's constants (a (4,) tensor on the latents' device)."""
    sa, s1ma, sa_prev, s1ma_prev = consts.unbind()
    if plan.v_prediction:
        x0 = sa * x - s1ma * out
        eps = sa * out + s1ma * x
    else:
        x0 = (x - s1ma * out) / sa
        eps = out
    x0 = x0.clamp(-plan.clip, plan.clip)
    return sa_prev * x0 + s1ma_prev * eps


def _check_ddim(scheduler: Any, plan: ClippedDDIMPlan, num_inference_steps: int, start: int = 0) -> None:
    """Replay the real scheduler with outputs large enough to clip, and compare (float64)."""
    gen = torch.Generator().manual_seed(4321)
    real = _fresh(scheduler, num_inference_steps, start)
    x = torch.randn(2, 3, generator=gen, dtype=torch.float64) * 3
    ours = x.clone()
    for i, t in enumerate(real.timesteps[start:]):
        out = torch.randn(2, 3, generator=gen, dtype=torch.float64) * 3
        x = real.step(out, t, x, return_dict=False)[0].to(torch.float64)
        ours = ddim_step(plan, plan.consts[i], ours, out)
        err = float((x - ours).norm() / x.norm().clamp_min(1e-12))
        if not err < 1e-6:
            raise PlanUnsupported(
                f"DDIMScheduler step {i} differs from the clipped-DDIM formula by {err:.2e}"
            )
