"""benchmarks/kshapes_soup.py: the mean of draws' weights, with the frozen files copied unchanged."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def soup():
    spec = importlib.util.spec_from_file_location("kshapes_soup", ROOT / "benchmarks" / "kshapes_soup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _member(root: Path, name: str, weight: float, frozen: torch.Tensor) -> Path:
    folder = root / name
    (folder / "unet").mkdir(parents=True)
    (folder / "vae").mkdir()
    save_file(
        {"w": torch.full((2, 3), weight, dtype=torch.float16), "steps": torch.tensor([7])},
        str(folder / "unet" / "diffusion_pytorch_model.safetensors"),
    )
    save_file({"w": frozen}, str(folder / "vae" / "diffusion_pytorch_model.safetensors"))
    (folder / "unet" / "config.json").write_text('{"sample_size": 16}')
    (folder / "training_config.yaml").write_text(f"seed: {weight}\n")
    return folder


def test_the_mean_of_the_trained_weights_and_the_frozen_files_copied(soup, tmp_path: Path) -> None:
    frozen = torch.randn(4)
    members = [_member(tmp_path, f"m{i}", w, frozen) for i, w in enumerate((1.0, 2.0, 4.5))]
    averaged = soup.average_folders(members, tmp_path / "soup")
    assert averaged == ["unet/diffusion_pytorch_model.safetensors"]
    unet = load_file(tmp_path / "soup" / "unet" / "diffusion_pytorch_model.safetensors")
    assert unet["w"].dtype == torch.float16 and torch.all(unet["w"] == 2.5)
    assert torch.equal(unet["steps"], torch.tensor([7]))
    assert torch.equal(
        load_file(tmp_path / "soup" / "vae" / "diffusion_pytorch_model.safetensors")["w"], frozen
    )
    assert (tmp_path / "soup" / "unet" / "config.json").read_text() == '{"sample_size": 16}'
    record = json.loads((tmp_path / "soup" / "soup.json").read_text())
    assert record["members"] == [str(m) for m in members] and record["dropped"] == ["training_config.yaml"]
    assert not (tmp_path / "soup" / "training_config.yaml").exists()  # a member's record, not the soup's


def test_configs_that_differ_only_in_where_they_were_loaded_from_are_the_same(soup, tmp_path: Path) -> None:
    members = [_member(tmp_path, f"m{i}", float(i), torch.zeros(4)) for i in range(2)]
    for i, member in enumerate(members):  # diffusers records the folder each config was loaded from
        (member / "unet" / "config.json").write_text(
            json.dumps({"_name_or_path": f"/runs/m{i}/unet", "sample_size": 16})
        )
    soup.average_folders(members, tmp_path / "soup")
    assert json.loads((tmp_path / "soup" / "unet" / "config.json").read_text())["sample_size"] == 16


def test_members_that_differ_outside_the_weights_are_refused(soup, tmp_path: Path) -> None:
    a, b = _member(tmp_path, "a", 1.0, torch.zeros(4)), _member(tmp_path, "b", 2.0, torch.zeros(4))
    (b / "unet" / "config.json").write_text('{"sample_size": 32}')
    with pytest.raises(ValueError, match=r"config\.json differs"):
        soup.average_folders([a, b], tmp_path / "soup")
    assert not (tmp_path / "soup").exists() and not (tmp_path / "soup.partial").exists()
    (b / "unet" / "extra.txt").write_text("x")
    with pytest.raises(ValueError, match=r"different files: unet/extra\.txt"):
        soup.average_folders([a, b], tmp_path / "soup2")


def test_a_corrupt_weights_file_is_named_and_nothing_is_left_behind(soup, tmp_path: Path) -> None:
    a, b = _member(tmp_path, "a", 1.0, torch.zeros(4)), _member(tmp_path, "b", 2.0, torch.zeros(4))
    (b / "unet" / "diffusion_pytorch_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(
        ValueError, match=r"b/unet/diffusion_pytorch_model\.safetensors: not a readable safetensors"
    ):
        soup.average_folders([a, b], tmp_path / "soup")
    assert not (tmp_path / "soup").exists() and not (tmp_path / "soup.partial").exists()
