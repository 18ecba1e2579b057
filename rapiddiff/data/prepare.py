"""``rapiddiff data prepare``: check a dataset once, link its captions once, reuse both every run.

Writes a folder with ``manifest.json`` (which table, its size and modification time, the settings
that decide which rows are usable, the usable rows), ``skipped.jsonl`` (every bad item and why)
and, with a KnowledgeStore, ``annotations.jsonl`` (entity spans per usable row). Pass the folder
as ``ImageTextDataset(..., prepared=DIR)``: no image is opened to build the dataset and no caption
is linked again. A manifest that no longer matches its table is refused with the command to rerun.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from rapiddiff.utils.io import atomic_write_text, removed_if_failed
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)

MANIFEST_VERSION = 1


def _table_identity(table: Path) -> dict[str, Any]:
    stat = table.stat()
    return {"table": str(table.resolve()), "table_bytes": stat.st_size, "table_mtime_ns": stat.st_mtime_ns}


def _texts_digest(texts: list[str]) -> str:
    return hashlib.sha256("\n".join(texts).encode("utf-8")).hexdigest()


def prepare_dataset(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    store: str | os.PathLike[str] | None = None,
    image_size: int = 256,
    small_images: str = "upscale",
    t2s: bool = False,
    verify: str = "full",
    progress: bool = True,
    **options: Any,
) -> dict[str, Any]:
    """Check ``source`` (images decoded with ``verify="full"``), link with ``store``, write ``out``.

    A run that fails leaves no ``out`` behind if it was not there before."""
    out = Path(out)
    with removed_if_failed(out):
        return _prepare(source, out, store, image_size, small_images, t2s, verify, progress, options)


def _prepare(
    source: str | os.PathLike[str],
    out: Path,
    store: str | os.PathLike[str] | None,
    image_size: int,
    small_images: str,
    t2s: bool,
    verify: str,
    progress: bool,
    options: dict[str, Any],
) -> dict[str, Any]:
    from rapiddiff.data.loader import ImageTextDataset

    out.mkdir(parents=True, exist_ok=True)
    (out / "skipped.jsonl").unlink(missing_ok=True)
    linker = None
    if store is not None:
        from rapiddiff.kg.linker import EntityLinker
        from rapiddiff.kg.store import KnowledgeStore

        linker = EntityLinker.from_store(KnowledgeStore.load(store))
    dataset = ImageTextDataset(
        source,
        image_size=image_size,
        small_images=small_images,  # type: ignore[arg-type]
        t2s=t2s,
        verify=verify,  # type: ignore[arg-type]
        skip_log=out / "skipped.jsonl",
        linker=linker,
        progress=progress,
        **options,
    )
    all_texts = [dataset.texts[i] for i in range(len(dataset))]
    manifest = {
        "version": MANIFEST_VERSION,
        **_table_identity(dataset.table),
        "settings": {"t2s": t2s, "small_images": small_images, "image_size": image_size},
        "verify": verify,
        "rows": len(dataset) + len(dataset.skipped),
        "usable_rows": dataset.indices,
        "texts_sha256": _texts_digest(all_texts),
        "store": str(Path(store).resolve()) if store is not None else None,
    }
    if dataset.annotations.spans is not None:
        lines = [
            json.dumps({"row": row, "text": text, "entities": [list(s) for s in spans]}, ensure_ascii=False)
            for row, text, spans in zip(
                dataset.indices, dataset.texts, dataset.annotations.spans, strict=True
            )
        ]
        atomic_write_text(out / "annotations.jsonl", "\n".join(lines) + ("\n" if lines else ""))
        manifest["annotated_captions"] = sum(bool(s) for s in dataset.annotations.spans)
    else:
        (out / "annotations.jsonl").unlink(missing_ok=True)
    if not (out / "skipped.jsonl").exists():
        atomic_write_text(out / "skipped.jsonl", "")
    atomic_write_text(out / "manifest.json", json.dumps(manifest, ensure_ascii=False) + "\n")
    return {k: v for k, v in manifest.items() if k != "usable_rows"} | {
        "usable": len(dataset),
        "skipped": len(dataset.skipped),
        "out": str(out),
    }


def load_prepared(
    prepared: str | os.PathLike[str], table: Path, texts: list[str], settings: dict[str, Any]
) -> tuple[list[int], list[tuple[dict[str, Any], str]], list[list[tuple[int, int, int]]] | None]:
    """(usable rows, skipped items, entity spans or None) from a ``prepare`` folder, checked."""
    folder = Path(prepared)
    path = folder / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: write it with `rapiddiff data prepare {table} --out {folder}`"
        )
    manifest = json.loads(path.read_text(encoding="utf-8"))
    rerun = f"rerun `rapiddiff data prepare {table} --out {folder}`"
    if manifest.get("version") != MANIFEST_VERSION:
        raise ValueError(f"{path}: written by another version of rapiddiff; {rerun}")
    if _table_identity(table) != {k: manifest.get(k) for k in ("table", "table_bytes", "table_mtime_ns")}:
        raise ValueError(
            f"{path}: prepared for {manifest.get('table')} as it was then; {table} differs. {rerun}"
        )
    theirs = manifest.get("settings", {})
    relevant = {
        k: v for k, v in settings.items() if not (k == "image_size" and settings["small_images"] != "skip")
    }
    mismatched = {k: (theirs.get(k), v) for k, v in relevant.items() if theirs.get(k) != v}
    if mismatched:
        detail = ", ".join(f"{k}: prepared {a!r}, asked {b!r}" for k, (a, b) in mismatched.items())
        raise ValueError(f"{path}: prepared with other settings ({detail}); {rerun} with these settings")
    keep = [int(r) for r in manifest["usable_rows"]]
    if _texts_digest([texts[r] for r in keep]) != manifest["texts_sha256"]:
        raise ValueError(f"{path}: the captions differ from those prepared; {rerun}")
    skipped = []
    skipped_path = folder / "skipped.jsonl"
    if skipped_path.is_file():
        for line in skipped_path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                reason = row.pop("reason")
                skipped.append((row, reason))
    spans = None
    annotations = folder / "annotations.jsonl"
    if annotations.is_file():
        by_row = {}
        for line in annotations.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                by_row[int(row["row"])] = [tuple(s) for s in row["entities"]]
        spans = [by_row.get(r, []) for r in keep]
    log.info("%s: %d usable rows from %s (no scan)", table, len(keep), folder)
    return keep, skipped, spans
