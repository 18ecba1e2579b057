"""``rapiddiff bench``: stock diffusers (``eager``), the strongest stock torch.compile ``recipe``
(diffusion-fast's) and rapiddiff's fast path (``rapiddiff``, ``rapiddiff-tome``,
``rapiddiff+KEY=VALUE[,...]`` for other switches), timed side by side in one process on the same
weights, seed and prompt: it/s, images/s, end-to-end seconds (``blocked_autorange`` median), peak
memory, warm-up, and parity with ``eager`` (latent relative error, image PSNR). Writes
``bench.json``, ``bench.md`` and the first images side by side.
"""

from __future__ import annotations

import contextlib
import csv
import faulthandler
import gc
import io
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from rapiddiff.infer.accelerate import AccelerateConfig, accelerate
from rapiddiff.models import presets
from rapiddiff.models.token_merge import check_ratio
from rapiddiff.utils.device import resolve_device
from rapiddiff.utils.io import atomic_write_text
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)

VARIANTS = ("eager", "recipe", "rapiddiff", "rapiddiff-tome")
TUNED = "rapiddiff+"  # rapiddiff+KEY=VALUE[,KEY=VALUE]: the defaults with AccelerateConfig fields changed
# Fields a tuned variant may not set: the bench owns the compile-cache file (the rapiddiff row's).
NOT_TUNABLE = ("compile_cache",)
# Switch-by-switch parity runs (no compile: each is cheap and isolates one transform).
SWITCHES: dict[str, dict[str, Any]] = {
    "channels_last": {"channels_last": True},
    "fuse_qkv": {"fuse_qkv": True},
    "attention=auto": {"attention": "auto"},
    "cross_kv_cache": {"cross_kv_cache": True},
    "batch_time_proj": {"batch_time_proj": True},
    "loop=resident": {"loop": "resident"},
    "loop=graph": {"loop": "graph"},
    "compile_unet": {"compile_unet": "default", "loop": "resident"},
}
PROMPT = "a red tomato on a blue table, studio light"
# The benchmark protocol (not a sampling default): 50 PNDM steps at guidance 7.5, as the SD 1.5
# speed figures of diffusers and diffusion-fast are measured, so the rows compare with theirs.
PROTOCOL_STEPS = 50
PROTOCOL_GUIDANCE = 7.5


@dataclass
class BenchConfig:
    model: str | None = None
    """A diffusers / rapiddiff model folder; None builds random weights of ``preset``."""
    preset: str = "sd15"
    """Architecture for random weights (rapiddiff.models.presets): sd15, kshapes or tiny."""
    steps: int = PROTOCOL_STEPS
    guidance: float = PROTOCOL_GUIDANCE
    batches: tuple[int, ...] = (1, 8)
    variants: tuple[str, ...] = ("eager", "recipe", "rapiddiff")
    switches: tuple[str, ...] = ()
    """Switch-by-switch parity runs at batch 1 (names from SWITCHES; "all" for every one)."""
    dtype: str = "float16"
    seed: int = 0
    min_run_time: float = 2.0
    """Seconds of timed runs per variant and batch (blocked_autorange)."""
    second_process: bool = False
    """Start a new process that loads the fast path's compile cache and time it to full speed."""
    compile: bool = True
    """torch.compile in rapiddiff's variants (off: a quick smoke run on a CPU)."""
    profile: bool = False
    """Profile one fast-path image per ``profile_variants`` (torch.profiler): profile.txt, profile.csv."""
    profile_variants: tuple[str, ...] = ("rapiddiff",)
    """The rapiddiff variants (``rapiddiff`` or ``rapiddiff+KEY=VALUE``) the profile covers."""
    out: str = "bench-out"
    device: str = "auto"
    budget_s: float = 0.0
    """Skip the remaining tasks once this many seconds have passed (0: no limit)."""
    stacks_after_s: float = 300.0
    """Print every thread's stack to stderr when one task has run this long (0: never), so a task
    that hangs on a device leaves where it hangs in the log."""
    token_merge: float = 0.5
    """The ToMe ratio of the ``rapiddiff-tome`` variant."""

    def __post_init__(self) -> None:
        for variant in self.variants:
            parse_variant(variant)  # raises naming the variant and what is allowed
        for variant in self.profile_variants:
            if variant != "rapiddiff" and not variant.startswith(TUNED):
                raise ValueError(f"profile variants are rapiddiff or {TUNED}KEY=VALUE, got {variant!r}")
            parse_variant(variant)
        if "all" in self.switches:
            self.switches = tuple(SWITCHES)
        bad = [s for s in self.switches if s not in SWITCHES]
        if bad:
            raise ValueError(f"unknown switches {bad}; choose from all, {', '.join(SWITCHES)}")
        if self.steps < 1 or any(b < 1 for b in self.batches):
            raise ValueError("steps and batch sizes must be ≥ 1")
        check_ratio(self.token_merge, "token_merge")


