"""A new process to full speed: AOTInductor packages vs torch.compile with the compile cache (issue 16).

One run, on one GPU (results under ``--out``, default $OUT):

1. a model folder: random weights of ``--preset`` saved in the diffusers layout (or ``--model DIR``);
2. ``rapiddiff accelerate export --model DIR`` in a fresh process: wall time, and each package's
   export/compile seconds from its manifest;
3. fresh processes (each with new, empty Inductor/Triton cache folders, as on another machine),
   interleaved per round: ``aoti`` (``accelerate(pipe, aoti="load")``), ``compile-cold`` (the
   shipped path with no cache: it compiles and writes the cache file, once), ``compile-cache``
   (the shipped path loading that file, today's second process), and the same two with regional
   compilation (``compile_regions=True``: each transformer/ResNet block compiled alone, its own
   cache file): ``regional-cold``, ``regional-cache``. Each reports seconds after its
   start to imports done, weights loaded, accelerated, first image and full speed (the end of the
   second image), its it/s (median of 5 images), the fast path's report and Dynamo/Inductor
   counters (an ``aoti`` process should compile nothing);
4. parity: the ``aoti`` and ``regional-cache`` processes' final latents and first images against
   ``compile-cache``'s.

Python's bytecode decides a third of a package process's start: the device image sets
``PYTHONDONTWRITEBYTECODE=1`` and ships torch without ``__pycache__``, so every process there compiled
every imported module from source (19 s of a package process's 25 s went to imports). An installed
environment has bytecode (pip compiles it at install), so the device scripts run ``compileall``
first; ``--no-bytecode-round`` adds one ``aoti-nopyc`` process that reads none
(``PYTHONPYCACHEPREFIX`` set to an empty folder), the same run's control. ``meta.bytecode`` records
what the processes found.

    python benchmarks/aoti_cold_start.py --preset sd15 --steps 50 --rounds 2 --budget-s 450 --timeout-s 300

``--preset tiny --device cpu`` runs the same sequence on a CPU (a smoke test of the script, not a
GPU figure).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder; default: random weights of --preset")
    p.add_argument("--preset", default="sd15", help="architecture for random weights: sd15, kshapes, tiny")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--guidance", type=float, default=7.5)
    p.add_argument("--rounds", type=int, default=2, help="rounds of the warm (cache/package) processes")
    p.add_argument(
        "--variants",
        nargs="+",
        default=["aoti", "compile", "regional"],
        choices=["aoti", "compile", "regional"],
        help="aoti: the packages; compile: torch.compile + cache; regional: regional compile + cache",
    )
    p.add_argument(
        "--grouped",
        action="store_true",
        help="all rounds of one variant before the next (default: interleaved)",
    )
    p.add_argument(
        "--no-bytecode-round",
        action="store_true",
        help="after the packages' rounds, one package process that reads no compiled bytecode",
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--budget-s", type=float, default=540.0, help="start no new process after this many s")
    p.add_argument("--timeout-s", type=float, default=420.0, help="limit for one child process")
    p.add_argument("--out", default=os.environ.get("OUT", "aoti-cold-start-out"))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- the child: one fresh process ------------------------------------------------------------------
def child(spec: dict[str, Any]) -> None:
    import torch

    from rapiddiff.infer.accelerate import AccelerateConfig, accelerate
    from rapiddiff.infer.bench import first_then_steady  # the prompt and timing of bench's second process
    from rapiddiff.infer.pipeline import RapidDiffusionPipeline

    imported = time.time()  # torch, diffusers, transformers, rapiddiff

    device = torch.device(spec["device"])
    dtype = getattr(torch, spec["dtype"])
    # Where the time between imports and weights goes: the device's context, then the model's classes.
    torch.empty(1, device=device)
    device_ready = time.time()
    from rapiddiff.models.bundle import diffusers_class

    diffusers_class("UNet2DConditionModel"), diffusers_class("AutoencoderKL")
    classes = time.time()
    pipe = RapidDiffusionPipeline.from_pretrained(spec["model"], device=device, dtype=dtype)
    loaded = time.time()
    if spec["variant"].startswith("aoti"):
        config = AccelerateConfig(dtype=spec["dtype"], aoti="load", aoti_dir=spec["packages"])
    else:
        regional = spec["variant"].startswith("regional")
        cache = spec["cache"].replace("compile-cache", "regional-cache") if regional else spec["cache"]
        config = AccelerateConfig(dtype=spec["dtype"], compile_cache=cache, compile_regions=regional)
    if device.type != "cuda":
        config.loop = "resident"
    fast = accelerate(pipe, config)
    accelerated = time.time()
    out, first, full_speed, e2e = first_then_steady(
        fast, steps=spec["steps"], guidance=spec["guidance"], seed=0
    )
    torch.save({"latents": out.latents.cpu(), "image": torch.from_numpy(out.images[0])}, spec["result"])
    from torch._dynamo.utils import counters

    print(
        json.dumps(
            {
                "imported_at": imported,
                "device_ready_at": device_ready,
                "classes_imported_at": classes,
                "loaded_at": loaded,
                "accelerated_at": accelerated,
                "first_image_at": first,
                "full_speed_at": full_speed,
                "e2e_s": e2e,
                "it_s": spec["steps"] / e2e,
                "report": {k: v for k, v in fast.report.items() if k.startswith(("aoti", "compile", "loop"))},
                "counters": {
                    k: dict(v) for k, v in counters.items() if k in ("inductor", "aot_autograd", "stats")
                },
            },
            default=str,
        ),
        flush=True,
    )


def run_child(args: argparse.Namespace, variant: str, model: Path, cache: Path, out: Path, n: int) -> dict:
    fresh = Path(tempfile.mkdtemp(prefix="aoti-cold-fresh-"))
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(fresh),
        "TRITON_CACHE_DIR": str(fresh / "triton"),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    spec = {
        "variant": variant,
        "model": str(model),
        "cache": str(cache),
        "packages": str(cache.parent / "accelerated"),
        "device": args.device,
        "dtype": args.dtype,
        "steps": args.steps,
        "guidance": args.guidance,
        "result": str(out / f"result-{variant}-{n}.pt"),
    }
    if variant == "aoti-nopyc":  # bytecode looked up under an empty folder: every module compiled from source
        env["PYTHONPYCACHEPREFIX"] = str(fresh / "no-bytecode")
    started = time.time()
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(spec)],
            env=env,
            capture_output=True,
            text=True,
            timeout=args.timeout_s,
        )
    except subprocess.TimeoutExpired as err:
        return {
            "variant": variant,
            "error": f"timed out after {args.timeout_s:.0f} s",
            "log": str(err.stderr)[-2000:],
        }
    finally:
        shutil.rmtree(fresh, ignore_errors=True)
    (out / f"child-{variant}-{n}.log").write_text(proc.stderr[-300_000:])
    if proc.returncode != 0:
        row = {"variant": variant, "rc": proc.returncode, "error": proc.stderr[-3000:]}
        if proc.returncode == -11:  # SIGSEGV: once, the same process under a debugger for the native frames
            row["backtrace"] = native_backtrace(
                [sys.executable, __file__, "--child", json.dumps(spec)], env, out / f"gdb-{variant}-{n}.log"
            )
        return row
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in [k for k in row if k.endswith("_at")]:
        row[key[:-3] + "_s"] = round(row.pop(key) - started, 2)
    return {"variant": variant, **row}


def native_backtrace(cmd: list[str], env: dict[str, str], log: Path, timeout: float = 400) -> str:
    """Run ``cmd`` under cuda-gdb (the device image has no gdb) and return the crashing thread's
    backtrace, or why there is none. Python's faulthandler names only the Python frame."""
    gdb = shutil.which("cuda-gdb") or shutil.which("gdb")
    if gdb is None:
        return "no debugger on this machine"
    batch = ["-batch", "-ex", "set pagination off", "-ex", "run", "-ex", "bt 40", "-ex", "info registers rip"]
    try:
        proc = subprocess.run(
            [gdb, *batch, "--args", *cmd], env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return f"the debugger run did not end within {timeout:.0f} s"
    log.write_text(proc.stdout[-200_000:] + "\n--- stderr ---\n" + proc.stderr[-50_000:])
    lines = proc.stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if "SIGSEGV" in line or "signal" in line.lower()), None)
    return "\n".join(lines[start : start + 45]) if start is not None else proc.stdout[-3000:]


