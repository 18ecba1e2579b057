"""CPU time to upscale one 128×128 image to 512×512: the kshapes compact net vs the old 6×32 RRDB.

Both networks have random weights (speed does not depend on them) and are built from their
configs: the compact one from ``configs/upscaler/kshapes.yaml`` (``model.network``), the RRDB one
with the 6 blocks × 32 features the kshapes config used before. fp32, ``torch.inference_mode``,
``torch.set_num_threads(--threads)``; one warm-up call, then the median of ``--repeats`` calls.
Prints a table and writes ``$OUT/upscaler_cpu_speed.json`` (or ``--out``) when given.

    OMP_NUM_THREADS=2 python benchmarks/upscaler_cpu_speed.py --threads 2 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import yaml

from rapiddiff.models.upscaler import build_upscaler, upscale

ROOT = Path(__file__).resolve().parents[1]
OLD_RRDB = {"arch": "rrdb", "num_blocks": 6, "num_feat": 32, "scale": 4}


def kshapes_network() -> dict:
    """``model.network`` of the shipped kshapes upscaler config (arch and build options)."""
    config = yaml.safe_load((ROOT / "configs/upscaler/kshapes.yaml").read_text("utf-8"))
    return {k: v for k, v in config["model"]["network"].items() if v is not None}


def time_one(network: dict, size: int, repeats: int) -> dict:
    options = dict(network)
    arch = options.pop("arch")
    torch.manual_seed(0)
    net = build_upscaler(arch, **options).eval()
    image = torch.rand(1, 3, size, size, generator=torch.Generator().manual_seed(0))
    out = upscale(net, image)  # warm-up (allocations, oneDNN kernel selection)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        upscale(net, image)
        seconds.append(time.perf_counter() - start)
    params = sum(p.numel() for p in net.parameters())
    return {
        "network": network,
        "params": params,
        "fp16_mb": round(params * 2 / 1e6, 3),
        "output": list(out.shape),
        "median_s": round(statistics.median(seconds), 4),
        "min_s": round(min(seconds), 4),
        "runs_s": [round(s, 4) for s in seconds],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per network (default 5)")
    parser.add_argument("--size", type=int, default=128, help="input side in pixels (default 128 → 512)")
    parser.add_argument(
        "--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}",
        "threads": args.threads,
        "input": [args.size, args.size],
        "compact_kshapes": time_one(kshapes_network(), args.size, args.repeats),
        "rrdb_6x32": time_one(OLD_RRDB, args.size, args.repeats),
    }
    for name in ("compact_kshapes", "rrdb_6x32"):
        r = results[name]
        print(
            f"{name:16s} {r['params']:>9,d} params  {r['fp16_mb']:.2f} MB fp16  median {r['median_s']:.3f} s"
        )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "upscaler_cpu_speed.json").write_text(json.dumps(results, indent=2), "utf-8")
    return results


if __name__ == "__main__":
    main()
