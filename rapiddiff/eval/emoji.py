"""``rapiddiff eval emoji``: does the model draw the emoji a prompt names? Read by the frozen judge.

Prompts come from an emoji-zh data folder (``splits.json``, ``entities.jsonl``): seen entities by
their ``zh`` name, alias prompts (``zh-Hant`` names, unique keywords no caption uses), held-out and
validation entities, each with a background shade and (every other prompt) a position. Images are
drawn through ``eval knowledge``'s machinery for every knowledge mode asked (same seeds); the judge
(:mod:`rapiddiff.eval.judge`) reads entity top-1 / top-5 and subcategory, the deterministic reader
(:mod:`rapiddiff.eval.emoji_layout`) background and position. A "judge-feature Fréchet distance"
(not FID) compares generated with real renders, beside the same distance between two real styles.
Writes ``OUT/metrics/emoji.json``, ``OUT/emoji.md`` and a grid per split (``OUT/grid_<split>.png``).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rapiddiff.eval.common import METRICS_DIR, metric_record, parse_choices, write_json, write_jsonl
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)

SPLITS = ("seen", "alias", "heldout", "val")
"""seen: ``zh`` names of training captions; alias: names no caption uses; heldout: KG-only entities
(the test side); val: KG-only entities to choose checkpoints, guidance or seeds on."""
TEMPLATES = ("{bg}背景上有一个{e}", "{bg}背景的{pos}有一个{e}")
"""kshapes' evaluation templates (rapiddiff.data.kshapes.captions.PROMPT_TEMPLATES), repeated here so
that `eval --help` imports no data package; a test keeps them equal."""
FRECHET_LABEL = "judge-feature Fréchet distance"


def emoji_prompts(
    data_dir: str | Path, splits: Sequence[str], vocab: Any, *, limit: int | None = None
) -> list[dict[str, Any]]:
    """The evaluation prompts of a data folder: text, entity id, split, the name asked for and its
    kind (zh / zh_hant / keyword), background, position (None where the template names none)."""
    from rapiddiff.eval.judge import read_entities

    data_dir = Path(data_dir)
    path = data_dir / "splits.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: --data must be a folder written by `rapiddiff data emoji`"
        )
    split_ids = json.loads(path.read_text(encoding="utf-8"))
    entities = {e["id"]: e for e in read_entities(data_dir)}
    backgrounds, positions = sorted(vocab.backgrounds), sorted(vocab.positions)
    rows = []
    for split in splits:
        if split == "alias":
            asks = [(a["id"], a["name"], a.get("kind", "alias")) for a in split_ids.get("alias_prompts", [])]
        else:
            asks = [(i, entities[i].get("zh") or i, "zh") for i in split_ids.get(split, []) if i in entities]
        unknown = [a[0] for a in asks if a[0] not in entities]
        if unknown:
            raise ValueError(
                f"{path}: split {split} names entities not in entities.jsonl: {', '.join(unknown[:5])}"
            )
        for k, (entity, name, kind) in enumerate(asks[:limit]):
            # The same entity and name always get the same background and position, whatever else is asked.
            rng = random.Random(f"{split}/{entity}/{name}")
            template = TEMPLATES[k % len(TEMPLATES)] if positions else TEMPLATES[0]
            bg, pos = rng.choice(backgrounds), rng.choice(positions) if positions else None
            rows.append({
                "text": template.format(bg=bg, pos=pos, e=name), "entity": entity, "split": split, "name": name,
                "kind": kind, "subcategory": entities[entity]["subcategory"], "background": bg,
                "position": pos if "{pos}" in template else None,
            })  # fmt: skip
    if not rows:
        raise ValueError(f"{path}: no prompts for split(s) {', '.join(splits)}")
    return rows


def judge_run(
    run_dir: Path, judge: Any, vocab: Any, *, batch_size: int = 64
) -> tuple[list[dict[str, Any]], Any]:
    """Every image of a run read by the judge and the layout reader; one record per image (also
    ``judgements.jsonl``), and the judge's penultimate features [N, D]."""
    import numpy as np
    import torch

    from rapiddiff.eval.common import open_rgb, read_index
    from rapiddiff.eval.emoji_layout import read_layout

    index = read_index(run_dir)
    records, features = [], []
    for start in range(0, len(index), batch_size):
        rows = index[start : start + batch_size]
        images = [open_rgb(run_dir / r["file"]) for r in rows]
        pixels = torch.stack(
            [torch.from_numpy(np.array(im.resize(images[0].size))).permute(2, 0, 1) for im in images]
        )
        top, feats = judge.read(pixels.float() / 255, k=5)
        features.append(feats.numpy())
        for row, image, guesses in zip(rows, images, top, strict=True):
            layout = read_layout(image, vocab)
            records.append({
                **row,
                "judged": guesses[0], "judged_top5": guesses,
                "judged_subcategory": judge.subcategory_of[guesses[0]],
                "top1_ok": guesses[0] == row["entity"], "top5_ok": row["entity"] in guesses,
                "subcategory_ok": judge.subcategory_of[guesses[0]] == row["subcategory"],
                "detected_background": layout["background"], "detected_position": layout["position"],
                "background_ok": layout["background"] == row["background"],
                "position_ok": layout["position"] == row["position"] if row.get("position") else None,
            })  # fmt: skip
    write_jsonl(run_dir / "judgements.jsonl", records)
    return records, np.concatenate(features)


