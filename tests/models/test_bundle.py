"""Model folders: rapiddiff's (with knowledge and upscaler) round-trips, diffusers loads it, broken parts are named."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from rapiddiff.infer.pipeline import RapidDiffusionPipeline
from rapiddiff.kg.store import KnowledgeStore
from rapiddiff.models.bundle import load_model_folder, read_rapiddiff_info, save_model_folder
from rapiddiff.models.upscaler import build_rrdb

PROMPT = "蓝色背景上有一个番茄"
GEN = {"num_inference_steps": 3, "seed": 4, "output_type": "np", "progress": False}


@pytest.fixture(scope="module")
def taiyi(tiny_folders):
    """The shared Taiyi-style tiny folder (tests/conftest.py); tests here copy it before changing it."""
    return tiny_folders["bert"]


@pytest.fixture(scope="module")
def store() -> KnowledgeStore:
    g = torch.Generator().manual_seed(1)
    names = ["番茄", "红色", "圆形", "蓝色"]
    return KnowledgeStore.from_arrays(
        names,
        ["颜色", "形状"],
        torch.randn(4, 8, generator=g),
        torch.randn(2, 8, generator=g),
        [(0, 0, 1), (0, 1, 2)],
    )


@pytest.fixture(scope="module")
def saved(taiyi, store, tmp_path_factory):
    """A rapiddiff folder: the Taiyi-style model + a KnowledgeStore with non-zero fusion gates + an upscaler."""
    bundle = load_model_folder(taiyi)
    bundle.text_encoder.set_store(store)
    with torch.no_grad():
        bundle.text_encoder.fusion.gates.fill_(0.5)
    bundle.upscaler = build_rrdb(num_blocks=1, num_feat=8).eval()
    images = RapidDiffusionPipeline.from_bundle(bundle)(PROMPT, **GEN).images
    path = save_model_folder(bundle, tmp_path_factory.mktemp("saved") / "rapid")
    return path, images


def test_saved_folder_layout(saved):
    path, _ = saved
    for part in (
        "model_index.json",
        "unet",
        "vae",
        "scheduler",
        "text_encoder",
        "tokenizer",
        "knowledge/store",
    ):
        assert (path / part).exists(), part
    assert (path / "upscaler/upscaler.safetensors").is_file()
    info = read_rapiddiff_info(path)
    assert info["knowledge"] == "knowledge/" and info["upscaler"] == "upscaler/upscaler.safetensors"
    index = json.loads((path / "model_index.json").read_text())
    assert index["text_encoder"] == ["transformers", "BertModel"]
    assert "knowledge" not in index and "upscaler" not in index


def test_saved_folder_gives_the_same_image(saved):
    path, images = saved
    pipe = RapidDiffusionPipeline.from_pretrained(path)
    assert pipe.upscaler is not None and pipe.text_encoder.store is not None
    np.testing.assert_array_equal(pipe(PROMPT, **GEN).images, images)
    # Knowledge matters for this prompt (番茄 is linked): switching it off changes the image.
    off = pipe(PROMPT, **{**GEN, "knowledge": False}).images
    assert np.abs(off - images).max() > 1e-4


def test_diffusers_loads_the_saved_folder(saved):
    from diffusers import StableDiffusionPipeline

    path, _ = saved
    ref = StableDiffusionPipeline.from_pretrained(path, safety_checker=None)
    ref.set_progress_bar_config(disable=True)
    expected = ref(
        PROMPT, num_inference_steps=3, generator=[torch.Generator().manual_seed(4)], output_type="np"
    ).images
    ours = RapidDiffusionPipeline.from_pretrained(path, knowledge=False)(PROMPT, **GEN).images
    torch.testing.assert_close(ours, expected)  # diffusers = rapiddiff with knowledge aside


def test_resave_over_an_existing_folder(saved, tmp_path):
    path, images = saved
    target = shutil.copytree(path, tmp_path / "copy")
    (target / "NOTES.md").write_text("mine")
    save_model_folder(load_model_folder(path), target)
    np.testing.assert_array_equal(
        RapidDiffusionPipeline.from_pretrained(target)(PROMPT, **GEN).images, images
    )
    assert not list(tmp_path.glob(".copy*"))  # no temporary folders left behind
    assert (target / "NOTES.md").read_text() == "mine"  # files that are not model parts stay
    # A bundle without knowledge or upscaler leaves none of the old ones behind.
    plain = load_model_folder(path, load_upscaler=False)
    plain.text_encoder.store = plain.text_encoder.fusion = None
    save_model_folder(plain, target)
    assert not (target / "knowledge").exists() and not (target / "upscaler").exists()
    assert read_rapiddiff_info(target).keys() == {"rapiddiff_version"}


def _broken_copy(src, dst, mutate):
    shutil.copytree(src, dst)
    mutate(dst)
    return dst


def test_missing_or_broken_parts_are_named(taiyi, tmp_path):
    cases = [
        (
            lambda d: (d / "unet/diffusion_pytorch_model.safetensors").unlink(),
            FileNotFoundError,
            "unet/diffusion_pytorch_model.safetensors is missing",
        ),
        (
            lambda d: (d / "vae/diffusion_pytorch_model.safetensors").write_bytes(b"not weights"),
            ValueError,
            "vae/diffusion_pytorch_model.safetensors could not be loaded",
        ),
        (
            lambda d: (d / "text_encoder/config.json").unlink(),
            FileNotFoundError,
            "text_encoder/config.json is missing",
        ),
        (
            lambda d: shutil.rmtree(d / "scheduler"),
            FileNotFoundError,
            "scheduler/scheduler_config.json is missing",
        ),
        (lambda d: shutil.rmtree(d / "tokenizer"), FileNotFoundError, "tokenizer is missing"),
    ]
    for i, (mutate, error, message) in enumerate(cases):
        broken = _broken_copy(taiyi, tmp_path / f"b{i}", mutate)
        with pytest.raises(error, match=message) as info:
            load_model_folder(broken)
        assert str(broken) in str(info.value)
    with pytest.raises(FileNotFoundError, match="model folder not found"):
        load_model_folder(tmp_path / "nowhere")


def test_unet_config_not_matching_its_weights_is_named(taiyi, tmp_path):
    def widen(d):
        cfg = json.loads((d / "unet/config.json").read_text())
        cfg["cross_attention_dim"] = 48
        (d / "unet/config.json").write_text(json.dumps(cfg))

    broken = _broken_copy(taiyi, tmp_path / "w", widen)
    with pytest.raises(ValueError, match=r"unet/diffusion_pytorch_model\.safetensors could not be loaded"):
        load_model_folder(broken)


def test_text_width_must_match_unet(taiyi):
    from diffusers import UNet2DConditionModel

    from rapiddiff.models.presets import unet_config

    bundle = load_model_folder(taiyi)
    bundle.unet = UNet2DConditionModel(**{**unet_config("tiny"), "cross_attention_dim": 48})
    with pytest.raises(ValueError, match="outputs 32-wide states but the U-Net's cross_attention_dim is 48"):
        bundle.check()


def test_hub_layouts_fp16_variant_and_bin_text_encoder(taiyi, tmp_path):
    """Folders as many SD 1.x checkpoints ship: fp16-variant U-Net weights, a pytorch_model.bin text encoder."""
    from safetensors.torch import load_file

    def hub_layout(d):
        (d / "unet/diffusion_pytorch_model.safetensors").rename(
            d / "unet/diffusion_pytorch_model.fp16.safetensors"
        )
        torch.save(load_file(d / "text_encoder/model.safetensors"), d / "text_encoder/pytorch_model.bin")
        (d / "text_encoder/model.safetensors").unlink()

    hub = _broken_copy(taiyi, tmp_path / "hub", hub_layout)
    expected = RapidDiffusionPipeline.from_pretrained(taiyi)(PROMPT, **GEN).images
    np.testing.assert_array_equal(RapidDiffusionPipeline.from_pretrained(hub)(PROMPT, **GEN).images, expected)


def test_sampling_defaults_round_trip(saved, tmp_path):
    path, _ = saved
    bundle = load_model_folder(path)
    assert bundle.sampling is None
    bundle.sampling = {"num_inference_steps": 25, "guidance_scale": 7.5, "scheduler": "pndm"}
    save_model_folder(bundle, tmp_path / "m")
    assert read_rapiddiff_info(tmp_path / "m")["sampling"] == bundle.sampling.to_dict()
    assert load_model_folder(tmp_path / "m").sampling == bundle.sampling
    # ...and survive into the pipeline (from_bundle), which uses them when a call does not say.
    pipe = RapidDiffusionPipeline.from_pretrained(tmp_path / "m")
    assert pipe.sampling == bundle.sampling
    assert pipe("x", seed=0, output_type="latent", progress=False).metadata[0]["steps"] == 25
