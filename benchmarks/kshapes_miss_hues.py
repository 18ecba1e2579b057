"""Where a wrongly coloured object's colour lies: between the asked colour and the one read, or on it.

    python benchmarks/kshapes_miss_hues.py RUN/knowledge_on [--colours 橙色,黄色,蓝色,紫色]

RUN is a `rapiddiff eval knowledge` run folder (its detections.jsonl and images). For every image of
an asked colour, the object's median CIELAB colour (pixels far from the border's background, eroded)
and its ΔE76 to each palette colour: right images sit close to theirs; a miss that sits between the
asked colour and the neighbour the detector read is a blend (the U-Net's imprecision), one that sits
on the neighbour is a swap (the conditioning's confusion). Issue 18's attribute-caption misses.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
from PIL import Image
from scipy import ndimage

from rapiddiff.data.kshapes import detect
from rapiddiff.data.kshapes.palette import COLOURS


def object_lab(path: Path) -> np.ndarray | None:
    """The median CIELAB colour of the object: pixels far from the border's median background."""
    rgb = np.asarray(Image.open(path).convert("RGB"), np.float32) / 255
    lab = detect.srgb_to_lab(rgb)
    frame = max(2, min(lab.shape[:2]) // 64)
    border = np.concatenate(
        [
            lab[:frame].reshape(-1, 3),
            lab[-frame:].reshape(-1, 3),
            lab[:, :frame].reshape(-1, 3),
            lab[:, -frame:].reshape(-1, 3),
        ]
    )
    mask = np.linalg.norm(lab - np.median(border, 0), axis=-1) > detect.SEED_THRESHOLD
    mask = ndimage.binary_erosion(mask, iterations=max(1, min(lab.shape[:2]) // 128))
    return np.median(lab[mask], 0) if mask.sum() > 20 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a mode folder of an eval knowledge run (knowledge_on)")
    parser.add_argument("--colours", default="橙色,黄色,蓝色,紫色")
    args = parser.parse_args()
    palette = {name: detect.srgb_to_lab(np.array(rgb, np.float32) / 255) for name, rgb in COLOURS.items()}
    rows = [json.loads(line) for line in (args.run / "detections.jsonl").open(encoding="utf-8")]
    print("| asked | right images | their ΔE to it, median | misses: read as (ΔE to asked / to read) |")
    print("|---|---:|---:|---|")
    for asked in args.colours.split(","):
        right, misses = [], []
        for row in rows:
            lab = object_lab(args.run / row["file"]) if row["colour"] == asked else None
            if lab is None:
                continue
            to = {name: float(np.linalg.norm(lab - ref)) for name, ref in palette.items()}
            if row["colour_ok"]:
                right.append(to[asked])
            else:
                misses.append(
                    f"{row['detected_colour']} ({to[asked]:.0f} / {to[row['detected_colour']]:.0f})"
                )
        median = f"{statistics.median(right):.1f}" if right else "-"
        print(f"| {asked} | {len(right)} | {median} | {', '.join(misses) or 'none'} |")


if __name__ == "__main__":
    main()
