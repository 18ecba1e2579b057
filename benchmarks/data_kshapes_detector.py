"""Accuracy of the kshapes attribute detector on a fresh render set, clean and degraded.

Writes a fresh kshapes test split (seed 1234, never used for training) at 128² with its 512²
drawings, then reads colour, shape, background and position back off every image with
``detect_attributes`` — clean, and after Gaussian noise, Gaussian blur (radius scaled with the
image), both, a global colour shift and JPEG compression — the kinds of damage a generated image
shows, up to levels where the detector starts to fail. Results go to
``$OUT/data_kshapes_detector.{json,md}`` (or ``--out``).

    OMP_NUM_THREADS=1 python benchmarks/data_kshapes_detector.py --n 1000
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from PIL import Image, ImageFilter

from rapiddiff.data.kshapes import KShapesConfig, detect_attributes, generate_kshapes

KEYS = ("colour", "shape", "background", "position")


def degrade(image: Image.Image, kind: str, rng: np.random.Generator) -> Image.Image:
    """Apply the damage named ``kind``: "noiseS" (Gaussian σ=S grey levels), "blurR" (Gaussian
    radius R at 128², scaled with the image), "shiftD" (every channel of the whole image moved by
    up to ±D), "jpegQ", or several joined by "+"."""
    scale = image.size[0] / 128
    for part in kind.split("+"):
        if part.startswith("blur"):
            image = image.filter(ImageFilter.GaussianBlur(float(part[4:]) * scale))
        elif part.startswith("noise"):
            noisy = np.asarray(image, np.float32) + rng.normal(0, float(part[5:]), (*image.size[::-1], 3))
            image = Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))
        elif part.startswith("shift"):
            delta = rng.uniform(-float(part[5:]), float(part[5:]), 3)
            image = Image.fromarray(np.clip(np.asarray(image, np.float32) + delta, 0, 255).astype(np.uint8))
        elif part.startswith("jpeg"):
            buffer = io.BytesIO()
            image.save(buffer, format="JPEG", quality=int(part[4:]))
            image = Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")
        elif part != "clean":
            raise ValueError(f"unknown degradation {part!r}")
    return image


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1000, help="test images")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = parser.parse_args()
    kinds = (
        "clean",
        "noise8",
        "noise16",
        "noise32",
        "blur1",
        "blur2",
        "blur3",
        "noise8+blur1",
        "noise25+blur2",
        "shift20",
        "shift40",
        "jpeg75",
        "jpeg30",
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ks"
        generate_kshapes(KShapesConfig(out=root, seed=1234, train=0, val=0, test=args.n), progress=False)
        meta = [
            json.loads(line)
            for line in (root / "test" / "metadata.jsonl").read_text(encoding="utf-8").splitlines()
        ]
        for folder, size in ((root / "test", 128), (root / "hr" / "test", 512)):
            images = [Image.open(folder / m["file_name"]).convert("RGB") for m in meta]
            for kind in kinds:
                rng = np.random.default_rng(0)
                right = dict.fromkeys((*KEYS, "all"), 0)
                start = time.perf_counter()
                for image, m in zip(images, meta, strict=True):
                    got = detect_attributes(degrade(image, kind, rng))
                    ok = {k: got[k] == m[k] for k in KEYS}
                    for k in KEYS:
                        right[k] += ok[k]
                    right["all"] += all(ok.values())
                ms = (time.perf_counter() - start) / len(images) * 1000
                row = {
                    "size": size,
                    "degradation": kind,
                    **{k: v / len(meta) for k, v in right.items()},
                    "ms_per_image": ms,
                }
                rows.append(row)
                print(row, flush=True)
    info = {
        "command": f"OMP_NUM_THREADS=1 python benchmarks/data_kshapes_detector.py --n {args.n}",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": f"{platform.machine()}, {os.cpu_count()} CPU cores visible",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "data_kshapes_detector.json").write_text(json.dumps({"meta": info, "rows": rows}, indent=1))
    lines = [
        f"`{info['command']}` — {info['device']}, {info['date']}",
        "",
        "| size | degradation | colour | shape | background | position | all four | ms/image |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['size']} | {r['degradation']} | {r['colour']:.1%} | {r['shape']:.1%} | {r['background']:.1%} | "
        f"{r['position']:.1%} | {r['all']:.1%} | {r['ms_per_image']:.1f} |"
        for r in rows
    ]
    (args.out / "data_kshapes_detector.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
