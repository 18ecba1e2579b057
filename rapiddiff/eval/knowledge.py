"""``rapiddiff eval knowledge``: does the model draw what the KG knows about an entity?

Each kshapes evaluation prompt is drawn with knowledge fusion on and off (same seeds); the kshapes
detector reads colour, shape, background and position off each image, tabulated for seen and
held-out entities × knowledge mode ("held-out, on" against "held-out, off" is what knowledge adds).
Also: the ``attribute`` split (the base generator), where misses fall, and render consistency
(:mod:`~rapiddiff.eval.consistency`). Layout: ``RUN/knowledge_{on,off}/``, ``RUN/knowledge.md``,
``RUN/metrics/knowledge.json``; resumable, and an image two modes would draw alike is drawn once.
"""

from __future__ import annotations

import argparse
import os
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from rapiddiff.eval.common import (
    METRICS_DIR,
    metric_record,
    open_rgb,
    parse_choices,
    read_index,
    read_jsonl,
    write_json,
    write_jsonl,
)
from rapiddiff.eval.sample import (
    SampleSettings,
    add_sampling_arguments,
    generate,
    load_pipeline,
    model_config,
    plan_jobs,
    settings_from_args,
)
from rapiddiff.utils.config import load_config
from rapiddiff.utils.logging import get_logger

# Modules that load torch, numpy or PIL are imported inside the functions that use them:
# `rapiddiff eval --help` imports every eval module.

log = get_logger(__name__)

SPLITS = ("seen", "heldout")
"""The splits evaluated by default: seen entities and the test held-out (KG-only) ones."""
ATTRIBUTE_SPLITS = ("attribute", "attribute_val")
"""Attribute captions naming colour, shape, background and position (no entity): "attribute" the
test set, "attribute_val" the validation set (other backgrounds and positions) to choose on. The
names of :data:`rapiddiff.data.kshapes.generate.ATTRIBUTE_STREAMS`, repeated here so that `eval
--help` does not import the kshapes package (its detector pulls in scipy); a test keeps them equal."""
ALL_SPLITS = (*SPLITS, "val", *ATTRIBUTE_SPLITS)
"""... "val": the validation KG-only entities (select checkpoints on these, never on "heldout"), and
the attribute splits."""
MODES = {"on": True, "off": False, "embed": True, "text": True, "both": True}
"""on: knowledge in the model's own mode (embed unless its folder says otherwise); off: the base
encoder; embed / text / both: that knowledge mode (text: the KG facts spelled into the prompt, the
honest ceiling for the vector path; :mod:`rapiddiff.models.expansion`)."""
REQUIRED = ("text", "entity", "colour", "shape", "split")
SCORED = ("colour", "shape", "background", "position")
"""What the detector reads off an image and an attribute caption names (all four: "all")."""
REQUIRED_ATTRIBUTE = ("text", *SCORED, "split")
"""An attribute-split record names no entity; it must say every attribute it asks for."""
ATTRIBUTE_FILE = "prompts_attribute.jsonl"


def read_knowledge_prompts(kshapes: str | Path, splits: Sequence[str] = SPLITS) -> list[dict[str, Any]]:
    """``kshapes/prompts.jsonl`` (or a prompts file given directly), checked field by field.

    The attribute splits come from the file given, or from a folder's ``prompts_attribute.jsonl``;
    a kshapes folder without that file or split (written before it existed) gets the same prompts
    made from its ``kshapes.yaml`` (:func:`rapiddiff.data.kshapes.generate.attribute_prompts`)."""
    path = Path(kshapes)
    folder = path if path.is_dir() else None
    if folder is not None:
        path = folder / "prompts.jsonl"
    rows: list[dict[str, Any]] = []
    if folder is None or any(s not in ATTRIBUTE_SPLITS for s in splits):
        rows = _read_checked(path)
    rows = [r for r in rows if r["split"] in splits]
    missing = [s for s in ATTRIBUTE_SPLITS if s in splits and not any(r["split"] == s for r in rows)]
    if missing and folder is not None:
        rows += _attribute_prompts(folder, missing)
    if not rows:
        raise ValueError(f"{path}: no prompts for split(s) {', '.join(splits)}")
    return rows


