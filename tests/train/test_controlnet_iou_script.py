"""benchmarks/controlnet_mask_iou.py on a tiny model, on a CPU: both arms from the same seeds, the
IoU of the generated object's mask, the kshapes knowledge read of each arm per split (test captions
and ``eval knowledge``'s held-out prompts), the grid, and the batch-1 speed measure."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
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


def _untrained_controlnet(model: Path, folder: Path) -> Path:
    from diffusers import ControlNetModel

    from rapiddiff.models.bundle import load_model_folder
    from rapiddiff.train.controlnet import conditioning_channels_for

    unet = load_model_folder(model).unet
    ControlNetModel.from_unet(
        unet, conditioning_embedding_out_channels=conditioning_channels_for(2)
    ).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def kshapes(tmp_path_factory) -> Path:
    from rapiddiff.data.kshapes import KShapesConfig, generate_kshapes

    data = tmp_path_factory.mktemp("kshapes") / "kshapes"
    generate_kshapes(
        KShapesConfig(out=data, size=32, hr_scale=0, train=0, val=0, test=12, masks=True), progress=False
    )
    return data


def test_iou_script_measures_both_arms_and_writes_the_grid(
    knowledge_model: Path, kshapes: Path, tmp_path: Path
) -> None:
    folder = _untrained_controlnet(knowledge_model, tmp_path / "cn")
    out = tmp_path / "iou"
    summary = _script().main(
        [f"--model={knowledge_model}", f"--controlnet={folder}", f"--data={kshapes / 'test'}", f"--out={out}",
         "--limit=3", "--steps=2", "--batch-size=2", "--device=cpu", "--heldout-prompts=2",
         "--images-per-prompt=2", "--grid-rows=4"]
    )  # fmt: skip
    # 3 test items, then 2 held-out prompts × 2 images (eval knowledge's prompts and seeds).
    assert summary["n"] == 3 and summary["n_prompts"] == 4 and len(summary["rows"]) == 7
    prompts = [r for r in summary["rows"] if r["source"] == "prompts"]
    assert {r["split"] for r in prompts} == {"heldout"} and [r["seed"] for r in prompts] == [0, 1, 2, 3]
    # An untrained ControlNet adds zeros: the two arms are the same images, so the same IoU and read.
    for r in summary["rows"]:
        assert r["iou_with"] == r["iou_without"] and 0.0 <= r["iou_with"] <= 1.0
        assert r["detected_colour_with"] == r["detected_colour_without"]
        assert r["both_ok_with"] == r["both_ok_without"]
    assert summary["mean_iou_data"] > 0.8  # the rule reads a real image's object as its mask says
    assert all(r["iou_data"] is None for r in prompts)  # a prompt has no data image
    table = summary["knowledge"]
    assert table["heldout"]["n"] == 4 and sum(g["n"] for g in table.values()) == 7
    assert all(g["both_diff_points"] == 0.0 for g in table.values())
    assert set(table) <= {"seen", "heldout", "attribute_test", "heldout_test", "val_test"}
    assert summary["targets"]["heldout, both right: with control >= without - 3.0 points"] is True
    assert summary["targets"]["batch-1 time with / without control <= 1.35"] is None  # not timed
    written = json.loads((out / "iou.json").read_text(encoding="utf-8"))
    assert written["n"] == 3 and written["knowledge"] == table and written["complete"] is True
    with Image.open(out / "grid.png") as grid:
        assert grid.size == (3 * 16 + 4, 4 * 16 + 10)  # 2 test + 2 prompt rows of control | with | without


def test_cases_follow_the_captions_asked_for(kshapes: Path) -> None:
    script = _script()
    data = script.open_data(kshapes / "test", 32)
    splits = script.entity_splits(kshapes)
    rows = [
        json.loads(line) for line in (kshapes / "test" / "metadata.jsonl").read_text("utf-8").splitlines()
    ]
    everything = script.test_cases(data, splits, captions="all", limit=None, seed=5)
    assert [c["text"] for c in everything] == [r["text"] for r in rows]
    assert [c["seed"] for c in everything] == list(range(5, 5 + len(rows)))
    entity = script.test_cases(data, splits, captions="entity", limit=None, seed=0)
    assert [c["text"] for c in entity] == [r["text"] for r in rows if r["entity"]]
    seen = script.test_cases(data, splits, captions="seen", limit=None, seed=0)
    assert [c["text"] for c in seen] == [
        r["text"] for r in rows if r["entity"] and splits[r["entity"]] == "seen"
    ]
    assert 0 < len(seen) < len(entity) < len(everything)  # the 12 items hold all three kinds
    assert all(c["split"] == "seen" for c in seen) and [c["seed"] for c in seen] == list(range(len(seen)))


def test_a_prompt_mask_is_the_data_drawing_at_the_named_position() -> None:
    mask = _script().prompt_mask({"shape": "圆形", "colour": "红色", "position": "左边"}, 64)
    assert tuple(mask.shape) == (3, 64, 64) and float(mask.min()) == 0.0 and float(mask.max()) == 1.0
    ys, xs = np.nonzero(mask[0].numpy() >= 0.5)
    assert abs(xs.mean() - 0.23 * 64) < 1.0 and abs(ys.mean() - 0.5 * 64) < 1.0
    assert abs(len(xs) / (np.pi * (0.12 * 64) ** 2) - 1) < 0.1  # the circle's area at scale 1
    centre = _script().prompt_mask({"shape": "方形", "colour": "红色", "position": None}, 64)
    ys, xs = np.nonzero(centre[0].numpy() >= 0.5)
    assert abs(xs.mean() - 32) < 1.0  # no position named: the centre


def test_speed_flag_times_both_arms_and_joins_the_record(
    knowledge_model: Path, kshapes: Path, tmp_path: Path
) -> None:
    folder = _untrained_controlnet(knowledge_model, tmp_path / "cn")
    out = tmp_path / "iou"
    common = [f"--model={knowledge_model}", f"--controlnet={folder}", f"--data={kshapes / 'test'}",
              f"--out={out}", "--steps=2", "--device=cpu", "--speed-runs=3", "--speed-warmup=1"]  # fmt: skip
    summary = _script().main([*common, "--limit=1", "--heldout-prompts=0", "--speed"])
    speed = summary["speed"]
    assert speed["fast"] is False and speed["batch"] == 1  # a CPU: the eager pipeline
    assert len(speed["seconds"]["with"]) == len(speed["seconds"]["without"]) == 3
    assert speed["ratio"] == pytest.approx(speed["median_s_with"] / speed["median_s_without"])
    assert speed["prompt"] == summary["rows"][0]["text"]  # the first test case's caption and mask
    assert summary["targets"]["batch-1 time with / without control <= 1.35"] in (True, False)
    assert json.loads((out / "speed.json").read_text(encoding="utf-8"))["ratio"] == speed["ratio"]
    # A speed-only run joins the measure's iou.json, the IoU rows kept.
    again = _script().main([*common, "--no-measure", "--speed"])
    written = json.loads((out / "iou.json").read_text(encoding="utf-8"))
    assert written["speed"]["seconds"] == again["speed"]["seconds"] and len(written["rows"]) == 1
    with pytest.raises(SystemExit):
        _script().parse_args([*common, "--no-measure"])  # nothing to measure


@pytest.mark.gpu
def test_iou_script_runs_on_the_gpu_in_bf16_and_times_the_fast_path(
    knowledge_model: Path, kshapes: Path, tmp_path: Path
) -> None:
    folder = _untrained_controlnet(knowledge_model, tmp_path / "cn")
    summary = _script().main(
        [f"--model={knowledge_model}", f"--controlnet={folder}", f"--data={kshapes / 'test'}",
         f"--out={tmp_path / 'iou'}", "--limit=2", "--steps=2", "--device=cuda", "--dtype=bfloat16",
         "--heldout-prompts=1", "--images-per-prompt=2", "--speed", "--speed-runs=3"]
    )  # fmt: skip
    assert summary["n"] == 2 and summary["device"] == "cuda" and summary["n_prompts"] == 2
    speed = summary["speed"]
    assert speed["fast"] is True and speed["ratio"] > 0
    assert speed["fast_path_report"].get("controlnet", "").startswith("on")  # the net ran in the loop
