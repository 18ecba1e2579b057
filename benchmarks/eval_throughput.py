"""How fast ``rapiddiff eval sample`` / ``eval knowledge`` make and score images.

Times the sampling loop that both commands run (``rapiddiff.eval.sample.generate``), eager and
through the fast path, at several batch sizes, then the kshapes detector (in-process and with
worker processes). One warm-up batch per configuration is excluded from the timing.

    OUT=/tmp/out python benchmarks/eval_throughput.py --model MODEL_DIR      # GPU: a kshapes model
    OUT=/tmp/out python benchmarks/eval_throughput.py --tiny --steps 2        # CPU smoke test

Writes ``$OUT/eval_throughput.json`` and ``$OUT/eval_throughput.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, help="model folder (a kshapes model on the GPU)")
    parser.add_argument("--tiny", action="store_true", help="use a tiny random model (CPU smoke test)")
    parser.add_argument("--images", type=int, default=64, help="timed images per configuration")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--no-fast", action="store_true", help="skip the fast path")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args(argv)

    import torch

    from rapiddiff.data.kshapes import ENTITIES
    from rapiddiff.eval.knowledge import score_run
    from rapiddiff.eval.sample import SampleSettings, generate, plan_jobs
    from rapiddiff.infer.pipeline import RapidDiffusionPipeline
    from rapiddiff.utils.device import resolve_device, resolve_dtype

    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="eval-bench-"))
    model = args.model
    if args.tiny or model is None:
        from rapiddiff.models.presets import write_tiny_sd_folder

        model = write_tiny_sd_folder(work / "tiny", text="bert")
    device = resolve_device(args.device)
    pipe = RapidDiffusionPipeline.from_pretrained(model, device=device, dtype=resolve_dtype("auto", device))
    paths = {"eager": pipe}
    if not args.no_fast and device.type == "cuda":
        from rapiddiff.infer.accelerate import accelerate

        # accelerate() transforms the pipeline it is given: the fast path gets its own copy.
        fast = RapidDiffusionPipeline.from_pretrained(
            model, device=device, dtype=resolve_dtype("auto", device)
        )
        paths["fast"] = accelerate(fast)

    prompts = [{"text": f"浅蓝色背景上有一个{e.name}"} for e in ENTITIES]
    rows = []
    for name, sampler in paths.items():
        for bs in [int(b) for b in args.batch_sizes.split(",")]:
            settings = SampleSettings(model=str(model), steps=args.steps, fast=name == "fast")
            warm = plan_jobs(prompts[:1], bs, 10_000)
            generate(sampler, warm, work / f"warm-{name}-{bs}", settings, batch_size=bs)
            jobs = plan_jobs(prompts, 1, 0)
            jobs = (jobs * (args.images // len(jobs) + 1))[: args.images]
            jobs = [type(j)(k, j.prompt, k, f"images/{k:06d}_s{k}.png") for k, j in enumerate(jobs)]
            run = work / f"{name}-{bs}"
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            generate(sampler, jobs, run, settings, batch_size=bs)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            rows.append(
                {
                    "path": name,
                    "batch": bs,
                    "images": len(jobs),
                    "seconds": round(seconds, 3),
                    "images_per_s": round(len(jobs) / seconds, 3),
                }
            )
            print(rows[-1], flush=True)

    # Detector throughput on the last run's images (their content does not change its cost much).
    index_rows = [json.loads(line) for line in (run / "index.jsonl").read_text().splitlines()]
    for row in index_rows:
        row.update(entity="x", colour="红色", shape="圆形", split="seen")
    (run / "index.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in index_rows))
    detect = []
    for workers in (0, min(8, os.cpu_count() or 1)):
        t0 = time.perf_counter()
        score_run(run, None, workers=workers)
        seconds = time.perf_counter() - t0
        detect.append(
            {
                "workers": workers,
                "images": len(index_rows),
                "images_per_s": round(len(index_rows) / seconds, 2),
            }
        )
        print(detect[-1], flush=True)

    result = {
        "command": " ".join([sys.executable, *sys.argv]),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": str(model),
        "steps": args.steps,
        "sampling": rows,
        "detector": detect,
    }
    (out / "eval_throughput.json").write_text(json.dumps(result, ensure_ascii=False, indent=2) + "\n")
    md = ["| path | batch | images/s |", "|---|---:|---:|"]
    md += [f"| {r['path']} | {r['batch']} | {r['images_per_s']:.2f} |" for r in rows]
    md += ["", "| detector workers | images/s |", "|---:|---:|"]
    md += [f"| {d['workers']} | {d['images_per_s']:.1f} |" for d in detect]
    md += ["", f"{result['device']}, {result['date']}, {args.steps} steps, model {model}"]
    (out / "eval_throughput.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
