"""``rapiddiff data <command>``: dataset tools (kshapes benchmark, emoji-zh, inspect, prepare).

Heavy imports (torch, datasets, PIL) stay inside the command functions so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="data_command", metavar="<command>")
    sub.required = True

    ks = sub.add_parser(
        "kshapes",
        help="write the kshapes benchmark (images at base and 4× size, captions, KG, prompts)",
        description=(
            "Write the kshapes benchmark: 66 real Chinese entities with colour/shape/category facts "
            "in a KG (kg/triples.tsv, kg/aliases.tsv), rendered single-object images in train/ val/ "
            "test/ (imagefolders with metadata.jsonl) and hr/ (the same drawings at 4× size), "
            "held-out entities that no training caption names, and evaluation prompts. "
            "The same --seed gives byte-identical files. Defaults are those of configs/data/kshapes.yaml; "
            "--config reads another YAML, and the options below override either."
        ),
    )
    ks.add_argument(
        "--out", type=Path, required=True, help="output folder (must be empty or new, see --overwrite)"
    )
    ks.add_argument("--seed", type=int, default=None, help="random seed (default 0)")
    ks.add_argument("--config", type=Path, default=None, help="a YAML file of KShapesConfig settings")
    ks.add_argument("--size", type=int, default=None, help="base image size in pixels (default 128)")
    ks.add_argument(
        "--hr-scale", type=int, default=None, help="hr/ images are size × this (default 4; 0: no hr/)"
    )
    ks.add_argument(
        "--no-hr-copies",
        dest="hr_copies",
        action="store_const",
        const=False,
        default=None,
        help="do not write hr/: the base images stay byte-identical (still reduced from the hr drawing)",
    )
    ks.add_argument("--train", type=int, default=None, help="training images (default 20000)")
    ks.add_argument("--val", type=int, default=None, help="validation images (default 1000)")
    ks.add_argument("--test", type=int, default=None, help="test images (default 1000)")
    ks.add_argument("--heldout", type=int, default=None, help="held-out entities (default 15)")
    ks.add_argument(
        "--layout", choices=["row3", "grid9"], default=None, help="positions: 左/中/右 or a 3×3 grid"
    )
    ks.add_argument("--workers", type=int, default=None, help="drawing processes (default: one per core)")
    ks.add_argument(
        "--small", action="store_true", help="a small preset for tests: 64² images, 240/60/60 images"
    )
    ks.add_argument(
        "--masks",
        action="store_const",
        const=True,
        default=None,
        help="also write each image's object mask (<split>/masks/, a `mask` column): for a mask ControlNet",
    )
    ks.add_argument("--overwrite", action="store_true", help="replace kshapes files already in --out")
    ks.set_defaults(func=_kshapes)

    emo = sub.add_parser(
        "emoji",
        help="build emoji-zh: real emoji artwork and CLDR Chinese names → images, captions, KG, splits",
        description=(
            "Build the emoji-zh folder from installed npm packages (folders or `npm pack` tarballs given "
            "with --package; nothing is downloaded): composed images with Chinese captions in train/ val/ "
            "test/, the KG in kg/, the artwork in glyphs/, entities.jsonl, splits.json (seen, held-out, "
            "validation entities and alias prompts), prompts.jsonl, LICENSES/, ATTRIBUTION.md and "
            "build.json. Defaults are those of configs/data/emoji.yaml; options override them."
        ),
    )
    emo.add_argument(
        "--out", type=Path, required=True, help="output folder (must be empty or new, see --overwrite)"
    )
    emo.add_argument(
        "--package",
        dest="packages",
        action="append",
        default=None,
        help="a folder or .tgz holding the npm packages (repeatable; default: $RAPIDDIFF_EMOJI_PACKAGES)",
    )
    emo.add_argument("--config", type=Path, default=None, help="a YAML file of EmojiConfig settings")
    emo.add_argument("--seed", type=int, default=None, help="random seed (default 0)")
    emo.add_argument("--limit", type=int, default=None, help="use N emoji, stratified by subcategory")
    emo.add_argument(
        "--include",
        action="append",
        default=None,
        help="an emoji (id or character) a --limit slice must hold",
    )
    emo.add_argument("--size", type=int, default=None, help="image size in pixels (default 128)")
    emo.add_argument("--train-per-entity", type=int, default=None, help="training images per seen entity (8)")
    emo.add_argument(
        "--masks",
        action="store_const",
        const=True,
        default=None,
        help="also write each image's object mask (<split>/masks/, a `mask` column): for a mask ControlNet",
    )
    emo.add_argument(
        "--no-hr-copies",
        dest="hr_copies",
        action="store_const",
        const=False,
        default=None,
        help="do not write hr/ even when the SVG packages are given (the base images do not change)",
    )
    emo.add_argument("--overwrite", action="store_true", help="replace emoji files already in --out")
    emo.set_defaults(func=_emoji)

    ins = sub.add_parser(
        "inspect",
        help="check an image–caption dataset: counts, bad items, size/length histograms, entity coverage",
        description=(
            "Decode every image of PATH (an image folder with metadata.jsonl, or a CSV/TSV/JSONL/parquet "
            "file) and report: usable and skipped items (with reasons), image-size and caption-length "
            "statistics and histograms, and with --store the share of captions that mention an entity of "
            "a KnowledgeStore. With --out, writes report.json, skipped.jsonl, image_sizes.png and "
            "caption_lengths.png there."
        ),
    )
    ins.add_argument("path", type=Path, help="image folder or table file")
    ins.add_argument("--store", type=Path, default=None, help="KnowledgeStore folder for entity coverage")
    ins.add_argument("--out", type=Path, default=None, help="folder for report.json, skipped.jsonl and PNGs")
    ins.add_argument(
        "--image-size", type=int, default=256, help="training size; smaller images are counted (256)"
    )
    ins.add_argument(
        "--small-images",
        choices=["upscale", "skip"],
        default="upscale",
        help="count images below --image-size as skipped (skip) or as usable (upscale)",
    )
    ins.add_argument("--image-column", default="image", help="image column (folders use file_name)")
    ins.add_argument("--text-column", default="text", help="caption column")
    ins.add_argument("--column-names", default=None, help="comma-separated names for a headerless CSV/TSV")
    ins.add_argument("--t2s", action="store_true", help="convert traditional captions to simplified first")
    ins.add_argument("--json", action="store_true", help="print the full report as JSON")
    ins.set_defaults(func=_inspect)

    prep = sub.add_parser(
        "prepare",
        help="check a dataset once and link its captions once; pass --out as any train command's data",
        description=(
            "Decode every image of PATH, record the usable rows and every skipped item (with its reason), "
            "and with --store link every caption to the KnowledgeStore's entities. Writes manifest.json, "
            "skipped.jsonl and annotations.jsonl to --out. OUT is then a dataset: --data OUT (train vae), "
            "data.train: OUT (train clip, unet, finetune) or ImageTextDataset(OUT) builds without opening "
            "an image or linking a caption. The manifest remembers the table's size and "
            "modification time and is refused once the table changes."
        ),
    )
    prep.add_argument("path", type=Path, help="image folder or table file")
    prep.add_argument(
        "--out", type=Path, required=True, help="folder for manifest.json, skipped.jsonl, annotations.jsonl"
    )
    prep.add_argument(
        "--store", type=Path, default=None, help="KnowledgeStore folder to link captions against"
    )
    prep.add_argument(
        "--image-size", type=int, default=256, help="training size (used with --small-images skip)"
    )
    prep.add_argument(
        "--small-images", choices=["upscale", "skip"], default="upscale", help="policy for small images"
    )
    prep.add_argument("--image-column", default="image", help="image column (folders use file_name)")
    prep.add_argument("--text-column", default="text", help="caption column")
    prep.add_argument("--column-names", default=None, help="comma-separated names for a headerless CSV/TSV")
    prep.add_argument("--t2s", action="store_true", help="convert traditional captions to simplified")
    prep.set_defaults(func=_prepare)


def _kshapes(args: argparse.Namespace) -> int:
    from rapiddiff.data.kshapes import SMALL_PRESET, KShapesConfig, generate_kshapes
    from rapiddiff.utils.config import load_config

    overrides = dict(SMALL_PRESET) if args.small else {}
    given = {
        "out": args.out,
        "seed": args.seed,
        "size": args.size,
        "hr_scale": args.hr_scale,
        "hr_copies": args.hr_copies,
        "train": args.train,
        "val": args.val,
        "test": args.test,
        "heldout": args.heldout,
        "layout": args.layout,
        "workers": args.workers,
        "masks": args.masks,
    }
    overrides.update({k: v for k, v in given.items() if v is not None})
    cfg = load_config(KShapesConfig, args.config, **overrides)
    try:
        summary = generate_kshapes(cfg, overwrite=args.overwrite)
    except FileExistsError as err:
        raise ValueError(str(err)) from err
    print(json.dumps(summary, ensure_ascii=False, indent=1))
    return 0


def _emoji(args: argparse.Namespace) -> int:
    import os

    from rapiddiff.data.emoji import EmojiConfig, build_emoji
    from rapiddiff.utils.config import load_config

    packages = args.packages or [
        p for p in os.environ.get("RAPIDDIFF_EMOJI_PACKAGES", "").split(os.pathsep) if p
    ]
    given = {
        "out": args.out,
        "packages": packages or None,
        "seed": args.seed,
        "limit": args.limit,
        "include": args.include,
        "size": args.size,
        "train_per_entity": args.train_per_entity,
        "masks": args.masks,
        "hr_copies": args.hr_copies,
    }
    cfg = load_config(EmojiConfig, args.config, **{k: v for k, v in given.items() if v is not None})
    try:
        summary = build_emoji(cfg, overwrite=args.overwrite)
    except FileExistsError as err:
        raise ValueError(str(err)) from err
    shown = {k: v for k, v in summary.items() if k != "skipped"}
    shown["hr"] = {k: v for k, v in summary["hr"].items() if k != "without"}  # the list is in build.json
    print(json.dumps(shown, ensure_ascii=False, indent=1))
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from rapiddiff.data.inspect import format_report, inspect_dataset

    report = inspect_dataset(
        args.path,
        out=args.out,
        store=args.store,
        image_size=args.image_size,
        small_images=args.small_images,
        image_column=args.image_column,
        text_column=args.text_column,
        column_names=args.column_names.split(",") if args.column_names else None,
        t2s=args.t2s,
    )
    print(json.dumps(report, ensure_ascii=False, indent=1) if args.json else format_report(report))
    if args.out:
        print(f"report written to {args.out}")
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from rapiddiff.data.prepare import prepare_dataset

    summary = prepare_dataset(
        args.path,
        args.out,
        store=args.store,
        image_size=args.image_size,
        small_images=args.small_images,
        t2s=args.t2s,
        image_column=args.image_column,
        text_column=args.text_column,
        column_names=args.column_names.split(",") if args.column_names else None,
    )
    print(json.dumps(summary, ensure_ascii=False, indent=1))
    return 0
