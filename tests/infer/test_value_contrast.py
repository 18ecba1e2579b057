"""Value contrast through the pipeline and the CLI: the folder's default, the flag, the PNG record,
--from-png, knowledge off, and bad values."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from rapiddiff.cli import main
from rapiddiff.infer.pipeline import RapidDiffusionPipeline
from rapiddiff.infer.png import read_png_metadata
from tests.models.test_contrast import _store

GEN = {"seed": 2, "num_inference_steps": 3, "output_type": "np", "progress": False}


@pytest.fixture(scope="module")
def model(tiny_model, tmp_path_factory):
    """The tiny model with a store holding three colours and three shapes, gates open."""
    from rapiddiff.models.bundle import load_model_folder, save_model_folder

    bundle = load_model_folder(tiny_model)
    bundle.text_encoder.set_store(_store())
    with torch.no_grad():
        bundle.text_encoder.fusion.gates.fill_(0.5)
    return save_model_folder(bundle, tmp_path_factory.mktemp("contrast-model") / "model")


def test_pipeline_contrast_changes_only_knowledge_on_images_and_is_recorded(model):
    pipe = RapidDiffusionPipeline.from_pretrained(model)
    plain = pipe("一个红色的圆形", **GEN)
    sharp = pipe("一个红色的圆形", value_contrast=0.5, **GEN)
    assert np.abs(sharp.images - plain.images).max() > 1e-4
    assert sharp.metadata[0]["value_contrast"] == 0.5 and "value_contrast" not in plain.metadata[0]
    off = pipe("一个红色的圆形", knowledge=False, **GEN)
    off_sharp = pipe("一个红色的圆形", knowledge=False, value_contrast=0.5, **GEN)
    np.testing.assert_array_equal(off.images, off_sharp.images)  # knowledge off: the base encoder exactly
    assert "value_contrast" not in off_sharp.metadata[0]
    # a prompt with no attribute word the KG knows: the same image
    np.testing.assert_array_equal(
        pipe("一只猫", value_contrast=0.5, **GEN).images, pipe("一只猫", **GEN).images
    )
    with pytest.raises(ValueError, match=r"value_contrast must be a number in \[0, 2\]"):
        pipe("一个红色的圆形", value_contrast=-1, **GEN)


def test_cli_flag_folder_default_and_from_png(model, tmp_path, capsys):
    base = ["--model", str(model), "--steps", "3", "--device", "cpu", "--no-progress", "--seed", "5"]
    assert (
        main(["generate", "一个红色的圆形", *base, "--value-contrast", "0.5", "--out", str(tmp_path / "a")])
        == 0
    )
    first = next((tmp_path / "a").glob("*.png"))
    assert read_png_metadata(first)["value_contrast"] == 0.5
    assert main(["generate", "--from-png", str(first), "--out", str(tmp_path / "b"), "--no-progress"]) == 0
    again = next((tmp_path / "b").glob("*.png"))
    np.testing.assert_array_equal(np.asarray(Image.open(first)), np.asarray(Image.open(again)))

    info = json.loads((model / "rapiddiff.json").read_text("utf-8"))
    folder = tmp_path / "folder"
    import shutil

    shutil.copytree(model, folder)
    info["sampling"] = {**info.get("sampling", {}), "value_contrast": 0.5}
    (folder / "rapiddiff.json").write_text(json.dumps(info), "utf-8")
    base[1] = str(folder)
    assert (
        main(["generate", "一个红色的圆形", *base, "--out", str(tmp_path / "c")]) == 0
    )  # the folder's default
    default = next((tmp_path / "c").glob("*.png"))
    assert read_png_metadata(default)["value_contrast"] == 0.5
    np.testing.assert_array_equal(np.asarray(Image.open(first)), np.asarray(Image.open(default)))
    assert (
        main(["generate", "一个红色的圆形", *base, "--value-contrast", "0", "--out", str(tmp_path / "d")])
        == 0
    )
    assert "value_contrast" not in read_png_metadata(next((tmp_path / "d").glob("*.png")))
    capsys.readouterr()
    assert (
        main(["generate", "一个红色的圆形", *base, "--value-contrast", "3", "--out", str(tmp_path / "e")])
        != 0
    )
    assert "--value-contrast must be a number in [0, 2]" in capsys.readouterr().err
