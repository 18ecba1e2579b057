"""One malformed line must not stop ``data inspect``, ``data prepare`` or the loader (issue 15,
item 2): the line is skipped, counted, and named by file and 1-based line in the skip log; a
command that fails anyway leaves no empty output folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from rapiddiff.data.loader import ImageTextDataset, StreamingImageTextDataset, collate_image_text

COLOURS = [(220, 30, 30), (30, 200, 30), (30, 30, 220), (230, 200, 30)]


def _images(root: Path) -> list[str]:
    names = []
    for i, rgb in enumerate(COLOURS):
        Image.new("RGB", (20, 20), rgb).save(root / f"{i}.png")
        names.append(f"{i}.png")
    return names


def _folder_with_bad_line(root: Path) -> Path:
    """metadata.jsonl: line 1 good, line 2 blank, line 3 broken JSON, 4 good, 5 not an object,
    6 a caption that is a number where other lines have text, 7 and 8 good."""
    root.mkdir(parents=True)
    names = _images(root)
    lines = [
        json.dumps({"file_name": names[0], "text": "红色的方块"}, ensure_ascii=False),
        "",
        '{"file_name": "1.png", "text": "绿色的方块"',  # the closing brace is missing
        json.dumps({"file_name": names[1], "text": "绿色的方块"}, ensure_ascii=False),
        '["2.png", "蓝色"]',
        json.dumps({"file_name": names[2], "text": 3}),
        json.dumps({"file_name": names[2], "text": "蓝色的方块"}, ensure_ascii=False),
        json.dumps({"file_name": names[3], "text": "黄色的方块"}, ensure_ascii=False),
    ]
    (root / "metadata.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


def _logged(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_loader_skips_malformed_jsonl_lines_and_names_file_and_line(tmp_path):
    root = _folder_with_bad_line(tmp_path / "data")
    log = tmp_path / "skipped.jsonl"
    ds = ImageTextDataset(root, image_size=16, skip_log=log)
    assert ds.texts == ["红色的方块", "绿色的方块", "蓝色的方块", "黄色的方块"]
    for i, rgb in enumerate(COLOURS):
        expected = torch.tensor(rgb, dtype=torch.float32) / 127.5 - 1
        torch.testing.assert_close(ds[i]["pixel_values"][:, 8, 8], expected, atol=0.01, rtol=0)
    logged = _logged(log)
    assert [(row["line"], row["source"]) for row in logged] == [
        (n, str(root / "metadata.jsonl")) for n in (3, 5, 6)
    ]
    assert logged[0]["reason"].startswith("malformed line (Expecting ',' delimiter")
    assert logged[0]["content"].startswith('{"file_name": "1.png"')
    assert logged[1]["reason"] == "malformed line (a JSON list, not an object)"
    assert logged[2]["reason"] == "malformed line (field 'text' is number where earlier lines have str)"
    assert len(ds.skipped) == 3


def test_other_skips_name_the_line_too(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    _images(root)
    rows = [
        {"file_name": "0.png", "text": "红"},
        {"file_name": "gone.png", "text": "丢"},
        {"file_name": "1.png"},
    ]
    (root / "metadata.jsonl").write_text(
        "\n\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n", encoding="utf-8"
    )
    ds = ImageTextDataset(root, image_size=16, skip_log=tmp_path / "skipped.jsonl")
    logged = _logged(tmp_path / "skipped.jsonl")
    # Row 1 is on line 3 and row 2 on line 5 (blank lines between): the log says both.
    assert [(r["row"], r["line"], r["reason"]) for r in logged] == [
        (1, 3, f"missing file {root / 'gone.png'}"),
        (2, 5, "empty caption"),
    ]
    assert len(ds) == 1


@pytest.mark.parametrize("suffix", [".csv", ".tsv"])
def test_csv_and_tsv_lines_with_the_wrong_number_of_fields_are_skipped(tmp_path, suffix):
    _images(tmp_path)
    sep = "," if suffix == ".csv" else "\t"
    lines = [
        sep.join(["image", "text"]),
        sep.join(["0.png", "红色"]),
        sep.join(["1.png", "绿色", "多出来的一列"]),  # one field too many: pandas stops here
        sep.join(["2.png", "蓝色"]),
    ]
    table = tmp_path / f"pairs{suffix}"
    table.write_text("\n".join(lines) + "\n", encoding="utf-8")
    ds = ImageTextDataset(table, image_size=16, skip_log=tmp_path / "skipped.jsonl")
    assert ds.texts == ["红色", "蓝色"]
    assert [ds[i]["index"] for i in range(len(ds))] == [0, 2]
    (logged,) = _logged(tmp_path / "skipped.jsonl")
    assert logged["line"] == 3 and logged["source"] == str(table)
    assert logged["reason"] == "malformed line (3 fields where the header has 2)"


def test_a_file_with_no_readable_line_is_an_error_naming_the_line(tmp_path):
    (tmp_path / "metadata.jsonl").write_text("not json\n{broken\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"metadata\.jsonl: no line could be read \(line 1: malformed line"):
        ImageTextDataset(tmp_path)


def test_streaming_skips_malformed_lines_of_every_shard(tmp_path):
    _images(tmp_path)
    (tmp_path / "a.jsonl").write_text(
        '{"image": "0.png", "text": "红"}\n{"image": "1.png", "text": \n', encoding="utf-8"
    )
    (tmp_path / "b.jsonl").write_text('{"image": "2.png", "text": "蓝"}\n[]\n', encoding="utf-8")
    stream = StreamingImageTextDataset(
        str(tmp_path / "*.jsonl"), image_size=16, skip_log=tmp_path / "s.jsonl"
    )
    loader = torch.utils.data.DataLoader(stream, batch_size=4, num_workers=2, collate_fn=collate_image_text)
    texts = sorted(t for batch in loader for t in batch["text"])
    assert texts == ["红", "蓝"]
    logged = sorted((Path(r["source"]).name, r["line"]) for r in _logged(tmp_path / "s.jsonl"))
    assert logged == [("a.jsonl", 2), ("b.jsonl", 2)]


def test_inspect_and_prepare_run_through_a_malformed_line(tmp_path, capsys):
    from rapiddiff.cli import main

    root = _folder_with_bad_line(tmp_path / "data")
    assert main(["data", "inspect", str(root), "--out", str(tmp_path / "report"), "--image-size", "16"]) == 0
    printed = capsys.readouterr().out
    assert "4 usable, 3 skipped" in printed and "malformed line" in printed
    report = json.loads((tmp_path / "report" / "report.json").read_text(encoding="utf-8"))
    assert report["skipped_by_reason"] == {"malformed line": 3}
    assert [r["line"] for r in _logged(tmp_path / "report" / "skipped.jsonl")] == [3, 5, 6]

    prepared = tmp_path / "prepared"
    assert main(["data", "prepare", str(root), "--out", str(prepared), "--image-size", "16"]) == 0
    ds = ImageTextDataset(root, image_size=16, prepared=prepared)
    assert ds.texts == ["红色的方块", "绿色的方块", "蓝色的方块", "黄色的方块"]
    assert [item["line"] for item, _ in ds.skipped] == [3, 5, 6]


@pytest.mark.parametrize("command", ["inspect", "prepare"])
def test_a_failed_command_leaves_no_empty_output_folder(tmp_path, capsys, command):
    from rapiddiff.cli import main

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "metadata.jsonl").write_text("{broken\n", encoding="utf-8")
    out = tmp_path / "out"
    assert main(["data", command, str(tmp_path / "data"), "--out", str(out)]) == 2
    assert "line 1: malformed line" in capsys.readouterr().err
    assert not out.exists()
