"""Value contrast on the chain's own U-Nets: the same models, prompts and seeds, strength S against 0.

    python benchmarks/kshapes_contrast_eval.py --chain /tmp/ks --seeds 0,1,2 --strengths 0.25 --out OUT

After `kshapes_chain.py` has trained and evaluated its seeds (CHAIN/seed-S/), each seed's knowledge-on
U-Net folder is evaluated again with ``rapiddiff eval knowledge --value-contrast S``: the attribute
captions (knowledge on) and the seen, held-out and validation entities (modes on and both), with the
chain's own steps, images per prompt, seed and chosen guidance, so strength 0 is the chain's own
evaluation (results/knowledge_unet-on, results/knowledge_attribute_unet-on) and the rows compare like
with like. Every evaluation of every seed runs at once (the models are small). OUT/contrast.{md,json}:
mean ± sd over the seeds, and each seed's figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

MEASURES = (  # (split, knowledge, column) of eval knowledge's table
    ("attribute", "on", "all"),
    ("attribute", "on", "colour"),
    ("attribute", "on", "shape"),
    ("heldout", "on", "both"),
    ("heldout", "both", "both"),
    ("heldout", "both", "colour"),
    ("heldout", "both", "shape"),
    ("seen", "on", "both"),
    ("seen", "both", "both"),
    ("val", "on", "both"),
    ("val", "both", "both"),
)


def table(path: Path) -> dict[tuple[str, str, str], float]:
    rows = json.loads(path.read_text("utf-8"))["table"]
    return {
        (r["split"], r["knowledge"], column): r[column]
        for r in rows
        if "variant" not in r
        for column in ("all", "colour", "shape", "both")
        if r.get(column) is not None
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chain", type=Path, required=True, help="kshapes_chain.py's --out")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument(
        "--strengths", default="0.25", help="comma-separated; 0 is the chain's own evaluation"
    )
    parser.add_argument(
        "--model", default="unet_on", help="the seed folder's model (unet_on_r2 after two rounds)"
    )
    parser.add_argument("--steps", default="25")
    parser.add_argument("--images-per-prompt", default="2")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    strengths = [float(s) for s in args.strengths.split(",") if float(s) > 0]
    procs = []
    for seed in seeds:
        run = args.chain / f"seed-{seed}"
        guidance = json.loads((run / "results" / "guidance.json").read_text("utf-8"))["chosen"]
        for strength in strengths:
            for name, splits, modes in (
                ("attribute", "attribute", "on"),
                ("entities", "seen,heldout,val", "on,both"),
            ):
                out = run / "results" / f"contrast_{strength:g}" / name
                if (out / "metrics" / "knowledge.json").exists():
                    continue
                cmd = [sys.executable, "-m", "rapiddiff", "eval", "knowledge", "--model", str(run / args.model),
                       "--kshapes", str(run / "data"), "--out", str(out), "--splits", splits, "--modes", modes,
                       "--value-contrast", str(strength), "--steps", args.steps, "--images-per-prompt",
                       args.images_per_prompt, "--seed", str(seed), "--guidance", str(guidance)]  # fmt: skip
                out.mkdir(parents=True, exist_ok=True)
                log = (out.parent / f"{name}.log").open("w")
                procs.append((cmd, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)))
    failed = [cmd for cmd, proc in procs if proc.wait() != 0]
    if failed:
        raise SystemExit(
            f"{len(failed)} evaluation(s) failed; their logs are beside their run folders: {failed[0]}"
        )
    figures: dict[str, dict[str, dict[int, float]]] = {}  # strength → measure → seed → %
    for seed in seeds:
        results = args.chain / f"seed-{seed}" / "results"
        per_strength = {
            "0": {**table(results / "knowledge_attribute_unet-on" / "metrics" / "knowledge.json"),
                  **table(results / "knowledge_unet-on" / "metrics" / "knowledge.json")},
            **{f"{s:g}": {**table(results / f"contrast_{s:g}" / "attribute" / "metrics" / "knowledge.json"),
                          **table(results / f"contrast_{s:g}" / "entities" / "metrics" / "knowledge.json")}
               for s in strengths},
        }  # fmt: skip
        for strength, found in per_strength.items():
            for key in MEASURES:
                if key in found:
                    figures.setdefault(strength, {}).setdefault(" ".join(key), {})[seed] = found[key]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "contrast.json").write_text(json.dumps(figures, indent=1, ensure_ascii=False), "utf-8")
    names = list(figures)
    lines = [
        "| split, knowledge, measure % | " + " | ".join(f"value contrast {s}" for s in names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for key in MEASURES:
        measure = " ".join(key)
        cells = []
        for s in names:
            per_seed = figures[s].get(measure, {})
            values = list(per_seed.values())
            if not values:
                cells.append("")
                continue
            sd = statistics.stdev(values) if len(values) > 1 else 0.0
            seeds_text = " / ".join(f"{v:.1f}" for v in values)
            cells.append(f"{statistics.mean(values):.1f} ± {sd:.1f} ({seeds_text})")
        lines.append(f"| {measure} | " + " | ".join(cells) + " |")
    (args.out / "contrast.md").write_text("\n".join(lines) + "\n", "utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
