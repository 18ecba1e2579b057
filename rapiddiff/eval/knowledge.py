"""``rapiddiff eval knowledge``: does the model draw what the KG knows about an entity?

For every kshapes evaluation prompt (``prompts.jsonl``: text, entity, colour, shape, split ∈
seen/heldout) the model generates images twice, knowledge fusion on and off, with the same
seeds; the kshapes detector reads colour and shape off each image; the accuracies (colour,
shape, both) are tabulated for seen / held-out entities × knowledge on / off. Held-out
entities never appear in a training caption: only the KG can tell the model their colour and
shape, so "held-out, on" against "held-out, off" is the number that shows what knowledge adds.

Layout: ``RUN/knowledge_on/`` and ``RUN/knowledge_off/`` are ordinary eval runs (images,
index.jsonl, detections.jsonl); ``RUN/metrics/knowledge.json`` and ``RUN/knowledge.md`` hold the
table. Generation is batched and resumable like ``eval sample``.
"""

from __future__ import annotations

import argparse
import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from rapiddiff.eval.common import METRICS_DIR, metric_record, read_jsonl, write_json, write_jsonl
from rapiddiff.eval.sample import SampleSettings, generate, plan_jobs
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)

SPLITS = ("seen", "heldout")
"""The splits evaluated by default: seen entities and the test held-out (KG-only) ones."""
ALL_SPLITS = (*SPLITS, "val")
"""... and "val": the validation KG-only entities (select checkpoints on these, never on "heldout")."""
MODES = {"on": True, "off": False, "embed": True, "text": True, "both": True}
"""on: knowledge in the model's own mode (embed unless its folder says otherwise); off: the base
encoder; embed / text / both: that knowledge mode (text: the KG facts spelled into the prompt, the
honest ceiling for the vector path; :mod:`rapiddiff.models.expansion`)."""
REQUIRED = ("text", "entity", "colour", "shape", "split")


def read_knowledge_prompts(kshapes: str | Path, splits: Sequence[str] = SPLITS) -> list[dict[str, Any]]:
    """``kshapes/prompts.jsonl`` (or a prompts file given directly), checked field by field."""
    path = Path(kshapes)
    if path.is_dir():
        path = path / "prompts.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: --kshapes must be a folder written by `rapiddiff data kshapes` "
            "(or a prompts.jsonl with text, entity, colour, shape, split)"
        )
    rows = read_jsonl(path)
    for number, row in enumerate(rows, start=1):
        missing = [k for k in REQUIRED if not row.get(k)]
        if missing:
            raise ValueError(
                f"{path}: record {number} lacks {', '.join(missing)} (needs {', '.join(REQUIRED)})"
            )
        if row["split"] not in ALL_SPLITS:
            raise ValueError(
                f"{path}: record {number}: split {row['split']!r} is not one of {', '.join(ALL_SPLITS)}"
            )
    rows = [r for r in rows if r["split"] in splits]
    if not rows:
        raise ValueError(f"{path}: no prompts for split(s) {', '.join(splits)}")
    return rows


def score_run(
    run_dir: Path, detect: Callable[[Any], dict[str, Any]] | None = None, *, workers: int | None = None
) -> list[dict[str, Any]]:
    """Detect colour and shape on every image of a run; one record per image (also written to
    ``detections.jsonl``). ``detect`` defaults to the kshapes detector, which can run in
    ``workers`` processes (it is numpy/scipy on one image: processes, not threads, use the cores;
    None: up to 8 for runs of 200 images or more, else in-process)."""
    from tqdm.auto import tqdm

    from rapiddiff.eval.common import read_index

    index = read_index(run_dir)
    tasks = [(str(run_dir), row) for row in index]
    bar = {"total": len(index), "desc": f"detect {run_dir.name}", "unit": "img"}
    if workers is None:
        workers = min(8, os.cpu_count() or 1) if len(index) >= 200 else 0
    if detect is None and workers > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # forkserver: workers never inherit this process's CUDA context or threads.
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("forkserver")) as pool:
            records = list(tqdm(pool.map(_detect_one, tasks, chunksize=16), **bar))
    else:
        records = [_detect_one(task, detect) for task in tqdm(tasks, **bar)]
    write_jsonl(run_dir / "detections.jsonl", records)
    return records


def _detect_one(
    task: tuple[str, dict[str, Any]], detect: Callable[[Any], dict[str, Any]] | None = None
) -> dict[str, Any]:
    from rapiddiff.eval.common import open_rgb

    if detect is None:
        from rapiddiff.data.kshapes import detect_attributes as detect
    run_dir, row = task
    found = detect(open_rgb(Path(run_dir) / row["file"]))
    colour_ok, shape_ok = found.get("colour") == row["colour"], found.get("shape") == row["shape"]
    return {
        **row,
        "detected_colour": found.get("colour"),
        "detected_shape": found.get("shape"),
        "colour_ok": colour_ok,
        "shape_ok": shape_ok,
        "both_ok": colour_ok and shape_ok,
    }


