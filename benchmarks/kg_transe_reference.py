"""Reproduce published TransE figures on UMLS and Kinships with ``rapiddiff kg train``'s code path.

Datasets ship inside the pykeen wheel (no download). References (filtered, test split):
UMLS Hits@10 0.989, mean rank 1.84; Kinships Hits@10 0.878 (pykeen's ablation study, TransE; in
github.com/pykeen/benchmarking ablation/summary/results.tsv that is the 4-replicate mean of the
sLCWA + NSSA studies, 0.8776). configs/kg/kinships.yaml runs the study's LCWA + cross-entropy
pipeline, whose own 4 replicates averaged 0.863 (0.853-0.873); both are printed.
Pass: |ours - published| <= 0.02 on Hits@10.

Which Hits@10: ours uses pykeen's "realistic" ranks (tied scores share their mean rank). The
study's pykeen 0.1.2-dev results.json files list hits_at_k "best"/"avg"/"worst" (optimistic /
realistic / pessimistic) and for TransE they are identical (continuous distances have no ties),
so the published figure is the same under all three; we compare realistic and also print the
optimistic and pessimistic values so a tie problem would show.

    python benchmarks/kg_transe_reference.py                       # both, configs/kg/{umls,kinships}.yaml
    python benchmarks/kg_transe_reference.py --only kinships --threads 2
    OUT=/some/dir python benchmarks/kg_transe_reference.py --device cuda   # writes OUT/kg_transe_reference.{json,md}

Each run writes its KnowledgeStore under --store-root (default runs/kg/) with the metrics in
its config.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCES = {
    "umls": {"hits_at_10": 0.989, "mean_rank": 1.84},
    # config_hits_at_10: the shipped config's own pipeline in the study (mean of its 4 replicates)
    "kinships": {"hits_at_10": 0.878, "config_hits_at_10": 0.863},
}
METRIC = "filtered Hits@10, realistic ranks (ties share their mean rank)"
TOLERANCE = 0.02


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--only", choices=sorted(REFERENCES), action="append", help="run only this dataset (repeatable)"
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--epochs", type=int, default=None, help="override the configs' epochs (for a quick look)"
    )
    parser.add_argument("--store-root", type=Path, default=ROOT / "runs" / "kg")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    import torch

    from rapiddiff.kg.transe import load_transe_config, train_transe
    from rapiddiff.utils.logging import setup_logging

    setup_logging(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for name in args.only or sorted(REFERENCES):
        cfg = load_transe_config(
            ROOT / "configs" / "kg" / f"{name}.yaml",
            out=args.store_root / name,
            device=args.device,
            epochs=args.epochs,
            num_threads=args.threads,
            progress=not args.no_progress,
        )
        _, metrics = train_transe(cfg)
        ref = REFERENCES[name]
        delta = metrics["hits_at_10"] - ref["hits_at_10"]
        rows.append(
            {
                "dataset": name,
                **{
                    k: metrics[k]
                    for k in (
                        "hits_at_10",
                        "hits_at_10_optimistic",
                        "hits_at_10_pessimistic",
                        "hits_at_3",
                        "hits_at_1",
                        "mrr",
                        "mean_rank",
                        "epochs_run",
                        "train_seconds",
                    )
                },
                "published_hits_at_10": ref["hits_at_10"],
                "published_mean_rank": ref.get("mean_rank"),
                "config_published_hits_at_10": ref.get("config_hits_at_10"),
                "metric": METRIC,
                "delta_hits_at_10": delta,
                "within_tolerance": abs(delta) <= TOLERANCE,
            }
        )
        print(json.dumps(rows[-1]), flush=True)

    device = str(args.device)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev_desc = (
        torch.cuda.get_device_name(0)
        if device.startswith("cuda")
        else f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    )
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": dev_desc,
        "command": "python "
        + " ".join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]),
        "metric": METRIC,
        "rows": rows,
    }
    lines = [
        "| dataset | Hits@10 (realistic) | optimistic / pessimistic | published | Δ | same pipeline published | "
        "MR | published MR | MRR | Hits@1 | Hits@3 | epochs | train s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pmr = f"{r['published_mean_rank']:.2f}" if r["published_mean_rank"] else "—"
        pcfg = f"{r['config_published_hits_at_10']:.3f}" if r["config_published_hits_at_10"] else "—"
        lines.append(
            f"| {r['dataset']} | {r['hits_at_10']:.3f} | {r['hits_at_10_optimistic']:.3f} / "
            f"{r['hits_at_10_pessimistic']:.3f} | {r['published_hits_at_10']:.3f} | {r['delta_hits_at_10']:+.3f} | "
            f"{pcfg} | {r['mean_rank']:.2f} | {pmr} | {r['mrr']:.3f} | {r['hits_at_1']:.3f} | {r['hits_at_3']:.3f} | "
            f"{r['epochs_run']} | {r['train_seconds']:.0f} |"
        )
    table = f"Metric: {METRIC}; Δ = ours − published.\n\n" + "\n".join(lines)
    print(f"\n{report['date']} — {report['device']}\n{table}")
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "kg_transe_reference.json").write_text(json.dumps(report, indent=2))
        Path(out, "kg_transe_reference.md").write_text(f"{report['date']} — {report['device']}\n\n{table}\n")
    return 0 if all(r["within_tolerance"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
