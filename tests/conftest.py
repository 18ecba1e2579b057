"""Shared test setup: offline hubs, deterministic small torch, temporary folders."""

from __future__ import annotations

import os

# No network here or in CI: any attempt to reach a model hub must fail fast, not hang.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PYSTOW_HOME", os.path.join(os.path.dirname(__file__), ".pystow-unused"))

import pytest


@pytest.fixture(autouse=True)
def _seeded_torch():
    import torch

    torch.manual_seed(0)
    yield
