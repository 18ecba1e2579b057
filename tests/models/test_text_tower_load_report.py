"""Loading a BERT text tower that ships a pooler (Taiyi's) prints no transformers "UNEXPECTED" table
for the pooler rapiddiff never uses; a real mismatch is still reported."""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file
from transformers import BertConfig, BertModel

from rapiddiff.models.text_encoder import load_text_model

CONFIG = {
    "vocab_size": 64,
    "hidden_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 16,
}


def _tower(folder, extra: dict | None = None):
    torch.manual_seed(0)
    BertModel(BertConfig(**CONFIG), add_pooling_layer=True).save_pretrained(folder)
    if extra:
        file = folder / "model.safetensors"
        save_file({**load_file(file), **extra}, file, metadata={"format": "pt"})
    return folder


def test_the_unused_pooler_is_loaded_quietly_and_dropped(tmp_path, caplog):
    model = load_text_model(_tower(tmp_path / "taiyi-like"))
    assert model.pooler is None
    assert "UNEXPECTED" not in caplog.text


def test_a_real_unexpected_key_is_still_reported(tmp_path, caplog):
    load_text_model(_tower(tmp_path / "odd", {"encoder.layer.0.extra.weight": torch.zeros(2)}))
    err = caplog.text
    assert "UNEXPECTED" in err and "extra" in err and "pooler" not in err
