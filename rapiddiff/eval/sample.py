"""``rapiddiff eval sample``: the images of an evaluation, batched and resumable.

Prompts come from a file (one a line, or JSONL with a ``text`` field; other fields such as
``entity`` are carried into the index) or from a dataset's captions (``--dataset``, through
``rapiddiff.data.loader``; ``--save-real`` also writes those images, the reference set for FID).

Image ``j`` of prompt ``i`` gets seed ``seed + i * images_per_prompt + j`` and the file
``images/<i:06d>_s<seed>.png``: names depend only on prompt index and seed, so a rerun skips
what exists (after checking, from the PNG's own text chunks, that it was made for the same
prompt) and an interrupted run resumes. ``sample.json`` keeps the settings; a rerun with other
settings into the same folder is refused instead of mixing two experiments.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rapiddiff.eval.common import (
    IMAGES_DIR,
    INDEX_NAME,
    SAMPLE_INFO,
    add_device_arguments,
    read_jsonl,
    write_json,
    write_jsonl,
)
from rapiddiff.utils.device import resolve_device, resolve_dtype
from rapiddiff.utils.io import atomic_open, read_text_lines
from rapiddiff.utils.logging import get_logger

# Modules that load torch, numpy or PIL are imported inside the functions that use them:
# `rapiddiff eval --help` imports every eval module.

log = get_logger(__name__)


def _sampling_defaults() -> Any:
    from rapiddiff.models.sampling import SamplingDefaults  # deferred: it imports torch

    return SamplingDefaults()


@dataclass
class SampleSettings:
    """Everything that decides what an image looks like, besides prompt and seed."""

    model: str
    steps: int = field(default_factory=lambda: _sampling_defaults().num_inference_steps)
    guidance: float = field(default_factory=lambda: _sampling_defaults().guidance_scale)
    scheduler: str = field(default_factory=lambda: _sampling_defaults().scheduler)
    height: int | None = None
    width: int | None = None
    negative_prompt: str | None = None
    knowledge: bool = True
    upscale: bool = False
    seed: int = 0
    images_per_prompt: int = 1
    fast: bool = False  # the fast path's images differ from eager ones by float noise: not mixed in a run

    def call_kwargs(self) -> dict[str, Any]:
        return {
            "num_inference_steps": self.steps,
            "guidance_scale": self.guidance,
            "scheduler": self.scheduler,
            "height": self.height,
            "width": self.width,
            "knowledge": self.knowledge,
            "upscale": self.upscale,
        }


@dataclass
class Job:
    index: int  # the prompt's position in the prompt list
    prompt: str
    seed: int
    file: str  # relative to the run folder
    extra: dict[str, Any] = field(default_factory=dict)  # entity, split, ... from the prompt file

    def record(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "prompt": self.prompt,
            "seed": self.seed,
            "index": self.index,
            **self.extra,
        }


def image_name(index: int, seed: int) -> str:
    return f"{IMAGES_DIR}/{index:06d}_s{seed}.png"


def read_prompts(path: str | Path) -> list[dict[str, Any]]:
    """Prompts as dicts with a ``text`` key: a ``.jsonl`` file (``text`` field required, other
    fields kept) or plain text, one prompt a line (blank lines skipped)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    if path.suffix.lower() in (".jsonl", ".json"):
        rows = read_jsonl(path)
        for number, row in enumerate(rows, start=1):
            if not isinstance(row.get("text"), str):
                raise ValueError(
                    f"{path}: record {number} has no string 'text' field (keys: {', '.join(row)})"
                )
    else:
        rows = [{"text": line.strip()} for _, line in read_text_lines(path, what="prompt")]
    if not rows:
        raise ValueError(f"{path}: no prompts in it")
    return rows


def dataset_prompts(
    source: str | Path, *, limit: int | None, real_dir: Path | None, image_size: int | None
) -> list[dict[str, Any]]:
    """Captions of an image–caption dataset (skipped items left out, as the loader skips them);
    with ``real_dir``, the matching images are written there too (the FID reference set)."""
    from rapiddiff.data.loader import ImageTextDataset

    kwargs = {"image_size": image_size} if image_size else {}
    dataset = ImageTextDataset(str(source), **kwargs)
    n = len(dataset) if limit is None else min(limit, len(dataset))
    if real_dir is None and hasattr(dataset, "texts"):  # captions only: no image is decoded
        rows = [{"text": t, "dataset_index": i} for i, t in enumerate(dataset.texts[:n])]
    else:
        rows = []
        for i in range(n):
            item = dataset[i]
            rows.append({"text": item["text"], "dataset_index": int(item.get("index", i))})
            if real_dir is not None:
                _save_real(item["pixel_values"], real_dir / f"{i:06d}.png")
    if not rows:
        raise ValueError(f"{source}: no usable image–caption pairs")
    return rows


