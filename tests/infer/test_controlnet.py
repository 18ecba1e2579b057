"""ControlNet in the one generation path, against diffusers' ``StableDiffusionControlNetPipeline``
(one net and ``MultiControlNetModel``) on the same tiny weights and seed; scale 0 and the control
window; loading (safetensors only); the CLI, the PNG round trip and serving are in their own files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from rapiddiff.infer.pipeline import RapidDiffusionPipeline
from rapiddiff.models.controlnet import ControlSpec, load_controlnet
from rapiddiff.utils.io import UnsafeCheckpointError

PROMPT = "蓝色背景上有一个番茄"
NEGATIVE = "模糊"
STEPS = 4


def write_tiny_controlnet(folder: Path, unet_folder: Path, seed: int) -> Path:
    """A ControlNet made from the tiny U-Net (``ControlNetModel.from_unet``), its zero-initialised
    convolutions given random weights so that it changes the image, saved as diffusers does."""
    from diffusers import ControlNetModel, UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(unet_folder)
    # The tiny VAE is 2×: one downsampling step in the conditioning embedding (SD's 8× VAE has three).
    net = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(16, 32))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in net.named_parameters():
            if "controlnet_" in name or "conv_out" in name:  # the zero convolutions
                param.copy_(torch.randn(param.shape, generator=g) * 0.3)
    net.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def nets(tiny_folders, tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("controlnets")
    unet = tiny_folders["clip"] / "unet"
    return [write_tiny_controlnet(root / f"net{k}", unet, seed=k) for k in range(2)]


@pytest.fixture(scope="module")
def control_images(tmp_path_factory) -> list[Path]:
    """Two control images of another size than the generation's (so the resize is exercised)."""
    root = tmp_path_factory.mktemp("control-images")
    rng = np.random.default_rng(1)
    paths = []
    for k in range(2):
        path = root / f"control{k}.png"
        Image.fromarray(rng.integers(0, 256, (24, 20, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def _diffusers(folder: Path, nets: list[Path], images: list[Path], seed: int, **kw) -> np.ndarray:
    from diffusers import ControlNetModel, StableDiffusionControlNetPipeline

    loaded = [ControlNetModel.from_pretrained(n) for n in nets]
    ref = StableDiffusionControlNetPipeline.from_pretrained(
        folder,
        controlnet=loaded[0] if len(loaded) == 1 else loaded,
        safety_checker=None,
        requires_safety_checker=False,
    )
    ref.set_progress_bar_config(disable=True)
    pics = [Image.open(p).convert("RGB") for p in images]
    return ref(
        PROMPT,
        pics[0] if len(pics) == 1 else pics,
        negative_prompt=NEGATIVE,
        num_inference_steps=STEPS,
        guidance_scale=7.5,
        height=16,
        width=16,
        generator=[torch.Generator("cpu").manual_seed(seed)],
        output_type="np",
        **kw,
    ).images


def _ours(pipe: RapidDiffusionPipeline, seed: int, control, **kw):
    return pipe(
        PROMPT,
        NEGATIVE,
        num_inference_steps=STEPS,
        guidance_scale=7.5,
        height=16,
        width=16,
        seed=seed,
        knowledge=False,
        output_type="np",
        progress=False,
        control=control,
        **kw,
    )


@pytest.fixture(scope="module")
def one_net(tiny_folders, nets) -> RapidDiffusionPipeline:
    pipe = RapidDiffusionPipeline.from_pretrained(tiny_folders["clip"])
    pipe.load_controlnet(nets[0])
    return pipe


def test_same_image_as_diffusers(tiny_folders, nets, control_images, one_net):
    spec = ControlSpec(
        control_images[0],
        controlnet_conditioning_scale=0.8,
        control_guidance_start=0.0,
        control_guidance_end=1.0,
    )
    out = _ours(one_net, 5, spec)
    expected = _diffusers(
        tiny_folders["clip"], nets[:1], control_images[:1], 5, controlnet_conditioning_scale=0.8
    )
    torch.testing.assert_close(out.images, expected, atol=1e-5, rtol=1e-5)
    plain = _ours(one_net, 5, None)
    assert np.abs(plain.images - out.images).max() > 1e-3  # the net does change the image
    meta = out.metadata[0]["control"]
    assert meta == [
        {
            "image": str(control_images[0].resolve()),
            "image_sha256": meta[0]["image_sha256"],
            "controlnet": str(nets[0].resolve()),
            "scale": 0.8,
            "start": 0.0,
            "end": 1.0,
        }
    ]
    assert len(meta[0]["image_sha256"]) == 64


def test_window_as_diffusers(tiny_folders, nets, control_images, one_net):
    """control_guidance_start/end: the net acts only inside its window, as diffusers' controlnet_keep."""
    spec = ControlSpec(control_images[0], control_guidance_start=0.25, control_guidance_end=0.75)
    out = _ours(one_net, 2, spec)
    expected = _diffusers(
        tiny_folders["clip"],
        nets[:1],
        control_images[:1],
        2,
        control_guidance_start=0.25,
        control_guidance_end=0.75,
    )
    torch.testing.assert_close(out.images, expected, atol=1e-5, rtol=1e-5)
    full = _ours(one_net, 2, ControlSpec(control_images[0]))
    assert np.abs(full.images - out.images).max() > 1e-4


def test_scale_zero_is_no_control(one_net, control_images):
    plain = _ours(one_net, 3, None)
    zero = _ours(one_net, 3, ControlSpec(control_images[0], controlnet_conditioning_scale=0.0))
    np.testing.assert_array_equal(zero.images, plain.images)
    assert "control" not in plain.metadata[0]


def test_multi_controlnet_as_diffusers(tiny_folders, nets, control_images):
    pipe = RapidDiffusionPipeline.from_pretrained(tiny_folders["clip"])
    pipe.load_controlnet(*nets)
    specs = [
        ControlSpec(control_images[0], controlnet_conditioning_scale=0.7, control_guidance_end=0.5),
        ControlSpec(control_images[1], controlnet_conditioning_scale=1.2, control_guidance_start=0.25),
    ]
    out = _ours(pipe, 4, specs)
    expected = _diffusers(
        tiny_folders["clip"],
        nets,
        control_images,
        4,
        controlnet_conditioning_scale=[0.7, 1.2],
        control_guidance_start=[0.0, 0.25],
        control_guidance_end=[0.5, 1.0],
    )
    torch.testing.assert_close(out.images, expected, atol=1e-5, rtol=1e-5)
    assert [c["controlnet"] for c in out.metadata[0]["control"]] == [str(n.resolve()) for n in nets]
    with pytest.raises(ValueError, match="2 loaded ControlNet"):
        _ours(pipe, 4, specs[:1])


def test_batch_and_guidance_off(one_net, control_images):
    """Every image of a batch gets the control image; each equals its own single-image call (seed rule)."""
    spec = ControlSpec(control_images[0])
    both = one_net(
        PROMPT, seed=[1, 2], num_images_per_prompt=2, num_inference_steps=STEPS, height=16, width=16,
        output_type="np", progress=False, control=spec, knowledge=False,
    )  # fmt: skip
    alone = one_net(
        PROMPT, seed=2, num_inference_steps=STEPS, height=16, width=16,
        output_type="np", progress=False, control=spec, knowledge=False,
    )  # fmt: skip
    np.testing.assert_allclose(both.images[1], alone.images[0], atol=1e-5)
    off = one_net(
        PROMPT, seed=1, num_inference_steps=STEPS, guidance_scale=1.0, height=16, width=16,
        output_type="np", progress=False, control=spec, knowledge=False,
    )  # fmt: skip
    assert off.images.shape == (1, 16, 16, 3)


def test_img2img_and_inpaint_with_control(one_net, control_images, tmp_path):
    from tests.infer.helpers import task_inputs

    tasks = task_inputs(tmp_path)
    for task in ("img2img", "inpaint"):
        plain = _ours(one_net, 1, None, **tasks[task])
        out = _ours(one_net, 1, ControlSpec(control_images[0]), **tasks[task])
        assert out.images.shape == (1, 16, 16, 3) and np.isfinite(out.images).all()
        assert np.abs(out.images - plain.images).max() > 1e-4
        assert out.metadata[0]["task"] == task and "control" in out.metadata[0]


def test_img2img_as_diffusers(tiny_folders, nets, control_images, one_net, tmp_path):
    from diffusers import ControlNetModel, StableDiffusionControlNetImg2ImgPipeline

    from tests.infer.helpers import task_inputs

    kw = task_inputs(tmp_path)["img2img"]
    out = _ours(one_net, 6, ControlSpec(control_images[0]), **kw)
    ref = StableDiffusionControlNetImg2ImgPipeline.from_pretrained(
        tiny_folders["clip"],
        controlnet=ControlNetModel.from_pretrained(nets[0]),
        safety_checker=None,
        requires_safety_checker=False,
    )
    ref.set_progress_bar_config(disable=True)
    expected = ref(
        PROMPT,
        Image.open(kw["init_image"]).convert("RGB"),
        Image.open(control_images[0]).convert("RGB"),
        negative_prompt=NEGATIVE,
        strength=kw["strength"],
        controlnet_conditioning_scale=1.0,  # this pipeline's default is 0.8
        num_inference_steps=STEPS,
        guidance_scale=7.5,
        height=16,
        width=16,
        generator=[torch.Generator("cpu").manual_seed(6)],
        output_type="np",
    ).images
    torch.testing.assert_close(out.images, expected, atol=1e-5, rtol=1e-5)


def test_errors_teach_the_fix(tiny_folders, one_net, control_images, tmp_path):
    pipe = RapidDiffusionPipeline.from_pretrained(tiny_folders["clip"])
    with pytest.raises(ValueError, match="--controlnet"):
        _ours(pipe, 1, ControlSpec(control_images[0]))
    with pytest.raises(ValueError, match="control_guidance_start < control_guidance_end"):
        ControlSpec(control_images[0], control_guidance_start=0.6, control_guidance_end=0.5)
    with pytest.raises(ValueError, match="finite"):
        ControlSpec(control_images[0], controlnet_conditioning_scale=float("nan"))
    with pytest.raises(FileNotFoundError, match="control image 1"):
        _ours(one_net, 1, ControlSpec(tmp_path / "missing.png"))
    with pytest.raises(ValueError, match="DeepCache"):
        _ours(one_net, 1, ControlSpec(control_images[0]), deep_cache=2)


def test_loading_refuses_pickles_and_reads_single_files(nets, tmp_path):
    import shutil

    from safetensors.torch import save_file

    # A folder with only a pickled .bin is refused, naming the fix.
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(nets[0] / "config.json", pickled / "config.json")
    torch.save({"w": torch.zeros(1)}, pickled / "diffusion_pytorch_model.bin")
    with pytest.raises(UnsafeCheckpointError, match="safetensors"):
        load_controlnet(pickled)
    with pytest.raises(UnsafeCheckpointError, match="safetensors"):
        load_controlnet(pickled / "diffusion_pytorch_model.bin")
    # One .safetensors file (diffusers' key names) with its config.json beside it.
    single = tmp_path / "single"
    single.mkdir()
    shutil.copy(nets[0] / "config.json", single / "config.json")
    reference = load_controlnet(nets[0])
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, single / "canny.safetensors")
    net = load_controlnet(single / "canny.safetensors")
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(net.state_dict()[key], value)


def test_model_folder_controlnet_is_used(tiny_folders, nets, control_images, tmp_path):
    """A model folder with a controlnet/ (as diffusers' ControlNet pipelines save) needs no load call."""
    import shutil

    folder = tmp_path / "with-cn"
    shutil.copytree(tiny_folders["clip"], folder)
    shutil.copytree(nets[0], folder / "controlnet")
    pipe = RapidDiffusionPipeline.from_pretrained(folder)
    out = _ours(pipe, 5, ControlSpec(control_images[0], controlnet_conditioning_scale=0.8))
    expected = _diffusers(
        tiny_folders["clip"], nets[:1], control_images[:1], 5, controlnet_conditioning_scale=0.8
    )
    torch.testing.assert_close(out.images, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scheduler", ["pndm"])
def test_fast_path_runs_the_controlnet_in_its_loop(tiny_folders, nets, control_images, scheduler):
    """The GPU-resident loop (the one a CUDA graph captures; on a CPU it runs eagerly) with two
    ControlNets, their windows and scales read from its buffers: the eager images, call after call."""
    from rapiddiff.infer.accelerate import AccelerateConfig, accelerate

    eager = RapidDiffusionPipeline.from_pretrained(tiny_folders["clip"])
    eager.load_controlnet(*nets)
    fast = RapidDiffusionPipeline.from_pretrained(tiny_folders["clip"])
    fast.load_controlnet(*nets)
    switches = {"fuse_qkv": True, "cross_kv_cache": True, "channels_last": True, "batch_time_proj": True}
    accelerate(fast, AccelerateConfig.off(loop="resident", **switches))  # every switch a CPU runs
    calls = [
        [ControlSpec(control_images[0], control_guidance_end=0.5), ControlSpec(control_images[1])],
        [  # the same loop, other scales and windows: read from its buffers, nothing rebuilt
            ControlSpec(control_images[1], controlnet_conditioning_scale=0.3),
            ControlSpec(control_images[0], controlnet_conditioning_scale=1.4, control_guidance_start=0.25),
        ],
    ]
    for specs in calls:
        expected = _ours(eager, 8, specs, scheduler=scheduler).images
        out = _ours(fast, 8, specs, scheduler=scheduler)
        torch.testing.assert_close(out.images, expected, atol=1e-5, rtol=1e-5)
    assert fast.report.status("controlnet").state == "on", fast.report
    assert len(fast.denoiser.loops.loops) == 1
    # Without control the same pipeline keeps its loop too (another shape: a loop of its own).
    torch.testing.assert_close(
        _ours(fast, 8, None, scheduler=scheduler).images, _ours(eager, 8, None, scheduler=scheduler).images,
        atol=1e-5, rtol=1e-5,
    )  # fmt: skip
