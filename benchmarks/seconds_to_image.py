"""Seconds to an image against quality: which sampler, step count and DeepCache setting to name "fast".

For one model (the built-in one by default, ``--model DIR``, or random weights of ``--preset sd15``
at SD 1.5's architecture, as ``rapiddiff bench`` builds them), a grid of sampler × steps ×
DeepCache interval is timed per image (warm: a first call per setting is not timed, then the median
over every image of the setting) and compared with 50 PNDM steps on the same prompts and seeds:
PSNR and SSIM (torchmetrics) of each image against the 50-step PNDM image. The fast path runs on a
GPU (``accelerate(pipe)``), the eager pipeline on a CPU. ``--knowledge-eval`` also scores each
setting with a pluggable scorer — a callable ``(model folder, settings) → score`` — by default the
built-in model's own knowledge evaluation (``rapiddiff eval knowledge``'s scoring, through its code).

Writes OUT/seconds_to_image.json and OUT/seconds_to_image.md after every setting, so ``--budget-s``
can stop early and still leave what finished.

    python benchmarks/seconds_to_image.py --device cpu --budget-s 900 --seeds 2
    python benchmarks/seconds_to_image.py --preset sd15 --device cuda --budget-s 240 --out $OUT
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PROMPTS = ("浅蓝色背景上有一个番茄", "白色背景的左上角有一个香蕉", "一只熊猫")
REFERENCE_SAMPLER = "pndm"  # with --reference-steps and no DeepCache: what everything is compared with
Scorer = Callable[[Path, dict[str, Any]], float]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the built-in model)")
    p.add_argument(
        "--preset", default=None, help="random weights of this architecture instead: sd15, kshapes, tiny"
    )
    p.add_argument("--device", default="auto", help="cpu, cuda or auto")
    p.add_argument("--samplers", nargs="+", default=["pndm", "ddim", "dpm++", "unipc"])
    p.add_argument("--steps", nargs="+", type=int, default=[10, 15, 20, 25, 30, 50])
    p.add_argument(
        "--deep-cache", nargs="+", type=int, default=[1, 3], help="DeepCache intervals (1: off, exact)"
    )
    p.add_argument(
        "--reference-steps", type=int, default=50, help="PNDM steps of the reference images (default 50)"
    )
    p.add_argument("--seeds", type=int, default=3, help="seeds per prompt (the same for every setting)")
    p.add_argument("--prompts", nargs="+", default=list(PROMPTS))
    p.add_argument("--guidance", type=float, default=None, help="guidance scale (default: the model's)")
    p.add_argument("--size", type=int, default=None, help="image side (default: the model's)")
    p.add_argument("--no-fast", action="store_true", help="eager on a GPU too")
    p.add_argument(
        "--budget-s", type=float, default=0.0, help="start no setting after this many s (0: no limit)"
    )
    p.add_argument("--knowledge-eval", action="store_true", help="score every setting with --scorer too")
    p.add_argument(
        "--scorer",
        default="knowledge",
        help="knowledge (eval knowledge's scoring on --kshapes) or MODULE:FUNCTION, a callable "
        "(model folder, settings dict) → score (higher is better)",
    )
    p.add_argument(
        "--kshapes", default=None, help="with --scorer knowledge: a `rapiddiff data kshapes` folder"
    )
    p.add_argument("--score-limit", type=int, default=4, help="with --scorer knowledge: prompts per split")
    p.add_argument("--out", default=os.environ.get("OUT", "seconds-to-image-out"))
    return p.parse_args(argv)


# ---- the model -----------------------------------------------------------------------------------
def load(args: argparse.Namespace) -> tuple[Any, Path | None, Any]:
    """(pipeline, model folder or None, device); behind the fast path on a GPU."""

    from rapiddiff.infer.pipeline import RapidDiffusionPipeline
    from rapiddiff.utils.device import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    dtype = resolve_dtype("auto", device)
    folder: Path | None = None
    if args.preset:
        from rapiddiff.infer.bench import BenchConfig, build_pipeline

        name = str(dtype).removeprefix("torch.")
        stock = build_pipeline(BenchConfig(preset=args.preset, dtype=name), device)
        pipe = RapidDiffusionPipeline.from_diffusers(stock)
    else:
        from rapiddiff.infer.generate_cli import resolve_model_dir

        folder = resolve_model_dir(args.model)
        pipe = RapidDiffusionPipeline.from_pretrained(folder, device=device, dtype=dtype)
    if device.type == "cuda" and not args.no_fast:
        from rapiddiff.infer.accelerate import accelerate

        pipe = accelerate(pipe)
    return pipe, folder, device


def gpu_loop_note(pipe: Any, sampler: str, steps: int) -> str:
    """ "" when the fast path's GPU loop runs this sampler, else why it falls back to the eager loop."""
    denoiser = pipe.denoiser
    if not hasattr(denoiser, "plan_for"):
        return ""
    from rapiddiff.models.sampling import make_scheduler

    plan = denoiser.plan_for(make_scheduler(sampler, pipe.scheduler.config), steps)
    return f"eager loop: {plan}" if isinstance(plan, str) else ""


