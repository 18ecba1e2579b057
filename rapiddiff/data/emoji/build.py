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
    compose_mask,
    sample_placement,
)
from rapiddiff.data.emoji.kg import aliases_tsv, choose_aliases, keyword_counts, kg_triples
from rapiddiff.data.emoji.licenses import ATTRIBUTION, LICENSES_DIR, write_licenses
from rapiddiff.data.emoji.packages import STYLES, find_packages
from rapiddiff.data.emoji.splits import choose_splits, choose_subset
from rapiddiff.utils.io import atomic_write_text, jsonl_text, prepare_output_folder
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)

IMAGE_SPLITS = ("train", "val", "test")
MASKS = "masks"  # <split>/masks/: the object masks (EmojiConfig.masks)
OUTPUTS = (
    *IMAGE_SPLITS,
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
    "no hr/ copies: the packages' artwork is 64 px, and a 4× copy needs the object at up to "
    "0.46 × 512 = 236 px; an upsampled 64 px image would teach the upscaler blur"
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

    def __post_init__(self) -> None:
        if self.size < 32 or self.size % 8:
            raise ValueError(f"size must be a multiple of 8 and at least 32, got {self.size}")
        if self.limit is not None and self.limit < 3:
            raise ValueError(
                f"limit must be at least 3 (seen, held-out and validation entities), got {self.limit}"
            )
        if not (0 <= self.heldout < 1 and 0 <= self.validation < 1 and self.heldout + self.validation < 1):
            raise ValueError("heldout and validation are shares in [0, 1) that add up to less than 1")
        self.out = Path(self.out)


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
) -> None:
    from tqdm.auto import tqdm

    bar = tqdm(
        total=sum(map(len, splits.values())), desc="emoji: composing", unit="img", disable=not progress
    )
    for split, items in splits.items():
        (cfg.out / split).mkdir(parents=True, exist_ok=True)
        if cfg.masks:
            (cfg.out / split / MASKS).mkdir(exist_ok=True)
        for item in items:
            glyph = glyphs[item.entity.id, item.style]
            compose(glyph, item.place, cfg.size).save(
                cfg.out / split / item.file_name, format="PNG", compress_level=1
            )
            if cfg.masks:
                compose_mask(glyph, item.place, cfg.size).save(
                    cfg.out / split / MASKS / item.file_name, format="PNG", compress_level=1
                )
            bar.update()
        rows = [i.metadata(split) | ({"mask": f"{MASKS}/{i.file_name}"} if cfg.masks else {}) for i in items]
        # Metadata last: a folder with metadata.jsonl is a finished split.
        atomic_write_text(cfg.out / split / "metadata.jsonl", jsonl_text(rows))
    bar.close()


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
        packages = find_packages(cfg.packages, Path(cache))
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
    _write_images(cfg, items, glyphs, progress)

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
        "hr": {"written": False, "reason": HR_NOTE},
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
