"""``rapiddiff data prepare``: one check and one linking pass, reused; stale manifests refused."""

from __future__ import annotations

import json
import os

import pytest
from PIL import Image

from rapiddiff.data.loader import ImageTextDataset


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "set"
    root.mkdir()
    Image.new("RGB", (32, 32), "red").save(root / "a.png")
    Image.new("RGB", (8, 8), "blue").save(root / "small.png")
    (root / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\nbroken")
    rows = [
        {"file_name": "a.png", "text": "一个红色的番茄"},
        {"file_name": "bad.png", "text": "坏图"},
        {"file_name": "small.png", "text": "小的番茄"},
        {"file_name": "a.png", "text": ""},
        {"file_name": "a.png", "text": "没有实体"},
    ]
    (root / "metadata.jsonl").write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8"
    )
    return root


def _store(path):
    import torch

    from rapiddiff.kg.store import KnowledgeStore

    store = KnowledgeStore.from_arrays(
        ["番茄", "红色", "颜色"],
        ["颜色", "类别"],
        torch.randn(3, 4),
        torch.randn(2, 4),
        triples=[(0, 0, 1), (1, 1, 2)],
    )
    store.save(path)
    return path


def test_prepare_then_build_without_scanning_or_linking(folder, tmp_path, monkeypatch):
    from rapiddiff.cli import main

    store = _store(tmp_path / "store")
    out = tmp_path / "prepared"
    args = ["data", "prepare", str(folder), "--out", str(out), "--store", str(store)]
    assert main([*args, "--image-size", "16", "--small-images", "skip"]) == 0
    manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["usable_rows"] == [0, 4] and manifest["annotated_captions"] == 1
    assert len((out / "skipped.jsonl").read_text(encoding="utf-8").splitlines()) == 3

    # Building from the manifest opens no image and links nothing.
    import rapiddiff.data.loader as loader

    def no_scan(*a, **k):
        raise AssertionError("scanned although prepared")

    monkeypatch.setattr(loader.ImageTextDataset, "_scan", no_scan)
    ds = ImageTextDataset(folder, image_size=16, small_images="skip", prepared=out)
    assert len(ds) == 2 and len(ds.skipped) == 3
    assert ds[0]["entities"] == [(2, 4, 1), (5, 7, 0)] and ds[1]["entities"] == []
    assert ds[0]["pixel_values"].shape == (3, 16, 16)

    with pytest.raises(ValueError, match="small_images: prepared 'skip', asked 'upscale'"):
        ImageTextDataset(folder, image_size=16, prepared=out)
    # Touching the table makes the manifest stale.
    meta = folder / "metadata.jsonl"
    os.utime(meta, ns=(meta.stat().st_atime_ns, meta.stat().st_mtime_ns + 10**9))
    with pytest.raises(ValueError, match="rerun `rapiddiff data prepare"):
        ImageTextDataset(folder, image_size=16, small_images="skip", prepared=out)


def test_prepare_without_store_has_no_annotations(folder, tmp_path):
    from rapiddiff.data.prepare import prepare_dataset

    summary = prepare_dataset(folder, tmp_path / "p", image_size=16, progress=False)
    assert summary["usable"] == 3 and summary["skipped"] == 2
    assert not (tmp_path / "p" / "annotations.jsonl").exists()
    ds = ImageTextDataset(folder, image_size=16, prepared=tmp_path / "p")
    assert "entities" not in ds[0] and [ds[i]["index"] for i in range(3)] == [0, 2, 4]


def test_a_prepared_folder_is_the_data_of_a_training_run(tmp_path, monkeypatch):
    """`data prepare`'s output folder is a valid `--data.train` (here: a 1-step U-Net fit): the
    table it was prepared from, with its checked rows, so the bad image is never opened."""
    from rapiddiff.cli import main
    from rapiddiff.train import unet as unet_stage
    from tests.train.helpers import read_losses, tiny_unet_args, write_imagefolder

    data = write_imagefolder(tmp_path / "data", n=4)
    (data / "0003.png").write_bytes(b"\x89PNG\r\n\x1a\nbroken")  # skipped by prepare, counted there
    out = tmp_path / "prepared"
    assert main(["data", "prepare", str(data), "--out", str(out), "--image-size", "16"]) == 0
    dataset = ImageTextDataset(out, image_size=16)
    assert dataset.table == data / "metadata.jsonl" and dataset.indices == [0, 1, 2]
    monkeypatch.setattr(
        ImageTextDataset, "_scan", lambda *a, **k: pytest.fail("the prepared rows were scanned")
    )
    root = tmp_path / "run"
    record = [
        "--trainer.callbacks=tests.train.helpers.RecordLosses",
        f"--trainer.callbacks.path={root / 'l.txt'}",
    ]
    unet_stage.cli_main([*tiny_unet_args(out, root, max_steps=1), *record])
    assert list(read_losses(root / "l.txt")) == [1]  # one optimizer step ran
