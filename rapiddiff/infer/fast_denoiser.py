"""The fast denoise stage: runs each :class:`~rapiddiff.infer.job.DenoiseJob` on the GPU-resident
loop (replaying its captured graph), or on the one eager loop where the loop cannot express it."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

from rapiddiff.infer.fast_attention import BackendTable
from rapiddiff.infer.fast_cache import CompileCache
from rapiddiff.infer.fast_capture import LoopCache, LoopShape
from rapiddiff.infer.fast_packages import PackageParts, Plan, package_store
from rapiddiff.infer.fast_plan import PlanUnsupported, clipped_ddim_plan, linear_plan
from rapiddiff.infer.fast_report import FastPathReport, SwitchStatus, fallback
from rapiddiff.infer.fast_transforms import apply_transforms
from rapiddiff.infer.job import DenoiseJob
from rapiddiff.models.deep_cache import DeepCache
from rapiddiff.models.token_merge import TokenMerge
from rapiddiff.utils.logging import get_logger

if TYPE_CHECKING:
    from rapiddiff.infer.fast_config import AccelerateConfig

log = get_logger(__name__)


class GraphDenoiser:
    """Applies the module transforms on creation, then runs denoise jobs on the GPU loop."""

    fixed_batch = True  # one captured loop per shape: callers that can (eval) keep batches full

    def __init__(self, pipe: Any, config: AccelerateConfig) -> None:
        self.pipe, self.config = pipe, config
        self.unet, self.vae = pipe.unet, pipe.vae
        self.device = next(self.unet.parameters()).device
        self.report = FastPathReport()
        auto = config.attention == "auto" and self.device.type == "cuda"
        self.backends = BackendTable(self.unet, auto, self._report_picks)
        self.loop_kind = apply_transforms(pipe, config, self.report, self.backends.table)
        self.cache = (
            CompileCache(config.compile_cache, self.report, self.backends.table)
            if config.compile_cache
            else None
        )
        store = package_store(pipe, config.aoti, config.aoti_dir, self.loop_kind, self.report)
        packages = None
        if store is not None:
            packages = PackageParts(store, self.unet, self.vae, config, self.backends, self.report)
        self.loops = LoopCache(
            self.unet,
            self.vae,
            graph=self.loop_kind == "graph",
            cross_kv=config.cross_kv_cache,
            max_graphs=config.max_graphs,
            backends=self.backends,
            packages=packages,
            report=self.report,
        )
        self._plans: dict[tuple, Plan | str] = {}
        self._eager_reasons: set[str] = set()

    def _report_picks(self, picks: list[str]) -> None:
        self.report.set("attention", SwitchStatus("on", "on, per shape", ", ".join(picks)), quiet=True)

    def plan_for(self, scheduler: Any, steps: int, start: int = 0, scaled_start: bool = False) -> Plan | str:
        """The GPU loop's plan for this scheduler and schedule, or the reason there is none."""
        key = (type(scheduler).__name__, str(dict(scheduler.config)), steps, start, scaled_start)
        if key not in self._plans:
            self._plans[key] = _make_plan(scheduler, steps, start, scaled_start)
        return self._plans[key]

    def _why_eager(self, job: DenoiseJob) -> str | None:
        """Why this job cannot run on the GPU loop (None: it can)."""
        if job.inpaint is not None:
            return "inpainting blends a per-pixel mask into every step, which the loop's coefficient table cannot express"
        if job.step_kwargs.get("eta"):
            return f"eta={job.step_kwargs['eta']} injects fresh noise at every step"
        plan = self.plan_for(job.scheduler, job.steps, job.start, not job.pure_noise)
        if isinstance(plan, str):
            return f"{type(job.scheduler).__name__}: {plan}"
        if job.control is not None and plan.num_evaluations != len(job.timesteps):
            # The control window counts the scheduler's timesteps; the loop, its evaluations.
            reason = f"ControlNet: the loop's {plan.num_evaluations} evaluations are not the {len(job.timesteps)} timesteps"
            self.report.set(
                "controlnet", fallback(reason, "eager loop on the transformed modules"), quiet=True
            )
            return reason
        return None

    def __call__(self, job: DenoiseJob, *, decode: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run one denoise (and decode) job → (latents [N, C, h, w] float32, images [N, 3, H, W] or None)."""
        guidance = job.uncond is not None
        context = torch.cat([job.uncond, job.cond]) if guidance else job.cond  # (2N or N, L, D)
        context = context.to(self.unet.dtype)
        with torch.no_grad():
            if self.loop_kind == "eager":  # asked for: not a fallback
                return self._eager(job, context, decode)
            reason = self._why_eager(job)
            if reason is not None:
                if reason not in self._eager_reasons:
                    self._eager_reasons.add(reason)
                    log.warning("accelerate: eager loop (the transformed modules, no loop graph): %s", reason)
                return self._eager(job, context, decode)
            latents, images = self._replay(job, context, guidance)
        if self.cache is not None and self.config.compile_unet:
            self.cache.save_if_missing()
        return latents, images if decode else None

    def _replay(
        self, job: DenoiseJob, context: torch.Tensor, guidance: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        plan = self.plan_for(job.scheduler, job.steps, job.start, not job.pure_noise)
        assert not isinstance(plan, str)
        start = job.noise if job.pure_noise else job.latents  # what row 0 of the plan's basis holds
        shape = LoopShape(
            tuple(start.shape),
            tuple(context.shape),
            guidance,
            job.deep_cache,
            job.guidance_rescale,
            job.token_merge,
            tuple(tuple(image.shape) for image in job.control.images) if job.control is not None else (),
            id(job.control.net) if job.control is not None else 0,
        )
        loop = self.loops.get(
            plan, shape, job.control.net if job.control is not None else None, sampler_name(job.scheduler)
        )
        if job.control is not None:
            assert loop.control is not None
            loop.control.load(job.control)
            self.report.set("controlnet", SwitchStatus("on", "in the loop"), quiet=True)

        def attempt() -> tuple[torch.Tensor, torch.Tensor | None]:
            with self._approximations(job, start):
                return loop(start, context, job.guidance_scale)

        try:
            return attempt()
        except RuntimeError as err:
            if not loop.use_graph:
                raise
            # Something in the loop is not capturable here: keep the speed we can, say why.
            self.report.set("loop", fallback(f"CUDA graph capture failed: {str(err)[:200]}", "resident"))
            self.loop_kind, self.loops.graph, loop.use_graph, loop.graph = "resident", False, False, None
            torch.cuda.synchronize()
            return attempt()

    def _eager(
        self, job: DenoiseJob, context: torch.Tensor, decode: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The one eager loop (rapiddiff.models.sampling.denoise) on the transformed modules."""
        _, _, h, w = job.latents.shape
        self.backends.ensure(context.shape[0], h, w, context.shape[1])
        kv = self.loops.kv_fn(context) if self.config.cross_kv_cache else None

        def model(x: torch.Tensor, t: torch.Tensor, ctx: torch.Tensor, **unet_kwargs: Any) -> torch.Tensor:
            return self.loops.unet_fn(x, t, ctx, kv, **unet_kwargs)

        latents, images = job.run(model, self.vae, decode=decode, dtype=self.unet.dtype, unet=self.unet)
        return latents.float(), images

    def _approximations(self, job: DenoiseJob, latents: torch.Tensor) -> contextlib.ExitStack:
        """DeepCache's and token merging's wrappers installed around one loop run (a graph replay
        never calls them; the capture and a resident run do, in evaluation order)."""
        stack = contextlib.ExitStack()
        if job.deep_cache > 1:
            stack.enter_context(DeepCache.of(self.unet).active(job.deep_cache))
        if job.token_merge > 0:
            merger = TokenMerge.of(self.unet)
            stack.enter_context(merger.active(job.token_merge, tuple(latents.shape[-2:]), latents.device))
        return stack

    def building_packages(self) -> int | None:
        """The pid of the background package build this fast path started, while it runs (else None)."""
        packages = self.loops.packages
        return packages.builds.running() if packages is not None and packages.builds is not None else None

    def clear(self) -> None:
        """Drop the captured loops (and their memory pools) and the loaded packages: the next loop
        checks its packages again (after a change to the modules, e.g. new LoRA layers)."""
        self.loops.clear()


def sampler_name(scheduler: Any) -> str | None:
    """The sampler name (``SCHEDULERS``' key) of a diffusers scheduler, or None for another class."""
    from rapiddiff.models.sampling import SCHEDULERS

    return {cls: key for key, cls in SCHEDULERS.items()}.get(type(scheduler).__name__)


def _make_plan(scheduler: Any, steps: int, start: int = 0, scaled_start: bool = False) -> Plan | str:
    try:
        return linear_plan(scheduler, steps, start=start, scaled_start=scaled_start)
    except PlanUnsupported as err:
        reason = str(err)
    try:  # DDIM with clip_sample (diffusers' default for DDIM): its own GPU formula
        return clipped_ddim_plan(scheduler, steps, start=start)
    except PlanUnsupported:
        return reason
