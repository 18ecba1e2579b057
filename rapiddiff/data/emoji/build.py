"""``rapiddiff data emoji``: build the emoji-zh folder from installed packages (no network).

Everything random follows from ``numpy.random.default_rng([seed, stream])`` and seeded hashes, so
the same packages and config give the same files.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from rapiddiff.data.emoji.catalog import Emoji, read_catalogue, skip
from rapiddiff.data.emoji.compose import (
    CAPTION_TEMPLATES,
    PROMPT_TEMPLATES,
    SIZE_TEXT,
    CaptionIndex,
    Placement,
    compose,
    compose_hr,
    compose_mask,
    sample_placement,
)
from rapiddiff.data.emoji.kg import aliases_tsv, choose_aliases, keyword_counts, kg_triples
from rapiddiff.data.emoji.licenses import ATTRIBUTION, LICENSES_DIR, write_licenses
from rapiddiff.data.emoji.packages import OPTIONAL, STYLES, VECTOR_PACKAGES, find_packages
from rapiddiff.data.emoji.splits import choose_splits, choose_subset
from rapiddiff.data.emoji.vector import agreement, rasterise, require_rasteriser, vector_sets
from rapiddiff.utils.io import atomic_write_text, jsonl_text, prepare_output_folder
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)

IMAGE_SPLITS = ("train", "val", "test")
MASKS = "masks"  # <split>/masks/: the object masks (EmojiConfig.masks)
OUTPUTS = (
    *IMAGE_SPLITS,
    "hr",
    "kg",
    "glyphs",
    LICENSES_DIR,
    ATTRIBUTION,
    "entities.jsonl",
    "splits.json",
    "heldout_entities.txt",
    "validation_entities.txt",
    "kg_only_entities.json",
    "prompts.jsonl",
    "build.json",
    "emoji.yaml",
)
HR_NOTE = (
    "no hr/ copies: the PNG artwork is 64 px, and a 4× copy needs the object at up to "
    "0.46 × 512 = 236 px (an upsampled 64 px image would teach the upscaler blur); pass the SVG "
    f"packages ({', '.join(OPTIONAL)}, `npm pack` them) with --package to draw hr/ from vectors"
)


@dataclass
class EmojiConfig:
    """Settings of ``rapiddiff data emoji`` (defaults: configs/data/emoji.yaml)."""

    out: Path = Path("emoji")
    """Output folder."""
    packages: list[str] = field(default_factory=list)
    """Folders or .tgz files holding the npm packages (packages.REQUIRED)."""
    seed: int = 0
    """Splits, placements and captions follow from the seed."""
    size: int = 128
    """Image size in pixels."""
    limit: int | None = None
    """Use this many emoji (stratified by subcategory); None: all."""
    include: list[str] = field(default_factory=list)
    """Emoji (ids or characters) that a --limit slice must contain, with their components."""
    heldout: float = 0.10
    """Share of entities held out (in the KG, in no caption): the test side."""
    validation: float = 0.05
    """Share of entities for validation (in the KG, in no caption), disjoint from the held-out ones."""
    train_per_entity: int = 8
    """Training images per seen entity (the styles in turn)."""
    val_per_entity: int = 1
    """Images per seen entity in val/ (a validation loss on fresh placements)."""
    test_per_entity: int = 1
    """Images per seen entity in test/."""
    prompts_per_entity: int = 2
    """Evaluation prompts per entity and per alias in prompts.jsonl."""
    masks: bool = False
    """Also write each image's object mask, ``<split>/masks/NNNNNN.png`` (the pasted glyph's alpha),
    named in a ``mask`` column of metadata.jsonl: the conditioning images of a mask ControlNet."""
    hr_scale: int = 4
    """hr/<split>/ holds the images at size × hr_scale, drawn from the SVG packages where given (0: none)."""
    hr_copies: bool = True
    """False: no hr/ even when the SVG packages are given (the base images are the same either way)."""
    hr_min_psnr: float = 20.0
    """An SVG draws a glyph's hr copies only if, rendered at 64 px, it matches the PNG to this PSNR
    (dB): the same artwork reads 21–40 dB, another revision of the design below 15."""
    hr_min_iou: float = 0.8
    """... and the IoU of their alpha masks is at least this (a redesigned thin line drawing can
    keep a high PSNR, not its outline)."""

    def __post_init__(self) -> None:
        if self.size < 32 or self.size % 8:
            raise ValueError(f"size must be a multiple of 8 and at least 32, got {self.size}")
        if self.limit is not None and self.limit < 3:
            raise ValueError(
                f"limit must be at least 3 (seen, held-out and validation entities), got {self.limit}"
            )
        if not (0 <= self.heldout < 1 and 0 <= self.validation < 1 and self.heldout + self.validation < 1):
            raise ValueError("heldout and validation are shares in [0, 1) that add up to less than 1")
        if self.hr_scale < 0:
            raise ValueError(f"hr_scale must be 0 (no hr/) or a positive factor, got {self.hr_scale}")
        self.out = Path(self.out)

    @property
    def writes_hr(self) -> bool:
        return bool(self.hr_scale) and self.hr_copies


def _check_glyphs(
    emojis: list[Emoji], skipped: list[dict[str, Any]]
) -> tuple[list[Emoji], dict[tuple[str, str], Image.Image]]:
    """Decode every image; a corrupt one is skipped and named, and an emoji left with fewer than
    two styles is dropped."""
    glyphs: dict[tuple[str, str], Image.Image] = {}
    kept = []
    for e in emojis:
        for style, path in list(e.images.items()):
            try:
                with Image.open(path) as image:
                    glyphs[e.id, style] = image.convert("RGBA")
            except (OSError, ValueError, SyntaxError) as err:
                skip(skipped, path, e.id, f"unreadable {style} image: {err}")
                del e.images[style]
        if len(e.images) >= 2:
            kept.append(e)
        else:
            skip(
                skipped,
                e.images.get("google", "emoji.json"),
                e.id,
                f"artwork in {len(e.images)} style(s), needs 2",
            )
    return kept, glyphs


def _hr_artwork(
    cfg: EmojiConfig,
    packages: dict[str, Any],
    emojis: list[Emoji],
    glyphs: dict[tuple[str, str], Image.Image],
) -> tuple[dict[tuple[str, str], str], dict[str, Any]]:
    """(emoji id, style) → the SVG that draws its hr copies, and build.json's "hr" record. A glyph
    gets no hr copy (and is named, with why) where its style's SVG package is not given, the package
    lacks it, or its SVG is not the PNG's artwork (below ``hr_min_psnr``)."""
    if not cfg.writes_hr:
        return {}, {"written": False, "reason": "hr_copies is false or hr_scale is 0"}
    sets = vector_sets(packages)
    if not sets:
        log.info(HR_NOTE)
        return {}, {"written": False, "reason": HR_NOTE}
    art: dict[tuple[str, str], str] = {}
    without: list[dict[str, Any]] = []
    agree: list[float] = []
    for e in emojis:
        for style in sorted(e.images):
            if style not in sets:
                without.append({"id": e.id, "style": style, "reason": f"{VECTOR_PACKAGES[style]} not given"})
                continue
            svg, why = sets[style].svg(e.id)
            if svg is not None:
                score, iou = agreement(glyphs[e.id, style], svg)
                if score >= cfg.hr_min_psnr and iou >= cfg.hr_min_iou:
                    art[e.id, style] = svg
                    agree.append(score)
                    continue
                why = (f"SVG is other artwork than the PNG ({score:.1f} dB, alpha IoU {iou:.2f}; "
                       f"needs {cfg.hr_min_psnr:g} dB, {cfg.hr_min_iou:g})")  # fmt: skip
            without.append({"id": e.id, "style": style, "reason": why})
    log.info("hr/: %d of %d glyphs drawn from SVG (%d without: see build.json hr.without)",
             len(art), len(art) + len(without), len(without))  # fmt: skip
    record = {
        "written": True,
        "scale": cfg.hr_scale,
        "size": cfg.size * cfg.hr_scale,
        "min_psnr": cfg.hr_min_psnr,
        "min_iou": cfg.hr_min_iou,
        "packages": {s: {"package": v.package.name, "version": v.package.version} for s, v in sets.items()},
        "glyphs": {s: sum(1 for k in art if k[1] == s) for s in STYLES},
        "median_glyph_psnr": round(float(np.median(agree)), 2) if agree else None,
        "without": without,
    }
    return art, record


