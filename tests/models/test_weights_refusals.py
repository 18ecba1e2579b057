"""A weights file that is a code-running pickle is refused with its name and the reason, wherever it
is given: a `--lora` file, a Chinese-CLIP folder (`train clip --model.init_from`), a text tower."""

from __future__ import annotations

import pytest
import torch

from rapiddiff.utils.io import UnsafeCheckpointError


class Payload:
    def __reduce__(self):
        return (print, ("code ran",))


def _evil(path):
    torch.save({"unet.x.lora.down.weight": torch.zeros(1), "x": Payload()}, path)
    return path


def test_a_pickle_as_lora_is_refused_with_the_reason(tmp_path, capsys):
    from rapiddiff.models.lora import read_lora

    evil = _evil(tmp_path / "lora.bin")
    with pytest.raises(
        UnsafeCheckpointError, match=rf"--lora: {evil}: refused: it is a pickle that would run"
    ):
        read_lora(evil)
    assert "code ran" not in capsys.readouterr().out


def test_a_pickle_in_a_chinese_clip_folder_is_refused_with_the_reason(tmp_path, capsys):
    from transformers import ChineseCLIPConfig

    from rapiddiff.models.clip import KnowledgeCLIP

    folder = tmp_path / "cn-clip"
    small = {"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 8}
    ChineseCLIPConfig(text_config={**small, "vocab_size": 32}, vision_config={**small, "image_size": 8, "patch_size": 4},
                      projection_dim=8).save_pretrained(folder)  # fmt: skip
    evil = _evil(folder / "pytorch_model.bin")
    with pytest.raises(UnsafeCheckpointError, match=rf"Chinese-CLIP folder: {evil}: refused: .*safetensors"):
        KnowledgeCLIP.from_pretrained(folder)
    assert "code ran" not in capsys.readouterr().out


def test_checking_a_protocol_4_pickle_gives_no_torch_warning(tmp_path):
    """torch's restricted unpickler warns "Detected pickle protocol 4" before it refuses such a file;
    the refusal is ours to say (named, with the reason), without torch's noise before it."""
    import warnings

    from rapiddiff.models.weights import check_weights_file

    file = tmp_path / "weights.pth"
    torch.save({"w": torch.ones(2)}, file, pickle_protocol=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        with pytest.raises(UnsafeCheckpointError, match=rf"{file}: refused"):
            check_weights_file(file)