# ---- one setting ---------------------------------------------------------------------------------
def draw(pipe: Any, args: argparse.Namespace, setting: tuple[str, int, int]) -> tuple[list[Any], list[float]]:
    """Every (prompt, seed) image of ``setting`` as float tensors [3, H, W] in [0, 1], and the seconds
    each took (after one untimed warm-up call: compile, graph capture, caches)."""
    import torch

    sampler, steps, interval = setting
    kw: dict[str, Any] = {"scheduler": sampler, "num_inference_steps": steps, "deep_cache": interval}
    kw.update(output_type="np", progress=False, upscale=False)
    if args.guidance is not None:
        kw["guidance_scale"] = args.guidance
    if args.size:
        kw["height"] = kw["width"] = args.size
    pipe([args.prompts[0]], seed=[0], **kw)  # warm-up, not timed
    images, seconds = [], []
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for prompt in args.prompts:
        for seed in range(args.seeds):
            sync()
            t0 = time.perf_counter()
            out = pipe([prompt], seed=[seed], **kw)
            sync()
            seconds.append(time.perf_counter() - t0)
            images.append(torch.from_numpy(out.images[0]).permute(2, 0, 1).float())
    return images, seconds


def quality(images: list[Any], reference: list[Any]) -> dict[str, float]:
    """Mean PSNR (dB, data range 1, capped at 100) and SSIM (torchmetrics' Gaussian 11, σ 1.5)."""
    import torch
    from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

    a, b = torch.stack(images), torch.stack(reference)
    psnr = [
        min(100.0, float(peak_signal_noise_ratio(x[None], y[None], data_range=1.0)))
        for x, y in zip(a, b, strict=True)
    ]
    ssim = float(structural_similarity_index_measure(a, b, data_range=1.0))
    return {"psnr_db": round(statistics.fmean(psnr), 2), "ssim": round(ssim, 4)}


# ---- scorers -------------------------------------------------------------------------------------
def knowledge_scorer(args: argparse.Namespace) -> Scorer:
    """``rapiddiff eval knowledge``'s scoring (held-out attribute accuracy, %, knowledge on) for one
    setting, through its own code: prompts of --kshapes, its detector, its table."""
    if not args.kshapes:
        raise SystemExit("--scorer knowledge needs --kshapes DIR (a `rapiddiff data kshapes` folder)")

    pipes: dict[Path, Any] = {}  # one pipeline per model folder, loaded at its first setting

    def score(model: Path, settings: dict[str, Any]) -> float:
        from rapiddiff.eval.knowledge import evaluate_knowledge, read_knowledge_prompts
        from rapiddiff.eval.sample import SampleSettings, load_pipeline

        prompts = read_knowledge_prompts(args.kshapes, ("seen", "heldout"))
        by_split: dict[str, list[dict[str, Any]]] = {}
        for row in prompts:
            by_split.setdefault(row["split"], []).append(row)
        prompts = [r for rows in by_split.values() for r in rows[: args.score_limit]]
        pipe = pipes.get(model) or pipes.setdefault(model, load_pipeline(model, device=args.device))
        call = _with_deep_cache(pipe, settings["deep_cache"])
        name = f"{settings['scheduler']}-{settings['num_inference_steps']}-dc{settings['deep_cache']}"
        sample = SampleSettings(
            model=str(model), steps=settings["num_inference_steps"], scheduler=settings["scheduler"],
            guidance=args.guidance if args.guidance is not None else pipe.sampling.guidance_scale,
            images_per_prompt=1,
        )  # fmt: skip
        record = evaluate_knowledge(
            call, prompts, Path(args.out) / "knowledge" / name, sample, modes=("on",), overwrite=True
        )
        return float(record["value"]) if record.get("value") is not None else float("nan")

    return score


def _with_deep_cache(pipe: Any, interval: int) -> Any:
    """``pipe`` with ``deep_cache=interval`` on every call (eval's sampler has no such setting)."""
    if interval <= 1:
        return pipe

    class WithDeepCache:
        def __getattr__(self, name: str) -> Any:
            return getattr(pipe, name)

        def __call__(self, *a: Any, **kw: Any) -> Any:
            return pipe(*a, **{**kw, "deep_cache": interval})

    return WithDeepCache()