@dataclass(frozen=True)
class Item:
    file_name: str
    entity: Emoji
    style: str
    place: Placement
    template: str

    def metadata(self, split: str) -> dict[str, Any]:
        e, p = self.entity, self.place
        return {
            "file_name": self.file_name,
            "text": self.template.format(bg=p.background, pos=p.position, sz=SIZE_TEXT[p.size], e=e.zh),
            "entity": e.id,
            "name": e.zh,
            "style": self.style,
            "background": p.background,
            "position": p.position,
            "size": p.size or "中",
            "category": e.category,
            "subcategory": e.subcategory,
            "caption_type": "entity",
            "split": split,
        }


def sample_items(cfg: EmojiConfig, seen: list[Emoji], split: str) -> list[Item]:
    """One split's images: ``<split>_per_entity`` per seen entity, styles in turn."""
    per = getattr(cfg, f"{split}_per_entity")
    rng = np.random.default_rng([cfg.seed, IMAGE_SPLITS.index(split) + 1])
    items = []
    for k in range(per):
        for e in seen:
            styles = sorted(e.images)
            template = CAPTION_TEMPLATES[int(rng.integers(len(CAPTION_TEMPLATES)))]
            place = sample_placement(rng)
            items.append(Item(f"{len(items):06d}.png", e, styles[k % len(styles)], place, template))
    return items


