"""The model folder's own load of unet/, vae/ and a BERT text_encoder/ gives what diffusers' and
transformers' ``from_pretrained`` give: the same config, tensors (values and dtype), mode, outputs
and images, for the built-in model and a tiny diffusers-format folder; and the library imports it
defers leave nothing missing for a later import."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rapiddiff.models.builtin import builtin_model_dir
from rapiddiff.models.bundle import (
    _load_diffusers_part,
    _load_own_weights,
    diffusers_class,
    load_model_folder,
)

PARTS = [("unet", "UNet2DConditionModel"), ("vae", "AutoencoderKL")]


def _generic(folder: Path, part: str, class_name: str, dtype: torch.dtype) -> torch.nn.Module:
    """diffusers' general loader, as the model folder used it before its own load."""
    return diffusers_class(class_name).from_pretrained(str(folder / part), torch_dtype=dtype)


def _assert_same_module(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    assert type(ours) is type(theirs)
    assert dict(ours.config) == dict(theirs.config)
    assert ours.training == theirs.training is False
    _assert_tensors_equal(ours.state_dict(), theirs.state_dict())
    _assert_tensors_equal(dict(ours.named_buffers()), dict(theirs.named_buffers()))


def _assert_tensors_equal(mine: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> None:
    assert list(mine) == list(other)
    for key, value in mine.items():
        assert value.dtype == other[key].dtype, key
        assert value.device == other[key].device, key
        assert value.shape == other[key].shape, key
        assert torch.equal(value, other[key]), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("part", "class_name"), PARTS)
def test_builtin_parts_equal_diffusers_from_pretrained(part, class_name, dtype):
    folder = builtin_model_dir("kshapes")
    # The built-in model ships inside the package: missing, it is a packaging bug, not a skip.
    assert (folder / "model_index.json").is_file(), f"the built-in model is missing from {folder}"
    ours = _load_own_weights(
        diffusers_class(class_name),
        folder / part,
        folder / part / "diffusion_pytorch_model.safetensors",
        dtype,
    )
    assert ours is not None, "the built-in model must take the direct load"
    _assert_same_module(ours, _generic(folder, part, class_name, dtype))


@pytest.mark.parametrize(("part", "class_name"), PARTS)
def test_tiny_diffusers_folder_parts_equal_from_pretrained(tiny_model, part, class_name):
    ours = _load_diffusers_part(tiny_model, part, class_name, torch.float32)
    assert not any(p.is_meta for p in ours.parameters())
    _assert_same_module(ours, _generic(tiny_model, part, class_name, torch.float32))


def test_tiny_folder_image_equals_one_from_diffusers_parts(tiny_model):
    from rapiddiff.infer.pipeline import RapidDiffusionPipeline

    bundle = load_model_folder(tiny_model)
    ours = RapidDiffusionPipeline.from_bundle(bundle)
    bundle.unet = _generic(tiny_model, "unet", "UNet2DConditionModel", torch.float32)
    bundle.vae = _generic(tiny_model, "vae", "AutoencoderKL", torch.float32)
    theirs = RapidDiffusionPipeline.from_bundle(bundle)
    kwargs = {"seed": 3, "num_inference_steps": 3, "output_type": "np", "progress": False}
    assert (ours("一个红色的苹果", **kwargs).images == theirs("一个红色的苹果", **kwargs).images).all()


@pytest.mark.parametrize("where", ["builtin", "tiny"])
def test_text_tower_equals_transformers_from_pretrained(where, tiny_model):
    from rapiddiff.models.text_encoder import _TEXT_MODEL_MODULES, load_text_model
    from rapiddiff.utils.imports import import_module

    folder = builtin_model_dir("kshapes") if where == "builtin" else tiny_model
    assert (folder / "text_encoder" / "model.safetensors").is_file(), f"no text tower weights in {folder}"
    cls = import_module(_TEXT_MODEL_MODULES["BertModel"]).BertModel
    theirs = cls.from_pretrained(str(folder / "text_encoder"), add_pooling_layer=False)
    ours = load_text_model(folder / "text_encoder")
    if where == "builtin":  # the shipped fp16 tower must take the direct load
        from rapiddiff.models.text_encoder import _load_own_weights

        assert _load_own_weights(cls, folder / "text_encoder", {"add_pooling_layer": False}) is not None
    assert type(ours) is type(theirs)
    assert ours.config.to_dict() == theirs.config.to_dict()
    assert ours.config._attn_implementation == theirs.config._attn_implementation
    assert ours.training == theirs.training is False
    _assert_tensors_equal(ours.state_dict(), theirs.state_dict())
    _assert_tensors_equal(dict(ours.named_buffers()), dict(theirs.named_buffers()))
    ids = torch.randint(0, ours.config.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1:, 9:] = 0
    with torch.inference_mode():
        a = ours.float()(input_ids=ids, attention_mask=mask).last_hidden_state
        b = theirs.float()(input_ids=ids, attention_mask=mask).last_hidden_state
    assert torch.equal(a, b)


def _copy_part(src: Path, dst: Path, state: dict[str, torch.Tensor]) -> Path:
    dst.mkdir(parents=True)
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(state, dst / "diffusion_pytorch_model.safetensors")
    return dst / "diffusion_pytorch_model.safetensors"


def test_files_it_does_not_cover_go_to_diffusers(tiny_model, tmp_path):
    cls = diffusers_class("AutoencoderKL")
    state = load_file(tiny_model / "vae" / "diffusion_pytorch_model.safetensors")
    extra = _copy_part(
        tiny_model / "vae", tmp_path / "extra" / "vae", {**state, "stray.weight": torch.ones(1)}
    )
    assert _load_own_weights(cls, extra.parent, extra, torch.float32) is None
    key = next(iter(state))
    missing = _copy_part(
        tiny_model / "vae", tmp_path / "missing" / "vae", {k: v for k, v in state.items() if k != key}
    )
    assert _load_own_weights(cls, missing.parent, missing, torch.float32) is None
    wrong = {**state, key: torch.zeros(*state[key].shape, 2)}
    reshaped = _copy_part(tiny_model / "vae", tmp_path / "shape" / "vae", wrong)
    assert _load_own_weights(cls, reshaped.parent, reshaped, torch.float32) is None
    # ... and a class it was not checked against never takes it
    unet2d = diffusers_class("UNet2DModel")
    assert _load_own_weights(unet2d, extra.parent, extra, torch.float32) is None


def test_diffusers_fallback_still_reports_a_broken_file(tiny_model, tmp_path):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    weights = folder / "unet" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"unet/diffusion_pytorch_model\.safetensors"):
        load_model_folder(folder)


