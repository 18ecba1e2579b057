"""RapidDiffusionPipeline against diffusers' StableDiffusionPipeline on tiny SD 1.x and Taiyi-style folders."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from rapiddiff.infer.pipeline import RapidDiffusionPipeline, check_size, make_scheduler

PROMPTS = ["蓝色背景上有一个番茄", "a red circle"]
NEGATIVE = "模糊"
SEEDS = [3, 11]


@pytest.fixture(scope="module")
def folders(tiny_folders):
    return tiny_folders


@pytest.fixture(scope="module")
def pipes(folders):
    return {text: RapidDiffusionPipeline.from_pretrained(path) for text, path in folders.items()}


def _diffusers_images(folder, scheduler: str, steps: int = 4, guidance: float = 7.5) -> np.ndarray:
    from diffusers import StableDiffusionPipeline

    ref = StableDiffusionPipeline.from_pretrained(folder, safety_checker=None)
    ref.scheduler = make_scheduler(scheduler, ref.scheduler.config)  # how a diffusers user swaps samplers
    ref.set_progress_bar_config(disable=True)
    return ref(
        PROMPTS,
        negative_prompt=[NEGATIVE] * len(PROMPTS),
        num_inference_steps=steps,
        guidance_scale=guidance,
        generator=[torch.Generator("cpu").manual_seed(s) for s in SEEDS],
        output_type="np",
    ).images


@pytest.mark.parametrize(
    ("text", "scheduler"), [("clip", "pndm"), ("bert", "pndm"), ("clip", "ddim"), ("bert", "dpm++")]
)
def test_same_images_as_diffusers(folders, pipes, text, scheduler):
    expected = _diffusers_images(folders[text], scheduler)
    out = pipes[text](
        PROMPTS,
        NEGATIVE,
        num_inference_steps=4,
        guidance_scale=7.5,
        seed=SEEDS,
        scheduler=scheduler,
        knowledge=False,
        output_type="np",
        progress=False,
    )
    assert out.images.shape == (2, 16, 16, 3)
    torch.testing.assert_close(out.images, expected)


def test_images_depend_on_seed_prompt_and_sampler(pipes):
    pipe = pipes["clip"]

    def gen(prompt="a red circle", seed=1, **kw):
        kw = {"num_inference_steps": 3, "output_type": "np", "progress": False, **kw}
        return pipe(prompt, seed=seed, **kw).images[0]

    base = gen()
    np.testing.assert_array_equal(gen(), base)  # same seed and settings ⇒ same image
    for other in (gen(seed=2), gen(prompt="a blue square"), gen(scheduler="ddim"), gen(guidance_scale=1.0)):
        assert np.abs(other - base).max() > 1e-4


def test_image_does_not_depend_on_its_batch(pipes):
    pipe = pipes["bert"]
    kw = {"num_inference_steps": 3, "output_type": "np", "progress": False}
    batch = pipe(PROMPTS, seed=[5, 9], **kw).images
    alone = pipe(PROMPTS[1], seed=9, **kw).images
    np.testing.assert_allclose(alone[0], batch[1], atol=1e-5, rtol=0)
    many = pipe(PROMPTS[0], seed=5, num_images_per_prompt=3, **kw)
    assert many.seeds == [5, 6, 7]
    np.testing.assert_allclose(many.images[0], batch[0], atol=1e-5, rtol=0)


def test_sizes(pipes):
    pipe = pipes["clip"]
    assert pipe.size_multiple == 4  # tiny: 2× VAE × 2 U-Net levels
    out = pipe("x", height=24, width=12, num_inference_steps=2, seed=0, progress=False)
    assert out.images[0].size == (12, 24)
    with pytest.raises(ValueError, match=r"height 18 → nearest valid: 16 or 20"):
        pipe("x", height=18, width=16, num_inference_steps=1, progress=False)
    with pytest.raises(ValueError, match=r"nearest valid: 8 or 16"):
        check_size(16, 9, 8)


def test_bad_input(pipes, caplog):
    pipe = pipes["clip"]
    with pytest.raises(ValueError, match="choose one of: pndm, ddim, dpm\\+\\+"):
        pipe("x", scheduler="euler-ancestral", progress=False)
    with pytest.raises(ValueError, match="2 seeds given for 1 images"):
        pipe("x", seed=[1, 2], progress=False)
    with caplog.at_level(logging.WARNING, logger="rapiddiff"):
        pipe("", num_inference_steps=1, seed=0, progress=False)
        pipe("番茄" * 100, num_inference_steps=1, seed=0, progress=False)
    assert "unconditionally" in caplog.text
    assert "truncated" in caplog.text


def test_upscale_in_the_pipeline(pipes, tmp_path):
    from rapiddiff.models.upscaler import build_rrdb, save_upscaler

    pipe = pipes["clip"]
    with pytest.raises(ValueError, match="no upscaler"):
        pipe("x", num_inference_steps=1, upscale=True, progress=False)
    pipe.set_upscaler(save_upscaler(build_rrdb(num_blocks=1, num_feat=8), tmp_path / "up.safetensors"))
    try:
        out = pipe("x", num_inference_steps=1, seed=0, upscale=True, progress=False)
    finally:
        pipe.upscaler = None
    assert out.images[0].size == (64, 64)
    assert out.metadata[0]["upscale"] is True and out.metadata[0]["height"] == 16


def test_to_changes_dtype_and_keeps_working(folders):
    pipe = RapidDiffusionPipeline.from_pretrained(folders["clip"]).to(dtype=torch.bfloat16)
    assert pipe.dtype == torch.bfloat16 and pipe.text_encoder.dtype == torch.bfloat16
    out = pipe("x", num_inference_steps=2, seed=0, output_type="np", progress=False)
    assert out.images.dtype == np.float32 and np.isfinite(out.images).all()


def test_knowledge_text_mode_is_the_base_encoder_on_the_expanded_prompt(knowledge_model, tmp_path):
    """`--knowledge text` spells the entity's KG facts into the prompt (the honest ceiling for the
    vector path): the image is the base encoder's on the expanded prompt, and its PNG remakes it."""
    from rapiddiff.cli import main
    from rapiddiff.infer.png import generation_kwargs, read_png_metadata

    pipe = RapidDiffusionPipeline.from_pretrained(knowledge_model)
    entity = pipe.text_encoder.store.entity_names[0]
    prompt = f"蓝色背景上有一个{entity}"
    with pipe.text_encoder.knowledge_as("text"):
        expanded = pipe.text_encoder.expand([prompt])[0]
    assert expanded != prompt and entity in expanded
    kwargs = {"num_inference_steps": 2, "seed": 5, "output_type": "np", "progress": False}
    text = pipe(prompt, knowledge="text", **kwargs)
    np.testing.assert_array_equal(text.images, pipe(expanded, knowledge=False, **kwargs).images)
    assert np.abs(text.images - pipe(prompt, knowledge="embed", **kwargs).images).max() > 1e-4
    assert text.metadata[0]["knowledge"] is True and text.metadata[0]["knowledge_mode"] == "text"
    assert pipe.text_encoder.knowledge_mode == "embed"  # the call's mode does not stick

    out = tmp_path / "out"
    args = ["generate", prompt, "--model", str(knowledge_model), "--knowledge", "text", "--steps", "2"]
    assert main([*args, "--seed", "5", "--device", "cpu", "--no-progress", "--out", str(out)]) == 0
    (png,) = sorted(out.glob("*.png"))
    assert generation_kwargs(read_png_metadata(png))["knowledge"] == "text"
