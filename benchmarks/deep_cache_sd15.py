"""DeepCache speed at SD 1.5 size on a GPU: the exact path and N = 2, 3, 5, in one process.

Random SD 1.5 weights (``rapiddiff.infer.bench.build_pipeline``, preset sd15, fp16), 512², 50
PNDM steps, CFG 7.5, batch 1, one prompt. Three paths, each with the exact run (N = 1) first:

* ``eager``: the pipeline's eager loop (``RapidDiffusionPipeline``, no fast-path transform);
* ``graph``: ``accelerate(pipe, compile_unet=None, compile_vae=None)``: fp16, channels-last, fused
  QKV, cross-attention K/V cache, attention backend per shape, and the GPU-resident loop captured
  as one CUDA graph (a loop per interval);
* ``compiled``: ``accelerate(pipe)``, the shipped defaults (torch.compile adds one compile for the
  cached-step variant of the U-Net).

Speed only: PSNR against the exact path on random weights says nothing about the price in
quality (that is measured on the trained kshapes model, ``deep_cache_kshapes.py``). Per variant:
one warm-up call (two for graph capture), then the median of ``--repeats`` timed calls, end to
end (prompt encoding, loop, VAE decode, copy to the host). Results go to ``OUT/deep_cache_sd15.json``
after every row, so a run cut short by its time limit keeps what it measured.

    python benchmarks/deep_cache_sd15.py --paths eager graph compiled --intervals 1 2 3 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

PROMPT = "a red tomato on a blue table, studio light"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--paths", nargs="+", default=["eager", "graph", "compiled"])
    parser.add_argument("--intervals", type=int, nargs="+", default=[1, 2, 3, 5])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--preset", default="sd15")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = parser.parse_args(argv)

    import torch

    from rapiddiff.infer.accelerate import AccelerateConfig, accelerate
    from rapiddiff.infer.bench import BenchConfig, build_pipeline, free_memory
    from rapiddiff.infer.pipeline import RapidDiffusionPipeline

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "preset": args.preset,
        "steps": args.steps,
        "scheduler": "pndm",
        "batch": 1,
        "guidance": 7.5,
        "dtype": "float16",
    }
    rows: list[dict[str, Any]] = []

    def save() -> None:
        (out / "deep_cache_sd15.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))

    cfg = BenchConfig(preset=args.preset, dtype="float16", steps=args.steps)
    for path in args.paths:
        built = build_pipeline(cfg, device)
        pipe = RapidDiffusionPipeline.from_diffusers(built)
        t0 = time.perf_counter()
        if path == "graph":
            pipe = accelerate(pipe, AccelerateConfig(compile_unet=None, compile_vae=None))
        elif path == "compiled":
            pipe = accelerate(pipe, AccelerateConfig())
        setup = time.perf_counter() - t0
        for n in args.intervals:

            def run(n: int = n, pipe: Any = pipe) -> Any:
                return pipe(
                    PROMPT,
                    seed=0,
                    num_inference_steps=args.steps,
                    output_type="np",
                    progress=False,
                    deep_cache=n,
                )

            t0 = time.perf_counter()
            for _ in range(2 if path != "eager" else 1):
                run()
            warm = time.perf_counter() - t0
            times = []
            for _ in range(args.repeats):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                result = run()
                times.append(time.perf_counter() - t0)
            evaluations = args.steps + 1  # PNDM: one more U-Net evaluation than steps
            row = {
                "path": path,
                "deep_cache": n,
                "median_s": statistics.median(times),
                "times_s": times,
                "it_s": args.steps / statistics.median(times),
                "warmup_s": warm,
                "transform_s": setup,
                "full_unet_evals": evaluations if n == 1 else len(range(0, evaluations, n)),
                "stages_ms": {k: round(v * 1e3, 2) for k, v in result.seconds.items()},
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
                "report": getattr(pipe, "report", {}),
            }
            base = next((r for r in rows if r["path"] == path and r["deep_cache"] == 1), None)
            row["speedup"] = base["median_s"] / row["median_s"] if base else None
            rows.append(row)
            save()
            print(
                f"{path:9s} N={n}: {row['median_s'] * 1e3:8.1f} ms/image  {row['it_s']:6.1f} it/s  "
                f"x{row['speedup'] or 1:.2f}  warm {warm:.1f}s",
                flush=True,
            )
        del pipe, built
        free_memory()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