def test_deferred_packages_complete_on_use():
    """In a fresh interpreter: loading the classes leaves the model zoos unimported, and every
    later way of reaching them still works (their __init__ runs in place on first use)."""
    code = textwrap.dedent(
        """
        import json, sys
        from rapiddiff.models.bundle import diffusers_class
        from rapiddiff.models.text_encoder import _TEXT_MODEL_MODULES
        from rapiddiff.utils.imports import import_module
        unet = diffusers_class("UNet2DConditionModel")
        vae = diffusers_class("AutoencoderKL")
        bert = getattr(import_module(_TEXT_MODEL_MODULES["BertModel"], defer=["transformers.models"]), "BertModel")
        skipped = [m for m in ("diffusers.models.unets.unet_1d", "diffusers.models.transformers.transformer_flux",
                               "diffusers.models.autoencoders.autoencoder_dc") if m in sys.modules]
        import diffusers, transformers
        from diffusers.models.unets import UNet1DModel
        from diffusers.models.transformers import Transformer2DModel
        from transformers.models import clip
        checks = {
            "skipped": skipped,
            "unet": diffusers.UNet2DConditionModel is unet and diffusers.models.UNet2DConditionModel is unet,
            "unets": sys.modules["diffusers.models.unets"].UNet2DConditionModel is unet,
            "vae": diffusers.AutoencoderKL is vae,
            "zoo": UNet1DModel.__name__ == "UNet1DModel" and diffusers.UNet2DModel.__name__ == "UNet2DModel"
                   and Transformer2DModel is diffusers.Transformer2DModel,
            "bert": transformers.BertModel is bert and transformers.models.bert.BertModel is bert,
            "clip": clip.CLIPTextModel is transformers.CLIPTextModel,
            "auto": transformers.models.auto.AutoConfig is transformers.AutoConfig,
        }
        print(json.dumps(checks))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    checks = json.loads(done.stdout.strip().splitlines()[-1])
    assert checks.pop("skipped") == []
    assert all(checks.values()), checks


def test_cast_is_torchs_widening_bit_for_bit():
    """bundle.cast widens float16 through numpy: the same bits as torch's ``.to`` for every finite
    float16 (normal, subnormal, ±0) and ±inf; NaN stays NaN. Other casts are torch's own."""
    from rapiddiff.models.bundle import cast

    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    ours, torchs = cast(every, torch.float32), every.to(torch.float32)
    assert ours.dtype == torch.float32 and ours.shape == every.shape and ours.is_contiguous()
    finite = ~torch.isnan(torchs)
    assert torch.equal(ours[finite].view(torch.int32), torchs[finite].view(torch.int32))
    assert torch.isnan(ours[~finite]).all() and int((~finite).sum()) == 2 * 1023  # every NaN code
    weight = torch.randn(4, 3, 2, 2).half()[:, 1:]  # a non-contiguous view
    assert torch.equal(cast(weight, torch.float32), weight.float())
    assert cast(weight, torch.float16) is weight
    assert torch.equal(cast(weight.float(), torch.bfloat16), weight.float().bfloat16())