def _save_real(pixels: Any, path: Path) -> None:
    from PIL import Image

    if path.exists():
        return
    array = ((pixels.float().clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0).cpu().numpy()
    with atomic_open(path) as handle:
        Image.fromarray(array).save(handle, format="PNG")


def plan_jobs(prompts: Sequence[dict[str, Any]], images_per_prompt: int, seed: int) -> list[Job]:
    if images_per_prompt < 1:
        raise ValueError(f"--images-per-prompt must be ≥ 1, got {images_per_prompt}")
    jobs = []
    for i, row in enumerate(prompts):
        extra = {k: v for k, v in row.items() if k != "text"}
        for j in range(images_per_prompt):
            s = seed + i * images_per_prompt + j
            jobs.append(Job(i, row["text"], s, image_name(i, s), extra))
    return jobs


def _existing_matches(path: Path, job: Job) -> bool:
    """Is ``path`` an image made for this job? Checked against the prompt in its PNG text chunks."""
    from rapiddiff.infer.png import read_png_metadata

    if not path.is_file():
        return False
    try:
        meta = read_png_metadata(path)
    except (ValueError, OSError, SyntaxError):  # unreadable or half-written: make it again
        return False
    prompt = meta.get("prompt")
    if prompt is not None and prompt != job.prompt:
        raise ValueError(
            f"{path} was made for the prompt {prompt!r}, not {job.prompt!r}: this run folder holds another "
            "prompt list; use a new --out folder"
        )
    return True


def _link_or_copy(source: Path, target: Path) -> None:
    """``target`` as a hard link to ``source`` (no second copy on disk), a copy across file systems."""
    import os
    import shutil

    if not source.is_file():
        raise FileNotFoundError(f"{source}: the image to reuse is not there")
    target.unlink(missing_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def check_settings(run_dir: Path, settings: SampleSettings, overwrite: bool) -> None:
    """Refuse to resume a run made with other settings (unless ``overwrite``)."""
    import json

    info = run_dir / SAMPLE_INFO
    if overwrite or not info.is_file():
        return
    previous = json.loads(info.read_text(encoding="utf-8")).get("settings", {})
    changed = {k: (previous.get(k), v) for k, v in asdict(settings).items() if previous.get(k, v) != v}
    if changed:
        diff = ", ".join(f"{k}: {a!r} → {b!r}" for k, (a, b) in changed.items())
        raise ValueError(
            f"{run_dir} was sampled with other settings ({diff}); its images would mix two experiments. "
            "Use a new --out folder, or --overwrite to regenerate every image."
        )


def generate(
    pipe: Callable[..., Any],
    jobs: Sequence[Job],
    run_dir: str | Path,
    settings: SampleSettings,
    *,
    batch_size: int = 8,
    overwrite: bool = False,
    info: dict[str, Any] | None = None,
    reuse: dict[str, Path] | None = None,
) -> dict[str, Any]:
    """Make every job's image that is not there yet; write ``index.jsonl`` and ``sample.json``.

    ``pipe`` follows RapidDiffusionPipeline's call contract (prompts, seeds as a list, settings
    as keywords; ``.images`` of PIL images). ``reuse`` maps a job's file to an image another run
    drew under the same conditioning and seed: it is linked in (copied where links fail) instead
    of drawn (``eval knowledge`` draws mode "both" of a caption with no KG facts once, as "on").
    Returns counts and timings.
    """
    from tqdm.auto import tqdm

    from rapiddiff.infer.png import save_png

    run_dir = Path(run_dir)
    check_settings(run_dir, settings, overwrite)
    (run_dir / IMAGES_DIR).mkdir(parents=True, exist_ok=True)
    reuse = reuse or {}
    for job in jobs:
        if job.file in reuse and (overwrite or not _existing_matches(run_dir / job.file, job)):
            _link_or_copy(Path(reuse[job.file]), run_dir / job.file)
    todo = [
        job
        for job in jobs
        if job.file not in reuse and (overwrite or not _existing_matches(run_dir / job.file, job))
    ]
    info = dict(info or {})
    sample_info = {"settings": asdict(settings), **info, "num_images": len(jobs)}
    write_json(run_dir / SAMPLE_INFO, sample_info)  # first: a crash mid-run still records the settings
    reused = sum(job.file in reuse for job in jobs)
    log.info(
        "%d images planned, %d already there, %d reused from another run, %d to make",
        len(jobs), len(jobs) - len(todo) - reused, reused, len(todo),
    )  # fmt: skip

    started = time.perf_counter()
    kwargs = settings.call_kwargs()
    negative = settings.negative_prompt
    with tqdm(total=len(todo), desc="sampling", unit="img") as bar:
        for start in range(0, len(todo), batch_size):
            batch = todo[start : start + batch_size]
            # A pipeline with compiled / graph-captured loops (the fast path) gets full batches only:
            # the last one is padded with repeats whose images are dropped, so no new shape recompiles.
            padded = (
                batch + [batch[-1]] * (batch_size - len(batch))
                if getattr(pipe, "fixed_batch", False)
                else batch
            )
            out = pipe(
                [job.prompt for job in padded],
                negative_prompt=negative,
                seed=[job.seed for job in padded],
                progress=False,
                **kwargs,
            )
            images = list(out.images)[: len(batch)] if len(padded) > len(batch) else list(out.images)
            if len(images) != len(batch):
                raise RuntimeError(f"the pipeline returned {len(images)} images for {len(batch)} prompts")
            metas = list(getattr(out, "metadata", None) or [{} for _ in batch])
            for job, image, meta in zip(batch, images, metas, strict=True):
                # The pipeline's own metadata (what `rapiddiff generate` writes) wins where it has a key.
                meta = {
                    "prompt": job.prompt,
                    "seed": job.seed,
                    "negative_prompt": negative,
                    "steps": settings.steps,
                    "guidance": settings.guidance,
                    "model": settings.model,
                    **meta,
                }
                save_png(image, run_dir / job.file, meta)
            bar.update(len(batch))
    seconds = time.perf_counter() - started
    write_jsonl(run_dir / INDEX_NAME, (job.record() for job in jobs))
    stats = {
        "generated": len(todo),
        "skipped_existing": len(jobs) - len(todo) - reused,
        "reused": reused,
        "seconds": round(seconds, 3),
        "images_per_second": round(len(todo) / seconds, 4) if todo and seconds > 0 else None,
        "batch_size": batch_size,
    }
    sample_info["last_run"] = stats
    write_json(run_dir / SAMPLE_INFO, sample_info)
    return stats


# --- loading the model --------------------------------------------------------------------------


def model_config(model_dir: str | Path) -> dict[str, Any]:
    """What a report shows about a model folder: model_index.json, the U-Net and VAE configs,
    the knowledge settings (whichever exist)."""
    import json

    model_dir = Path(model_dir)
    config: dict[str, Any] = {"path": str(model_dir)}
    for key, rel in (
        ("model_index", "model_index.json"),
        ("unet", "unet/config.json"),
        ("vae", "vae/config.json"),
        ("scheduler", "scheduler/scheduler_config.json"),
        ("knowledge", "knowledge/fusion_config.json"),
        ("rapiddiff", "rapiddiff.json"),
    ):
        path = model_dir / rel
        if path.is_file():
            try:
                config[key] = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError:
                config[key] = f"(unreadable JSON: {path})"
    return config


def _native_size(config: dict[str, Any]) -> int | None:
    """The model's image size (U-Net sample size × VAE factor), read from its configs: the
    reference images of ``--save-real`` are made at the size the model generates."""
    from rapiddiff.models.sampling import default_size

    try:
        unet, vae = (SimpleNamespace(config=SimpleNamespace(**config[k])) for k in ("unet", "vae"))
        return default_size(unet, vae)
    except (KeyError, TypeError, ValueError):
        return None


def load_pipeline(model: str | Path, *, device: str = "auto", dtype: str = "auto", fast: bool = False) -> Any:
    """RapidDiffusionPipeline on the device; with ``fast``, behind the fast path."""
    from rapiddiff.infer.pipeline import RapidDiffusionPipeline

    dev = resolve_device(device)
    pipe = RapidDiffusionPipeline.from_pretrained(model, device=dev, dtype=resolve_dtype(dtype, dev))
    if not fast:
        return pipe
    from rapiddiff.infer.accelerate import accelerate

    return accelerate(pipe)  # the same pipeline, its denoise stage the graph-captured loop


# --- CLI ----------------------------------------------------------------------------------------


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """Generation settings shared by ``eval sample`` and ``eval knowledge``."""
    parser.add_argument("--steps", type=int, help="denoising steps (default: the model's, else 50)")
    parser.add_argument(
        "--guidance", type=float, help="classifier-free guidance scale (default: the model's, else 7.5)"
    )
    parser.add_argument("--scheduler", help="sampler: pndm, ddim or dpm++ (default: the model's, else pndm)")
    parser.add_argument("--height", type=int, help="image height (default: the model's)")
    parser.add_argument("--width", type=int, help="image width (default: the model's)")
    parser.add_argument("--negative-prompt", help="one negative prompt for every image")
    parser.add_argument("--seed", type=int, default=0, help="base seed (image j of prompt i: seed + i*K + j)")
    parser.add_argument("--images-per-prompt", type=int, default=1, metavar="K")
    parser.add_argument("--batch-size", type=int, default=8, help="images per pipeline call (default: 8)")
    parser.add_argument("--fast", action="store_true", help="use the fast path (rapiddiff.infer.accelerate)")
    parser.add_argument("--overwrite", action="store_true", help="regenerate images that already exist")
    add_device_arguments(parser)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Generate the images of an evaluation into RUN/images/ with RUN/index.jsonl (file, prompt, seed, "
        "entity, ...) and RUN/sample.json (settings, model config, timings). Resumable: images already "
        "written are kept. Then: eval fid / clipscore / report on RUN."
    )
    parser.add_argument("--model", required=True, type=Path, help="model folder (rapiddiff, SD 1.x or Taiyi)")
    parser.add_argument("--out", required=True, type=Path, help="run folder to fill")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompts", type=Path, help="prompt file: one a line, or JSONL with a 'text' field")
    source.add_argument("--dataset", type=Path, help="take the captions of this image–caption dataset")
    parser.add_argument("--limit", type=int, help="use only the first N prompts/captions")
    parser.add_argument(
        "--save-real",
        action="store_true",
        help="with --dataset: also write its images to RUN/real/ (FID reference)",
    )
    parser.add_argument(
        "--knowledge", choices=("on", "off"), default="on", help="knowledge fusion (default: on)"
    )
    parser.add_argument(
        "--upscale",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the model's ×4 upscaler on every image (default: on when the model has one, as generate)",
    )
    add_sampling_arguments(parser)


def settings_from_args(args: argparse.Namespace, *, knowledge: bool) -> SampleSettings:
    """The run's settings: flags win over the model folder's sampling defaults (rapiddiff.json),
    which win over the library's — the rule ``rapiddiff generate`` follows, so both make one image."""
    from rapiddiff.models.bundle import read_sampling
    from rapiddiff.models.sampling import SamplingDefaults, canonical_scheduler_name

    defaults = read_sampling(args.model) or SamplingDefaults()
    upscale = getattr(args, "upscale", False)
    if upscale is None:
        upscale = (Path(args.model) / "upscaler").is_dir()
    return SampleSettings(
        model=str(args.model),
        steps=defaults.num_inference_steps if args.steps is None else args.steps,
        guidance=defaults.guidance_scale if args.guidance is None else args.guidance,
        scheduler=canonical_scheduler_name(args.scheduler or defaults.scheduler),
        height=args.height,
        width=args.width,
        negative_prompt=args.negative_prompt,
        knowledge=knowledge,
        upscale=upscale,
        seed=args.seed,
        images_per_prompt=args.images_per_prompt,
        fast=args.fast,
    )


def run(args: argparse.Namespace) -> int:
    if not args.model.is_dir():
        raise FileNotFoundError(f"model folder not found: {args.model}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be ≥ 1, got {args.batch_size}")
    if args.prompts is not None:
        prompts = read_prompts(args.prompts)[: args.limit]
        source = str(args.prompts)
    else:
        prompts = dataset_prompts(
            args.dataset,
            limit=args.limit,
            real_dir=args.out / "real" if args.save_real else None,
            image_size=args.height or _native_size(model_config(args.model)),
        )
        source = str(args.dataset)
    settings = settings_from_args(args, knowledge=args.knowledge == "on")
    check_settings(args.out, settings, args.overwrite)  # before the model loads: fail fast
    pipe = load_pipeline(args.model, device=args.device, dtype=args.dtype, fast=args.fast)
    jobs = plan_jobs(prompts, args.images_per_prompt, args.seed)
    stats = generate(
        pipe,
        jobs,
        args.out,
        settings,
        batch_size=args.batch_size,
        overwrite=args.overwrite,
        info={
            "prompts": source,
            "fast": args.fast,
            "model_config": model_config(args.model),
            "device": str(getattr(pipe, "device", args.device)),
        },
    )
    print(f"{stats['generated']} images made, {stats['skipped_existing']} kept → {args.out}")
    return 0
