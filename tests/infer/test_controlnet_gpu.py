"""ControlNet on CUDA in half precision against diffusers' ``StableDiffusionControlNetPipeline`` on
the same tiny weights and the same start latents (PSNR ≥ 35 dB), eager and on the fast path (the
ControlNet inside the CUDA-graph-captured loop; the second call replays the graph). Skipped without
CUDA::

    python -m pytest tests/infer/test_controlnet_gpu.py -q -m gpu
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from rapiddiff.infer.accelerate import AccelerateConfig, accelerate
from rapiddiff.infer.pipeline import RapidDiffusionPipeline
from rapiddiff.models.controlnet import ControlSpec
from tests.infer.helpers import psnr
from tests.infer.test_controlnet import NEGATIVE, PROMPT, STEPS, write_tiny_controlnet

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)
SEEDS = [3, 11]


@pytest.fixture(scope="module")
def setup(tiny_folders, tmp_path_factory):
    root = tmp_path_factory.mktemp("cn-gpu")
    nets = [write_tiny_controlnet(root / f"net{k}", tiny_folders["clip"] / "unet", seed=k) for k in range(2)]
    rng = np.random.default_rng(3)
    images = []
    for k in range(2):
        images.append(root / f"c{k}.png")
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(images[-1])
    return {"folder": tiny_folders["clip"], "nets": nets, "images": images}


def _specs(images, count):
    return [
        ControlSpec(
            images[k], controlnet_conditioning_scale=0.8 + 0.4 * k, control_guidance_end=1.0 - 0.25 * k
        )
        for k in range(count)
    ]


def _diffusers(setup, count: int) -> np.ndarray:
    from diffusers import ControlNetModel, StableDiffusionControlNetPipeline

    nets = [ControlNetModel.from_pretrained(n, torch_dtype=torch.float16) for n in setup["nets"][:count]]
    ref = StableDiffusionControlNetPipeline.from_pretrained(
        setup["folder"],
        controlnet=nets[0] if count == 1 else nets,
        torch_dtype=torch.float16,
        safety_checker=None,
        requires_safety_checker=False,
    ).to("cuda")
    ref.set_progress_bar_config(disable=True)
    # The start latents rapiddiff draws (float32 on the CPU, per seed), so both start alike.
    latents = torch.cat(
        [torch.randn((1, 4, 8, 8), generator=torch.Generator().manual_seed(s)) for s in SEEDS]
    )
    specs = _specs(setup["images"], count)
    pics = [Image.open(p).convert("RGB") for p in setup["images"][:count]]
    one = count == 1
    return ref(
        PROMPT,
        pics[0] if one else pics,
        negative_prompt=NEGATIVE,
        num_inference_steps=STEPS,
        guidance_scale=7.5,
        height=16,
        width=16,
        num_images_per_prompt=len(SEEDS),
        latents=latents.to("cuda", torch.float16),
        controlnet_conditioning_scale=specs[0].controlnet_conditioning_scale
        if one
        else [s.controlnet_conditioning_scale for s in specs],
        control_guidance_start=[s.control_guidance_start for s in specs],
        control_guidance_end=[s.control_guidance_end for s in specs],
        output_type="np",
    ).images


def _ours(pipe, setup, count: int):
    return pipe(
        PROMPT,
        NEGATIVE,
        num_inference_steps=STEPS,
        guidance_scale=7.5,
        height=16,
        width=16,
        seed=SEEDS,
        num_images_per_prompt=len(SEEDS),
        knowledge=False,
        output_type="np",
        progress=False,
        control=_specs(setup["images"], count),
    )


def _pipe(setup, count: int) -> RapidDiffusionPipeline:
    pipe = RapidDiffusionPipeline.from_pretrained(setup["folder"], device="cuda", dtype=torch.float16)
    pipe.load_controlnet(*setup["nets"][:count])
    return pipe


@pytest.mark.parametrize("count", [1, 2])
def test_fp16_controlnet_matches_diffusers(setup, count):
    expected = _diffusers(setup, count)
    out = _ours(_pipe(setup, count), setup, count)
    assert psnr(out.images, expected) >= 35, psnr(out.images, expected)


FAST = {
    "no-compile": AccelerateConfig(compile_unet=None, compile_vae=None),
    "defaults": AccelerateConfig(),  # torch.compile of the U-Net: the residuals are extra inputs
}


@pytest.mark.parametrize(("count", "config"), [(1, "no-compile"), (2, "no-compile"), (1, "defaults")])
def test_fast_path_with_controlnet_matches_diffusers(setup, count, config):
    expected = _diffusers(setup, count)
    fast = accelerate(_pipe(setup, count), FAST[config])
    for _ in range(2):
        out = _ours(fast, setup, count)
        assert psnr(out.images, expected) >= 35, psnr(out.images, expected)
    assert fast.report.status("controlnet").state == "on", fast.report  # inside the captured loop
    assert fast.report.status("loop").value == "graph", fast.report