def _read_checked(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: --kshapes must be a folder written by `rapiddiff data kshapes` "
            "(or a prompts.jsonl with text, entity, colour, shape, split)"
        )
    rows = read_jsonl(path)
    for number, row in enumerate(rows, start=1):
        required = REQUIRED_ATTRIBUTE if row.get("split") in ATTRIBUTE_SPLITS else REQUIRED
        missing = [k for k in required if not row.get(k)]
        if missing:
            raise ValueError(
                f"{path}: record {number} lacks {', '.join(missing)} (needs {', '.join(required)})"
            )
        if row["split"] not in ALL_SPLITS:
            raise ValueError(
                f"{path}: record {number}: split {row['split']!r} is not one of {', '.join(ALL_SPLITS)}"
            )
    return rows


def _attribute_prompts(folder: Path, splits: Sequence[str]) -> list[dict[str, Any]]:
    """The attribute splits of a kshapes folder, in the order asked: from its prompts_attribute.jsonl
    (read once), else (a folder written before that file or split existed) made from its kshapes.yaml
    — the same prompts `rapiddiff data kshapes` writes today for that config."""
    written = _read_checked(folder / ATTRIBUTE_FILE) if (folder / ATTRIBUTE_FILE).is_file() else []
    rows = []
    for split in splits:
        rows += [r for r in written if r["split"] == split] or _attribute_prompts_from_config(folder, split)
    return rows


def _attribute_prompts_from_config(folder: Path, split: str) -> list[dict[str, Any]]:
    config = folder / "kshapes.yaml"
    if not config.is_file():
        raise FileNotFoundError(
            f"{folder}: neither {ATTRIBUTE_FILE} with split {split!r} nor kshapes.yaml: split {split!r} needs a "
            f"folder written by `rapiddiff data kshapes` (rewrite it with the same --seed, or leave {split!r} out "
            "of --splits)"
        )
    from rapiddiff.data.kshapes.generate import KShapesConfig, attribute_prompts

    cfg = load_config(KShapesConfig, config)
    rows = attribute_prompts(cfg, split)
    log.info("%s has no %s prompts in %s: %d made from its kshapes.yaml (seed %d)",
             folder, split, ATTRIBUTE_FILE, len(rows), cfg.seed)  # fmt: skip
    return rows


def score_run(
    run_dir: Path, detect: Callable[[Any], dict[str, Any]] | None = None, *, workers: int | None = None
) -> list[dict[str, Any]]:
    """Detect colour, shape, background and position on every image of a run, and measure its
    render consistency (:func:`rapiddiff.eval.consistency.render_consistency`, when the detector
    gives the object's geometry); one record per image (also written to ``detections.jsonl``).
    ``detect`` defaults to the kshapes detector, which can run in
    ``workers`` processes (it is numpy/scipy on one image: processes, not threads, use the cores;
    None: up to 8 for runs of 200 images or more, else in-process)."""
    from tqdm.auto import tqdm

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
    from rapiddiff.eval.consistency import render_consistency

    run_dir, row = task
    image = open_rgb(Path(run_dir) / row["file"])
    if detect is None:
        from rapiddiff.data.kshapes import detect_attributes

        # Positions are read on the layout the prompt was written for (row3 unless it says).
        found = detect_attributes(image, layout=row.get("layout") or "row3")
    else:
        found = detect(image)
    colour_ok, shape_ok = found.get("colour") == row["colour"], found.get("shape") == row["shape"]
    # Background and position count where the prompt names them (None: not asked).
    background_ok = found.get("background") == row["background"] if row.get("background") else None
    position_ok = found.get("position") == row["position"] if row.get("position") else None
    return {
        **row,
        "detected_colour": found.get("colour"),
        "detected_shape": found.get("shape"),
        "detected_background": found.get("background"),
        "detected_position": found.get("position"),
        "colour_ok": colour_ok,
        "shape_ok": shape_ok,
        "both_ok": colour_ok and shape_ok,
        "background_ok": background_ok,
        "position_ok": position_ok,
        "all_ok": colour_ok and shape_ok and background_ok is not False and position_ok is not False,
        **render_consistency(image, found),
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


def _percent(values: list[bool | None]) -> float | None:
    """Percent true over the values that are not None (None: nothing was asked)."""
    asked = [v for v in values if v is not None]
    return 100.0 * sum(asked) / len(asked) if asked else None


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _label(row: dict[str, Any]) -> str:
    """The entity a record is about; for attribute captions, the colour × shape pair."""
    return row.get("entity") or f"{row['colour']}的{row['shape']}"


def _accuracy_row(subset: list[dict[str, Any]], split: str, mode: str, variant: str | None) -> dict[str, Any]:
    n = len(subset)
    entities = {_label(r) for r in subset}
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
        # Over the prompts that name them (None: none does); "all": every attribute named, right.
        "background": _percent([r.get("background_ok") for r in subset]),
        "position": _percent([r.get("position_ok") for r in subset]),
        "all": _percent([r.get("all_ok") for r in subset]),
        # Render consistency: the image against the re-render of what the detector read.
        "psnr": _mean([r.get("psnr") for r in subset]),
        "ssim": _mean([r.get("ssim") for r in subset]),
    }