def parse_variant(name: str) -> dict[str, Any]:
    """The AccelerateConfig switches a variant name sets: {} for the named VARIANTS, the parsed
    fields for ``rapiddiff+KEY=VALUE[,KEY=VALUE...]`` (a bare KEY is true). Values are read by the
    field's type (bool: true/false, int, None: none) and checked by AccelerateConfig itself, so a bad
    value's error names the valid ones. ValueError naming the variant otherwise."""
    if name in VARIANTS:
        return {}
    kinds = {f.name: str(f.type) for f in fields(AccelerateConfig) if f.name not in NOT_TUNABLE}
    grammar = f"{TUNED}KEY=VALUE[,KEY=VALUE...] with KEY one of {', '.join(kinds)}"
    if not name.startswith(TUNED) or not name[len(TUNED) :]:
        raise ValueError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)} or {grammar}")
    switches: dict[str, Any] = {}
    for item in name[len(TUNED) :].split(","):
        key, sep, text = item.partition("=")
        if key not in kinds:
            raise ValueError(f"variant {name!r}: unknown switch {key!r}; expected {grammar}")
        if key in switches:
            raise ValueError(f"variant {name!r}: {key} given twice")
        switches[key] = _switch_value(name, key, kinds[key], text if sep else None)
    try:
        AccelerateConfig(**switches)
    except ValueError as err:
        raise ValueError(f"variant {name!r}: {err}") from err
    return switches


def _switch_value(variant: str, key: str, kind: str, text: str | None) -> Any:
    low = (text or "").strip().lower()
    if kind == "bool":
        if text is None or low in ("true", "1", "on", "yes"):
            return True
        if low in ("false", "0", "off", "no"):
            return False
        raise ValueError(f"variant {variant!r}: {key} takes true or false, got {text!r}")
    if text is None:
        raise ValueError(f"variant {variant!r}: {key} needs a value ({key}=...)")
    if "None" in kind and low in ("none", "null"):
        return None
    if kind.startswith("int"):
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"variant {variant!r}: {key} takes an integer, got {text!r}") from None
    return text


@dataclass
class Row:
    variant: str
    batch: int
    steps: int
    it_s: float = math.nan
    images_s: float = math.nan
    e2e_s: float = math.nan
    peak_gib: float = math.nan
    reserved_gib: float = math.nan
    warmup_s: float = math.nan
    latent_rel_err: float = math.nan
    psnr_db: float = math.nan
    note: str = ""
    stages: dict[str, float] = field(default_factory=dict)


