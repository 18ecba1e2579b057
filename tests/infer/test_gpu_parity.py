"""GPU parity of every fast-path switch and of the graph-captured loop, per task (txt2img, img2img,
inpaint), against the eager pipeline on the same seeds. Skipped without CUDA.

How to run them on a CUDA machine (for the device tool: carry the wheels that
``benchmarks/device/make_wheels.sh`` writes into ``.whl/``, install them with
``pip install --no-deps --target /tmp/site .whl/*.whl`` and put ``/tmp/site`` and the checkout on
``PYTHONPATH``)::

    python -m pytest tests/infer/test_gpu_parity.py -q -m gpu
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rapiddiff.infer.accelerate import AccelerateConfig, accelerate
from rapiddiff.infer.pipeline import RapidDiffusionPipeline
from tests.infer.test_parity import TASKS, _ours

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

# Each switch alone (from everything off), then the shipped defaults without / with compile.
GPU_SWITCHES = {
    "dtype=float16": {"dtype": "float16"},
    "channels_last": {"channels_last": True},
    "fuse_qkv": {"fuse_qkv": True},
    "cross_kv_cache": {"cross_kv_cache": True},
    "batch_time_proj": {"batch_time_proj": True},
    "attention=auto": {"attention": "auto"},
    "attention=efficient": {"attention": "efficient"},
    "loop=resident": {"loop": "resident"},
    "loop=graph": {"loop": "graph"},
    "defaults-no-compile": "defaults-no-compile",
    "defaults": "defaults",
    "compile_regions": {"compile_unet": "default", "compile_regions": True, "loop": "graph"},
}


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(1 / mse)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    from PIL import Image

    root = tmp_path_factory.mktemp("gpu-task-images")
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(root / "init.png")
    mask = np.zeros((16, 16), np.uint8)
    mask[:, 8:] = 255
    Image.fromarray(mask, "L").save(root / "mask.png")
    return {"init": root / "init.png", "mask": root / "mask.png"}


def _config(switch: str) -> AccelerateConfig:
    spec = GPU_SWITCHES[switch]
    if spec == "defaults":
        return AccelerateConfig()
    if spec == "defaults-no-compile":
        return AccelerateConfig(compile_unet=None, compile_vae=None)
    return AccelerateConfig.off(**spec)


@pytest.mark.parametrize("switch", list(GPU_SWITCHES))
@pytest.mark.parametrize("task", TASKS)
def test_gpu_switch_gives_the_eager_image(tiny_folders, images, task, switch):
    folder = tiny_folders["bert"]
    eager = RapidDiffusionPipeline.from_pretrained(folder, device="cuda")
    expected = _ours(eager, task, "pndm", [3, 11], images)
    fast = accelerate(RapidDiffusionPipeline.from_pretrained(folder, device="cuda"), _config(switch))
    # Must not fall back on a GPU.
    applies = ("loop", "dtype", "attention")
    assert not any(fast.report.status(k).state == "fallback" for k in applies), fast.report
    for _ in range(2):  # the second call replays the captured graph
        out = _ours(fast, task, "pndm", [3, 11], images)
        fp32 = fast.dtype == torch.float32
        if fp32:
            np.testing.assert_allclose(out.images, expected.images, atol=2e-3, rtol=0, err_msg=switch)
        else:  # half precision: close, not equal
            assert _psnr(out.images, expected.images) > 30, (switch, _psnr(out.images, expected.images))
        assert out.seeds == [3, 11]


def test_gpu_seed_rule_matches_cpu(tiny_folders, images):
    """The same seed gives the same image on the CPU and on the GPU (noise is drawn on the CPU)."""
    folder = tiny_folders["bert"]
    cpu = _ours(RapidDiffusionPipeline.from_pretrained(folder), "txt2img", "pndm", 5, images).images
    gpu = _ours(
        RapidDiffusionPipeline.from_pretrained(folder, device="cuda"), "txt2img", "pndm", 5, images
    ).images
    np.testing.assert_allclose(gpu, cpu, atol=2e-3, rtol=0)