def per_entity(records_by_mode: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each entity's (each attribute pair's) hits and readings per mode, keyed "split/label": the
    attribute splits ask for the same 48 pairs, so a label alone would pool the two sets."""
    table: dict[str, dict[str, Any]] = defaultdict(dict)
    for mode, records in records_by_mode.items():
        groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in records:
            groups[f"{r['split']}/{_label(r)}"].append(r)
        for entity, rs in groups.items():
            table[entity]["split"] = rs[0]["split"]
            table[entity]["expected"] = {"colour": rs[0]["colour"], "shape": rs[0]["shape"]}
            table[entity][mode] = {
                "both": sum(r["both_ok"] for r in rs) / len(rs),
                "detected": [f"{r['detected_colour']}/{r['detected_shape']}" for r in rs],
            }
    return dict(sorted(table.items()))


MISREADINGS_SHOWN = 5


def attribute_misses(records_by_mode: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Where the attribute captions miss, per attribute split × mode: "all four" % by background and
    by shape (worst first), and the commonest misreadings (attribute, asked, read, images; read None:
    no object found). A miss rate that one background or shape carries is a different problem from
    one spread evenly; the accuracy rows alone do not tell them apart."""
    rows = []
    for split in ATTRIBUTE_SPLITS:
        for mode, records in records_by_mode.items():
            subset = [r for r in records if r["split"] == split]
            if not subset:
                continue
            misread: Counter[tuple[str, str, str | None]] = Counter()
            for r in subset:
                for attribute in SCORED:
                    if r.get(f"{attribute}_ok") is False:
                        misread[(attribute, r[attribute], r.get(f"detected_{attribute}"))] += 1
            rows.append(
                {
                    "split": split,
                    "knowledge": mode,
                    "images": len(subset),
                    "by_background": _all_four_by(subset, "background"),
                    "by_shape": _all_four_by(subset, "shape"),
                    "misreadings": [
                        {"attribute": a, "asked": asked, "read": read, "images": n}
                        for (a, asked, read), n in misread.most_common(MISREADINGS_SHOWN)
                    ],
                }
            )
    return rows