def _prompts(
    cfg: EmojiConfig, emojis: list[Emoji], split_of: dict[str, str], aliases: list[dict[str, str]]
) -> list[dict[str, Any]]:
    """Evaluation prompts: every entity by its zh name (split seen / heldout / val) and every alias
    prompt (split "alias": a seen entity by a name no caption uses)."""
    rng = np.random.default_rng([cfg.seed, 99])
    by_id = {e.id: e for e in emojis}
    asks = [(e, e.zh, split_of[e.id], None) for e in emojis]
    asks += [(by_id[a["id"]], a["name"], "alias", a["kind"]) for a in aliases]
    rows = []
    for e, name, split, kind in asks:
        for k in range(cfg.prompts_per_entity):
            p = sample_placement(rng)
            text = PROMPT_TEMPLATES[k % len(PROMPT_TEMPLATES)].format(
                bg=p.background, pos=p.position, sz=SIZE_TEXT[p.size], e=name
            )
            row = {"text": text, "entity": e.id, "name": e.zh, "split": split, "background": p.background,
                   "position": p.position, "size": p.size or "中", "category": e.category, "subcategory": e.subcategory}  # fmt: skip
            rows.append(row | ({"alias": name, "alias_kind": kind} if kind else {}))
    return rows


def _write_images(
    cfg: EmojiConfig,
    splits: dict[str, list[Item]],
    glyphs: dict[tuple[str, str], Image.Image],
    progress: bool,
    hr_art: dict[tuple[str, str], str] | None = None,
) -> dict[str, int]:
    """The base images of every split, and the hr copy of each one whose glyph has an SVG in
    ``hr_art`` (hr/<split>/, same file name); returns the hr images written per split."""
    from tqdm.auto import tqdm

    hr_art = hr_art or {}
    bar = tqdm(
        total=sum(map(len, splits.values())), desc="emoji: composing", unit="img", disable=not progress
    )
    hr_counts = {}
    for split, items in splits.items():
        (cfg.out / split).mkdir(parents=True, exist_ok=True)
        if cfg.masks:
            (cfg.out / split / MASKS).mkdir(exist_ok=True)
        hr_rows = []
        for item in items:
            glyph = glyphs[item.entity.id, item.style]
            compose(glyph, item.place, cfg.size).save(
                cfg.out / split / item.file_name, format="PNG", compress_level=1
            )
            if cfg.masks:
                compose_mask(glyph, item.place, cfg.size).save(
                    cfg.out / split / MASKS / item.file_name, format="PNG", compress_level=1
                )
            svg = hr_art.get((item.entity.id, item.style))
            if svg is not None:
                (cfg.out / "hr" / split).mkdir(parents=True, exist_ok=True)
                hr = compose_hr(
                    lambda side, svg=svg: rasterise(svg, side), item.place, cfg.size, cfg.hr_scale
                )
                hr.save(cfg.out / "hr" / split / item.file_name, format="PNG", compress_level=1)
                hr_rows.append(item.metadata(split))
            bar.update()
        rows = [i.metadata(split) | ({"mask": f"{MASKS}/{i.file_name}"} if cfg.masks else {}) for i in items]
        # Metadata last: a folder with metadata.jsonl is a finished split.
        atomic_write_text(cfg.out / split / "metadata.jsonl", jsonl_text(rows))
        if hr_rows:
            atomic_write_text(cfg.out / "hr" / split / "metadata.jsonl", jsonl_text(hr_rows))
        hr_counts[split] = len(hr_rows)
    bar.close()
    return hr_counts


def _entity_row(e: Emoji, split: str, aliases: list[tuple[str, str]]) -> dict[str, Any]:
    return {
        "id": e.id, "char": e.char, "zh": e.zh, "zh_hant": e.zh_hant, "keywords": e.keywords,
        "unique_keywords": [a for a, _ in aliases if a in e.keywords],  # naming this emoji only
        "category": e.category, "subcategory": e.subcategory,
        "category_zh": e.category_zh, "subcategory_zh": e.subcategory_zh,
        "split": split, "styles": sorted(e.images), "components": e.components, "region": e.region,
    }  # fmt: skip


