"""Shared fixtures of the eval tests: one tiny diffusers model folder and its pipeline."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from rapiddiff.models.presets import write_tiny_sd_folder

    return write_tiny_sd_folder(tmp_path_factory.mktemp("tiny-model") / "model", text="bert")


@pytest.fixture(scope="session")
def tiny_pipe(tiny_model):
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
