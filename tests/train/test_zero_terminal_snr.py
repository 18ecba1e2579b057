"""Zero terminal SNR (Lin et al. 2024) as a training option: the schedule is rescaled so ᾱ_T = 0,
the model folder records it, and every sampling path (pipeline, fast loop, diffusers) samples it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rapiddiff.models import sampling
from rapiddiff.models.presets import scheduler_config
from rapiddiff.train import unet as unet_stage
from tests.train.helpers import tiny_unet_args, write_imagefolder

ZERO_SNR = ["--model.loss.prediction_type=v_prediction", "--model.loss.zero_terminal_snr=true"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny U-Net trained 2 steps with zero terminal SNR + v-prediction + min-SNR, exported."""
    root = tmp_path_factory.mktemp("zsnr")
    data = write_imagefolder(root / "data")
    # guidance 5.0, not the default 7.5: the chain's assembled folder must keep the trained one's
    unet_stage.cli_main(
        [*tiny_unet_args(data, root / "run", max_steps=2), *ZERO_SNR, "--model.sampling.guidance_scale=5.0"]
    )
    return root / "run" / "model"


def test_the_model_folder_records_the_schedule_and_round_trips(trained: Path) -> None:
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    from rapiddiff.models.bundle import load_model_folder

    config = json.loads((trained / "scheduler" / "scheduler_config.json").read_text())
    assert config["_class_name"] == "DDIMScheduler"  # PNDM cannot step from ᾱ_T = 0
    assert config["rescale_betas_zero_snr"] is True
    assert config["timestep_spacing"] == "trailing"
    assert config["prediction_type"] == "v_prediction" and config["clip_sample"] is False
    sampling_defaults = json.loads((trained / "rapiddiff.json").read_text())["sampling"]
    assert sampling_defaults["scheduler"] == "ddim"
    bundle = load_model_folder(trained)
    assert bundle.sampling is not None and bundle.sampling.scheduler == "ddim"
    assert sampling.zero_terminal_snr(bundle.scheduler.config)
    # diffusers' own pipeline loads the same schedule, ᾱ_T = 0, and starts sampling at t = T.
    pipe = StableDiffusionPipeline.from_pretrained(trained, safety_checker=None)
    assert isinstance(pipe.scheduler, DDIMScheduler)
    assert float(pipe.scheduler.alphas_cumprod[-1]) == 0.0
    pipe.scheduler.set_timesteps(4)
    assert int(pipe.scheduler.timesteps[0]) == 999


def test_sampling_is_finite_and_the_fast_loop_matches_eager(trained: Path) -> None:
    from rapiddiff.infer.accelerate import accelerate
    from rapiddiff.infer.pipeline import RapidDiffusionPipeline

    eager = RapidDiffusionPipeline.from_pretrained(trained)
    kwargs = {"num_inference_steps": 4, "seed": [0, 1], "progress": False, "output_type": "np"}
    ref = eager(["蓝色背景上有一个番茄", "熊猫"], **kwargs)
    assert torch.isfinite(ref.latents).all() and ref.metadata[0]["scheduler"] == "ddim"
    # DPM++ reads the flag too (diffusers clamps its ᾱ_T to 2^-24); PNDM is refused with the reason.
    assert torch.isfinite(eager("熊猫", scheduler="dpm++", **{**kwargs, "seed": 0}).latents).all()
    with pytest.raises(ValueError, match="zero terminal SNR"):
        eager("熊猫", scheduler="pndm", **{**kwargs, "seed": 0})
    from rapiddiff.serve.config import ServeConfig
    from rapiddiff.serve.engine import model_limits

    # Serving offers only the samplers that can step from ᾱ_T = 0: a pndm request is a 400, not a 500.
    assert model_limits(eager, ServeConfig()).schedulers == sampling.ZERO_SNR_SAMPLERS
    fast = accelerate(RapidDiffusionPipeline.from_pretrained(trained), compile_unet=None, compile_vae=None)
    out = fast(["蓝色背景上有一个番茄", "熊猫"], **kwargs)
    assert not fast.report["loop"].startswith("eager")  # DDIM v-prediction is a linear plan
    assert float((out.latents - ref.latents).norm() / ref.latents.norm()) < 1e-4
    # CFG rescale, eager and fast alike; recorded in the image's settings.
    ref_r = eager(["蓝色背景上有一个番茄", "熊猫"], guidance_rescale=0.7, **kwargs)
    out_r = fast(["蓝色背景上有一个番茄", "熊猫"], guidance_rescale=0.7, **kwargs)
    assert ref_r.metadata[0]["guidance_rescale"] == 0.7
    assert float((ref_r.latents - ref.latents).norm()) > 0
    assert float((out_r.latents - ref_r.latents).norm() / ref_r.latents.norm()) < 1e-4


