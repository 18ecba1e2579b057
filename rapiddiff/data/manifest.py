"""A ``rapiddiff data prepare`` folder's manifest: what it was prepared from, and reading it back
checked (the rows, the skipped items and the entity spans), below both the loader and ``prepare``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1


def table_identity(table: Path) -> dict[str, Any]:
    stat = table.stat()
    return {"table": str(table.resolve()), "table_bytes": stat.st_size, "table_mtime_ns": stat.st_mtime_ns}


def texts_digest(texts: list[str]) -> str:
    return hashlib.sha256("\n".join(texts).encode("utf-8")).hexdigest()


def prepared_table(folder: Path) -> Path | None:
    """The table a prepare folder was written for (None where ``folder`` is no prepare folder)."""
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        table = json.loads(path.read_text(encoding="utf-8")).get("table")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return None
    return Path(table) if isinstance(table, str) else None


def load_prepared(
    prepared: str | os.PathLike[str], table: Path, texts: list[str], settings: dict[str, Any]
) -> tuple[list[int], list[tuple[dict[str, Any], str]], list[list[tuple[int, int, int]]] | None]:
    """(usable rows, skipped items, entity spans or None) from a ``prepare`` folder, checked."""
    folder = Path(prepared)
    path = folder / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: write it with `rapiddiff data prepare {table} --out {folder}`"
        )
    manifest = json.loads(path.read_text(encoding="utf-8"))
    rerun = f"rerun `rapiddiff data prepare {table} --out {folder}`"
    if manifest.get("version") != MANIFEST_VERSION:
        raise ValueError(f"{path}: written by another version of rapiddiff; {rerun}")
    if table_identity(table) != {k: manifest.get(k) for k in ("table", "table_bytes", "table_mtime_ns")}:
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
    if texts_digest([texts[r] for r in keep]) != manifest["texts_sha256"]:
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
