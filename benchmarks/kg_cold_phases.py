"""CPU and wall seconds of each start-up phase of a cold `rapiddiff generate`, in one fresh process.

    python benchmarks/kg_cold_phases.py          # run it twice or more: each run is one fresh process

Phases: import torch; `RapidDiffusionPipeline.from_pretrained` of the built-in model (which imports
diffusers, transformers and peft inside); the first entity link (jieba's dictionary). CPU seconds
are the process's own (user + sys), so on a machine shared with other jobs they compare trees
where wall seconds measure the neighbours.
"""

from __future__ import annotations

import os
import resource
import time


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    rows = []
    last = (time.perf_counter(), _cpu())

    def mark(name: str) -> None:
        nonlocal last
        now = (time.perf_counter(), _cpu())
        rows.append((name, now[0] - last[0], now[1] - last[1]))
        last = now

    import torch  # noqa: F401

    mark("import torch")
    from rapiddiff.infer.generate_cli import default_model_dir
    from rapiddiff.infer.pipeline import RapidDiffusionPipeline

    mark("import rapiddiff.infer.pipeline")
    pipe = RapidDiffusionPipeline.from_pretrained(default_model_dir())
    mark("load the model")
    pipe.text_encoder.linker.link("浅蓝色背景上有一个番茄")
    mark("first link (jieba)")
    load = os.getloadavg()[0]
    print(f"load {load:.2f} | " + " | ".join(f"{n}: {w:.2f} s wall, {c:.2f} s CPU" for n, w, c in rows))


if __name__ == "__main__":
    main()
