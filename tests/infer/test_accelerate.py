"""The fast path against the eager reference, on tiny models (CPU): every switch that applies here
gives the eager image, and GPU-only switches fall back with a logged reason."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from diffusers import (  # noqa: E402
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    PNDMScheduler,
    StableDiffusionPipeline,
)

from rapiddiff.infer.accelerate import AccelerateConfig, accelerate  # noqa: E402
from rapiddiff.infer.fast_attention import FastAttnProcessor, attention_shapes  # noqa: E402
from rapiddiff.infer.fast_cache import load_backend_table, save_backend_table  # noqa: E402
from rapiddiff.infer.fast_loop import DenoiseLoop  # noqa: E402
from rapiddiff.infer.fast_plan import PlanUnsupported, clipped_ddim_plan, linear_plan  # noqa: E402
from rapiddiff.models.presets import scheduler_config, write_tiny_sd_folder  # noqa: E402

PROMPT = "一只红色的番茄"
STEPS = 4


def _model(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A nonlinear stand-in for the U-Net: the plan must hold for any model, not a linear one."""
    return torch.tanh(0.7 * x) + 0.3 * torch.sin(x * float(t) / 500.0)


@pytest.mark.parametrize(
    "scheduler",
    [
        PNDMScheduler(**scheduler_config()),
        DDIMScheduler.from_config(scheduler_config(), clip_sample=False),
        DPMSolverMultistepScheduler.from_config(scheduler_config()),
    ],
    ids=["pndm", "ddim", "dpm++"],
)
def test_gpu_resident_loop_matches_the_scheduler_loop(scheduler):
    plan = linear_plan(scheduler, 7)
    noise = torch.randn(2, 4, 3, 3)
    # Reference: the diffusers loop, float64.
    ref = scheduler.__class__.from_config(scheduler.config)
    ref.set_timesteps(7)
    x = noise.double() * ref.init_noise_sigma
    for t in ref.timesteps:
        x = ref.step(_model(ref.scale_model_input(x, t), t), t, x, return_dict=False)[0]
    loop = DenoiseLoop(
        lambda x_in, t, context, kv: _model(x_in.double(), t).float(),
        plan,
        noise_shape=tuple(noise.shape),
        context_shape=(2, 5, 8),
        model_dtype=torch.float32,
        device=torch.device("cpu"),
        guidance=False,
    )
    latents, images = loop(noise, torch.zeros(2, 5, 8), 1.0)
    assert images is None
    err = float((latents.double() - x).norm() / x.norm())
    assert err < 1e-5, err
    # Buffers are reused: a second call with other noise is a fresh, correct run.
    again, _ = loop(noise, torch.zeros(2, 5, 8), 1.0)
    torch.testing.assert_close(again, latents)


def test_nonlinear_schedulers_are_refused_with_the_reason():
    with pytest.raises(PlanUnsupported, match="clip_sample"):
        linear_plan(DDIMScheduler.from_config(scheduler_config()), 5)
    with pytest.raises(PlanUnsupported, match="not linear"):
        linear_plan(EulerAncestralDiscreteScheduler.from_config(scheduler_config()), 5)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return write_tiny_sd_folder(tmp_path_factory.mktemp("tiny") / "sd", text="clip", seed=3)