def _all_four_by(records: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    groups: dict[str, list[bool]] = defaultdict(list)
    for r in records:
        groups[r[key]].append(bool(r.get("all_ok")))
    cells = [{key: k, "images": len(v), "all": 100.0 * sum(v) / len(v)} for k, v in groups.items()]
    return sorted(cells, key=lambda c: (c["all"], c[key]))


def misses_table(rows: Sequence[dict[str, Any]]) -> str:
    """:func:`attribute_misses` as markdown: "name % (images)" cells, worst first."""
    lines = [
        "| prompts | knowledge | all four % by background | all four % by shape | commonest misreadings (asked → read) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        by_bg, by_shape = (
            ", ".join(f"{c[key]} {c['all']:.1f} ({c['images']})" for c in r[f"by_{key}"])
            for key in ("background", "shape")
        )
        misread = ", ".join(
            f"{m['attribute']} {m['asked']} → {m['read'] or 'none'} ×{m['images']}" for m in r["misreadings"]
        )
        lines.append(f"| {r['split']} | {r['knowledge']} | {by_bg} | {by_shape} | {misread or '–'} |")
    return "\n".join(lines)


def markdown_table(rows: Sequence[dict[str, Any]], chance: dict[str, float] | None = None) -> str:
    """The table as markdown (for the results page), with the chance level under it when given."""
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


def _fmt(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def attribute_table(rows: Sequence[dict[str, Any]]) -> str:
    """Every attribute the prompts name, per split × knowledge (no per-variant rows): colour,
    shape, background, position (over prompts naming one) and "all named" — all four for split
    "attribute" (the base generator's figure)."""
    lines = [
        "| prompts | knowledge | images | colour % | shape % | background % | position % | all named % |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "variant" not in r:
            lines.append(
                f"| {r['split']} ({r['entities']}) | {r['knowledge']} | {r['images']} | {r['colour']:.1f} | "
                f"{r['shape']:.1f} | {_fmt(r.get('background'))} | {_fmt(r.get('position'))} | "
                f"{_fmt(r.get('all'))} |"
            )
    return "\n".join(lines)


def consistency_table(rows: Sequence[dict[str, Any]]) -> str:
    """Mean PSNR / SSIM of the images against the re-render of what the detector read."""
    lines = ["| prompts | knowledge | images | PSNR dB | SSIM |", "|---|---|---:|---:|---:|"]
    for r in rows:
        if "variant" not in r:
            lines.append(
                f"| {r['split']} ({r['entities']}) | {r['knowledge']} | {r['images']} | "
                f"{_fmt(r.get('psnr'), 2)} | {_fmt(r.get('ssim'), 4)} |"
            )
    return "\n".join(lines)


def knowledge_markdown(record: dict[str, Any]) -> str:
    """RUN/knowledge.md: the accuracy table, every attribute asked for, render consistency."""
    from rapiddiff.eval.consistency import SSIM

    rows = record["table"]
    parts = [markdown_table(rows, record["details"]["chance"])]
    parts += [
        "\nEvery attribute the prompts name (background and position over the prompts that name "
        "them; split attribute: all four):\n",
        attribute_table(rows),
    ]
    misses = record["details"].get("attribute_misses")
    if misses:
        parts += [
            "\nWhere the attribute captions miss (all four right, by background and by shape, worst first; "
            "images in brackets):\n",
            misses_table(misses),
        ]
    grid = record["details"].get("render_grid")
    parts += [
        "\nRender consistency: each image against kshapes' renderer drawing what the detector read "
        f"off it (PSNR over RGB; SSIM: {SSIM}){f'; pairs in {grid}' if grid else ''}:\n",
        consistency_table(rows),
    ]
    return "\n".join(parts)


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
    run_dirs, timings = draw_modes(
        pipe, jobs, out, settings, modes, batch_size=batch_size, overwrite=overwrite, info=info
    )
    records = {mode: score_run(run_dir, detect, workers=workers) for mode, run_dir in run_dirs.items()}
    from rapiddiff.eval.consistency import SSIM, write_grid

    grid = write_grid(run_dirs, records, out / "render_consistency.png", splits=ALL_SPLITS)
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
            "attribute_misses": attribute_misses(records),
            "render_consistency": {
                "renderer": "rapiddiff.data.kshapes.render (what the detector read, re-rendered)",
                "psnr": "RGB, data range 255, capped at 100 dB",
                "ssim": SSIM,
            },
            "render_grid": grid.name if grid else None,
            **(info or {}),
        },
    )
    write_json(out / METRICS_DIR / "knowledge.json", record)
    (out / "knowledge.md").write_text(knowledge_markdown(record) + "\n", encoding="utf-8")
    return record


def draw_modes(
    pipe: Any,
    jobs: Sequence[Any],
    out: Path,
    settings: SampleSettings,
    modes: Sequence[str],
    *,
    batch_size: int = 16,
    overwrite: bool = False,
    info: dict[str, Any] | None = None,
) -> tuple[dict[str, Path], dict[str, Any]]:
    """Draw ``jobs`` once per knowledge mode into ``out/knowledge_<mode>/`` (same seeds); an image an
    earlier mode drew under the same conditioning is linked in. Returns the run folders and timings."""
    run_dirs: dict[str, Path] = {}
    timings = {}
    drawn: dict[tuple[str, Any], Path] = {}  # (job file, conditioning) → the image an earlier mode drew
    for mode in modes:
        run_dir = out / f"knowledge_{mode}"
        keys = conditioning_keys(pipe, mode, jobs, settings.negative_prompt)
        reuse = {}
        if keys is not None:
            for job, key in zip(jobs, keys, strict=True):
                if (job.file, key) in drawn:
                    reuse[job.file] = drawn[job.file, key]
                else:
                    drawn[job.file, key] = run_dir / job.file
        with _knowledge_mode(pipe, mode):
            timings[mode] = generate(
                pipe, jobs, run_dir, replace(settings, knowledge=MODES[mode]), batch_size=batch_size,
                overwrite=overwrite, info=info, reuse=reuse,
            )  # fmt: skip
        run_dirs[mode] = run_dir
    return run_dirs, timings


def conditioning_keys(
    pipe: Any, mode: str, jobs: Sequence[Any], negative_prompt: str | None = None
) -> list[tuple[str, str, bool]] | None:
    """What each job's image is conditioned on in ``mode``: the prompt and negative prompt as the
    tower reads them (KG facts spelled in for "text" / "both") and whether fused vectors enter.
    Two modes with the same key for a job draw the same image from the same seed (an attribute
    caption names no entity with colour or shape facts: "both" reads it as "on" in mode embed,
    "text" as "off"), so :func:`evaluate_knowledge` draws it once. None: a text encoder without
    knowledge modes, where nothing is shared."""
    encoder = getattr(pipe, "text_encoder", None)
    if not hasattr(encoder, "knowledge_as") or not hasattr(encoder, "expand"):
        return None
    unique = list(dict.fromkeys(job.prompt for job in jobs))  # a prompt has several images
    with encoder.knowledge_as({"on": True, "off": False}.get(mode, mode)):
        read_as = dict(zip(unique, encoder.expand(unique), strict=True))
        negative = encoder.expand([negative_prompt or ""])[0]
        fused = bool(encoder.has_knowledge)
    return [(read_as[job.prompt], negative, fused) for job in jobs]


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

    parser.description = (
        "Knowledge accuracy on kshapes: generate for prompts naming seen and held-out entities, knowledge "
        "on and off (same seeds), read colour and shape off every image with the kshapes detector, and "
        "report accuracy (colour, shape, both) per split × knowledge as markdown and JSON "
        "(RUN/knowledge.md, RUN/metrics/knowledge.json). Split 'attribute' asks for attribute captions "
        "(colour, shape, background, position: all four scored). Every image also gets a render-"
        "consistency score: PSNR/SSIM against kshapes' renderer drawing what the detector read "
        "(pairs in RUN/render_consistency.png)."
    )
    parser.add_argument(
        "--model",
        default="builtin:kshapes",
        help="model folder trained on kshapes, or builtin:NAME (default: builtin:kshapes, the built-in kshapes "
        "model, whichever built-in model generate uses by default)",
    )
    parser.add_argument(
        "--kshapes", required=True, type=Path, help="folder from `rapiddiff data kshapes` (its prompts.jsonl)"
    )
    parser.add_argument("--out", required=True, type=Path, help="run folder (images, detections, table)")
    parser.add_argument(
        "--splits",
        default="seen,heldout",
        help="which prompt splits: seen, heldout (test KG-only), val (validation KG-only; select "
        "checkpoints on it), attribute (attribute captions naming colour, shape, background and "
        "position: the base generator), attribute_val (the same pairs on other backgrounds and positions: "
        "choose a model or CFG scale on it, never on attribute) (default: seen,heldout)",
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

    splits = parse_choices(args.splits, ALL_SPLITS, "--splits", "split")
    modes = parse_choices(args.modes, MODES, "--modes", "mode")
    prompts = read_knowledge_prompts(args.kshapes, splits)
    if args.limit is not None:
        by_split: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for row in prompts:
            if len(by_split[row["split"]]) < args.limit:
                by_split[row["split"]].append(row)
        prompts = [r for s in splits for r in by_split[s]]
    # builtin:NAME resolved as generate and serve do
    from rapiddiff.infer.generate_cli import resolve_model_dir

    args.model = resolve_model_dir(str(args.model))
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
    print(knowledge_markdown(record))
    for w in record["warnings"]:
        print(f"warning: {w}")
    print(f"→ {args.out / METRICS_DIR / 'knowledge.json'}")
    return 0
