"""Load benchmark of ``rapiddiff serve``: images/s and p50/p95 latency vs concurrency.

Two servers on one loaded model, in one run: the baseline answers one request at a time
(``max_batch=1``: no micro-batching), the other micro-batches (``--max-batch``). Each serves the
same closed-loop load: C clients, each sending its requests one after another, for C in
``--concurrency``. The servers are real (uvicorn on 127.0.0.1, the app ``rapiddiff serve`` runs,
requests through httpx); the model copy is loaded once and shared, so the fast path's compiled
graphs are built once (during the first server's warm-up, before ``/ready``, not timed). Each
level also reports the engine's recorded queue waits (arrival → its batch starts sampling).

    # the built-in model on the CPU
    python benchmarks/serve_load.py --device cpu --concurrency 1 4 16
    # SD 1.5 architecture (random weights), 512², on a GPU with the fast path; results to $OUT
    python benchmarks/serve_load.py --model sd15-random --device cuda --fast --size 512 --steps 25
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from rapiddiff.serve.app import create_app
from rapiddiff.serve.config import ServeConfig
from rapiddiff.serve.engine import Engine, load_pipeline
from rapiddiff.serve.metrics import quantile
from rapiddiff.utils.logging import setup_logging

PROMPTS = ["蓝色背景上有一个番茄", "一只熊猫", "红色的圆形", "绿色背景上有一个香蕉", "黄色的柠檬", "一个西瓜"]


def write_sd15_random(folder: Path, device: str) -> Path:
    """An SD 1.5-architecture folder with random weights (speed does not depend on weight values),
    made as ``rapiddiff bench`` makes its pipeline, saved in diffusers' layout in fp16."""
    import torch

    from rapiddiff.infer.bench import _random_pipeline

    pipe = _random_pipeline("sd15", torch.device(device), torch.float16, 0)
    pipe.save_pretrained(folder, safe_serialization=True)
    del pipe
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return folder


@contextlib.contextmanager
def running(engine: Engine) -> Any:
    import uvicorn

    with __import__("socket").socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(create_app(engine=engine), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 1800  # the fast path compiles during warm-up
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            r = httpx.get(f"{url}/ready", timeout=5)
            if r.status_code == 200:
                break
            if r.status_code == 500:
                raise RuntimeError(r.text)
        time.sleep(0.5)
    else:
        raise TimeoutError("server not ready")
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=600)


def batch_stats(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics").text
    values = {}
    for line in text.splitlines():
        if line.startswith(("rapiddiff_batch_size_sum ", "rapiddiff_batch_size_count ")):
            name, value = line.split()
            values[name] = float(value)
    return values["rapiddiff_batch_size_sum"], values["rapiddiff_batch_size_count"]


async def closed_loop(url: str, clients: int, per_client: int, body: dict[str, Any]) -> dict[str, Any]:
    latencies: list[float] = []

    async def client(index: int, http: httpx.AsyncClient) -> None:
        for k in range(per_client):
            seed = 1000 * index + k
            payload = {**body, "prompt": PROMPTS[(index + k) % len(PROMPTS)], "seed": seed}
            t0 = time.perf_counter()
            response = await http.post(f"{url}/v1/images/generations", json=payload)
            response.raise_for_status()
            latencies.append(time.perf_counter() - t0)

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=900, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(i, http) for i in range(clients)))
        wall = time.perf_counter() - t0
    return {
        "requests": len(latencies),
        "seconds": wall,
        "images_per_s": len(latencies) / wall,
        "p50_s": quantile(latencies, 0.5),
        "p95_s": quantile(latencies, 0.95),
        "mean_s": statistics.fmean(latencies),
    }