def wilson_interval(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a proportion, in percent: honest at small n and at 0 or 100 %.

    It treats images as independent; images of one entity are not quite (the model knows an
    entity or it does not), so read it as the least uncertainty there is; ``per_entity`` in the
    JSON shows how the hits spread over entities."""
    if n == 0:
        return (0.0, 100.0)
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / (1 + z * z / n)
    return (round(100 * max(0.0, centre - half), 2), round(100 * min(1.0, centre + half), 2))


def accuracy_table(
    records_by_mode: dict[str, list[dict[str, Any]]], *, by_variant: bool = False
) -> list[dict[str, Any]]:
    """Rows (split, knowledge, n, colour, shape, both) in percent, plus per-entity counts; with
    ``by_variant``, one row per prompt variant too (prompts_robust.jsonl's "variant" field)."""
    rows = []
    for split in ALL_SPLITS:
        for mode, records in records_by_mode.items():
            in_split = [r for r in records if r["split"] == split]
            groups: list[tuple[str | None, list[dict[str, Any]]]] = [(None, in_split)]
            if by_variant:
                variants = sorted({r.get("variant") or "" for r in in_split})
                groups += [(v, [r for r in in_split if (r.get("variant") or "") == v]) for v in variants]
            for variant, subset in groups:
                if subset:
                    rows.append(_accuracy_row(subset, split, mode, variant))
    return rows


def _accuracy_row(subset: list[dict[str, Any]], split: str, mode: str, variant: str | None) -> dict[str, Any]:
    n = len(subset)
    entities = {r["entity"] for r in subset}
    return {
        "split": split,
        **({"variant": variant} if variant is not None else {}),
        "knowledge": mode,
        "images": n,
        "entities": len(entities),
        "colour": 100.0 * sum(r["colour_ok"] for r in subset) / n,
        "shape": 100.0 * sum(r["shape_ok"] for r in subset) / n,
        "both": 100.0 * sum(r["both_ok"] for r in subset) / n,
        "both_ci95": list(wilson_interval(sum(r["both_ok"] for r in subset), n)),  # JSON-shaped
        "no_object": sum(r["detected_colour"] is None for r in subset),
    }


def per_entity(records_by_mode: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    table: dict[str, dict[str, Any]] = defaultdict(dict)
    for mode, records in records_by_mode.items():
        groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in records:
            groups[r["entity"]].append(r)
        for entity, rs in groups.items():
            table[entity]["split"] = rs[0]["split"]
            table[entity]["expected"] = {"colour": rs[0]["colour"], "shape": rs[0]["shape"]}
            table[entity][mode] = {
                "both": sum(r["both_ok"] for r in rs) / len(rs),
                "detected": [f"{r['detected_colour']}/{r['detected_shape']}" for r in rs],
            }
    return dict(sorted(table.items()))


def markdown_table(rows: Sequence[dict[str, Any]], chance: dict[str, float] | None = None) -> str:
    """The table as markdown (BENCHMARKS.md), with the chance level under it when given."""
    lines = [
        "| entities | knowledge | images | colour acc. % | shape acc. % | both % | both, 95 % CI |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        split = f"{r['split']}, {r['variant']}" if r.get("variant") else r["split"]
        lines.append(
            f"| {split} ({r['entities']}) | {r['knowledge']} | {r['images']} | "
            f"{r['colour']:.1f} | {r['shape']:.1f} | {r['both']:.1f} | "
            f"{r['both_ci95'][0]:.1f}–{r['both_ci95'][1]:.1f} |"
        )
    if chance:
        lines.append(
            f"\nChance (uniform guess): colour {chance['colour']:.1f} %, shape {chance['shape']:.1f} %, "
            f"both {chance['both']:.1f} %."
        )
    return "\n".join(lines)


def evaluate_knowledge(
    pipe: Any,
    prompts: Sequence[dict[str, Any]],
    out: str | Path,
    settings: SampleSettings,
    *,
    detect: Callable[[Any], dict[str, Any]] | None = None,
    modes: Sequence[str] = ("on", "off"),
    batch_size: int = 16,
    overwrite: bool = False,
    workers: int | None = None,
    info: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Generate (both modes, same seeds), detect, tabulate; returns the metric record."""
    out = Path(out)
    jobs = plan_jobs(prompts, settings.images_per_prompt, settings.seed)
    records: dict[str, list[dict[str, Any]]] = {}
    timings = {}
    for mode in modes:
        run_dir = out / f"knowledge_{mode}"
        mode_settings = replace(settings, knowledge=MODES[mode])
        with _knowledge_mode(pipe, mode):
            timings[mode] = generate(
                pipe, jobs, run_dir, mode_settings, batch_size=batch_size, overwrite=overwrite, info=info
            )
        records[mode] = score_run(run_dir, detect, workers=workers)
    rows = accuracy_table(records, by_variant=any(p.get("variant") for p in prompts))
    has_store = getattr(getattr(pipe, "text_encoder", None), "store", None) is not None
    warnings = (
        []
        if has_store
        else [
            "the model has no KnowledgeStore: knowledge on and off are the same encoder, so the rows must agree"
        ]
    )
    from rapiddiff.data.kshapes.palette import COLOURS, SHAPES

    # The headline: held-out entities, all prompts, the first mode asked for that uses knowledge.
    first = next((m for m in modes if m != "off"), None)
    headline = next(
        (r for r in rows if r["split"] == "heldout" and r["knowledge"] == first and "variant" not in r), None
    )
    record = metric_record(
        "knowledge",
        "kshapes attribute accuracy (both, held-out, knowledge on) %",
        headline["both"] if headline else None,
        table=rows,
        warnings=warnings,
        details={
            "detector": "rapiddiff.data.kshapes.detect_attributes",
            "chance": {
                "colour": 100.0 / len(COLOURS),
                "shape": 100.0 / len(SHAPES),
                "both": 100.0 / (len(COLOURS) * len(SHAPES)),
            },
            "settings": {k: v for k, v in vars(settings).items() if k != "knowledge"},
            "prompts": len(prompts),
            "images_per_mode": len(jobs),
            "timings": timings,
            "per_entity": per_entity(records),
            **(info or {}),
        },
    )
    write_json(out / METRICS_DIR / "knowledge.json", record)
    (out / "knowledge.md").write_text(
        markdown_table(rows, record["details"]["chance"]) + "\n", encoding="utf-8"
    )
    return record


def _knowledge_mode(pipe: Any, mode: str) -> Any:
    """The text encoder in ``mode`` ("embed", "text", "both") for a block; "on"/"off" leave it as is
    (generation switches knowledge on or off itself)."""
    import contextlib

    encoder = getattr(pipe, "text_encoder", None)
    if mode in ("on", "off"):
        return contextlib.nullcontext()
    if not hasattr(encoder, "knowledge_as"):
        raise ValueError(
            f"knowledge mode {mode!r} needs a rapiddiff KnowledgeTextEncoder; this model has none"
        )
    return encoder.knowledge_as(mode)


# --- CLI ----------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from rapiddiff.eval.sample import add_sampling_arguments

    parser.description = (
        "Knowledge accuracy on kshapes: generate for prompts naming seen and held-out entities, knowledge "
        "on and off (same seeds), read colour and shape off every image with the kshapes detector, and "
        "report accuracy (colour, shape, both) per split × knowledge as markdown and JSON "
        "(RUN/knowledge.md, RUN/metrics/knowledge.json)."
    )
    parser.add_argument("--model", required=True, type=Path, help="model folder trained on kshapes")
    parser.add_argument(
        "--kshapes", required=True, type=Path, help="folder from `rapiddiff data kshapes` (its prompts.jsonl)"
    )
    parser.add_argument("--out", required=True, type=Path, help="run folder (images, detections, table)")
    parser.add_argument(
        "--splits",
        default="seen,heldout",
        help="which entity splits: seen, heldout (test KG-only), val (validation KG-only; select "
        "checkpoints on it) (default: seen,heldout)",
    )
    parser.add_argument(
        "--modes",
        default="on,off",
        help="knowledge modes to run: on (the model's own), off, embed, text (KG facts spelled into the "
        "prompt), both (default: on,off)",
    )
    parser.add_argument("--limit", type=int, help="only the first N prompts of each split (quick checks)")
    parser.add_argument(
        "--workers",
        type=int,
        help="processes for the detector (default: up to 8 for ≥ 200 images; 0: in-process)",
    )
    add_sampling_arguments(parser)
    parser.set_defaults(images_per_prompt=4, batch_size=32)


def run(args: argparse.Namespace) -> int:
    from rapiddiff.eval.sample import load_pipeline, model_config, settings_from_args

    splits = [s.strip() for s in args.splits.split(",") if s.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for s in splits:
        if s not in ALL_SPLITS:
            raise ValueError(f"--splits: unknown split {s!r}; choose from {', '.join(ALL_SPLITS)}")
    for m in modes:
        if m not in MODES:
            raise ValueError(f"--modes: unknown mode {m!r}; choose from {', '.join(MODES)}")
    prompts = read_knowledge_prompts(args.kshapes, splits)
    if args.limit is not None:
        by_split: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for row in prompts:
            if len(by_split[row["split"]]) < args.limit:
                by_split[row["split"]].append(row)
        prompts = [r for s in splits for r in by_split[s]]
    if not args.model.is_dir():
        raise FileNotFoundError(f"model folder not found: {args.model}")
    pipe = load_pipeline(args.model, device=args.device, dtype=args.dtype, fast=args.fast)
    settings = settings_from_args(args, knowledge=True)
    record = evaluate_knowledge(
        pipe,
        prompts,
        args.out,
        settings,
        modes=modes,
        batch_size=args.batch_size,
        overwrite=args.overwrite,
        workers=args.workers,
        info={"kshapes": str(args.kshapes), "fast": args.fast, "model_config": model_config(args.model)},
    )
    print(markdown_table(record["table"], record["details"]["chance"]))
    for w in record["warnings"]:
        print(f"warning: {w}")
    print(f"→ {args.out / METRICS_DIR / 'knowledge.json'}")
    return 0
