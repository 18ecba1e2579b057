"""A data folder's licences (``LICENSES/`` and ``ATTRIBUTION.md``, as `rapiddiff data emoji` writes
them), carried into every model folder trained on it."""

from __future__ import annotations

import shutil
from pathlib import Path

LICENSES_DIR, ATTRIBUTION = "LICENSES", "ATTRIBUTION.md"


def copy_licenses(data_dir: str | Path, model_dir: str | Path) -> None:
    """Copy LICENSES/ and ATTRIBUTION.md of a data folder into a model folder (no-op for a
    data folder without them, e.g. kshapes)."""
    data_dir, model_dir = Path(data_dir), Path(model_dir)
    if not (data_dir / ATTRIBUTION).is_file():
        return
    model_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(data_dir / ATTRIBUTION, model_dir / ATTRIBUTION)
    shutil.copytree(data_dir / LICENSES_DIR, model_dir / LICENSES_DIR, dirs_exist_ok=True)


def copy_licenses_of_sources(sources: list[str | Path], model_dir: str | Path) -> list[Path]:
    """The licences of every training source that came from a licensed data folder (the source
    itself, e.g. a ``--data`` folder, or the folder above it, e.g. ``DATA/train``), copied into a
    model folder trained on it; returns the data folders they came from."""
    found: list[Path] = []
    for source in sources:
        path = Path(source)
        for folder in (path, path.parent):
            if (folder / ATTRIBUTION).is_file() and folder not in found:
                copy_licenses(folder, model_dir)
                found.append(folder)
                break
    return found
