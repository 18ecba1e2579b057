"""``rapiddiff data inspect``: counts, skip reasons, histograms and entity coverage."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from rapiddiff.data.inspect import histogram_png, inspect_dataset
from rapiddiff.data.kshapes import SMALL_PRESET, KShapesConfig, generate_kshapes


@pytest.fixture(scope="module")
def kshapes_with_bad_rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("inspect") / "ks"
    generate_kshapes(
        KShapesConfig(out=out, **{**SMALL_PRESET, "train": 30, "val": 2, "test": 2}), progress=False
    )
    train = out / "train"
    (train / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    Image.new("RGB", (20, 40), "red").save(train / "small.png")
    with (train / "metadata.jsonl").open("a", encoding="utf-8") as handle:
        for row in (
            {"file_name": "broken.png", "text": "坏图"},
            {"file_name": "gone.png", "text": "丢失"},
            {"file_name": "small.png", "text": "小图"},
            {"file_name": "000000.png", "text": ""},
        ):
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    return out


def _store(kshapes_dir):
    from rapiddiff.kg.store import KnowledgeStore
    from rapiddiff.kg.triples import read_aliases, read_triples

    triples = read_triples(kshapes_dir / "kg" / "triples.tsv")
    names = sorted({h for h, _, _ in triples} | {t for _, _, t in triples})
    relations = sorted({r for _, r, _ in triples})
    ids = {n: i for i, n in enumerate(names)}
    rel = {r: i for i, r in enumerate(relations)}
    rng = np.random.default_rng(0)
    return KnowledgeStore.from_arrays(
        names,
        relations,
        rng.normal(size=(len(names), 8)).astype(np.float32),
        rng.normal(size=(len(relations), 8)).astype(np.float32),
        triples=[(ids[h], rel[r], ids[t]) for h, r, t in triples],
        aliases=read_aliases(kshapes_dir / "kg" / "aliases.tsv"),
    )


def test_inspect_reports_counts_reasons_and_coverage(kshapes_with_bad_rows, tmp_path, capsys):
    store = _store(kshapes_with_bad_rows)
    store.save(tmp_path / "store")
    from rapiddiff.cli import main

    out = tmp_path / "report"
    args = [
        "data",
        "inspect",
        str(kshapes_with_bad_rows / "train"),
        "--image-size",
        "64",
        "--small-images",
        "skip",
    ]
    assert main([*args, "--store", str(tmp_path / "store"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "34 rows, 30 usable, 4 skipped" in printed
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert report["skipped_by_reason"] == {
        "not an image file": 1,
        "missing file": 1,
        "image too small": 1,
        "empty caption": 1,
    }
    assert len((out / "skipped.jsonl").read_text(encoding="utf-8").splitlines()) == 4
    assert report["image_size"]["median"] == 64 and report["below_training_size"] == 0
    # Every kshapes caption names an entity, a colour or a background, all of them KG entities.
    assert report["entities"]["caption_coverage"] == 1.0
    assert report["entities"]["distinct_entities"] > 5
    for name in ("image_sizes.png", "caption_lengths.png"):
        with Image.open(out / name) as image:
            assert image.format == "PNG" and image.size[0] > 300


def test_inspect_without_out_writes_nothing_and_counts_small_images(kshapes_with_bad_rows, tmp_path):
    report = inspect_dataset(kshapes_with_bad_rows / "train", image_size=128, progress=False)
    assert report["usable"] == 31  # the 20×40 image is usable when upscaling
    assert report["below_training_size"] == 31
    assert "histograms" not in report


def test_histogram_counts_every_value(tmp_path):
    values = [1, 2, 2, 3, 3, 3, 10]
    hist = histogram_png(values, tmp_path / "h.png", title="t", xlabel="x")
    assert sum(hist["counts"]) == len(values) and hist["counts"][:3] == [1, 2, 3]
    assert histogram_png([], tmp_path / "e.png", title="t", xlabel="x")["counts"] == []
