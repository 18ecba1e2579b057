"""Background shade and position read off an emoji-zh image, deterministically (no learned part).

The background is the median colour of the image's border frame, named by the nearest shade of
the data folder's vocabulary in CIELAB; the object is every pixel far from it (ΔE > 18, specks
opened away), and its position is the nearest position centre to its bounding box's centre.
The vocabulary (each shade's colour, each position word's centre, the object's usual size) is
measured on the data folder's own training images (:func:`calibrate`), so the reader follows
whatever palette and layout the builder used; kshapes' palette stands in where there are none.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from rapiddiff.data.kshapes.palette import BACKGROUNDS, LAYOUTS, srgb_to_lab
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)

OBJECT_DELTA_E = 18.0  # ΔE from the background that surely belongs to the object (kshapes' seed)
MIN_AREA = 0.002  # components smaller than this fraction of the image are specks, not the object
CALIBRATION_IMAGES = 24  # training images measured per shade and per position word


@dataclass(frozen=True)
class Vocabulary:
    """What the prompts can ask for: shade → sRGB, position word → centre (x, y) in [0, 1]."""

    backgrounds: dict[str, tuple[int, int, int]]
    positions: dict[str, tuple[float, float]]
    object_size: float | None = None
    """Median side of the object's bounding box over the training images (fraction of the image)."""
    source: str = "kshapes palette"

    def shades(self) -> np.ndarray:
        """The shades as float sRGB [K, 3] in [0, 1] (the judge's backgrounds)."""
        return np.array(list(self.backgrounds.values()), dtype=np.float32) / 255.0


def kshapes_vocabulary() -> Vocabulary:
    positions = {name: (x, y) for layout in LAYOUTS.values() for name, x, y in layout}
    return Vocabulary({name: rgb for name, (rgb, _) in BACKGROUNDS.items()}, positions)


def _border_rgb(rgb: np.ndarray) -> np.ndarray:
    h, w = rgb.shape[:2]
    frame = max(2, min(h, w) // 64)
    border = np.concatenate(
        [
            rgb[:frame].reshape(-1, 3),
            rgb[-frame:].reshape(-1, 3),
            rgb[:, :frame].reshape(-1, 3),
            rgb[:, -frame:].reshape(-1, 3),
        ]
    )
    return np.median(border, axis=0)


def object_box(rgb: np.ndarray, background: np.ndarray) -> tuple[float, float, float, float] | None:
    """(left, top, right, bottom) in [0, 1] of every pixel far from ``background`` (sRGB in [0, 1]),
    specks left out; None when nothing is there."""
    from scipy import ndimage

    h, w = rgb.shape[:2]
    far = np.linalg.norm(srgb_to_lab(rgb) - srgb_to_lab(background), axis=-1) > OBJECT_DELTA_E
    far = ndimage.binary_opening(far, iterations=max(1, min(h, w) // 128))
    labels, n = ndimage.label(far)
    if n == 0:
        return None
    sizes = np.bincount(labels.ravel())
    keep = np.nonzero(sizes >= MIN_AREA * h * w)[0]
    keep = keep[keep > 0]
    if len(keep) == 0:
        return None
    ys, xs = np.nonzero(np.isin(labels, keep))
    return (xs.min() / w, ys.min() / h, (xs.max() + 1) / w, (ys.max() + 1) / h)


def read_layout(image: Image.Image, vocab: Vocabulary) -> dict[str, Any]:
    """``{"background", "position", "box"}``: the nearest shade and position word (None: no object)."""
    rgb = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    border = _border_rgb(rgb)
    lab = srgb_to_lab(border)
    names = list(vocab.backgrounds)
    shades = srgb_to_lab(vocab.shades())
    background = names[int(np.argmin(np.linalg.norm(shades - lab, axis=-1)))]
    box = object_box(rgb, border)
    position = None
    if box is not None and vocab.positions:
        cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
        position = min(
            vocab.positions,
            key=lambda p: (vocab.positions[p][0] - cx) ** 2 + (vocab.positions[p][1] - cy) ** 2,
        )
    return {
        "background": background,
        "position": position,
        "box": None if box is None else [round(float(v), 4) for v in box],
    }


def calibrate(data_dir: str | Path, per_name: int = CALIBRATION_IMAGES) -> Vocabulary:
    """The vocabulary of a data folder, measured on its training images (``metadata.jsonl``'s
    ``background`` and ``position`` fields): each shade's median border colour, each position word's
    mean object centre, the median object size. No metadata.jsonl: kshapes' palette."""
    from rapiddiff.eval.common import read_jsonl

    data_dir = Path(data_dir)
    if not (data_dir / "metadata.jsonl").is_file() and (data_dir / "train" / "metadata.jsonl").is_file():
        data_dir = data_dir / "train"  # the builder's layout: train/ holds the images and their rows
    meta = data_dir / "metadata.jsonl"
    if not meta.is_file():
        log.info("%s has no metadata.jsonl: backgrounds and positions are kshapes' vocabulary", data_dir)
        return kshapes_vocabulary()
    borders: dict[str, list[np.ndarray]] = defaultdict(list)
    centres: dict[str, list[tuple[float, float]]] = defaultdict(list)
    sides: list[float] = []
    for row in read_jsonl(meta):
        bg, pos = row.get("background"), row.get("position")
        wanted = (bg and len(borders[bg]) < per_name) or (pos and len(centres[pos]) < per_name)
        if not wanted:
            continue
        path = data_dir / row["file_name"]
        try:
            rgb = np.asarray(Image.open(path).convert("RGB"), dtype=np.float32) / 255.0
        except OSError as err:
            log.warning("%s: unreadable training image left out of the calibration (%s)", path, err)
            continue
        border = _border_rgb(rgb)
        if bg and len(borders[bg]) < per_name:
            borders[bg].append(border)
        box = object_box(rgb, border)
        if box is not None:
            sides.append(max(box[2] - box[0], box[3] - box[1]))
            if pos and len(centres[pos]) < per_name:
                centres[pos].append(((box[0] + box[2]) / 2, (box[1] + box[3]) / 2))
    if not borders:
        raise ValueError(f"{meta}: no row names a background; cannot learn the folder's shades")
    backgrounds = {k: tuple(int(np.rint(c * 255)) for c in np.median(v, axis=0)) for k, v in borders.items()}
    positions = {k: tuple(float(round(c, 4)) for c in np.mean(v, axis=0)) for k, v in centres.items()}
    return Vocabulary(
        backgrounds,  # type: ignore[arg-type]
        positions,  # type: ignore[arg-type]
        float(np.median(sides)) if sides else None,
        f"measured on {meta} ({per_name} images per name at most)",
    )
