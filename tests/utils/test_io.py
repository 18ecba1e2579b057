from __future__ import annotations

import os
import pickle

import pytest
import torch

from rapiddiff.utils.io import UnsafeCheckpointError, atomic_open, load_weights, save_safetensors


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_safetensors_round_trip(tmp_path):
    tensors = {"a": torch.randn(3, 4), "b": torch.arange(5)}
    save_safetensors(tensors, tmp_path / "w.safetensors")
    loaded = load_weights(tmp_path / "w.safetensors")
    assert loaded.keys() == tensors.keys()
    for key in tensors:
        torch.testing.assert_close(loaded[key], tensors[key])


def test_streamed_safetensors_read_back_with_safetensors_own_reader(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    tensors = {
        "f32": torch.randn(3, 4),
        "bf16": torch.randn(2, 5).to(torch.bfloat16),
        "f16_view": torch.randn(4, 6).half()[:, ::2],  # not contiguous
        "i64": torch.arange(7),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
    }
    save_safetensors(tensors, tmp_path / "w.safetensors", metadata={"format": "test"})
    loaded = load_file(str(tmp_path / "w.safetensors"))
    assert loaded.keys() == tensors.keys()
    for key, tensor in tensors.items():
        assert loaded[key].dtype == tensor.dtype and torch.equal(loaded[key], tensor), key
    with safe_open(str(tmp_path / "w.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "test"}


def test_safetensors_refuses_what_the_format_cannot_hold(tmp_path):
    with pytest.raises(ValueError, match="complex64"):
        save_safetensors({"z": torch.zeros(2, dtype=torch.complex64)}, tmp_path / "z.safetensors")
    with pytest.raises(ValueError, match="strings"):
        save_safetensors({"a": torch.ones(1)}, tmp_path / "m.safetensors", metadata={"n": 3})
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_plain_torch_state_dict_loads(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "w.pth")
    torch.testing.assert_close(load_weights(tmp_path / "w.pth")["w"], torch.ones(2))


def test_pickle_with_code_is_refused(tmp_path):
    path = tmp_path / "evil.pth"
    with open(path, "wb") as handle:
        pickle.dump({"w": _Evil()}, handle)
    with pytest.raises(UnsafeCheckpointError, match="arbitrary Python objects"):
        load_weights(path)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_weights(tmp_path / "absent.safetensors")


def test_atomic_open_keeps_old_file_on_failure(tmp_path):
    path = tmp_path / "f.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError), atomic_open(path, "w", encoding="utf-8") as handle:
        handle.write("half")
        raise RuntimeError("crash mid-write")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]  # no temporary left behind


def test_atomic_writes_get_the_umask_mode_not_0600(tmp_path):
    from rapiddiff.utils.io import atomic_write_text

    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "f.txt", "x")
    finally:
        os.umask(old)
    assert (tmp_path / "f.txt").stat().st_mode & 0o777 == 0o644