# ---- building pipelines ---------------------------------------------------------------------------
def build_pipeline(cfg: BenchConfig, device: torch.device) -> Any:
    """A StableDiffusionPipeline: from ``cfg.model``, or random weights of ``cfg.preset`` (same seed ⇒ same weights)."""
    from diffusers import StableDiffusionPipeline

    dtype = getattr(torch, cfg.dtype)
    if cfg.model:
        pipe = StableDiffusionPipeline.from_pretrained(cfg.model, torch_dtype=dtype, safety_checker=None)
        pipe = pipe.to(device)
    else:
        pipe = _random_pipeline(cfg.preset, device, dtype, cfg.seed)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _random_pipeline(preset: str, device: torch.device, dtype: torch.dtype, seed: int) -> Any:
    from diffusers import AutoencoderKL, PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    unet_cfg = presets.unet_config(preset)
    with tempfile.TemporaryDirectory() as tmp:
        vocab = presets._write_byte_level_clip_tokenizer(Path(tmp))  # the real CLIP vocab cannot be fetched
        tokenizer = CLIPTokenizer(
            str(Path(tmp) / "vocab.json"), str(Path(tmp) / "merges.txt"), model_max_length=77
        )
    text_name = preset if preset == "sd15" else "tiny"
    text_cfg = presets.clip_text_config(text_name, vocab)
    width = unet_cfg["cross_attention_dim"]
    if text_cfg["hidden_size"] != width:  # e.g. kshapes: a small tower as wide as the U-Net's context
        text_cfg.update(
            hidden_size=width, projection_dim=width, num_attention_heads=4, intermediate_size=4 * width
        )
    torch.manual_seed(seed)
    with torch.device(device):
        unet = UNet2DConditionModel(**unet_cfg)
        vae = AutoencoderKL(**presets.vae_config(preset))
        text = CLIPTextModel(
            CLIPTextConfig(**text_cfg, bos_token_id=vocab - 2, eos_token_id=vocab - 1, pad_token_id=vocab - 1)
        )
    pipe = StableDiffusionPipeline(
        unet=unet,
        vae=vae,
        text_encoder=text,
        tokenizer=tokenizer,
        scheduler=PNDMScheduler(**presets.scheduler_config()),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    return pipe.to(device=device, dtype=dtype)


# ---- variants ------------------------------------------------------------------------------------
def apply_recipe(pipe: Any) -> None:
    """The strongest stock recipe (huggingface/diffusion-fast): stock diffusers and torch calls only."""
    pipe.unet.to(memory_format=torch.channels_last)
    pipe.vae.to(memory_format=torch.channels_last)
    pipe.unet.fuse_qkv_projections()
    pipe.vae.fuse_qkv_projections()
    pipe.unet = torch.compile(pipe.unet, mode="reduce-overhead", fullgraph=True)
    pipe.vae.decode = torch.compile(pipe.vae.decode, mode="reduce-overhead", fullgraph=True)


def make_runner(
    variant: str, pipe: Any, cfg: BenchConfig, cache: str | None, **switches: Any
) -> tuple[Callable[[int, str], tuple[Any, torch.Tensor | None]], Any]:
    """Apply ``variant`` to ``pipe``; return run(batch, output_type) → (images np, latents or None)."""
    prompt_kw = {"num_inference_steps": cfg.steps, "guidance_scale": cfg.guidance}
    if variant in ("eager", "recipe"):
        if variant == "recipe":
            apply_recipe(pipe)

        def run(batch: int, output_type: str = "np") -> tuple[Any, torch.Tensor | None]:
            # rapiddiff's seed rule: image k's noise from its own CPU generator seeded seed + k, drawn
            # in float32 (then cast), so every variant starts from the same latents.
            from rapiddiff.models.sampling import draw_noise, generators

            side = int(pipe.unet.config.sample_size)
            shape = (int(pipe.unet.config.in_channels), side, side)
            noise = draw_noise(generators([cfg.seed + k for k in range(batch)]), shape, pipe.unet.dtype)
            out = pipe(
                [PROMPT] * batch, latents=noise.to(pipe.device), output_type=output_type, **prompt_kw
            ).images
            if output_type == "latent":
                return None, out.float()
            return out, None

        return run, None
    if variant == "switch":
        config = AccelerateConfig.off(dtype=cfg.dtype, **switches)
    else:
        fields = {"dtype": cfg.dtype, "compile_cache": cache}
        config = AccelerateConfig(**{**fields, **parse_variant(variant), **switches})
        if not cfg.compile:
            config.compile_unet = config.compile_vae = None
    fast = accelerate(pipe, config)
    if variant == "rapiddiff-tome":
        prompt_kw["token_merge"] = cfg.token_merge

    def run_fast(batch: int, output_type: str = "np") -> tuple[Any, torch.Tensor | None]:
        out = fast([PROMPT] * batch, seed=cfg.seed, output_type="np", progress=False, **prompt_kw)
        return out.images, out.latents

    return run_fast, fast


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch._dynamo.reset()  # also drops Inductor's CUDA-graph trees
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def psnr(a: Any, b: Any) -> float:
    """PSNR in dB of two image arrays in [0, 1]."""
    import numpy as np

    mse = float(np.mean((np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench_one(
    variant: str,
    batch: int,
    cfg: BenchConfig,
    device: torch.device,
    reference: dict[str, Any],
    cache: str | None = None,
    **switches: Any,
) -> tuple[Row, Any]:
    """Build, transform, warm up, time and compare one variant at one batch size."""
    from torch.utils.benchmark import Timer

    name = variant if variant != "switch" else "switch:" + ",".join(f"{k}={v}" for k, v in switches.items())
    row = Row(name, batch, cfg.steps)
    pipe = build_pipeline(cfg, device)
    free_memory()
    start = time.perf_counter()
    run, fast = make_runner(variant, pipe, cfg, cache, **switches)
    images, latents = run(batch)
    for _ in range(2):  # reduce-overhead records its CUDA graphs on the 2nd/3rd call
        images, latents = run(batch)
    _sync()
    row.warmup_s = time.perf_counter() - start
    if latents is None:  # stock pipelines: one more call for the final latents
        _, latents = run(batch, "latent")
    timer = Timer(stmt="run(batch)", globals={"run": run, "batch": batch})
    measurement = timer.blocked_autorange(min_run_time=cfg.min_run_time)
    row.e2e_s = measurement.median
    row.it_s = cfg.steps / row.e2e_s
    row.images_s = batch / row.e2e_s
    if device.type == "cuda":
        row.peak_gib = torch.cuda.max_memory_allocated() / 2**30
        row.reserved_gib = torch.cuda.max_memory_reserved() / 2**30
    if fast is not None:
        row.note = "; ".join(f"{k}={v}" for k, v in fast.report.items() if v not in ("off",))
        out = fast(
            [PROMPT] * batch,
            seed=cfg.seed,
            output_type="np",
            num_inference_steps=cfg.steps,
            guidance_scale=cfg.guidance,
            progress=False,
            **({"token_merge": cfg.token_merge} if variant == "rapiddiff-tome" else {}),
        )
        row.stages = {k: round(v * 1e3, 2) for k, v in out.seconds.items()}
    key = f"b{batch}"
    if variant == "eager":
        reference[key] = (images, latents)
    elif key in reference:
        row.latent_rel_err = rel_err(latents, reference[key][1])
        row.psnr_db = psnr(images, reference[key][0])
    if variant == "rapiddiff":
        reference["rapiddiff-" + key] = images
    elif (
        variant == "rapiddiff-tome" and "rapiddiff-" + key in reference
    ):  # its price against the exact fast path
        exact = reference["rapiddiff-" + key]
        row.note = (
            f"token_merge={cfg.token_merge}, PSNR vs rapiddiff {psnr(images, exact):.1f} dB; " + row.note
        )
    first = images[0]
    del run, fast, pipe
    free_memory()
    return row, first


# ---- second process --------------------------------------------------------------------------------
def second_process(cfg: BenchConfig, cache: str, log_path: Path | None = None) -> dict[str, Any]:
    """Start a fresh interpreter with empty local compile caches that loads ``cache`` and runs the fast path.

    The local Inductor/Triton cache folders are new and empty, as on another machine: only the
    artifacts file can spare the recompilation.
    """
    env = dict(os.environ)
    fresh = tempfile.mkdtemp(prefix="rapiddiff-fresh-cache-")
    env.update(TORCHINDUCTOR_CACHE_DIR=fresh, TRITON_CACHE_DIR=os.path.join(fresh, "triton"))
    spec = json.dumps({**asdict(cfg), "cache": cache})
    started = time.time()
    env["RAPIDDIFF_BENCH_STARTED"] = repr(started)
    proc = subprocess.run(
        [sys.executable, "-m", "rapiddiff.infer.bench", "--child", spec],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if log_path is not None:
        atomic_write_text(log_path, proc.stderr[-200_000:])
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in [k for k in result if k.endswith("_at")]:
        result[key[:-3] + "_s"] = round(result.pop(key) - started, 2)
    return result


def first_then_steady(
    fast: Any, *, steps: int, guidance: float, seed: int, runs: int = 5
) -> tuple[Any, float, float, float]:
    """A new process's first image (it compiles or loads), then ``runs`` more: (the first image's
    output, the wall-clock times the first and the second image ended, the median seconds an image
    at full speed)."""
    kw = {
        "num_inference_steps": steps,
        "guidance_scale": guidance,
        "seed": seed,
        "output_type": "np",
        "progress": False,
    }
    out = fast([PROMPT], **kw)
    first = time.time()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fast([PROMPT], **kw)
        times.append(time.perf_counter() - t0)
    return out, first, first + times[0], sorted(times)[len(times) // 2]


def _child(spec: str) -> None:
    """The second process: build, accelerate with the cache, report when it reaches full speed."""
    imported = time.time()
    data = json.loads(spec)
    cache = data.pop("cache")
    cfg = BenchConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})
    device = torch.device("cuda")
    torch.cuda.init()
    pipe = build_pipeline(cfg, device)
    built = time.time()
    fast = accelerate(pipe, AccelerateConfig(dtype=cfg.dtype, compile_cache=cache))
    _, first, full_speed, e2e = first_then_steady(fast, steps=cfg.steps, guidance=cfg.guidance, seed=cfg.seed)
    from torch._dynamo.utils import counters

    report = {
        "imported_at": imported,
        "built_at": built,
        "first_image_at": first,
        "full_speed_at": full_speed,
        "e2e_s": e2e,
        "it_s": cfg.steps / e2e,
        "cache": fast.report.get("compile_cache", ""),
        "counters": {k: dict(v) for k, v in counters.items() if k in ("inductor", "aot_autograd", "stats")},
    }
    print(json.dumps(report, default=str))


# ---- the whole run -----------------------------------------------------------------------------------
def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    device = resolve_device(cfg.device)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "diffusers": __import__("diffusers").__version__,
        "config": asdict(cfg),
        "command": " ".join(sys.argv),
    }
    rows: list[Row] = []
    firsts: list[tuple[str, Any]] = []
    reference: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    cache = str(Path(tempfile.gettempdir()) / f"rapiddiff-compile-{cfg.preset}.bin")
    for stale in (cache, cache + ".attention.json"):  # a cold start: this run measures compilation
        if os.path.exists(stale):
            os.remove(stale)
    began = time.perf_counter()

    def save() -> str:
        # Written after every task: a run cut short still leaves every finished number behind.
        atomic_write_text(
            out / "bench.json",
            json.dumps({"meta": meta, "rows": [asdict(r) for r in rows], **extra}, indent=1, default=str),
        )
        table = markdown_table(rows, meta, extra)
        atomic_write_text(out / "bench.md", table)
        _save_grid(firsts, out / "first_images.png")
        return table

    def run_task(task: str, args: Any) -> None:
        if task == "second_process":
            if device.type == "cuda" and os.path.exists(cache):
                child_cfg = BenchConfig(**{**asdict(cfg), "batches": (1,), "second_process": False})
                extra["second_process"] = second_process(child_cfg, cache, out / "child.log")
                extra["compile_cache_mib"] = os.path.getsize(cache) / 2**20
                print("second process:", json.dumps(extra["second_process"])[:800], flush=True)
        elif task == "profile":
            deadline = began + cfg.budget_s if cfg.budget_s else float("inf")
            extra["profile"] = profile_fast(cfg, device, out, deadline)
        else:
            variant, batch, switches = args
            log.info("bench: %s at batch %d %s", variant, batch, switches or "")
            cached = cache if variant == "rapiddiff" else None
            try:
                row, first = bench_one(variant, batch, cfg, device, reference, cached, **switches)
            except Exception as err:  # one broken variant must not lose the others' numbers
                log.exception("bench: %s at batch %d failed", variant, batch)
                row = Row(variant, batch, cfg.steps, note=f"FAILED: {type(err).__name__}: {err}"[:300])
                first = None
                free_memory()
            rows.append(row)
            _print_row(row)
            if first is not None and variant != "switch":
                firsts.append((f"{variant} b{batch}", first))

    for task, args in plan_tasks(cfg):
        spent = time.perf_counter() - began
        if cfg.budget_s and spent > cfg.budget_s:
            what = f"{args[0]} at batch {args[1]}" if task == "run" else task
            log.warning(
                "bench: time budget %.0f s spent (%.0f s); not starting %s", cfg.budget_s, spent, what
            )
            print(f"skipped (time budget {cfg.budget_s:.0f} s spent at {spent:.0f} s): {what}", flush=True)
            extra.setdefault("skipped", []).append(what)
            save()
            continue
        with stacks_if_stuck(cfg.stacks_after_s):
            run_task(task, args)
        save()
    table = save()
    print(table, flush=True)
    return {"meta": meta, "rows": [asdict(r) for r in rows], **extra}


@contextlib.contextmanager
def stacks_if_stuck(seconds: float) -> Iterator[None]:
    """Print every thread's stack to stderr if the block is still running after ``seconds`` (0: off).
    A variant whose warm-up never ends otherwise leaves no trace of where it hangs."""
    stream = sys.__stderr__
    armed = seconds > 0 and stream is not None
    if armed:
        faulthandler.dump_traceback_later(seconds, file=stream)
    try:
        yield
    finally:
        if armed:
            faulthandler.cancel_dump_traceback_later()


def plan_tasks(cfg: BenchConfig) -> list[tuple[str, Any]]:
    """Most important first, so a time budget cuts the least useful: the first batch size with every
    variant, the second process, the other batch sizes, switch parity, the profile."""
    main = list(cfg.variants)
    if "eager" not in main:
        main.insert(0, "eager")  # the parity reference
    first, *others = cfg.batches
    tasks: list[tuple[str, Any]] = [("run", (v, first, {})) for v in main]
    if cfg.second_process:
        tasks.append(("second_process", None))
    tasks += [("run", (v, b, {})) for b in others for v in main]
    tasks += [("run", ("switch", first, SWITCHES[name])) for name in cfg.switches]
    if cfg.profile:
        tasks.append(("profile", None))
    return tasks


def profile_fast(cfg: BenchConfig, device: torch.device, out: Path, deadline: float = float("inf")) -> str:
    """GPU kernels of one image of each ``cfg.profile_variants`` without the loop graph (so each kernel
    is visible): the time by kernel family and the top kernels in ``out/profile.txt``, every kernel
    (name, calls, total and mean µs, family, variant) in ``out/profile.csv``. Both files are rewritten
    after each variant, and no variant starts after ``deadline`` (``time.perf_counter()``), so a run
    cut short keeps the profiles it finished."""
    from torch.profiler import ProfilerActivity, profile

    texts, summaries = [], []
    table_csv = io.StringIO()
    rows_csv = csv.writer(table_csv)  # variant names hold commas (rapiddiff+A=1,B=2): quoted where needed
    rows_csv.writerow(["variant", "family", "calls", "total_us", "mean_us", "kernel"])
    kw = {
        "num_inference_steps": cfg.steps,
        "guidance_scale": cfg.guidance,
        "seed": cfg.seed,
        "output_type": "np",
        "progress": False,
    }
    cuda = device.type == "cuda"
    for variant in cfg.profile_variants:
        if time.perf_counter() > deadline:
            summaries.append(f"{variant}: not profiled (time budget {cfg.budget_s:.0f} s spent)")
            print(summaries[-1], flush=True)
            continue
        pipe = build_pipeline(cfg, device)
        config = AccelerateConfig(**{"dtype": cfg.dtype, **parse_variant(variant), "loop": "resident"})
        fast = accelerate(pipe, config)
        fast([PROMPT], **kw)
        fast([PROMPT], **kw)
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            fast([PROMPT], **kw)
        events = prof.key_averages()
        sort = "cuda_time_total" if cuda else "self_cpu_time_total"
        table = events.table(sort_by=sort, row_limit=30, max_name_column_width=100)
        families: dict[str, float] = {}
        for evt in events:
            if cuda:
                us = float(
                    getattr(evt, "self_device_time_total", 0) or getattr(evt, "self_cuda_time_total", 0) or 0
                )
            else:  # a CPU run (tests, smoke runs): its operators' own time
                us = float(getattr(evt, "self_cpu_time_total", 0) or 0)
            if us > 0:
                family = _family(evt.key)
                families[family] = families.get(family, 0.0) + us / 1e3
                rows_csv.writerow(
                    [variant, family, evt.count, f"{us:.1f}", f"{us / max(evt.count, 1):.2f}", evt.key]
                )
        plan = fast.denoiser.plan_for(fast.scheduler, cfg.steps)
        evals = plan if isinstance(plan, str) else plan.num_evaluations
        what = "GPU time" if cuda else "CPU time (operators)"
        summary = f"{variant}: {what} of one image by kernel family (ms; U-Net ×{evals} evaluations + decode + text):\n"
        summary += "\n".join(
            f"  {k:<34} {v:8.2f}" for k, v in sorted(families.items(), key=lambda kv: -kv[1])
        )
        summary += f"\n  {'total':<34} {sum(families.values()):8.2f}"
        summaries.append(summary)
        texts.append(summary + "\n\n" + table)
        print(summary, flush=True)
        del fast, pipe
        free_memory()
        atomic_write_text(out / "profile.txt", "\n\n".join(texts))
        atomic_write_text(out / "profile.csv", table_csv.getvalue())
    return "\n\n".join(summaries)


def _family(name: str) -> str:
    low = name.lower()
    # Attention first: cuDNN's SDPA kernels are named "..._sdpa_..._flash_fprop_..." too.
    if any(k in low for k in ("fmha", "flash", "attention", "sdpa")):
        return "attention"
    if "fprop" in low or ("conv" in low and "triton" not in low):
        return "convolution"
    if any(k in low for k in ("nvjet", "gemm", "cublas", "gemv", "scaled_mm")):
        return "matmul (linear)"
    if "triton" in low:
        return "fused Triton (norms, elementwise)"
    return "other"


def _print_row(row: Row) -> None:
    print(
        f"{row.variant:>40} b{row.batch}: {row.it_s:7.1f} it/s {row.images_s:6.2f} img/s {row.e2e_s:7.3f} s "
        f"peak {row.peak_gib:5.2f} GiB warm-up {row.warmup_s:6.1f} s rel {row.latent_rel_err:.2e} "
        f"PSNR {row.psnr_db:5.1f} {row.note[:200]}",
        flush=True,
    )


def markdown_table(rows: list[Row], meta: dict[str, Any], extra: dict[str, Any]) -> str:
    lines = [
        f"{meta['device']}, torch {meta['torch']}, diffusers {meta['diffusers']}, {meta['date']}; "
        f"{meta['config']['preset'] if not meta['config']['model'] else meta['config']['model']}, "
        f"{meta['config']['steps']} steps, guidance {meta['config']['guidance']}, {meta['config']['dtype']}",
        "",
        "| variant | batch | it/s | images/s | end to end (s) | peak GiB | warm-up (s) | latent rel. err | PSNR (dB) | vs recipe |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    recipe = {r.batch: r for r in rows if r.variant == "recipe"}
    for r in rows:
        ratio = (
            f"{r.it_s / recipe[r.batch].it_s:.2f}×" if r.batch in recipe and recipe[r.batch].it_s > 0 else ""
        )
        lines.append(
            f"| {r.variant} | {r.batch} | {r.it_s:.1f} | {r.images_s:.2f} | {r.e2e_s:.3f} | {r.peak_gib:.2f} | "
            f"{r.warmup_s:.1f} | {r.latent_rel_err:.1e} | {r.psnr_db:.1f} | {ratio} |"
        )
    if extra.get("skipped"):
        lines += [
            "",
            f"Not started (time budget {meta['config']['budget_s']:.0f} s spent): {', '.join(extra['skipped'])}.",
        ]
    sp = extra.get("second_process")
    if sp and "error" not in sp:
        lines += [
            "",
            f"Second process (fresh local caches, compile cache {extra.get('compile_cache_mib', 0):.0f} MiB loaded): "
            f"imports done {sp.get('imported_s', math.nan):.1f} s after start, weights built {sp.get('built_s', math.nan):.1f} s, "
            f"first image {sp['first_image_s']:.1f} s, full speed from {sp['full_speed_s']:.1f} s, "
            f"then {sp['it_s']:.1f} it/s ({sp['e2e_s']:.3f} s per image).",
        ]
    elif sp:
        lines += ["", f"Second process failed: {sp['error'][-300:]}"]
    return "\n".join(lines) + "\n"


def _save_grid(firsts: list[tuple[str, Any]], path: Path) -> None:
    if not firsts:
        return
    import numpy as np
    from PIL import Image

    tiles = [np.asarray(img) for _, img in firsts]
    h = max(t.shape[0] for t in tiles)
    tiles = [np.pad(t, ((0, h - t.shape[0]), (0, 4), (0, 0))) for t in tiles]
    grid = (np.clip(np.concatenate(tiles, axis=1), 0, 1) * 255).round().astype("uint8")
    Image.fromarray(grid).save(path)
    atomic_write_text(path.with_suffix(".txt"), "left to right: " + ", ".join(n for n, _ in firsts) + "\n")


if __name__ == "__main__":  # the second process (second_process starts it); `rapiddiff bench` is the CLI
    if len(sys.argv) != 3 or sys.argv[1] != "--child":
        sys.exit("usage: python -m rapiddiff.infer.bench --child SPEC (run `rapiddiff bench` instead)")
    _child(sys.argv[2])
