"""What every ``rapiddiff eval`` command shares: image folders, the run layout, result files.

An *evaluation run* is a folder that ``eval sample`` (or ``eval knowledge``) fills:

```
RUN/
  images/           PNGs, named <prompt index>_s<seed>.png (deterministic, so reruns resume)
  index.jsonl       one line per image: file (relative to RUN), prompt, seed, index, entity, ...
  sample.json       how the images were made: model, its config, steps, guidance, seeds, timings
  metrics/*.json    what ``eval fid|clipscore|knowledge`` measured, one file per metric
```

Every metric file has the same top-level keys (:func:`metric_record`), so ``eval report`` can
tabulate them without knowing each metric.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rapiddiff import __version__
from rapiddiff.utils.io import atomic_write_text, read_text_lines

if TYPE_CHECKING:
    import torch
    from PIL import Image

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
INDEX_NAME = "index.jsonl"
IMAGES_DIR = "images"
SAMPLE_INFO = "sample.json"
METRICS_DIR = "metrics"


def list_images(folder: str | Path) -> list[Path]:
    """The image files directly inside ``folder`` (by suffix, sorted); decodes nothing.

    A run folder (one with ``index.jsonl``) stands for its ``images/`` subfolder.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"image folder not found: {folder}")
    if (folder / INDEX_NAME).is_file() and (folder / IMAGES_DIR).is_dir():
        folder = folder / IMAGES_DIR
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise FileNotFoundError(
            f"no images ({', '.join(IMAGE_SUFFIXES)}) in {folder}; point at the folder that holds them"
        )
    return files


def open_rgb(path: str | Path) -> Image.Image:
    """Decode one image as RGB; a broken file is an error that names it."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError) as err:
        raise ValueError(f"{path}: not a readable image ({err}); delete or replace it") from err


def uint8_batches(paths: Sequence[Path], batch_size: int) -> Iterator[tuple[list[Path], torch.Tensor]]:
    """Yield (files, uint8 tensor [B, 3, H, W]) batches; a batch never mixes image sizes.

    Feature extractors resize internally, so images of several sizes are fine, only not in one
    tensor. Files are read lazily, batch by batch.
    """
    import numpy as np
    import torch

    group: list[Path] = []
    arrays: list[np.ndarray] = []
    for path in paths:
        array = np.asarray(open_rgb(path))
        if arrays and array.shape != arrays[0].shape:
            yield group, torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()
            group, arrays = [], []
        group.append(path)
        arrays.append(array)
        if len(arrays) == batch_size:
            yield group, torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()
            group, arrays = [], []
    if arrays:
        yield group, torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read a JSONL file; a bad line is an error naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"file not found: {path}")
    rows = []
    for number, line in read_text_lines(path):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from err
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object per line, got {type(row).__name__}")
        rows.append(row)
    return rows


def write_jsonl(path: str | Path, rows: Iterable[dict[str, Any]]) -> None:
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    atomic_write_text(path, text)


def write_json(path: str | Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, ensure_ascii=False, indent=2) + "\n")


def read_index(run: str | Path) -> list[dict[str, Any]]:
    """The image index of an evaluation run (``RUN/index.jsonl``)."""
    run = Path(run)
    path = run / INDEX_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: {run} is not an evaluation run; make one with `rapiddiff eval sample --out {run}`"
        )
    return read_jsonl(path)


def metric_record(
    metric: str, label: str, value: float | None, *, details: dict[str, Any] | None = None, **extra: Any
) -> dict[str, Any]:
    """The common shape of a metric result file.

    ``label`` is what a table shows (e.g. "FID-CLIP(rapiddiff image tower)", never a bare "FID"
    for a non-standard extractor); ``details`` says how the number was made.
    """
    return {
        "metric": metric,
        "label": label,
        "value": value,
        **extra,
        "details": details or {},
        "rapiddiff_version": __version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def default_metric_path(folder: str | Path, metric: str) -> Path:
    """``RUN/metrics/<metric>.json`` for a run folder, else ``<metric>.json`` beside the folder."""
    folder = Path(folder)
    if (folder / INDEX_NAME).is_file():
        return folder / METRICS_DIR / f"{metric}.json"
    return folder.parent / f"{folder.name}.{metric}.json"


def add_device_arguments(parser: Any, *, dtype: bool = True) -> None:
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    if dtype:
        parser.add_argument(
            "--dtype", default="auto", help="float32, float16, bfloat16 or auto (fp16 on CUDA, fp32 on CPU)"
        )


def parse_choices(text: str, valid: Sequence[str], flag: str, what: str) -> list[str]:
    """A comma-separated option (``--splits seen,heldout``), each item checked against ``valid``."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    for item in items:
        if item not in valid:
            raise ValueError(f"{flag}: unknown {what} {item!r}; choose from {', '.join(valid)}")
    return items
