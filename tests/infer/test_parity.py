"""One generation path, checked against references: the same image as diffusers (knowledge off) for
every task × sampler, and the same image on the fast path as on the eager one for every
fast-path switch that runs on a CPU. The GPU-only switches (graph loop, fp16, attention backends,
compile) are checked in test_gpu_parity.py."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from PIL import Image

from rapiddiff.infer.accelerate import AccelerateConfig, accelerate
from rapiddiff.infer.pipeline import RapidDiffusionPipeline
from rapiddiff.models.sampling import make_scheduler

PROMPT = "蓝色背景上有一个番茄"
NEGATIVE = "模糊"
STEPS = 4
TASKS = ("txt2img", "img2img", "inpaint")
SCHEDULERS = ("pndm", "ddim", "dpm++")
# Fast-path switch sets that apply on a CPU (the rest fall back there, see test_accelerate.py).
SWITCHES = {
    "resident-loop": {"loop": "resident"},
    "fuse_qkv": {"fuse_qkv": True, "loop": "eager"},
    "cross_kv_cache": {"cross_kv_cache": True, "loop": "eager"},
    "channels_last": {"channels_last": True, "loop": "eager"},
    "batch_time_proj": {"batch_time_proj": True, "loop": "eager"},
    "all-cpu": {
        "loop": "resident",
        "fuse_qkv": True,
        "cross_kv_cache": True,
        "channels_last": True,
        "batch_time_proj": True,
    },
}
_SINGLE = ("fuse_qkv", "cross_kv_cache", "channels_last", "batch_time_proj")


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """An init image (16², the tiny model's size) and a mask (white = repaint: the right half), as files."""
    root = tmp_path_factory.mktemp("task-images")
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(root / "init.png")
    mask = np.zeros((16, 16), np.uint8)
    mask[:, 8:] = 255
    Image.fromarray(mask, "L").save(root / "mask.png")
    return {"init": root / "init.png", "mask": root / "mask.png"}


def task_kwargs(task: str, images: dict) -> dict:
    if task == "img2img":
        return {"init_image": images["init"], "strength": 0.75}
    if task == "inpaint":
        return {"init_image": images["init"], "mask_image": images["mask"], "strength": 1.0}
    return {}


def _diffusers(folder, task: str, scheduler: str, seed: int, images: dict) -> np.ndarray:
    import diffusers

    cls = {
        "txt2img": diffusers.StableDiffusionPipeline,
        "img2img": diffusers.StableDiffusionImg2ImgPipeline,
        "inpaint": diffusers.StableDiffusionInpaintPipeline,
    }[task]
    ref = cls.from_pretrained(folder, safety_checker=None, requires_safety_checker=False)
    ref.scheduler = make_scheduler(scheduler, ref.scheduler.config)  # as a diffusers user swaps samplers
    ref.set_progress_bar_config(disable=True)
    kw: dict = {}
    if task != "txt2img":
        kw["image"] = Image.open(images["init"]).convert("RGB")
        kw["strength"] = task_kwargs(task, images)["strength"]
    if task == "inpaint":
        kw["mask_image"] = Image.open(images["mask"]).convert("L")
        kw["height"] = kw["width"] = 16
    out = ref(
        PROMPT,
        negative_prompt=NEGATIVE,
        num_inference_steps=STEPS,
        guidance_scale=7.5,
        generator=[torch.Generator("cpu").manual_seed(seed)],
        output_type="np",
        **kw,
    ).images
    return _pasted(out, images) if task == "inpaint" else out


def _pasted(out: np.ndarray, images: dict, size: int = 16) -> np.ndarray:
    """diffusers' inpainting images with the init image pasted back outside the mask (as its
    ``apply_overlay`` does, and rapiddiff always does), both preprocessed as diffusers does."""
    from diffusers.image_processor import VaeImageProcessor

    init = VaeImageProcessor().preprocess(Image.open(images["init"]).convert("RGB"), height=size, width=size)
    masker = VaeImageProcessor(do_normalize=False, do_binarize=True, do_convert_grayscale=True)
    mask = masker.preprocess(Image.open(images["mask"]).convert("L"), height=size, width=size)
    init, mask = (init / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy(), mask.permute(0, 2, 3, 1).numpy()
    return out * mask + init * (1 - mask)


def _ours(pipe: RapidDiffusionPipeline, task: str, scheduler: str, seed, images: dict, **kw):
    if isinstance(seed, list):
        kw["num_images_per_prompt"] = len(seed)
    return pipe(
        PROMPT,
        NEGATIVE,
        num_inference_steps=STEPS,
        guidance_scale=7.5,
        seed=seed,
        scheduler=scheduler,
        knowledge=False,
        output_type="np",
        progress=False,
        **task_kwargs(task, images),
        **kw,
    )


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("task", TASKS)
def test_same_image_as_diffusers(tiny_folders, images, task, scheduler):
    """txt2img / img2img / inpaint × pndm / ddim / dpm++ equal diffusers' own pipelines (knowledge off)."""
    pipe = RapidDiffusionPipeline.from_pretrained(tiny_folders["clip"])
    expected = _diffusers(tiny_folders["clip"], task, scheduler, 7, images)
    out = _ours(pipe, task, scheduler, 7, images)
    assert out.images.shape == (1, 16, 16, 3)
    torch.testing.assert_close(out.images, expected, atol=1e-5, rtol=1e-5)
    if task != "txt2img":
        meta = out.metadata[0]
        assert meta["task"] == task and meta["init_image"] == str(images["init"].resolve())
        assert (
            len(meta["init_image_sha256"]) == 64 and meta["strength"] == task_kwargs(task, images)["strength"]
        )


# The single switches on img2img / inpaint are also covered by "all-cpu": slow-marked, so the
# `-m "not slow"` inner loop stays short; the full suite runs them.
_SWITCH_CASES = [
    pytest.param(task, switch, marks=[pytest.mark.slow] if task != "txt2img" and switch in _SINGLE else [])
    for task in TASKS
    for switch in SWITCHES
]


@pytest.mark.parametrize(("task", "switch"), _SWITCH_CASES)
def test_fast_path_same_image_as_eager(tiny_folders, images, task, switch, caplog):
    """Every CPU-applicable fast-path switch gives the eager image, per task; inpainting and other
    runs the loop cannot express take the one eager loop on the transformed modules, with the reason logged."""
    folder = tiny_folders["bert"]
    eager = _ours(RapidDiffusionPipeline.from_pretrained(folder), task, "dpm++", [3, 11], images)
    config = AccelerateConfig.off(compile_unet=None, compile_vae=None, **SWITCHES[switch])
    with caplog.at_level(logging.WARNING, logger="rapiddiff"):
        fast = accelerate(RapidDiffusionPipeline.from_pretrained(folder), config)
        out = _ours(fast, task, "dpm++", [3, 11], images)
    assert isinstance(fast, RapidDiffusionPipeline) and fast.report
    np.testing.assert_allclose(out.images, eager.images, atol=1e-4, rtol=0, err_msg=switch)
    assert out.seeds == eager.seeds == [3, 11] and out.metadata == eager.metadata
    if task == "inpaint" and SWITCHES[switch]["loop"] != "eager":
        assert any("eager loop" in r.getMessage() and "inpainting" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_resident_loop_runs_img2img_on_the_plan(tiny_folders, images, scheduler, caplog):
    """img2img starts part-way down the schedule: the coefficient table starts there too (no fallback)."""
    folder = tiny_folders["clip"]
    eager = _ours(RapidDiffusionPipeline.from_pretrained(folder), "img2img", scheduler, 5, images)
    fast = accelerate(RapidDiffusionPipeline.from_pretrained(folder), AccelerateConfig.off(loop="resident"))
    with caplog.at_level(logging.WARNING, logger="rapiddiff"):
        out = _ours(fast, "img2img", scheduler, 5, images)
    assert not any("eager loop" in r.getMessage() for r in caplog.records)
    np.testing.assert_allclose(out.images, eager.images, atol=1e-4, rtol=0)


def test_fast_path_gives_the_eager_images(tiny_folders):
    """accelerate() on the pipeline: same images, seeds and metadata."""
    prompts, seeds = ["蓝色背景上有一个番茄", "a red circle"], [3, 11]
    pipe = RapidDiffusionPipeline.from_pretrained(tiny_folders["bert"])
    kw = {"num_inference_steps": 3, "seed": seeds, "output_type": "np", "progress": False}
    eager = {s: pipe(prompts, NEGATIVE, scheduler=s, **kw).images for s in ("pndm", "dpm++")}
    # compile_unet=None: compiling takes minutes on 2 CPU cores
    assert accelerate(pipe, compile_unet=None, compile_vae=None) is pipe
    for name, expected in eager.items():
        fast = pipe(prompts, NEGATIVE, scheduler=name, **kw)
        np.testing.assert_allclose(fast.images, expected, atol=1e-4, rtol=0, err_msg=name)
        assert fast.seeds == seeds and fast.metadata[0]["scheduler"] == name
    assert np.abs(eager["pndm"] - eager["dpm++"]).max() > 1e-4  # the sampler choice reaches the fast stage


def test_eta_is_a_logged_fallback_with_the_same_image(tiny_folders, caplog):
    """DDIM with eta > 0 injects noise each step (from the per-image generators): the fast stage
    runs the eager loop for it, says so, and gives the eager image."""
    folder = tiny_folders["clip"]
    kw = {"num_inference_steps": 3, "seed": [1, 2], "scheduler": "ddim", "eta": 0.7, "output_type": "np"}
    eager = RapidDiffusionPipeline.from_pretrained(folder)(["a", "b"], progress=False, **kw)
    fast = accelerate(RapidDiffusionPipeline.from_pretrained(folder), AccelerateConfig.off(loop="resident"))
    with caplog.at_level(logging.WARNING, logger="rapiddiff"):
        out = fast(["a", "b"], progress=False, **kw)
    assert any("eager loop" in r.getMessage() and "eta" in r.getMessage() for r in caplog.records)
    np.testing.assert_allclose(out.images, eager.images, atol=1e-5, rtol=0)
    assert out.metadata[0]["eta"] == 0.7


def test_one_seed_rule_on_every_path(tiny_folders, images):
    """Image k depends only on its own seed: alone or in a batch, eager or fast, for every task."""
    folder = tiny_folders["bert"]
    pipe = RapidDiffusionPipeline.from_pretrained(folder)
    fast = accelerate(RapidDiffusionPipeline.from_pretrained(folder), AccelerateConfig.off(loop="resident"))
    for task in TASKS:
        batch = _ours(pipe, task, "pndm", [4, 9], images).images
        alone = _ours(pipe, task, "pndm", 9, images).images
        np.testing.assert_allclose(alone[0], batch[1], atol=1e-5, rtol=0, err_msg=task)
        np.testing.assert_allclose(
            _ours(fast, task, "pndm", 9, images).images[0], batch[1], atol=1e-4, rtol=0
        )


@pytest.mark.parametrize("strength", [1.0, 0.6])
def test_nine_channel_inpainting_unet_as_diffusers(tiny_folders, images, tmp_path, strength):
    """A 9-channel inpainting U-Net (latents ‖ mask ‖ masked-image latents) gives diffusers' images."""
    import shutil

    from diffusers import UNet2DConditionModel

    from rapiddiff.models.presets import unet_config

    folder = tmp_path / "inpaint-model"
    shutil.copytree(tiny_folders["clip"], folder)
    torch.manual_seed(2)
    UNet2DConditionModel(**{**unet_config("tiny"), "in_channels": 9}).save_pretrained(folder / "unet")
    pipe = RapidDiffusionPipeline.from_pretrained(folder)
    kw = {"init_image": images["init"], "mask_image": images["mask"], "strength": strength}
    out = pipe(PROMPT, NEGATIVE, num_inference_steps=STEPS, seed=7, knowledge=False, output_type="np",
               progress=False, **kw)  # fmt: skip
    import diffusers

    ref = diffusers.StableDiffusionInpaintPipeline.from_pretrained(
        folder, safety_checker=None, requires_safety_checker=False
    )
    ref.set_progress_bar_config(disable=True)
    expected = ref(
        PROMPT,
        negative_prompt=NEGATIVE,
        image=Image.open(images["init"]).convert("RGB"),
        mask_image=Image.open(images["mask"]).convert("L"),
        strength=strength,
        height=16,
        width=16,
        num_inference_steps=STEPS,
        generator=[torch.Generator("cpu").manual_seed(7)],
        output_type="np",
    ).images
    expected = _pasted(expected, images)
    torch.testing.assert_close(out.images, expected, atol=1e-5, rtol=1e-5)
