"""benchmarks/kshapes_weak_cells.py: a draw's weak cells come from the validation captions alone, and
the training table repeats exactly the lines of those cells."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def weak_cells():
    spec = importlib.util.spec_from_file_location(
        "kshapes_weak_cells", ROOT / "benchmarks" / "kshapes_weak_cells.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _image(split: str, shape: str, ok: bool, background: str = "灰色", position: str = "中间") -> dict:
    return {
        "split": split,
        "colour": "红色",
        "shape": shape,
        "background": background,
        "position": position,
        "all_ok": ok,
    }


def test_weak_values_read_the_validation_split_only(weak_cells) -> None:
    rows = (
        [_image("attribute_val", "椭圆形", ok=i >= 4) for i in range(10)]  # 4 of 10 ellipses missed
        + [_image("attribute_val", "圆形", ok=i >= 1) for i in range(30)]  # 1 of 30 circles
        + [_image("attribute", "方形", ok=False) for _ in range(20)]  # the test split: never read
    )
    weak = weak_cells.weak_values(rows)
    # 40 % against 12.5 % overall; the circle's one miss is under min_misses
    assert weak == {"shape": ["椭圆形"]}
    assert weak_cells.weak_values(rows, min_misses=5) == {}
    with pytest.raises(ValueError, match="no detections"):
        weak_cells.weak_values(rows, split="attribute_robust")


def test_oversample_repeats_the_weak_cells_lines(weak_cells, tmp_path: Path) -> None:
    lines = [
        {
            "file_name": "0.png",
            "text": "画面中间是一个鸡蛋",
            "shape": "椭圆形",
            "colour": "白色",
            "background": "灰色",
            "position": "中间",
        },
        {
            "file_name": "1.png",
            "text": "深绿色背景上有一个红色的圆形",
            "shape": "圆形",
            "colour": "红色",
            "background": "深绿色",
            "position": "中间",
        },
        {
            "file_name": "2.png",
            "text": "一个红色的圆形",
            "shape": "圆形",
            "colour": "红色",
            "background": "深绿色",
            "position": "左边",
        },
    ]
    (tmp_path / "metadata.jsonl").write_text(
        "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines), encoding="utf-8"
    )
    weak = {"shape": ["椭圆形"], "background": ["深绿色"]}
    counts = weak_cells.oversample(tmp_path, weak, 3, tmp_path / "weak.jsonl")
    written = [
        json.loads(x)["file_name"] for x in (tmp_path / "weak.jsonl").read_text(encoding="utf-8").splitlines()
    ]
    # the ellipse by its entity; dark green only where the caption names it (line 2's does not)
    assert written == ["0.png"] * 3 + ["1.png"] * 3 + ["2.png"]
    assert counts == {"lines": 3, "in_weak_cells": 2, "written": 7}
    with pytest.raises(ValueError, match="where its file_name paths point"):
        weak_cells.oversample(tmp_path, weak, 3, tmp_path.parent / "weak.jsonl")


def test_an_unreadable_line_is_left_out_and_named(weak_cells, tmp_path: Path, capsys) -> None:
    good = {"file_name": "0.png", "text": "一个鸡蛋", "shape": "椭圆形"}
    (tmp_path / "metadata.jsonl").write_text(json.dumps(good) + "\n{not json\n", encoding="utf-8")
    counts = weak_cells.oversample(tmp_path, {"shape": ["椭圆形"]}, 2, tmp_path / "weak.jsonl")
    assert counts == {"lines": 1, "in_weak_cells": 1, "written": 2}
    assert "metadata.jsonl:2" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.partial"))  # written atomically
    with pytest.raises(ValueError, match="shapes\\? the attributes are colour, shape"):
        weak_cells.oversample(tmp_path, {"shapes": ["椭圆形"]}, 2, tmp_path / "weak.jsonl")
    with pytest.raises(ValueError, match="shape 椭圆 is in no line"):
        weak_cells.oversample(tmp_path, {"shape": ["椭圆"]}, 2, tmp_path / "weak.jsonl")