def measure(
    engine: Engine, concurrency: list[int], per_client: Any, body: dict[str, Any]
) -> list[dict[str, Any]]:
    """Start a server on ``engine``, then the closed-loop load at each concurrency."""
    rows = []
    t0 = time.perf_counter()
    with running(engine) as url:
        print(f"  ready in {time.perf_counter() - t0:.0f} s (warm-up included)", flush=True)
        asyncio.run(closed_loop(url, 1, 1, body))  # one untimed request through the HTTP path
        for clients in concurrency:
            before = batch_stats(url)
            engine.metrics.queue_wait.clear()  # arrival → batch start, as the engine recorded it
            row = asyncio.run(closed_loop(url, clients, per_client(clients), body))
            after = batch_stats(url)
            calls = after[1] - before[1]
            waits = list(engine.metrics.queue_wait)
            row.update(
                concurrency=clients,
                mean_batch=(after[0] - before[0]) / calls if calls else 0.0,
                queue_wait_p50_ms=1000 * quantile(waits, 0.5),
                queue_wait_max_ms=1000 * max(waits, default=float("nan")),
            )
            rows.append(row)
            print(
                f"  c={clients:>2}: {row['images_per_s']:.2f} img/s, p50 {row['p50_s']:.2f} s, "
                f"p95 {row['p95_s']:.2f} s, mean batch {row['mean_batch']:.1f}, queue wait p50 "
                f"{row['queue_wait_p50_ms']:.1f} ms ({row['requests']} requests)",
                flush=True,
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="model folder, 'sd15-random', or the built-in model (default)"
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument("--fast", action="store_true", help="the fast path (GPU)")
    parser.add_argument("--size", type=int, default=None, help="image side (default: the model's)")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument(
        "--per-client",
        type=int,
        default=0,
        help="requests per client (default: 32 / C on a GPU, 16 / C on the CPU, ≥ 2)",
    )
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--max-wait-ms", type=float, default=20)
    parser.add_argument(
        "--fast-batches",
        type=int,
        nargs="+",
        default=[],
        help="with --fast: captured batch sizes (default 1,2,4,..)",
    )
    parser.add_argument(
        "--out", default=os.environ.get("OUT"), help="folder for serve_load.json (default $OUT)"
    )
    args = parser.parse_args(argv)
    setup_logging(0)  # the engine's warm-up times at INFO

    tmp = None
    model = args.model
    if model == "sd15-random":
        tmp = tempfile.TemporaryDirectory(prefix="rapiddiff-sd15-")
        device = "cuda" if args.device in ("auto", "cuda") else args.device
        t0 = time.perf_counter()
        model = str(write_sd15_random(Path(tmp.name) / "sd15-random", device))
        print(f"wrote an SD 1.5-size random model in {time.perf_counter() - t0:.0f} s", flush=True)
    sizes = [(args.size, args.size)] if args.size else []
    batched_cfg = ServeConfig(
        model=Path(model) if model else None, devices=[args.device], fast=args.fast, warmup_sizes=sizes,
        max_batch=args.max_batch, fast_batches=args.fast_batches, max_wait_ms=args.max_wait_ms, default_steps=args.steps, default_upscale=False,
        max_queue=4096,
    )  # fmt: skip
    baseline_cfg = ServeConfig(
        **{**batched_cfg.__dict__, "max_batch": 1, "max_wait_ms": 0, "fast_batches": []}
    )

    t0 = time.perf_counter()
    pipe = load_pipeline(batched_cfg, args.device)  # one copy for both servers

    def shared(config: ServeConfig, device: str) -> Any:
        return pipe

    print(f"loaded in {time.perf_counter() - t0:.0f} s on {pipe.device}", flush=True)
    body: dict[str, Any] = {"n": 1, "upscale": False}
    if args.size:
        body["size"] = f"{args.size}x{args.size}"
    # Enough requests that each level runs several full batches (fewer on the slow CPU).
    total = 32 if pipe.device.type == "cuda" else 16

    def per_client(clients: int) -> int:
        return args.per_client or max(2, total // clients)

    results: dict[str, Any] = {}
    for name, config in (("batched", batched_cfg), ("baseline", baseline_cfg)):
        print(f"{name} (max_batch={config.max_batch}, max_wait_ms={config.max_wait_ms}):", flush=True)
        results[name] = measure(Engine(config, loader=shared), args.concurrency, per_client, body)
        if args.out:  # as we go: a run cut short keeps what it measured
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "serve_load.json").write_text(json.dumps(results, indent=2))

    import torch

    meta = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name(pipe.device)
        if pipe.device.type == "cuda"
        else platform.processor() or "cpu",
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "model": args.model or "built-in",
        "size": args.size or pipe.default_size,
        "steps": args.steps,
        "fast": args.fast,
        "max_batch": args.max_batch,
        "max_wait_ms": args.max_wait_ms,
    }
    print(markdown(results, meta))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "serve_load.json").write_text(json.dumps({"meta": meta, **results}, indent=2))
    if tmp is not None:
        tmp.cleanup()
    return 0


def markdown(results: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [
        f"{meta['device']}, {meta['model']} {meta['size']}², {meta['steps']} steps, fast={meta['fast']}, "
        f"max_batch={meta['max_batch']}, max_wait={meta['max_wait_ms']} ms, {meta['date']}",
        "",
        "| concurrency | baseline img/s | batched img/s | speed-up | baseline p50 / p95 (s) | batched p50 / p95 (s) "
        "| mean batch | batched queue wait p50 / max (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for base, fast in zip(results["baseline"], results["batched"], strict=True):
        lines.append(
            f"| {base['concurrency']} | {base['images_per_s']:.2f} | {fast['images_per_s']:.2f} | "
            f"{fast['images_per_s'] / base['images_per_s']:.2f}× | {base['p50_s']:.2f} / {base['p95_s']:.2f} | "
            f"{fast['p50_s']:.2f} / {fast['p95_s']:.2f} | {fast['mean_batch']:.1f} | "
            f"{fast['queue_wait_p50_ms']:.1f} / {fast['queue_wait_max_ms']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
