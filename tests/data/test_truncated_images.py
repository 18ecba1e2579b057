"""An image found truncated only when decoded never silently becomes another sample (issue 15,
item 3): its slot takes the next good item with a warning that names both, the bad item is
logged and counted once per run — across DataLoader workers and epochs — and skipped after."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from rapiddiff.data.loader import ImageTextDataset

N = 6
BAD = 3  # row 3 (line 4 of metadata.jsonl) is truncated after a valid header


def _noise_png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (48, 48, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    root.mkdir()
    rows = []
    for i in range(N):
        data = _noise_png(i)
        (root / f"{i}.png").write_bytes(data[: len(data) // 2] if i == BAD else data)
        rows.append({"file_name": f"{i}.png", "text": f"第{i}张"})
    (root / "metadata.jsonl").write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8"
    )
    return root


def _check_pairs(batch: dict) -> None:
    # Every caption belongs to the row the item says it is: no image enters under another's caption.
    for text, index in zip(batch["text"], batch["index"].tolist(), strict=True):
        assert text == f"第{index}张"
        assert index != BAD


@pytest.mark.parametrize("workers", [0, 2])
def test_training_loader_logs_and_counts_a_truncated_image_once_over_epochs(folder, tmp_path, workers):
    from rapiddiff.train.data import ImageTextData

    skip_log = tmp_path / "skipped.jsonl"
    data = ImageTextData(
        str(folder), image_size=16, batch_size=2, num_workers=workers, dataset_options={"skip_log": skip_log}
    )
    data.setup("fit")
    dataset = data.train_set
    assert len(dataset) == N  # the header is fine: found only when decoded
    seen = 0
    for _epoch in range(3):  # a fresh set of workers every epoch
        for batch in data.train_dataloader():
            _check_pairs(batch)
            seen += len(batch["text"])
    assert seen == 3 * N
    logged = [json.loads(line) for line in skip_log.read_text(encoding="utf-8").splitlines()]
    assert len(logged) == 1
    assert logged[0]["line"] == BAD + 1 and logged[0]["row"] == BAD
    assert logged[0]["reason"].startswith("corrupt or truncated image")
    # The main process counts it, even when a worker found it.
    assert [item["row"] for item, _ in dataset.skipped] == [BAD]


def test_the_substitution_is_announced_once_with_both_rows(folder, caplog):
    dataset = ImageTextDataset(folder, image_size=16)
    with caplog.at_level(logging.WARNING, logger="rapiddiff"):
        for _epoch in range(3):
            items = [dataset[i] for i in range(len(dataset))]
    warnings = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(warnings) == 1
    assert "metadata.jsonl line 4 skipped from now on: corrupt or truncated image" in warnings[0]
    assert f"row {BAD + 1} takes its place in this batch" in warnings[0]
    assert [it["index"] for it in items] == [0, 1, 2, 4, 4, 5]
    assert all(it["text"] == f"第{it['index']}张" for it in items)
    assert len(dataset.skipped) == 1
