"""How fast the built-in model makes one image on this CPU, the way ``rapiddiff generate`` does.

Times, with torch using every core (``os.cpu_count()`` threads):

* model load (``RapidDiffusionPipeline.from_pretrained``, as the CLI calls it), once;
* one image at the model's base size with the CLI's default settings (steps, guidance,
  scheduler), end to end: text encoding, denoising, VAE decoding, PIL conversion;
* the same image upscaled ×4 (the CLI's default when the model has an upscaler);
* a cold first run: a fresh process running ``rapiddiff generate PROMPT`` (imports, load,
  one upscaled image, PNG write), wall time.

The in-process figures take one warm-up call, then the median of ``--repeats`` (≥ 3) calls.
Targets: ≤ 10 s base, ≤ 20 s upscaled.

    python benchmarks/builtin_cpu_speed.py                          # the shipped model
    python benchmarks/builtin_cpu_speed.py --model /tmp/bi/builtin --out /tmp/bench

Writes ``OUT/builtin_cpu_speed.json`` and ``OUT/builtin_cpu_speed.md`` (``--out``, default
``$OUT`` or ``bench-out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TARGETS_S = {"base": 10.0, "upscaled": 20.0}
PROMPT = "灰色背景上有一个番茄"


def cli_defaults(model_dir: Path) -> dict[str, Any]:
    """The sampling settings ``rapiddiff generate PROMPT`` uses with no other flags: the model
    folder's own (rapiddiff.json "sampling") over the CLI's, merged the way the CLI merges them."""
    from rapiddiff.infer.generate_cli import DEFAULT_SAMPLING, model_sampling_defaults

    return {**DEFAULT_SAMPLING, **model_sampling_defaults(model_dir)}


def time_calls(fn: Any, repeats: int) -> tuple[dict[str, Any], Any]:
    """One warm-up call, then ``repeats`` timed calls: (median, min, max and all in seconds,
    the last call's result)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - start)
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "times_s": [round(t, 3) for t in times],
    }, value


def cold_run(model: str | None, threads: int) -> dict[str, Any]:
    """Wall time of a fresh ``rapiddiff generate`` process (the first thing a user runs)."""
    with tempfile.TemporaryDirectory(prefix="builtin-cold-") as out:
        cmd = [sys.executable, "-m", "rapiddiff", "generate", PROMPT, "--seed", "0", "--out", out]
        cmd += ["--no-progress", "--device", "cpu"]
        if model is not None:
            cmd += ["--model", model]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        start = time.perf_counter()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            raise RuntimeError(f"cold run failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}")
        pngs = sorted(Path(out).glob("*.png"))
    return {"wall_s": wall, "command": " ".join(cmd[1:]), "pngs": len(pngs)}


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def markdown(result: dict[str, Any]) -> str:
    s = result["settings"]
    rows = [
        "| what | median s | min–max s | target s |",
        "|---|---|---|---|",
        f"| model load (once) | {result['load_s']:.2f} | – | – |",
    ]
    for name in ("base", "upscaled"):
        if name not in result:
            continue
        r = result[name]
        ok = "✓" if r["median_s"] <= TARGETS_S[name] else "✗"
        size = r["size"]
        rows.append(
            f"| {name} {size[0]}×{size[1]} | {r['median_s']:.2f} | {r['min_s']:.2f}–{r['max_s']:.2f} "
            f"| ≤ {TARGETS_S[name]:.0f} {ok} |"
        )
    if "cold" in result:
        cold = result["cold"]["wall_s"]
        rows.append(f"| cold `rapiddiff generate` (fresh process, upscaled) | {cold:.2f} | – | – |")
    head = (
        f"Built-in model `{result['model']}` on {result['cpu']} ({result['threads']} torch threads), "
        f"{s['num_inference_steps']} {s['scheduler']} steps, guidance {s['guidance_scale']}, "
        f"{result['date']}; median of {result['repeats']} after one warm-up."
    )
    return head + "\n\n" + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        help="model folder or builtin:NAME (default: the default built-in one, as `rapiddiff generate`)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per figure (≥ 3)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")))
    parser.add_argument("--no-cold", action="store_true", help="skip the fresh-process figure")
    args = parser.parse_args(argv)
    if args.repeats < 3:
        parser.error("--repeats must be ≥ 3 (a median of fewer says little)")

    import torch

    from rapiddiff.infer.generate_cli import resolve_model_dir
    from rapiddiff.infer.pipeline import RapidDiffusionPipeline
    from rapiddiff.utils.io import atomic_write_text

    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    model_dir = resolve_model_dir(str(args.model) if args.model else None)
    kwargs = cli_defaults(model_dir)

    start = time.perf_counter()
    pipe = RapidDiffusionPipeline.from_pretrained(model_dir, device="cpu")
    load_s = time.perf_counter() - start
    kwargs.update(seed=0, progress=False)

    result: dict[str, Any] = {
        "model": str(model_dir),
        "cpu": cpu_name(),
        "threads": threads,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "repeats": args.repeats,
        "settings": {k: v for k, v in kwargs.items() if k not in ("seed", "progress")},
        "load_s": load_s,
        "targets_s": TARGETS_S,
    }
    for name, upscale in (("base", False), ("upscaled", True)):
        if upscale and pipe.upscaler is None:
            print("the model has no upscaler: no upscaled figure", file=sys.stderr)
            continue
        timing, output = time_calls(lambda u=upscale: pipe(PROMPT, upscale=u, **kwargs), args.repeats)
        timing["size"] = list(output.images[0].size)
        result[name] = timing
        print(f"{name}: median {timing['median_s']:.2f} s {timing['times_s']}", flush=True)
    if not args.no_cold:
        result["cold"] = cold_run(args.model, threads)
        print(f"cold: {result['cold']['wall_s']:.2f} s", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(
        args.out / "builtin_cpu_speed.json", json.dumps(result, indent=2, ensure_ascii=False) + "\n"
    )
    atomic_write_text(args.out / "builtin_cpu_speed.md", markdown(result))
    print(f"wrote {args.out}/builtin_cpu_speed.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
