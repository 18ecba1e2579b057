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