# ---- the parent ------------------------------------------------------------------------------------
def make_model(args: argparse.Namespace, root: Path) -> tuple[Path, float]:
    """A diffusers-layout folder of random ``--preset`` weights (same seed: same weights as `rapiddiff bench`)."""
    import torch

    from rapiddiff.infer.bench import _random_pipeline

    started = time.perf_counter()
    folder = root / f"model-{args.preset}"
    pipe = _random_pipeline(args.preset, torch.device(args.device), getattr(torch, args.dtype), 0)
    pipe.save_pretrained(folder, safe_serialization=True)
    del pipe
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return folder, time.perf_counter() - started


def export(args: argparse.Namespace, model: Path, packages: Path, out: Path) -> dict[str, Any]:
    fresh = Path(tempfile.mkdtemp(prefix="aoti-cold-export-"))
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(fresh),
        "TRITON_CACHE_DIR": str(fresh / "triton"),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    cmd = [sys.executable, "-m", "rapiddiff", "accelerate", "export", "--model", str(model)]
    cmd += ["--batch", "1", "--guidance", str(args.guidance), "--device", args.device]
    cmd += ["--switches", f"dtype={args.dtype}", "--dir", str(packages)]
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    except subprocess.TimeoutExpired as err:
        return {"error": f"timed out after {args.timeout_s:.0f} s", "log": str(err.stderr)[-2000:]}
    finally:
        shutil.rmtree(fresh, ignore_errors=True)
    wall = time.perf_counter() - started
    (out / "export.log").write_text(proc.stderr[-300_000:])
    result: dict[str, Any] = {"command": " ".join(cmd[1:]), "wall_s": round(wall, 2), "rc": proc.returncode}
    if proc.returncode != 0:
        # A crash after a package was written (e.g. while loading it) still leaves that package: the
        # aoti processes load what exists and fall back for the rest, so the crash is told apart
        # from the build's.
        result["error"] = proc.stderr[-3000:]
    else:
        result["report"] = json.loads(proc.stdout.strip().splitlines()[-1])
    for manifest in sorted(packages.glob("*.json")):
        data = json.loads(manifest.read_text())
        result[manifest.stem] = {k: data[k] for k in ("export_s", "compile_s", "size")}
    return result


