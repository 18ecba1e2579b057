"""benchmarks/controlnet_mask_iou.py on a tiny model, on a CPU: both arms from the same seeds, the
IoU of the generated object's mask, the grid."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from PIL import Image

from tests.train.helpers import REPO


def _script():
    spec = importlib.util.spec_from_file_location(
        "controlnet_mask_iou", REPO / "benchmarks" / "controlnet_mask_iou.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_iou_script_measures_both_arms_and_writes_the_grid(knowledge_model: Path, tmp_path: Path) -> None:
    from diffusers import ControlNetModel

    from rapiddiff.data.kshapes import KShapesConfig, generate_kshapes
    from rapiddiff.models.bundle import load_model_folder
    from rapiddiff.train.controlnet import conditioning_channels_for

    data = tmp_path / "kshapes"
    generate_kshapes(KShapesConfig(out=data, size=32, train=0, val=0, test=3, masks=True), progress=False)
    unet = load_model_folder(knowledge_model).unet
    folder = tmp_path / "cn"
    ControlNetModel.from_unet(
        unet, conditioning_embedding_out_channels=conditioning_channels_for(2)
    ).save_pretrained(folder)
    out = tmp_path / "iou"
    summary = _script().main(
        [f"--model={knowledge_model}", f"--controlnet={folder}", f"--data={data / 'test'}", f"--out={out}",
         "--steps=2", "--batch-size=2", "--device=cpu"]
    )  # fmt: skip
    assert summary["n"] == 3 and len(summary["rows"]) == 3
    # An untrained ControlNet adds zeros: the two arms are the same images, so the same IoU.
    assert all(r["iou_with"] == r["iou_without"] for r in summary["rows"])
    assert all(0.0 <= r["iou_with"] <= 1.0 for r in summary["rows"])
    assert summary["mean_iou_data"] > 0.8  # the rule reads a real image's object as its mask says
    assert json.loads((out / "iou.json").read_text(encoding="utf-8"))["n"] == 3
    with Image.open(out / "grid.png") as grid:
        assert grid.size == (3 * 16 + 4, 3 * 16 + 8)  # 3 rows of control | with | without at 16²


@pytest.mark.gpu
def test_iou_script_runs_on_the_gpu_in_bf16(knowledge_model: Path, tmp_path: Path) -> None:
    from diffusers import ControlNetModel

    from rapiddiff.data.kshapes import KShapesConfig, generate_kshapes
    from rapiddiff.models.bundle import load_model_folder
    from rapiddiff.train.controlnet import conditioning_channels_for

    data = tmp_path / "kshapes"
    generate_kshapes(KShapesConfig(out=data, size=32, train=0, val=0, test=2, masks=True), progress=False)
    folder = tmp_path / "cn"
    unet = load_model_folder(knowledge_model).unet
    ControlNetModel.from_unet(
        unet, conditioning_embedding_out_channels=conditioning_channels_for(2)
    ).save_pretrained(folder)
    summary = _script().main(
        [f"--model={knowledge_model}", f"--controlnet={folder}", f"--data={data / 'test'}",
         f"--out={tmp_path / 'iou'}", "--steps=2", "--device=cuda", "--dtype=bfloat16"]
    )  # fmt: skip
    assert summary["n"] == 2 and summary["device"] == "cuda"
