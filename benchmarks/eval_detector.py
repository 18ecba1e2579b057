"""The ceiling of ``rapiddiff eval knowledge``: its scoring on kshapes' own rendered images.

``eval knowledge`` can only be as right as the detector that reads colour and shape off an
image. This scores the ground-truth renders of a kshapes split (entity captions only, as the
evaluation prompts are) through the same code (``rapiddiff.eval.knowledge.score_run``) and
reports the accuracy a perfect generator would get, and the detector's throughput.

    OUT=/tmp/out python benchmarks/eval_detector.py                    # renders 300 test images at 128²
    OUT=/tmp/out python benchmarks/eval_detector.py --kshapes DIR      # an existing kshapes folder

Writes ``$OUT/eval_detector.json`` and ``$OUT/eval_detector.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kshapes", type=Path, help="a kshapes folder (default: render a test split here)")
    parser.add_argument("--split", default="test")
    parser.add_argument("--images", type=int, default=300, help="images to render when no --kshapes is given")
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--workers", type=int, default=0)
    args = parser.parse_args(argv)

    from rapiddiff.eval.common import read_jsonl, write_jsonl
    from rapiddiff.eval.knowledge import accuracy_table, score_run

    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    kshapes = args.kshapes
    if kshapes is None:
        from rapiddiff.data.kshapes import KShapesConfig, generate_kshapes

        kshapes = Path(tempfile.mkdtemp(prefix="kshapes-")) / "ks"
        generate_kshapes(
            KShapesConfig(out=kshapes, size=args.size, train=0, val=0, test=args.images, hr_scale=0)
        )
    split = kshapes / args.split
    rows = [r for r in read_jsonl(split / "metadata.jsonl") if r.get("entity")]
    heldout = set((kshapes / "heldout_entities.txt").read_text(encoding="utf-8").split())
    # The split folder as an eval run: index.jsonl beside the images, files relative to it.
    run = Path(tempfile.mkdtemp(prefix="detector-run-"))
    (run / "images").symlink_to(split.resolve())
    write_jsonl(
        run / "index.jsonl",
        [
            {
                "file": f"images/{r['file_name']}",
                "prompt": r["text"],
                "entity": r["entity"],
                "colour": r["colour"],
                "shape": r["shape"],
                "split": "heldout" if r["entity"] in heldout else "seen",
            }
            for r in rows
        ],
    )
    t0 = time.perf_counter()
    records = score_run(run, None, workers=args.workers)
    seconds = time.perf_counter() - t0
    table = accuracy_table({"ground truth": records})
    result = {
        "command": " ".join([sys.executable, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": os.cpu_count(),
        "kshapes": str(kshapes),
        "size": args.size,
        "images": len(records),
        "images_per_s": round(len(records) / seconds, 1),
        "workers": args.workers,
        "table": table,
        "misses": [
            {k: r[k] for k in ("file", "colour", "shape", "detected_colour", "detected_shape")}
            for r in records
            if not r["both_ok"]
        ][:20],
    }
    (out / "eval_detector.json").write_text(json.dumps(result, ensure_ascii=False, indent=2) + "\n")
    md = ["| entities | images | colour % | shape % | both % |", "|---|---:|---:|---:|---:|"]
    md += [
        f"| {r['split']} | {r['images']} | {r['colour']:.1f} | {r['shape']:.1f} | {r['both']:.1f} |"
        for r in table
    ]
    md += [
        "",
        f"{len(records)} ground-truth renders at {args.size}², {result['images_per_s']} images/s "
        f"({args.workers or 'no'} worker processes, {os.cpu_count()} CPUs), {result['date']}",
    ]
    (out / "eval_detector.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
