"""Shared test setup: offline hubs, deterministic small torch, temporary folders."""

from __future__ import annotations

import os
import tempfile

# No network here or in CI: any attempt to reach a model hub must fail fast, not hang.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# pykeen/pystow cache datasets under PYSTOW_HOME: keep that out of the checkout and out of ~.
os.environ.setdefault("PYSTOW_HOME", tempfile.mkdtemp(prefix="rapiddiff-pystow-"))

import pytest


@pytest.fixture(autouse=True)
def _seeded_torch():
    import torch

    torch.manual_seed(0)
    yield