def build_emoji(cfg: EmojiConfig, *, overwrite: bool = False, progress: bool = True) -> dict[str, Any]:
    """Write the emoji-zh folder into ``cfg.out``; returns the summary also written to build.json."""
    from rapiddiff.utils.config import save_config

    with tempfile.TemporaryDirectory(prefix="rapiddiff-emoji-") as cache:
        optional = tuple(OPTIONAL) if cfg.writes_hr else ()
        packages = find_packages(cfg.packages, Path(cache), optional=optional)
        if given_svgs := [n for n in optional if n in packages]:
            require_rasteriser()  # before anything is written
            log.info("hr/ copies drawn from %s", ", ".join(given_svgs))
        prepare_output_folder(cfg.out, OUTPUTS, overwrite, "emoji")
        summary = _build(cfg, packages, progress)
        write_licenses(cfg.out, packages)
    save_config(cfg, cfg.out / "emoji.yaml")
    atomic_write_text(cfg.out / "build.json", json.dumps(summary, ensure_ascii=False, indent=1) + "\n")
    log.info("emoji-zh written to %s: %s", cfg.out, summary["counts"])
    return summary


def _build(cfg: EmojiConfig, packages: dict[str, Any], progress: bool) -> dict[str, Any]:
    skipped: list[dict[str, Any]] = []
    catalogue = read_catalogue(packages, skipped)
    counts = keyword_counts(catalogue)
    emojis, glyphs = _check_glyphs(choose_subset(catalogue, cfg.limit, cfg.seed, cfg.include), skipped)
    hr_art, hr = _hr_artwork(cfg, packages, emojis, glyphs)
    for row in skipped:
        log.warning("skipped %s [%s]: %s", row["file"], row["key"], row["reason"])
    ids = set(e.id for e in emojis)
    for e in emojis:
        e.components = [c for c in e.components if c in ids]
    index = CaptionIndex(e.zh for e in catalogue)
    # A name that other captions spell (大笑 in 哈哈大笑, or 大 + 笑脸) cannot be held out of them.
    splits = choose_splits(
        emojis, cfg.seed, cfg.heldout, cfg.validation, lambda e: not index.contains(e.zh, e.zh)
    )
    split_of = {i: s for s, members in splits.items() for i in members}
    aliases = choose_aliases(emojis, counts, index.contains)
    alias_prompts = [{"id": i, "name": a, "kind": k} for i in splits["seen"] for a, k in aliases[i]]
    seen = [e for e in emojis if split_of[e.id] == "seen"]
    items = {split: sample_items(cfg, seen, split) for split in IMAGE_SPLITS}
    hr_images = _write_images(cfg, items, glyphs, progress, hr_art)
    if hr["written"]:
        hr["images"] = hr_images
        hr["images_without"] = {split: len(items[split]) - n for split, n in hr_images.items()}

    out = cfg.out
    for e in emojis:
        for style, path in e.images.items():
            (out / "glyphs" / style).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, out / "glyphs" / style / f"{e.id}.png")
    triples = kg_triples(emojis, counts, index.in_template)
    atomic_write_text(out / "kg" / "triples.tsv", "# emoji-zh knowledge graph: head<TAB>relation<TAB>tail\n"
                      + "".join("\t".join(t) + "\n" for t in triples))  # fmt: skip
    atomic_write_text(out / "kg" / "aliases.tsv", aliases_tsv(emojis, aliases))
    atomic_write_text(
        out / "entities.jsonl", jsonl_text([_entity_row(e, split_of[e.id], aliases[e.id]) for e in emojis])
    )
    atomic_write_text(
        out / "splits.json",
        json.dumps(splits | {"alias_prompts": alias_prompts}, ensure_ascii=False, indent=1) + "\n",
    )
    name_of = {e.id: e.zh for e in emojis}
    names = {s: [name_of[i] for i in splits[s]] for s in ("heldout", "val")}
    atomic_write_text(out / "heldout_entities.txt", "".join(f"{n}\n" for n in names["heldout"]))
    atomic_write_text(out / "validation_entities.txt", "".join(f"{n}\n" for n in names["val"]))
    kg_only = {"heldout": names["heldout"], "validation": names["val"], "heldout_ids": splits["heldout"],
               "validation_ids": splits["val"], "seed": cfg.seed}  # fmt: skip
    atomic_write_text(out / "kg_only_entities.json", json.dumps(kg_only, ensure_ascii=False, indent=1) + "\n")
    atomic_write_text(out / "prompts.jsonl", jsonl_text(_prompts(cfg, emojis, split_of, alias_prompts)))
    return {
        "out": str(out),
        "sources": {n: {"version": p.version, "from": p.source} for n, p in sorted(packages.items())},
        "styles": {s: {"package": STYLES[s], "image_size": 64} for s in STYLES},
        "hr": hr,
        "counts": {
            "catalogue": len(catalogue),
            "entities": len(emojis),
            **{s: len(v) for s, v in splits.items()},
            "alias_prompts": len(alias_prompts),
            "aliases": sum(len(a) for a in aliases.values()),
            "triples": len(triples),
            **{f"images_{s}": len(v) for s, v in items.items()},
            "glyphs": sum(len(e.images) for e in emojis),
            "skipped": len(skipped),
        },
        "skipped": skipped,
    }
