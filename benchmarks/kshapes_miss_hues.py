"""Where a wrongly coloured object's colour lies: between the asked colour and the one read, or on it.

    python benchmarks/kshapes_miss_hues.py RUN/knowledge_on [--colours 橙色,黄色,蓝色,紫色]

RUN is a `rapiddiff eval knowledge` run folder (its detections.jsonl and images). For every image of
an asked colour, the object's CIELAB colour as the kshapes detector reads it (``detect_attributes``'s
``lab``) and its ΔE76 to each palette colour: right images sit close to theirs; a miss that sits between the
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

from rapiddiff.data.kshapes import detect_attributes
from rapiddiff.data.kshapes.palette import COLOUR_LAB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a mode folder of an eval knowledge run (knowledge_on)")
    parser.add_argument("--colours", default="橙色,黄色,蓝色,紫色")
    args = parser.parse_args()
    rows = [json.loads(line) for line in (args.run / "detections.jsonl").open(encoding="utf-8")]
    print("| asked | right images | their ΔE to it, median | misses: read as (ΔE to asked / to read) |")
    print("|---|---:|---:|---|")
    for asked in args.colours.split(","):
        right, misses = [], []
        for row in rows:
            if row["colour"] != asked:
                continue
            image = Image.open(args.run / row["file"])
            lab = detect_attributes(image, layout=row.get("layout") or "row3")["lab"]
            if lab is None:
                continue
            to = {name: float(np.linalg.norm(np.asarray(lab) - ref)) for name, ref in COLOUR_LAB.items()}
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