def _percent(values: list[bool | None]) -> float | None:
    asked = [v for v in values if v is not None]
    return round(100.0 * sum(asked) / len(asked), 2) if asked else None


def accuracy_rows(records_by_mode: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (split, mode), plus one per alias kind: images, entities, top-1 (with its 95 %
    Wilson interval), top-5, subcategory, background, position, in percent."""
    from rapiddiff.eval.knowledge import wilson_interval

    rows = []
    for split in SPLITS:
        for mode, records in records_by_mode.items():
            subset = [r for r in records if r["split"] == split]
            groups = [(None, subset)]
            if split == "alias":
                groups += [
                    (k, [r for r in subset if r["kind"] == k]) for k in sorted({r["kind"] for r in subset})
                ]
            for kind, group in groups:
                if not group:
                    continue
                hits = sum(r["top1_ok"] for r in group)
                rows.append({
                    "split": split, **({"kind": kind} if kind else {}), "knowledge": mode, "images": len(group),
                    "entities": len({r["entity"] for r in group}), "top1": _percent([r["top1_ok"] for r in group]),
                    "top1_ci95": list(wilson_interval(hits, len(group))), "top5": _percent([r["top5_ok"] for r in group]),
                    "subcategory": _percent([r["subcategory_ok"] for r in group]),
                    "background": _percent([r["background_ok"] for r in group]),
                    "position": _percent([r["position_ok"] for r in group]),
                })  # fmt: skip
    return rows


def real_features(
    judge: Any, data_dir: Path, entities: list[str], vocab: Any, *, size: int, seed: int
) -> dict[str, Any]:
    """Judge features of clean real renders (the artwork on the folder's shades, nothing degraded),
    one per entity asked, per style: {style: [N, D]}; entities without that style's glyph are left out."""
    import torch

    from rapiddiff.eval.judge import load_glyphs
    from rapiddiff.eval.judge_augment import Augment, render

    classes = list(dict.fromkeys(entities))
    glyphs = load_glyphs(data_dir, classes)
    side = vocab.object_size or 0.45
    aug = Augment.clean(scale=(max(0.1, side * 0.8), min(1.0, side * 1.25)))
    shades = torch.from_numpy(vocab.shades()).to(judge.device)
    out = {}
    for s, style in enumerate(glyphs.styles):
        keep = glyphs.style == s
        by_class = dict(zip(glyphs.labels[keep].tolist(), glyphs.pixels[keep], strict=True))
        wanted = [classes.index(e) for e in entities if classes.index(e) in by_class]
        if len(wanted) < 2:
            continue
        gen = torch.Generator(judge.device).manual_seed(seed + s)
        pixels = torch.stack([by_class[c] for c in wanted]).to(judge.device)
        feats = [
            judge.features(render(pixels[i : i + 256], size, shades, aug, gen))
            for i in range(0, len(wanted), 256)
        ]
        out[style] = torch.cat(feats).cpu().double().numpy()
    return out


def frechet_rows(
    generated: dict[tuple[str, str], Any], real: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """The judge-feature Fréchet distance of each (split, mode)'s images to the real renders of the
    same entities (all styles pooled), and between two real styles of the same entities."""
    import numpy as np

    from rapiddiff.eval.fid import fid_from_features

    rows = []
    for (split, mode), feats in generated.items():
        styles = real.get(split, {})
        if len(feats) < 2 or not styles:
            continue
        pooled = np.concatenate(list(styles.values()))
        row = {"split": split, "knowledge": mode, "images": len(feats), "real_images": len(pooled),
               "generated_vs_real": round(fid_from_features(pooled, feats), 4)}  # fmt: skip
        names = sorted(styles)
        if len(names) >= 2:
            row["real_styles"] = names[:2]
            row["style_vs_style"] = round(fid_from_features(styles[names[0]], styles[names[1]]), 4)
            row["ratio"] = (
                round(row["generated_vs_real"] / row["style_vs_style"], 3)
                if row["style_vs_style"] > 0
                else None
            )
        rows.append(row)
    return rows


def write_grids(
    run_dirs: dict[str, Path], records: dict[str, list[dict[str, Any]]], out: Path, per_split: int = 8
) -> list[str]:
    """One PNG per split: a column per prompt (its first image), a row per knowledge mode, each cell
    framed green where the judge's top-1 is right, red where not."""
    from PIL import Image, ImageOps

    written = []
    for split in SPLITS:
        modes = [m for m in run_dirs if any(r["split"] == split for r in records[m])]
        if not modes:
            continue
        firsts = {}
        for r in records[modes[0]]:
            if r["split"] == split and r["index"] not in firsts and len(firsts) < per_split:
                firsts[r["index"]] = r["file"]
        by_file = {m: {r["file"]: r for r in records[m]} for m in modes}
        cell = 96
        grid = Image.new("RGB", (cell * len(firsts), cell * len(modes)), "white")
        for y, mode in enumerate(modes):
            for x, file in enumerate(firsts.values()):
                image = Image.open(run_dirs[mode] / file).convert("RGB").resize((cell - 6, cell - 6))
                ok = by_file[mode][file]["top1_ok"]
                grid.paste(
                    ImageOps.expand(image, 3, fill=(40, 170, 60) if ok else (210, 40, 40)),
                    (x * cell, y * cell),
                )
        name = f"grid_{split}.png"
        grid.save(out / name)
        written.append(name)
    return written


def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def emoji_markdown(record: dict[str, Any]) -> str:
    lines = [
        "| prompts | knowledge | images | entity top-1 % | top-1, 95 % CI | top-5 % | subcategory % | background % | position % |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in record["table"]:
        split = f"{r['split']}, {r['kind']}" if r.get("kind") else r["split"]
        lines.append(
            f"| {split} ({r['entities']}) | {r['knowledge']} | {r['images']} | {_fmt(r['top1'])} | "
            f"{r['top1_ci95'][0]:.1f}–{r['top1_ci95'][1]:.1f} | {_fmt(r['top5'])} | {_fmt(r['subcategory'])} | "
            f"{_fmt(r['background'])} | {_fmt(r['position'])} |"
        )
    frechet = record["details"]["frechet"]
    if frechet:
        lines += ["", f"{FRECHET_LABEL} (the judge's penultimate features; not the Inception FID):", "",
                  "| prompts | knowledge | images | generated vs real | real style vs style | ratio |", "|---|---|---:|---:|---:|---:|"]  # fmt: skip
        for f in frechet:
            styles = " vs ".join(f.get("real_styles", []))
            lines.append(f"| {f['split']} | {f['knowledge']} | {f['images']} | {f['generated_vs_real']:.3f} | "
                         f"{f.get('style_vs_style', float('nan')):.3f} ({styles}) | {f.get('ratio')} |")  # fmt: skip
    judge = record["details"]["judge"]
    lines += [
        "",
        f"Judge: {judge['path']} ({judge['classes']} classes; its own test renders top-1 {judge['test_top1']} %).",
    ]
    return "\n".join(lines)


def evaluate_emoji(
    pipe: Any, data_dir: str | Path, judge: Any, out: str | Path, settings: Any, *, splits: Sequence[str] = ("seen", "alias", "heldout"),
    modes: Sequence[str] = ("on", "off"), limit: int | None = None, batch_size: int = 16, overwrite: bool = False,
    info: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Draw, judge, tabulate; returns the metric record (also OUT/metrics/emoji.json, OUT/emoji.md)."""
    from rapiddiff.eval.emoji_layout import calibrate
    from rapiddiff.eval.knowledge import draw_modes
    from rapiddiff.eval.sample import plan_jobs

    data_dir, out = Path(data_dir), Path(out)
    vocab = calibrate(data_dir)
    prompts = emoji_prompts(data_dir, splits, vocab, limit=limit)
    jobs = plan_jobs(prompts, settings.images_per_prompt, settings.seed)
    run_dirs, timings = draw_modes(
        pipe, jobs, out, settings, modes, batch_size=batch_size, overwrite=overwrite, info=info
    )
    records, generated = {}, {}
    for mode, run_dir in run_dirs.items():
        records[mode], feats = judge_run(run_dir, judge, vocab)
        for split in splits:
            keep = [i for i, r in enumerate(records[mode]) if r["split"] == split]
            if keep:
                generated[(split, mode)] = feats[keep]
    size = max(_image_size(run_dirs, records), 2)
    real = {}
    for split in splits:
        wanted = [j.extra["entity"] for j in jobs if j.extra["split"] == split]
        if wanted:
            real[split] = real_features(judge, data_dir, wanted, vocab, size=size, seed=settings.seed + 7)
    frechet = frechet_rows(generated, real)
    warnings = []
    if any(f["images"] < judge.net.head.in_features for f in frechet):
        warnings.append(f"fewer images than the judge's {judge.net.head.in_features} features in some Fréchet rows: "
                        "the distance is biased upwards at that size; compare rows of equal image counts only")  # fmt: skip
    rows = accuracy_rows(records)
    first = next((m for m in modes if m != "off"), modes[0])
    headline = next(
        (r for r in rows if r["split"] == "seen" and r["knowledge"] == first and "kind" not in r), None
    )
    figures = judge.config.figures.get("test", {}).get("all", {})
    record = metric_record(
        "emoji", f"emoji-zh entity top-1, seen, knowledge {first} (judge) %", headline["top1"] if headline else None,
        table=rows, warnings=warnings,
        details={
            **(info or {}),
            "judge": {"path": str(info.get("judge") if info else ""), "classes": len(judge.config.classes),
                      "test_top1": figures.get("top1"), "input_size": judge.config.input_size},
            "frechet": frechet, "frechet_label": FRECHET_LABEL,
            "vocabulary": {"backgrounds": vocab.backgrounds, "positions": vocab.positions,
                           "object_size": vocab.object_size, "source": vocab.source},
            "settings": {k: v for k, v in vars(settings).items() if k != "knowledge"},
            "prompts": len(prompts), "images_per_mode": len(jobs), "timings": timings,
            "grids": write_grids(run_dirs, records, out),
        },
    )  # fmt: skip
    write_json(out / METRICS_DIR / "emoji.json", record)
    (out / "emoji.md").write_text(emoji_markdown(record) + "\n", encoding="utf-8")
    return record


def _image_size(run_dirs: dict[str, Path], records: dict[str, list[dict[str, Any]]]) -> int:
    from PIL import Image

    mode = next(iter(run_dirs))
    with Image.open(run_dirs[mode] / records[mode][0]["file"]) as image:
        return image.size[0]


# --- CLI ----------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from rapiddiff.eval.sample import add_sampling_arguments

    parser.description = (
        "emoji-zh: generate for seen, alias, held-out and validation prompts of a `rapiddiff data emoji` folder in "
        "each knowledge mode (same seeds), read every image with the frozen judge (entity top-1 / top-5, "
        "subcategory) and the background/position reader, and a judge-feature Fréchet distance to real renders "
        "beside two real styles' distance (OUT/emoji.md, OUT/metrics/emoji.json, OUT/grid_<split>.png)."
    )
    parser.add_argument(
        "--model",
        default="builtin:emoji",
        help="model folder trained on emoji data, or builtin:NAME (default: builtin:emoji, the built-in emoji model)",
    )
    parser.add_argument("--data", required=True, type=Path, help="folder from `rapiddiff data emoji`")
    parser.add_argument("--judge", required=True, type=Path, help="folder from `rapiddiff eval judge-train`")
    parser.add_argument("--out", required=True, type=Path, help="run folder (images, judgements, tables)")
    parser.add_argument(
        "--splits", default="seen,alias,heldout", help=f"of {', '.join(SPLITS)} (default: seen,alias,heldout)"
    )
    parser.add_argument(
        "--modes", "--knowledge", dest="modes", default="on,off",
        help="knowledge modes, as eval knowledge: on, off, embed, text, both (default: on,off)",
    )  # fmt: skip
    parser.add_argument("--limit", type=int, help="only the first N prompts of each split (quick checks)")
    add_sampling_arguments(parser)
    parser.set_defaults(images_per_prompt=2, batch_size=32)


def run(args: argparse.Namespace) -> int:
    from rapiddiff.eval.judge import load_judge
    from rapiddiff.eval.knowledge import MODES
    from rapiddiff.eval.sample import load_pipeline, model_config, settings_from_args
    from rapiddiff.infer.generate_cli import resolve_model_dir
    from rapiddiff.utils.device import resolve_device

    splits = parse_choices(args.splits, SPLITS, "--splits", "split")
    modes = parse_choices(args.modes, MODES, "--modes", "mode")
    judge = load_judge(args.judge, device=resolve_device(args.device))  # before the model: fail fast
    args.model = resolve_model_dir(str(args.model))
    if not args.model.is_dir():
        raise FileNotFoundError(f"model folder not found: {args.model}")
    pipe = load_pipeline(args.model, device=args.device, dtype=args.dtype, fast=args.fast)
    record = evaluate_emoji(
        pipe, args.data, judge, args.out, settings_from_args(args, knowledge=True), splits=splits, modes=modes,
        limit=args.limit, batch_size=args.batch_size, overwrite=args.overwrite,
        info={"data": str(args.data), "judge": str(args.judge), "fast": args.fast, "model_config": model_config(args.model)},
    )  # fmt: skip
    print(emoji_markdown(record))
    for w in record["warnings"]:
        print(f"warning: {w}")
    print(f"→ {args.out / METRICS_DIR / 'emoji.json'}")
    return 0