def test_terminal_step_loss_is_finite_and_weighted(tmp_path: Path) -> None:
    loss = unet_stage.DiffusionLoss(prediction_type="v_prediction", zero_terminal_snr=True, snr_gamma=5.0)
    module = unet_stage.LatentDiffusion(unet="tiny", vae="tiny", text_encoder="tiny", loss=loss, ema=None)
    assert float(module.noise_scheduler.alphas_cumprod[-1]) == 0.0
    latents, noise = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    t = torch.tensor([999, 999])
    assert torch.equal(module.noise_scheduler.add_noise(latents, noise, t), noise)  # x_T is pure noise
    assert torch.allclose(module.target(latents, noise, t), -latents)  # v = -x0 at ᾱ = 0
    value = module.diffusion_loss(torch.zeros_like(latents), module.target(latents, noise, t), t)
    assert torch.isfinite(value) and value > 0  # the terminal step keeps a weight (min(SNR+1, γ)/(SNR+1) = 1)
    assert torch.allclose(value, (latents**2).mean())


def test_epsilon_on_a_zero_snr_schedule_is_refused() -> None:
    loss = unet_stage.DiffusionLoss(zero_terminal_snr=True)  # prediction_type None → the config's ε
    with pytest.raises(ValueError, match=r"needs model\.loss\.prediction_type: v_prediction"):
        unet_stage.LatentDiffusion(unet="tiny", vae="tiny", text_encoder="tiny", loss=loss, ema=None)


def test_samplers_and_defaults_for_a_zero_snr_config() -> None:
    config = sampling.zero_terminal_snr_config({**scheduler_config(), "prediction_type": "v_prediction"})
    assert sampling.default_sampler(config, "pndm") == "ddim"
    assert sampling.default_sampler(config, "dpm++") == "dpm++"
    assert sampling.default_sampler(scheduler_config(), "pndm") == "pndm"
    ddim = sampling.make_scheduler("ddim", config)
    assert float(ddim.alphas_cumprod[-1]) == 0.0
    with pytest.raises(ValueError, match="choose one of: ddim, dpm"):
        sampling.make_scheduler("plms", config)


def test_guidance_rescale_is_diffusers_rescale_and_checked() -> None:
    from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import rescale_noise_cfg

    guided, text = torch.randn(3, 4, 5, 5) * 3, torch.randn(3, 4, 5, 5)
    torch.testing.assert_close(
        sampling.rescale_guidance(guided, text, 0.7), rescale_noise_cfg(guided, text, guidance_rescale=0.7)
    )
    assert sampling.SamplingDefaults.from_dict({"guidance_rescale": 0.7}).guidance_rescale == 0.7
    with pytest.raises(ValueError, match=r"sampling.guidance_rescale: .*\[0, 1\]"):
        sampling.SamplingDefaults.from_dict({"guidance_rescale": 1.5})


def test_the_chain_switch_trains_and_ships_a_zero_snr_model(trained: Path, tmp_path: Path) -> None:
    """benchmarks/kshapes_chain.py: ``unet_zero_snr`` adds the stage overrides the fixture trained
    with; the built-in model it assembles samples with DDIM and records the CFG rescale."""
    import importlib.util
    import shutil
    import sys

    from rapiddiff.models.bundle import load_model_folder
    from rapiddiff.models.upscaler import build_upscaler, save_upscaler

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("kshapes_chain", root / "benchmarks" / "kshapes_chain.py")
    assert spec is not None and spec.loader is not None
    chain = importlib.util.module_from_spec(spec)
    sys.modules["kshapes_chain"] = chain  # dataclasses look their module up while it executes
    try:
        spec.loader.exec_module(chain)
        cfg = chain.load_config(chain.ChainConfig, root / "configs" / "kshapes" / "chain.yaml")
        assert cfg.unet_zero_snr is False  # the shipped chain is unchanged until chosen
        on = chain.Chain(
            tmp_path / "chain", chain.ChainConfig(unet_zero_snr=True, guidance_rescale=0.7), True
        )
        assert on.schedule_overrides() == ZERO_SNR
        assert chain.Chain(tmp_path / "chain0", cfg, True).schedule_overrides() == []
        data = tmp_path / "data"
        for split in ("train", "val", "test"):
            write_imagefolder(data / split)
        shutil.copy(data / "train" / "metadata.jsonl", data / "prompts.jsonl")
        upscaler = save_upscaler(build_upscaler("compact", num_feat=8, num_conv=2), tmp_path / "up")
        chain.assemble_builtin_model(trained, upscaler, data, tmp_path / "builtin", 4, guidance_rescale=0.7)
    finally:
        sys.modules.pop("kshapes_chain", None)
    bundle = load_model_folder(tmp_path / "builtin")
    assert bundle.sampling is not None
    assert (bundle.sampling.scheduler, bundle.sampling.guidance_rescale) == ("ddim", 0.7)
    # the guidance the chain evaluated the trained folder at, not a fixed 7.5
    trained_sampling = json.loads((trained / "rapiddiff.json").read_text())["sampling"]
    assert bundle.sampling.guidance_scale == trained_sampling["guidance_scale"]
    assert sampling.zero_terminal_snr(bundle.scheduler.config)
