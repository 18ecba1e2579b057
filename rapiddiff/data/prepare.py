"""``rapiddiff data prepare``: check a dataset once, link its captions once, reuse both every run.

Writes a folder with ``manifest.json`` (which table, its size and modification time, the settings
that decide which rows are usable, the usable rows), ``skipped.jsonl`` (every bad item and why)
and, with a KnowledgeStore, ``annotations.jsonl`` (entity spans per usable row). Pass the folder
as ``--data`` of any ``train`` command (or ``ImageTextDataset(DIR)``): no image is opened to build the dataset and no caption
is linked again. A manifest that no longer matches its table is refused with the command to rerun.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rapiddiff.data.loader import ImageTextDataset
from rapiddiff.data.manifest import MANIFEST, MANIFEST_VERSION, table_identity, texts_digest
from rapiddiff.kg.linker import EntityLinker
from rapiddiff.kg.store import KnowledgeStore
from rapiddiff.utils.io import atomic_write_text, removed_if_failed
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)


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
    out.mkdir(parents=True, exist_ok=True)
    (out / "skipped.jsonl").unlink(missing_ok=True)
    linker = None
    if store is not None:
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
        **table_identity(dataset.table),
        "settings": {"t2s": t2s, "small_images": small_images, "image_size": image_size},
        "verify": verify,
        "rows": len(dataset) + len(dataset.skipped),
        "usable_rows": dataset.indices,
        "texts_sha256": texts_digest(all_texts),
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
    atomic_write_text(out / MANIFEST, json.dumps(manifest, ensure_ascii=False) + "\n")
    return {k: v for k, v in manifest.items() if k != "usable_rows"} | {
        "usable": len(dataset),
        "skipped": len(dataset.skipped),
        "out": str(out),
    }
