"""Wall and CPU seconds of each phase of a cold `rapiddiff generate PROMPT`, in one fresh process.

    python benchmarks/cold_start_phases.py [--runs 3] [--out DIR]

Each run is a fresh ``python -c`` child (nothing imported or cached in memory; it runs in the output
folder, so ``rapiddiff`` is the one on PYTHONPATH or installed, not a checkout in the current
folder), which does what
``rapiddiff generate PROMPT --seed 1`` does with the built-in model, phase by phase: import torch;
import rapiddiff's pipeline module; ``RapidDiffusionPipeline.from_pretrained`` (the library imports
it needs — diffusers, transformers — happen inside, as in the command); the call's prompt encoding,
denoising and VAE decode; the ×4 upscale; writing the PNG with its metadata. CPU seconds are the
child's own (user + sys): on a machine shared with other jobs they compare trees where wall seconds
measure the neighbours. The table prints the median of the runs per phase.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, resource, sys, time

def cpu():
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime

rows, last = [], (time.perf_counter(), cpu())
def mark(name):
    global last
    now = (time.perf_counter(), cpu())
    rows.append((name, now[0] - last[0], now[1] - last[1]))
    last = now

import torch
mark("import torch")
from rapiddiff.infer.generate_cli import default_model_dir
from rapiddiff.infer.pipeline import RapidDiffusionPipeline
from rapiddiff.infer.png import save_png
mark("import rapiddiff")
pipe = RapidDiffusionPipeline.from_pretrained(default_model_dir())
mark("load the model (library imports inside)")
out = pipe("浅蓝色背景上有一个番茄", seed=1, upscale=True, progress=False)
mark("the call (encode, 25 steps, decode, upscale)")
rows.append(("  of which encode, 25 steps, decode", out.seconds["encode"] + out.seconds["denoise_decode"], None))
rows.append(("  of which upscale x4", out.seconds["upscale"], None))
save_png(out.images[0], os.path.join(sys.argv[1], "00001-1.png"), out.metadata[0])
mark("PNG")
import rapiddiff
print(json.dumps({"rows": rows, "modules": len(sys.modules), "tree": os.path.dirname(os.path.dirname(rapiddiff.__file__))}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", help="folder for the PNGs (default: a temporary one)")
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="cold-start-")
    runs = []
    for i in range(args.runs):
        load = os.getloadavg()[0]
        done = subprocess.run(
            [sys.executable, "-c", CHILD, out], capture_output=True, text=True, check=True, cwd=out
        )
        result = json.loads(done.stdout.strip().splitlines()[-1])
        runs.append(result["rows"])
        print(
            f"run {i + 1} ({result['tree']}, load {load:.2f}, {result['modules']} modules): "
            + " | ".join(f"{n} {w:.2f}" for n, w, _ in result["rows"]),
            flush=True,
        )
    print("\n| phase | wall s (median) | CPU s (median) |\n|---|---:|---:|")
    for k, (name, _, _) in enumerate(runs[0]):
        wall = statistics.median(r[k][1] for r in runs)
        cpus = [r[k][2] for r in runs if r[k][2] is not None]
        cpu_text = f"{statistics.median(cpus):.2f}" if cpus else "—"
        print(f"| {name} | {wall:.2f} | {cpu_text} |")


if __name__ == "__main__":
    main()