def _pipe(folder) -> StableDiffusionPipeline:
    pipe = StableDiffusionPipeline.from_pretrained(folder, safety_checker=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _eager(folder, scheduler=None):
    pipe = _pipe(folder)
    if scheduler is not None:
        pipe.scheduler = scheduler
    gen = torch.Generator().manual_seed(0)
    latents = pipe(PROMPT, num_inference_steps=STEPS, generator=gen, output_type="latent").images
    gen = torch.Generator().manual_seed(0)
    images = pipe(PROMPT, num_inference_steps=STEPS, generator=gen, output_type="np").images
    return latents, images


def _psnr(a, b) -> float:
    mse = float(np.mean((np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(1 / mse)


def test_all_switches_match_eager_and_gpu_switches_fall_back(tiny_folder, caplog):
    ref_latents, ref_images = _eager(tiny_folder)
    pipe = _pipe(tiny_folder)
    with caplog.at_level(logging.WARNING, logger="rapiddiff"):
        fast = accelerate(pipe, compile_unet=None, compile_vae=None)
    out = fast(PROMPT, num_inference_steps=STEPS, seed=0, output_type="np")
    assert float((out.latents - ref_latents).norm() / ref_latents.norm()) < 1e-4
    assert _psnr(out.images, ref_images) >= 35
    # CPU: what needs a GPU says so, in the report and in the log.
    for switch in ("loop", "attention", "dtype"):
        assert fast.report[switch].startswith("fallback:"), (switch, fast.report[switch])
        assert any(switch in r.getMessage() and "fallback" in r.getMessage() for r in caplog.records)
    assert fast.report["fuse_qkv"].startswith("on") and fast.report["cross_kv_cache"] == "on"
    assert all(isinstance(m.processor, FastAttnProcessor) for m in _attention(pipe.unet))


def _attention(model):
    from diffusers.models.attention_processor import Attention

    return [m for m in model.modules() if isinstance(m, Attention)]


def test_fused_qkv_costs_no_memory(tiny_folder):
    pipe = _pipe(tiny_folder)
    accelerate(pipe, compile_unet=None, compile_vae=None)
    fused = [m for m in _attention(pipe.unet) if getattr(m, "fused_projections", False)]
    assert fused
    for module in fused:
        big = module.to_kv if module.is_cross_attention else module.to_qkv
        assert module.to_k.weight.untyped_storage().data_ptr() == big.weight.untyped_storage().data_ptr()


def test_scheduler_without_a_plan_runs_the_eager_loop(tiny_folder, caplog):
    thresholded = DDIMScheduler.from_config(scheduler_config(), thresholding=True)  # per-sample quantile
    ref_latents, _ = _eager(tiny_folder, thresholded)
    pipe = _pipe(tiny_folder)
    pipe.scheduler = thresholded
    fast = accelerate(pipe, compile_unet=None, compile_vae=None)
    with caplog.at_level(logging.WARNING, logger="rapiddiff"):
        out = fast(PROMPT, num_inference_steps=STEPS, seed=0, output_type="np")
    assert any("eager loop" in r.getMessage() and "thresholding" in r.getMessage() for r in caplog.records)
    assert float((out.latents - ref_latents).norm() / ref_latents.norm()) < 1e-4


def test_clipping_ddim_runs_on_the_gpu_loop(tiny_folder, caplog):
    clipped = DDIMScheduler.from_config(scheduler_config())  # diffusers' default: clip_sample=True
    plan = clipped_ddim_plan(clipped, 6)
    noise = torch.randn(2, 4, 3, 3) * 2
    ref = DDIMScheduler.from_config(clipped.config)
    ref.set_timesteps(6)
    x, clipped_any = noise.double(), False
    for t in ref.timesteps:
        out = 3 * _model(x, t)
        a = ref.alphas_cumprod[t].double()
        clipped_any |= bool((((x - (1 - a).sqrt() * out) / a.sqrt()).abs() > 1).any())
        x = ref.step(out, t, x, return_dict=False)[0]
    assert clipped_any  # the check is only meaningful if clipping happened
    loop = DenoiseLoop(
        lambda x_in, t, context, kv: 3 * _model(x_in.double(), t).float(),
        plan,
        noise_shape=tuple(noise.shape),
        context_shape=(2, 5, 8),
        model_dtype=torch.float32,
        device=torch.device("cpu"),
        guidance=False,
    )
    latents, _ = loop(noise, torch.zeros(2, 5, 8), 1.0)
    assert float((latents.double() - x).norm() / x.norm()) < 1e-5
    # And through accelerate, against the diffusers pipeline with the same scheduler: no eager fallback.
    ref_latents, _ = _eager(tiny_folder, clipped)
    pipe = _pipe(tiny_folder)
    pipe.scheduler = clipped
    with caplog.at_level(logging.WARNING, logger="rapiddiff"):
        out = accelerate(pipe, compile_unet=None, compile_vae=None)(PROMPT, num_inference_steps=STEPS, seed=0)
    assert not any("eager loop" in r.getMessage() for r in caplog.records)
    assert float((out.latents - ref_latents).norm() / ref_latents.norm()) < 1e-4


def test_batches_and_seed_lists_match_eager(tiny_folder):
    pipe = _pipe(tiny_folder)
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    ref = pipe([PROMPT, "熊猫"], num_inference_steps=STEPS, generator=gens, output_type="latent").images
    fast = accelerate(_pipe(tiny_folder), compile_unet=None, compile_vae=None)
    out = fast([PROMPT, "熊猫"], num_inference_steps=STEPS, seed=[1, 2], output_type="pil")
    assert len(out.images) == 2 and out.images[0].size == (16, 16)
    assert float((out.latents - ref).norm() / ref.norm()) < 1e-4


def test_config_errors_name_the_choices():
    with pytest.raises(ValueError, match="reduce-overhead"):
        AccelerateConfig(compile_unet="fastest")
    with pytest.raises(ValueError, match="cudnn"):
        AccelerateConfig(attention="fa3")
    with pytest.raises(ValueError, match="graph, resident, eager"):
        AccelerateConfig(loop="async")


def test_attention_shapes_follow_the_unet_levels(tiny_folder):
    pipe = _pipe(tiny_folder)
    shapes = attention_shapes(pipe.unet, 8, 8)
    # tiny: attention only at level 1 (8×8 latents halved → 16 tokens), 8 heads of 64/8, 77-token context.
    assert shapes == {(16, 16, 8, 8), (16, 77, 8, 8)}


def test_backend_table_round_trips(tmp_path):
    table = {(4096, 4096, 40): "cudnn", (4096, 77, 40): "efficient"}
    save_backend_table(tmp_path / "cache.bin", table)
    assert load_backend_table(tmp_path / "cache.bin") == table
    assert load_backend_table(tmp_path / "other.bin") == {}


def test_lora_merged_works_and_unmerged_falls_back(tiny_folder):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(
        r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"], init_lora_weights=False
    )

    def with_lora(merge: bool) -> StableDiffusionPipeline:
        pipe = _pipe(tiny_folder)
        torch.manual_seed(5)
        pipe.unet.add_adapter(lora)
        if merge:
            pipe.unet.fuse_lora()
        return pipe

    gen = torch.Generator().manual_seed(0)
    ref = with_lora(False)(PROMPT, num_inference_steps=STEPS, generator=gen, output_type="latent").images
    plain, _ = _eager(tiny_folder)
    assert float((ref - plain).norm() / plain.norm()) > 1e-3  # the adapter changes the image

    merged = accelerate(with_lora(True), compile_unet=None, compile_vae=None)
    assert merged.report["fuse_qkv"].startswith("on")
    out = merged(PROMPT, num_inference_steps=STEPS, seed=0, output_type="np")
    assert float((out.latents - ref).norm() / ref.norm()) < 1e-4

    unmerged = accelerate(with_lora(False), compile_unet=None, compile_vae=None)
    assert "LoRA" in unmerged.report["fuse_qkv"] and unmerged.report["fuse_qkv"].startswith("fallback")
    out = unmerged(PROMPT, num_inference_steps=STEPS, seed=0, output_type="np")
    assert float((out.latents - ref).norm() / ref.norm()) < 1e-4
