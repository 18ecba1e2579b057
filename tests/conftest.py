"""Shared test setup: offline hubs, deterministic small torch, and the tiny model folders every
stage's tests use (made once per session, saved in the real formats)."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile

# No network here or in CI: any attempt to reach a model hub must fail fast, not hang.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# pykeen/pystow cache datasets under PYSTOW_HOME: keep that out of the checkout and out of ~, and
# remove it when the session ends (a folder per pytest run used to pile up in /tmp).
if "PYSTOW_HOME" not in os.environ:
    os.environ["PYSTOW_HOME"] = tempfile.mkdtemp(prefix="rapiddiff-pystow-")
    atexit.register(shutil.rmtree, os.environ["PYSTOW_HOME"], ignore_errors=True)

import pytest


def pytest_collection_modifyitems(config, items):
    """`gpu`-marked tests skip, with the reason, where torch sees no CUDA device (CI, this machine):
    one rule here instead of a skipif beside every marker."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run through the device tool)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seeded_torch():
    import torch

    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def tiny_folders(tmp_path_factory):
    """Tiny SD 1.x-layout folders: "clip" (a CLIP text tower, as SD 1.x) and "bert" (Taiyi-style)."""
    from rapiddiff.models.presets import write_tiny_sd_folder

    root = tmp_path_factory.mktemp("tiny-models")
    return {text: write_tiny_sd_folder(root / text, text=text) for text in ("clip", "bert")}


@pytest.fixture(scope="session")
def tiny_model(tiny_folders):
    """The Taiyi-style (BERT text tower) tiny model folder."""
    return tiny_folders["bert"]


@pytest.fixture(scope="session")
def tiny_pipe(tiny_model):
    """An eager pipeline on the tiny model, shared: tests must not transform it (accelerate a fresh one)."""
    from rapiddiff.infer.pipeline import RapidDiffusionPipeline

    return RapidDiffusionPipeline.from_pretrained(tiny_model)


@pytest.fixture(scope="session")
def knowledge_model(tiny_model, tmp_path_factory):
    """The tiny model with a KnowledgeStore of kshapes entities and non-zero fusion gates, saved
    as a rapiddiff model folder: knowledge on and off give different images."""
    import torch

    from rapiddiff.data.kshapes import ENTITIES
    from rapiddiff.kg.store import KnowledgeStore
    from rapiddiff.models.bundle import load_model_folder, save_model_folder

    names = [e.name for e in ENTITIES[:4]] + ["红色", "圆形"]
    g = torch.Generator().manual_seed(1)
    store = KnowledgeStore.from_arrays(
        names,
        ["颜色", "形状"],
        torch.randn(len(names), 8, generator=g),
        torch.randn(2, 8, generator=g),
        [(0, 0, 4), (0, 1, 5)],
    )
    bundle = load_model_folder(tiny_model)
    bundle.text_encoder.set_store(store)
    with torch.no_grad():
        bundle.text_encoder.fusion.gates.fill_(0.5)
    return save_model_folder(bundle, tmp_path_factory.mktemp("knowledge-model") / "model")


@pytest.fixture(scope="session")
def diffusers_lora(tiny_folders, tmp_path_factory):
    """A diffusers-format LoRA (U-Net + CLIP text tower adapters, non-zero) for the clip tiny model."""
    import peft
    import torch
    from diffusers import StableDiffusionPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    pipe = StableDiffusionPipeline.from_pretrained(tiny_folders["clip"], safety_checker=None)
    torch.manual_seed(3)
    pipe.unet.add_adapter(
        peft.LoraConfig(
            r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"], init_lora_weights=False
        )
    )
    pipe.text_encoder.add_adapter(
        peft.LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    out = tmp_path_factory.mktemp("lora") / "lora"
    StableDiffusionPipeline.save_lora_weights(
        out,
        unet_lora_layers=convert_state_dict_to_diffusers(get_peft_model_state_dict(pipe.unet)),
        text_encoder_lora_layers=convert_state_dict_to_diffusers(
            get_peft_model_state_dict(pipe.text_encoder)
        ),
        safe_serialization=True,
    )
    return out


@pytest.fixture
def logs(caplog):
    """caplog, also fed by the rapiddiff logger, which setup_logging keeps from propagating to the root."""
    logger = logging.getLogger("rapiddiff")
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)