def make_scorer(args: argparse.Namespace) -> Scorer | None:
    if not args.knowledge_eval:
        return None
    if args.scorer == "knowledge":
        return knowledge_scorer(args)
    module, _, name = args.scorer.partition(":")
    if not name:
        raise SystemExit(f"--scorer {args.scorer!r}: use knowledge or MODULE:FUNCTION")
    return getattr(importlib.import_module(module), name)


# ---- the grid ------------------------------------------------------------------------------------
def settings_grid(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """The reference first, then every other setting, fewest steps first (cheap rows finish early)."""
    from rapiddiff.models.sampling import canonical_scheduler_name

    grid = [
        (canonical_scheduler_name(s), n, d)
        for n in sorted(set(args.steps))
        for s in args.samplers
        for d in sorted(set(args.deep_cache))
    ]
    reference = (REFERENCE_SAMPLER, args.reference_steps, 1)
    return [reference, *[g for g in grid if g != reference]]


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    lines = [
        f"Seconds to an image vs {meta['reference_steps']}-step PNDM — {meta['model']}, {meta['device']} ({meta['path']}), "
        f"{meta['images']} images per setting ({len(meta['prompts'])} prompts × {meta['seeds']} seeds), "
        f"{meta['size']}², guidance {meta['guidance']}",
        "",
        "| sampler | steps | DeepCache | s / image | × faster | PSNR dB | SSIM | score | Δ score | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    ref = result["rows"][0] if result["rows"] else None  # the reference runs first
    for r in sorted(result["rows"], key=lambda r: r["seconds"]):
        speed = f"{ref['seconds'] / r['seconds']:.2f}" if ref else ""
        score = "" if r.get("score") is None else f"{r['score']:.1f}"
        delta = (
            ""
            if r.get("score") is None or not ref or ref.get("score") is None
            else f"{r['score'] - ref['score']:+.1f}"
        )
        cache = "off" if r["deep_cache"] <= 1 else str(r["deep_cache"])
        lines.append(
            f"| {r['sampler']} | {r['steps']} | {cache} | {r['seconds']:.3f} | {speed} | {r['psnr_db']:.2f} "
            f"| {r['ssim']:.4f} | {score} | {delta} | {r['note']} |"
        )
    if result["skipped"]:
        lines += ["", f"Not run (budget): {', '.join(result['skipped'])}"]
    return "\n".join(lines) + "\n"


def write(out: Path, result: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "seconds_to_image.json").write_text(json.dumps(result, indent=1, ensure_ascii=False))
    (out / "seconds_to_image.md").write_text(markdown(result), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    import torch

    # inference only; scoped, not process-wide: main() also runs inside the test process
    with torch.no_grad():
        return _main(argv)


def _main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse(argv)
    out = Path(args.out)
    scorer = make_scorer(args)
    pipe, folder, device = load(args)
    fast = hasattr(pipe.denoiser, "plan_for")
    meta = {
        "model": f"random {args.preset}" if args.preset else str(folder),
        "device": str(device),
        "reference_steps": args.reference_steps,
        "path": "fast path" if fast else "eager",
        "prompts": args.prompts,
        "seeds": args.seeds,
        "images": len(args.prompts) * args.seeds,
        "size": args.size or pipe.default_size,
        "guidance": args.guidance if args.guidance is not None else pipe.sampling.guidance_scale,
        "timing": "median seconds of one image (batch 1) over every image of the setting, after one warm-up call",
        "quality": f"PSNR (data range 1) and SSIM (torchmetrics) against {args.reference_steps}-step PNDM, same prompts and seeds",
    }
    result: dict[str, Any] = {"meta": meta, "rows": [], "skipped": []}
    reference: list[Any] = []
    for setting in settings_grid(args):
        name = "{}-{}-dc{}".format(*setting)
        if reference and args.budget_s and time.perf_counter() - started > args.budget_s:
            result["skipped"].append(name)
            continue
        images, seconds = draw(pipe, args, setting)
        reference = reference or images
        row = {"sampler": setting[0], "steps": setting[1], "deep_cache": setting[2]}
        row.update(seconds=round(statistics.median(seconds), 4), **quality(images, reference))
        row["note"] = gpu_loop_note(pipe, setting[0], setting[1]) if fast else ""
        if scorer is not None and folder is not None:
            row["score"] = scorer(
                folder, {"scheduler": setting[0], "num_inference_steps": setting[1], "deep_cache": setting[2]}
            )
        result["rows"].append(row)
        print(json.dumps(row, ensure_ascii=False), flush=True)
        write(out, result)  # after every setting: a budget or a crash still leaves what finished
    meta["wall_s"] = round(time.perf_counter() - started, 1)
    write(out, result)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
