"""Token merging's price on the built-in kshapes model (CPU): quality and speed against the exact path.

For each ratio R (0 = the exact path, measured in the same run) the same prompts and seeds go
through ``RapidDiffusionPipeline(..., token_merge=R)`` with the model's own sampling defaults.
Reported per R, as ``deep_cache_kshapes.py`` reports DeepCache (its prompts, PSNR and SSIM):

* PSNR and SSIM of every image against the exact image of the same prompt and seed (mean, standard
  deviation, minimum);
* the kshapes detector's colour / shape / both accuracy (``rapiddiff.eval.knowledge.score_run`` on a
  run folder per R), over all images and per seed (mean ± standard deviation over the seeds), and how
  often it reads the same colour and shape as on the exact image;
* wall seconds per image (batches after one warm-up batch) and ms per U-Net evaluation (one guided
  image, minimum of 7).

The kshapes model's latents are 16² (128² images), so its highest-resolution level has 256 tokens:
ToMe there merges few tokens and attention is a small part of the work — the quality price is
measured here, the speed that matters on SD 1.5 (4,096 tokens) with ``rapiddiff bench``.

    python benchmarks/token_merge_kshapes.py --out /tmp/tome --ratios 0 0.25 0.5 0.75 --prompts 24 --seeds 3

Writes ``OUT/token_merge_kshapes.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any


def _deep_cache_script() -> Any:
    """benchmarks/deep_cache_kshapes.py (prompts, psnr, ssim): one definition of each."""
    path = Path(__file__).with_name("deep_cache_kshapes.py")
    spec = importlib.util.spec_from_file_location("deep_cache_kshapes", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def unet_call_ms(pipe: Any, ratios: list[float], repeats: int = 7) -> dict[float, float]:
    """Milliseconds per U-Net evaluation with each ratio at the batch of one guided image (2 rows),
    min over ``repeats`` after a warm-up (robust to a busy machine)."""
    import torch

    from rapiddiff.models.token_merge import TokenMerge

    unet = pipe.unet
    side = int(unet.config.sample_size)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, int(unet.config.in_channels), side, side, generator=g)
    result = {}
    with torch.inference_mode():
        ctx = pipe.encode_prompt(["蓝色背景上有一个番茄"] * 2, do_classifier_free_guidance=False)[0]
        for ratio in ratios:
            best = math.inf
            for k in range(repeats + 1):
                if ratio > 0:
                    with TokenMerge.of(unet).active(ratio, (side, side), x.device) as step:
                        step(k)
                        t0 = time.perf_counter()
                        unet(x, torch.tensor(500), encoder_hidden_states=ctx)
                        took = time.perf_counter() - t0
                else:
                    t0 = time.perf_counter()
                    unet(x, torch.tensor(500), encoder_hidden_states=ctx)
                    took = time.perf_counter() - t0
                if k:  # the first is a warm-up
                    best = min(best, took)
            result[ratio] = best * 1e3
    return result


def _spread(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="model folder (default: the built-in kshapes model)")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    parser.add_argument("--scheduler", help="sampler (default: the model's own sampling defaults)")
    parser.add_argument("--steps", type=int, help="steps (default: the model's own)")
    args = parser.parse_args(argv)

    import numpy as np
    import torch

    from rapiddiff.infer.pipeline import RapidDiffusionPipeline
    from rapiddiff.models.builtin import builtin_model_dir
    from rapiddiff.models.token_merge import TokenMerge, check_ratio

    dc = _deep_cache_script()
    ratios = [check_ratio(r, "--ratios") for r in args.ratios]
    if 0.0 not in ratios:
        ratios = [0.0, *ratios]
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else builtin_model_dir("kshapes")
    pipe = RapidDiffusionPipeline.from_pretrained(model)
    controller = TokenMerge.of(pipe.unet)
    rows = dc.prompts(args.prompts)
    jobs = [(row, seed) for seed in range(args.seeds) for row in rows]
    side = int(pipe.unet.config.sample_size)
    grid = side >> controller.level
    tokens = grid * grid

    images: dict[float, list[Any]] = {}
    results: dict[float, dict[str, Any]] = {}
    records: dict[float, list[dict[str, Any]]] = {}
    for ratio in ratios:
        outs, times, records[ratio] = dc.generate_and_score(
            pipe, jobs, out / f"ratio_{ratio:g}", args, token_merge=ratio
        )
        images[ratio] = outs
        acc = {}
        for key in ("colour", "shape", "both"):
            per_seed = [
                100.0
                * statistics.mean(
                    r[f"{key}_ok"] for r, (_, s) in zip(records[ratio], jobs, strict=True) if s == seed
                )
                for seed in range(args.seeds)
            ]
            mean, sd = _spread(per_seed)
            acc[key] = {
                "all": 100.0 * statistics.mean(r[f"{key}_ok"] for r in records[ratio]),
                "per_seed": per_seed,
                "seed_mean": mean,
                "seed_sd": sd,
            }
        timed = times[1:] if len(times) > 1 else times  # the first batch warms up
        merged = min(int(tokens * ratio), tokens - (grid // 2) ** 2)
        results[ratio] = {
            "token_merge": ratio,
            "images": len(outs),
            "tokens_merged": f"{merged} of {tokens} in {len(controller._wrapped) // 2} blocks",
            "seconds_per_image_median": statistics.median(timed),
            "seconds_per_image_all": times,
            "accuracy_percent": acc,
        }
        print(
            json.dumps({k: v for k, v in results[ratio].items() if k != "seconds_per_image_all"}), flush=True
        )
    unet_ms = unet_call_ms(pipe, ratios)
    for ratio in ratios:
        r = results[ratio]
        r["unet_call_ms"] = unet_ms[ratio]
        same = [
            (a["detected_colour"], a["detected_shape"]) == (b["detected_colour"], b["detected_shape"])
            for a, b in zip(records[ratio], records[0.0], strict=True)
        ]
        r["same_detection_as_exact_percent"] = 100.0 * statistics.mean(same)
        pairs = list(zip(images[ratio], images[0.0], strict=True))
        p = [dc.psnr(a, b) for a, b in pairs]
        s = [dc.ssim(a.astype(np.float64), b.astype(np.float64)) for a, b in pairs]
        finite = [v for v in p if math.isfinite(v)]
        r["psnr_db_mean"], r["psnr_db_sd"] = _spread(finite) if finite else (math.inf, 0.0)
        r["psnr_db_min"] = min(p)
        r["ssim_mean"], r["ssim_sd"] = _spread(s)
        r["speedup_wall"] = results[0.0]["seconds_per_image_median"] / r["seconds_per_image_median"]

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
        "latent": f"{side}²",
        "torch_threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    (out / "token_merge_kshapes.json").write_text(
        json.dumps({"meta": meta, "results": list(results.values())}, indent=2, ensure_ascii=False)
    )
    lines = [
        "| R | tokens merged | ms per U-Net eval (min) | s/image (median) | speed-up | PSNR dB (mean ± sd, min) "
        "| SSIM (mean ± sd) | colour % | shape % | both % (seed mean ± sd) | same detection as exact % |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for ratio in ratios:
        r = results[ratio]
        acc = r["accuracy_percent"]
        psnr_cell = (
            "—" if ratio == 0 else f"{r['psnr_db_mean']:.1f} ± {r['psnr_db_sd']:.1f}, {r['psnr_db_min']:.1f}"
        )
        lines.append(
            f"| {'exact' if ratio == 0 else ratio} | {r['tokens_merged']} | {r['unet_call_ms']:.1f} | "
            f"{r['seconds_per_image_median']:.3f} | {r['speedup_wall']:.2f}× | {psnr_cell} | "
            f"{r['ssim_mean']:.3f} ± {r['ssim_sd']:.3f} | {acc['colour']['all']:.1f} | {acc['shape']['all']:.1f} | "
            f"{acc['both']['all']:.1f} ({acc['both']['seed_mean']:.1f} ± {acc['both']['seed_sd']:.1f}) | "
            f"{r['same_detection_as_exact_percent']:.1f} |"
        )
    table = "\n".join(lines)
    (out / "token_merge_kshapes.md").write_text(json.dumps(meta, ensure_ascii=False) + "\n\n" + table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