def parity(out: Path, a: str, b: str) -> dict[str, float]:
    import torch

    ra, rb = torch.load(out / a), torch.load(out / b)
    la, lb = ra["latents"].float(), rb["latents"].float()
    mse = float(((ra["image"].double() - rb["image"].double()) ** 2).mean())
    return {
        "latent_rel_err": float((la - lb).norm() / lb.norm().clamp_min(1e-12)),
        "psnr_db": math.inf if mse == 0 else 10 * math.log10(1 / mse),
    }


def summary(result: dict[str, Any]) -> str:
    lines = [
        f"{result['meta']['device']}, torch {result['meta']['torch']}, {result['meta']['date']}; "
        f"{result['meta']['model']}, {result['meta']['steps']} steps, guidance {result['meta']['guidance']}, batch 1",
        "",
    ]
    exp = result.get("export", {})
    if exp:
        lines.append(
            f"export: {exp.get('error', '')[-300:] or str(exp.get('wall_s')) + ' s wall'}"
            + "".join(
                f"; {k}: export {v['export_s']} s + compile {v['compile_s']} s, {v['size'] / 2**20:.1f} MiB"
                for k, v in exp.items()
                if isinstance(v, dict) and "compile_s" in v
            )
        )
    lines += [
        "",
        "| process | imports (s) | device ready (s) | model classes (s) | weights loaded (s) | accelerated (s) "
        "| first image (s) | full speed (s) | it/s | notes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["processes"]:
        if "error" in row:
            lines.append(f"| {row['variant']} | failed: {row['error'][-200:]!r} | | | | | | | | |")
            continue
        notes = "; ".join(
            f"{k}: {v}" for k, v in row["report"].items() if k.startswith(("aoti_", "compile_cache"))
        )
        lines.append(
            f"| {row['variant']} | {row['imported_s']:.1f} | {row.get('device_ready_s', math.nan):.1f} | "
            f"{row.get('classes_imported_s', math.nan):.1f} | {row['loaded_s']:.1f} | {row['accelerated_s']:.1f} | "
            f"{row['first_image_s']:.1f} | {row['full_speed_s']:.1f} | {row['it_s']:.1f} | {notes[:300]} |"
        )
    for variant, med in result.get("medians", {}).items():
        lines.append(f"\nmedian {variant}: full speed {med['full_speed_s']:.1f} s, {med['it_s']:.1f} it/s")
    for variant, p in result.get("parity", {}).items():
        lines.append(
            f"\n{variant} vs compile-cache: latent rel. err {p['latent_rel_err']:.1e}, "
            f"image PSNR {p['psnr_db']:.1f} dB"
        )
    return "\n".join(lines) + "\n"


def bytecode_facts() -> dict[str, Any]:
    """Whether this Python writes bytecode, and whether the heavy imports have it compiled."""
    from rapiddiff.utils.imports import missing_bytecode

    names = ("torch", "torch._dynamo", "diffusers", "transformers", "rapiddiff")
    missing = set(missing_bytecode(names))
    return {
        "PYTHONDONTWRITEBYTECODE": os.environ.get("PYTHONDONTWRITEBYTECODE"),
        "PYTHONPYCACHEPREFIX": os.environ.get("PYTHONPYCACHEPREFIX"),
        **{name: name not in missing for name in names},
    }


def plan_processes(
    variants: list[str], rounds: int, grouped: bool = False, no_bytecode: bool = False
) -> list[tuple[str, int]]:
    """Most important first, so a time budget cuts the least: packages vs today's compile cache
    (with the cache's cold first process), their further rounds in rotated order, then regional.
    ``grouped``: every round of the packages first, then the compile cache's (a budget that allows
    one compile-cold + compile-cache still gets the packages' median). ``no_bytecode``: one
    ``aoti-nopyc`` process right after the packages' last round."""
    plan = _plan(variants, rounds, grouped)
    if no_bytecode and "aoti" in variants:
        plan.insert(max(i for i, (v, _) in enumerate(plan) if v == "aoti") + 1, ("aoti-nopyc", 0))
    return plan


def _plan(variants: list[str], rounds: int, grouped: bool) -> list[tuple[str, int]]:
    if grouped:
        plan = [("aoti", n) for n in range(rounds)] if "aoti" in variants else []
        if "compile" in variants:
            plan += [("compile-cold", 0)] + [("compile-cache", n) for n in range(rounds)]
        if "regional" in variants:
            plan += [("regional-cold", 0)] + [("regional-cache", n) for n in range(rounds)]
        return plan
    plan = [("aoti", 0)] if "aoti" in variants else []
    if "compile" in variants:
        plan += [("compile-cold", 0), ("compile-cache", 0)]
    pair = [v for v, name in (("aoti", "aoti"), ("compile-cache", "compile")) if name in variants]
    for n in range(1, rounds):
        plan += [(v, n) for v in (pair[::-1] if n % 2 else pair)]
    if "regional" in variants:
        plan += [("regional-cold", 0), ("regional-cache", 0)]
        plan += [("regional-cache", n) for n in range(1, rounds)]
    return plan


def tally(result: dict[str, Any], out: Path) -> None:
    """Medians of the warm processes and parity against compile-cache (from what has run so far)."""
    for variant in ("aoti", "aoti-nopyc", "compile-cache", "regional-cache"):
        rows = [r for r in result["processes"] if r["variant"] == variant and "error" not in r]
        if rows:
            result.setdefault("medians", {})[variant] = {
                k: statistics.median(r[k] for r in rows) for k in ("first_image_s", "full_speed_s", "it_s")
            }
    for variant in ("aoti", "regional-cache"):
        if (out / f"result-{variant}-0.pt").exists() and (out / "result-compile-cache-0.pt").exists():
            result.setdefault("parity", {})[variant] = parity(
                out, f"result-{variant}-0.pt", "result-compile-cache-0.pt"
            )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child:
        child(json.loads(args.child))
        return 0
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="aoti-cold-start-"))
    device_name = (
        torch.cuda.get_device_name() if args.device.startswith("cuda") else f"cpu ({os.cpu_count()} cores)"
    )
    result: dict[str, Any] = {
        "meta": {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "device": device_name,
            "torch": torch.__version__,
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "model": args.model or f"random {args.preset} weights",
            "steps": args.steps,
            "guidance": args.guidance,
            "bytecode": bytecode_facts(),
        },
        "processes": [],
    }

    def save() -> None:
        (out / "aoti_cold_start.json").write_text(json.dumps(result, indent=1, default=str))
        (out / "aoti_cold_start.md").write_text(summary(result))

    try:
        if args.model:
            model = Path(args.model)
        else:
            model, took = make_model(args, scratch)
            result["meta"]["model_build_s"] = round(took, 1)
        # Packages into this run's scratch folder (never over a --model folder's own): it measures the export.
        packages = scratch / "accelerated"
        cache = scratch / "compile-cache.bin"
        result["export"] = export(args, model, packages, out) if "aoti" in args.variants else {}
        save()
        print("export:", json.dumps(result["export"], default=str)[:600], flush=True)
        # Most important first, so a budget cut loses the least: aoti, the cache's first (cold)
        # process, today's second process; then further rounds alternating which goes first.
        plan = plan_processes(args.variants, args.rounds, args.grouped, args.no_bytecode_round)
        if not any(packages.glob("*.json")):  # no package was written: nothing for aoti to load
            plan = [p for p in plan if p[0] != "aoti"]
        for variant, n in plan:
            if time.perf_counter() - began > args.budget_s:
                result.setdefault("skipped", []).append(f"{variant} {n}")
                continue
            row = run_child(args, variant, model, cache, out, n)
            row["round"] = n
            result["processes"].append(row)
            print(variant, n, json.dumps(row, default=str)[:600], flush=True)
            tally(result, out)  # after every process: a run cut short keeps its medians and parity
            save()
        save()
        print(summary(result), flush=True)
    finally:
        for stale in out.glob("result-*.pt"):
            stale.unlink()
        shutil.rmtree(scratch, ignore_errors=True)  # the random model, the packages, the cache file
    return 0


if __name__ == "__main__":
    sys.exit(main())
