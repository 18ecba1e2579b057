"""DeepCache's price on the built-in kshapes model (CPU): quality and speed against the exact path.

For each interval N (1 = the exact path, measured in the same run) the same prompts and seeds go
through ``RapidDiffusionPipeline(..., deep_cache=N)`` with the model's own sampling defaults.
Reported per N:

* PSNR and SSIM of every image against the exact image of the same prompt and seed;
* the kshapes detector's colour / shape / both accuracy (``rapiddiff.eval.knowledge.score_run``
  on a run folder per N, so it is the number ``rapiddiff eval knowledge`` would give), and how
  often it reads the same colour and shape as on the exact image;
* full and cached U-Net evaluations per image (counted by a hook on a deep layer's own forward
  and by the DeepCache controller) and wall seconds per image (batches after one warm-up batch).

    python benchmarks/deep_cache_kshapes.py --out /tmp/dc --intervals 1 2 3 5 --prompts 24 --seeds 2

Prompts: the kshapes evaluation templates over the built-in model's entities
(``evaluation_prompts``), the first ``--prompts`` of them; seeds 0..``--seeds``-1 for each.
Writes ``OUT/deep_cache_kshapes.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any


def prompts(count: int) -> list[dict[str, Any]]:
    from rapiddiff.data.kshapes.generate import KShapesConfig, evaluation_prompts

    rows = evaluation_prompts(KShapesConfig(out=Path("unused")), heldout=set())
    # Spread over entities: the first prompt of every entity, then the second ones.
    rows = rows[::2] + rows[1::2]
    return rows[:count]


def psnr(a: Any, b: Any) -> float:
    import numpy as np

    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def ssim(a: Any, b: Any) -> float:
    import torch
    from torchmetrics.functional import structural_similarity_index_measure

    ta = torch.from_numpy(a).permute(2, 0, 1)[None].double()
    tb = torch.from_numpy(b).permute(2, 0, 1)[None].double()
    return float(structural_similarity_index_measure(ta, tb, data_range=1.0))


def unet_call_times(pipe: Any, intervals: list[int], repeats: int = 7) -> dict[int, float]:
    """Milliseconds per U-Net evaluation averaged over one interval's full + cached calls, at the
    batch of one guided image (2 rows), min over ``repeats`` after a warm-up (robust to a busy machine)."""
    import torch

    from rapiddiff.models.deep_cache import DeepCache

    unet = pipe.unet
    side = int(unet.config.sample_size)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, int(unet.config.in_channels), side, side, generator=g)
    with torch.inference_mode():
        ctx = pipe.encode_prompt(["蓝色背景上有一个番茄"] * 2, do_classifier_free_guidance=False)[0]
        for _ in range(3):
            unet(x, torch.tensor(500), encoder_hidden_states=ctx)
        result = {}
        for n in intervals:
            best = math.inf
            for _ in range(repeats):
                with DeepCache.of(unet).active(n) as step:
                    t0 = time.perf_counter()
                    for i in range(n):
                        step(i)
                        unet(x, torch.tensor(500 - i), encoder_hidden_states=ctx)
                    best = min(best, (time.perf_counter() - t0) / n)
            result[n] = best * 1e3
    return result


def generate_and_score(
    pipe: Any, jobs: list[tuple[dict[str, Any], int]], run: Path, args: argparse.Namespace, **switch: Any
) -> tuple[list[Any], list[float], list[dict[str, Any]]]:
    """Images of ``jobs`` ((prompt row, seed) pairs) in batches of ``args.batch`` with ``switch``
    passed to the pipeline (e.g. ``deep_cache=3``), saved under ``run`` with an index.jsonl and read
    by the kshapes detector: (images, seconds per image of each batch, the detector's records)."""
    from PIL import Image

    from rapiddiff.eval.common import write_jsonl
    from rapiddiff.eval.knowledge import score_run

    times, outs = [], []
    for start in range(0, len(jobs), args.batch):
        batch = jobs[start : start + args.batch]
        t0 = time.perf_counter()
        res = pipe(
            [r["text"] for r, _ in batch],
            seed=[s for _, s in batch],
            output_type="np",
            progress=False,
            scheduler=args.scheduler,
            num_inference_steps=args.steps,
            **switch,
        )
        times.append((time.perf_counter() - t0) / len(batch))
        outs.extend(list(res.images))
    run.mkdir(exist_ok=True)
    index = []
    for k, ((row, seed), img) in enumerate(zip(jobs, outs, strict=True)):
        name = f"{k:04d}-{seed}.png"
        Image.fromarray((img * 255).round().astype("uint8")).save(run / name)
        index.append({"file": name, "seed": seed, **row})
    write_jsonl(run / "index.jsonl", index)
    return outs, times, score_run(run, workers=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="model folder (default: the built-in kshapes model)")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    parser.add_argument("--intervals", type=int, nargs="+", default=[1, 2, 3, 5])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    parser.add_argument("--scheduler", help="sampler (default: the model's own sampling defaults)")
    parser.add_argument("--steps", type=int, help="steps (default: the model's own)")
    args = parser.parse_args(argv)

    import numpy as np
    import torch

    from rapiddiff.infer.pipeline import RapidDiffusionPipeline
    from rapiddiff.models.builtin import builtin_model_dir
    from rapiddiff.models.deep_cache import DeepCache

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else builtin_model_dir("kshapes")
    pipe = RapidDiffusionPipeline.from_pretrained(model)
    rows = prompts(args.prompts)
    jobs = [(row, seed) for seed in range(args.seeds) for row in rows]
    if 1 not in args.intervals:
        args.intervals = [1, *args.intervals]
    deep = pipe.unet.mid_block.resnets[0]  # runs only on full evaluations (its block is cached)
    full_calls = [0]
    deep.register_forward_hook(lambda *_: full_calls.__setitem__(0, full_calls[0] + 1))
    controller = DeepCache.of(pipe.unet)

    images: dict[int, list[Any]] = {}
    results: dict[int, dict[str, Any]] = {}
    detections: dict[int, list[tuple[Any, Any]]] = {}
    for n in args.intervals:
        full_calls[0] = 0
        cached_before = controller.cached_evaluations
        outs, times, records = generate_and_score(pipe, jobs, out / f"interval_{n}", args, deep_cache=n)
        images[n] = outs
        detections[n] = [(r["detected_colour"], r["detected_shape"]) for r in records]
        acc = {
            k: 100.0 * sum(r[f"{k}_ok"] for r in records) / len(records) for k in ("colour", "shape", "both")
        }
        timed = times[1:] if len(times) > 1 else times  # the first batch warms up
        results[n] = {
            "interval": n,
            "images": len(outs),
            "full_unet_evals_per_image_batch": full_calls[0] / math.ceil(len(jobs) / args.batch),
            "cached_unet_evals_per_image_batch": (controller.cached_evaluations - cached_before)
            / math.ceil(len(jobs) / args.batch),
            "seconds_per_image_median": statistics.median(timed),
            "seconds_per_image_all": times,
            "accuracy_percent": acc,
        }
        print(json.dumps(results[n]), flush=True)
    unet_ms = unet_call_times(pipe, args.intervals)
    for n in args.intervals:
        results[n]["unet_call_ms"] = unet_ms[n]
        # The detector reads the same colour and shape as on the exact image (finer than accuracy).
        same = sum(a == b for a, b in zip(detections[n], detections[1], strict=True))
        results[n]["same_detection_as_exact_percent"] = 100.0 * same / len(detections[n])
        pairs = list(zip(images[n], images[1], strict=True))
        p = [psnr(a, b) for a, b in pairs]
        s = [ssim(a.astype(np.float64), b.astype(np.float64)) for a, b in pairs]
        finite = [v for v in p if math.isfinite(v)]
        results[n]["psnr_db_mean"] = statistics.mean(finite) if finite else math.inf
        results[n]["psnr_db_min"] = min(p)
        results[n]["ssim_mean"] = statistics.mean(s)
        base = results[1]["seconds_per_image_median"]
        results[n]["speedup_wall"] = base / results[n]["seconds_per_image_median"]

    meta = {
        "model": str(model),
        "sampling": {
            **pipe.sampling.to_dict(),
            **({"scheduler": args.scheduler} if args.scheduler else {}),
            **({"num_inference_steps": args.steps} if args.steps else {}),
        },
        "prompts": len(rows),
        "seeds": args.seeds,
        "batch": args.batch,
        "torch_threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "torch": torch.__version__,
    }
    (out / "deep_cache_kshapes.json").write_text(
        json.dumps({"meta": meta, "results": list(results.values())}, indent=2, ensure_ascii=False)
    )
    lines = [
        "| N | full / cached U-Net evals per batch | ms per U-Net eval (min) | s/image (median) | speed-up "
        "| PSNR dB (mean, min) | SSIM | colour % | shape % | both % | same detection as exact % |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n in args.intervals:
        r = results[n]
        acc = r["accuracy_percent"]
        lines.append(
            f"| {'exact' if n == 1 else n} | {r['full_unet_evals_per_image_batch']:.0f} / "
            f"{r['cached_unet_evals_per_image_batch']:.0f} | {r['unet_call_ms']:.1f} | "
            f"{r['seconds_per_image_median']:.3f} | "
            f"{r['speedup_wall']:.2f}× | {r['psnr_db_mean']:.1f}, {r['psnr_db_min']:.1f} | {r['ssim_mean']:.3f} | "
            f"{acc['colour']:.1f} | {acc['shape']:.1f} | {acc['both']:.1f} | "
            f"{r['same_detection_as_exact_percent']:.1f} |"
        )
    table = "\n".join(lines)
    (out / "deep_cache_kshapes.md").write_text(json.dumps(meta, ensure_ascii=False) + "\n\n" + table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
