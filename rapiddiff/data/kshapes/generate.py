"""``rapiddiff data kshapes``: write the kshapes benchmark (DESIGN.md, "kshapes").

Everything random is drawn in the main process from ``numpy.random.default_rng([seed, split])``
before any image is drawn, so the output is byte-identical for a seed whatever the number of
worker processes; PNGs carry no timestamps.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from rapiddiff.data.kshapes.captions import (
    ATTRIBUTE_PROMPT_TEMPLATES,
    ATTRIBUTE_TEMPLATES,
    DISTRACTOR_TEMPLATES,
    ENTITY_TEMPLATES,
    PROMPT_TEMPLATES,
    ROBUST_TEMPLATES,
)
from rapiddiff.data.kshapes.entities import (
    ENTITIES,
    Entity,
    choose_heldout,
    choose_validation,
    kg_aliases,
    kg_triples,
)
from rapiddiff.data.kshapes.palette import COLOURS, LAYOUTS, SHAPES, compatible_backgrounds
from rapiddiff.data.kshapes.render import ShapeSpec, render, render_mask
from rapiddiff.utils.config import save_config
from rapiddiff.utils.io import atomic_write_text, jsonl_text, prepare_output_folder
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)

SPLITS = ("train", "val", "test")
MASKS = "masks"  # <split>/masks/: the object masks (KShapesConfig.masks)
# Files and folders this generator owns inside --out (removed by --overwrite, nothing else).
OUTPUTS = (
    "train",
    "val",
    "test",
    "hr",
    "kg",
    "entities.json",
    "heldout_entities.txt",
    "validation_entities.txt",
    "kg_only_entities.json",
    "prompts.jsonl",
    "prompts_robust.jsonl",
    "prompts_attribute.jsonl",
    "kshapes.yaml",
)


@dataclass
class KShapesConfig:
    """Settings of ``rapiddiff data kshapes`` (defaults: configs/data/kshapes.yaml)."""

    out: Path = Path("kshapes")
    """Output folder."""
    seed: int = 0
    """Everything (held-out entities, images, captions) follows from the seed."""
    size: int = 128
    """Base image size in pixels (128 → 16² latents with an 8× VAE)."""
    hr_scale: int = 4
    """The hr/ copies are drawn at size × hr_scale (0: no hr/ folder)."""
    hr_copies: bool = True
    """False: the base images are still box-reduced from the size × hr_scale drawing, byte for byte
    those of a run with hr/, but hr/ is not written: for a stage that reads only the base images (the
    chain's U-Net calls regenerate the prep's data; the hr PNGs were over half of the drawing time)."""
    train: int = 20000
    """Images in train/."""
    val: int = 1000
    """Images in val/."""
    test: int = 1000
    """Images in test/."""
    heldout: int = 15
    """Test entities that appear in the KG but in no training caption."""
    validation_entities: int = 8
    """More KG-only entities (in no training caption), disjoint from the held-out ones: select
    checkpoints and recipes on these, never on the test held-out entities."""
    entity_fraction: float = 0.5
    """Share of images whose caption names an entity (the rest name colour and shape)."""
    alias_fraction: float = 0.2
    """Share of entity captions that use an alias (西红柿 for 番茄) where the entity has one."""
    layout: Literal["row3", "grid9"] = "row3"
    """Positions: 左边/中间/右边, or a 3×3 grid (左上方 ... 右下方)."""
    prompts_per_entity: int = 2
    """Evaluation prompts written per entity (seen and held-out) to prompts.jsonl."""
    workers: int = 0
    """Processes that draw images (0: one per CPU core, at most 8)."""
    masks: bool = False
    """Also write each image's object mask, ``<split>/masks/NNNNNN.png`` (grey level = how much of
    the pixel the object covers, from the same drawing), named in a ``mask`` column of
    metadata.jsonl: the conditioning images of a mask ControlNet (``rapiddiff train controlnet``)."""

    def __post_init__(self) -> None:
        if self.size < 32 or self.size % 8:
            raise ValueError(f"size must be a multiple of 8 and at least 32, got {self.size}")
        if self.hr_scale < 0:
            raise ValueError(f"hr_scale must be 0 (no hr/) or a positive factor, got {self.hr_scale}")
        for name in SPLITS:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be ≥ 0, got {getattr(self, name)}")
        if not 0.0 <= self.entity_fraction <= 1.0 or not 0.0 <= self.alias_fraction <= 1.0:
            raise ValueError("entity_fraction and alias_fraction must lie in [0, 1]")
        self.out = Path(self.out)

    @property
    def writes_hr(self) -> bool:
        """Whether the run writes the hr/ folder (drawn at all: hr_scale; kept: hr_copies)."""
        return bool(self.hr_scale) and self.hr_copies


SMALL_PRESET: dict[str, Any] = {"size": 64, "train": 240, "val": 60, "test": 60}


@dataclass(frozen=True)
class Item:
    """One image of a split: what is drawn and what the caption says."""

    file_name: str
    spec: ShapeSpec
    position: str
    text: str
    entity: str | None
    caption_type: str  # "entity" | "attribute"
    heldout: bool

    def metadata(self) -> dict[str, Any]:
        return {
            "file_name": self.file_name,
            "text": self.text,
            "entity": self.entity,
            "colour": self.spec.colour,
            "shape": self.spec.shape,
            "position": self.position,
            "background": self.spec.background,
            "caption_type": self.caption_type,
            "heldout_entity": self.heldout,
        }


def _pick(rng: np.random.Generator, options: list[Any] | tuple[Any, ...]) -> Any:
    return options[int(rng.integers(len(options)))]


def _spec(rng: np.random.Generator, shape: str, colour: str, layout: str) -> tuple[ShapeSpec, str]:
    position, x, y = _pick(rng, LAYOUTS[layout])
    background = _pick(rng, compatible_backgrounds(colour))
    spec = ShapeSpec(
        shape=shape,
        colour=colour,
        background=background,
        x=round(x + float(rng.uniform(-0.02, 0.02)), 4),
        # Bars and ellipses are flat, so they may move further up and down in a row layout.
        y=round(y + float(rng.uniform(-0.05, 0.05)), 4),
        scale=round(float(rng.uniform(0.9, 1.1)), 4),
        colour_shift=tuple(int(v) for v in rng.integers(-6, 7, size=3)),  # type: ignore[arg-type]
        background_shift=tuple(int(v) for v in rng.integers(-4, 5, size=3)),  # type: ignore[arg-type]
    )
    return spec, position


def sample_split(
    cfg: KShapesConfig, split: str, heldout: set[str], kg_only: set[str] | None = None
) -> list[Item]:
    """The items of one split. Training captions never name a KG-only entity (``kg_only``: the
    held-out and the validation ones; default ``heldout``); val and test draw entity captions from
    every entity (KG-only ones are what evaluation is about)."""
    n = getattr(cfg, split)
    kg_only = heldout if kg_only is None else kg_only
    rng = np.random.default_rng([cfg.seed, SPLITS.index(split) + 1])
    pool: list[Entity] = [e for e in ENTITIES if split != "train" or e.name not in kg_only]
    colours, items = list(COLOURS), []
    for i in range(n):
        if pool and rng.random() < cfg.entity_fraction:
            entity = _pick(rng, pool)
            spec, position = _spec(rng, entity.shape, entity.colour, cfg.layout)
            use_alias = entity.aliases and rng.random() < cfg.alias_fraction
            surface = _pick(rng, entity.aliases) if use_alias else entity.name
            text = _pick(rng, ENTITY_TEMPLATES).format(bg=spec.background, pos=position, e=surface)
            name, kind = entity.name, "entity"
        else:
            spec, position = _spec(rng, _pick(rng, SHAPES), _pick(rng, colours), cfg.layout)
            text = _pick(rng, ATTRIBUTE_TEMPLATES).format(
                bg=spec.background, pos=position, c=spec.colour, s=spec.shape
            )
            name, kind = None, "attribute"
        items.append(Item(f"{i:06d}.png", spec, position, text, name, kind, name in heldout))
    return items


def entity_split(name: str, heldout: set[str], validation: set[str]) -> str:
    """An entity's evaluation split: "heldout" (test), "val" (validation) or "seen"."""
    return "heldout" if name in heldout else "val" if name in validation else "seen"


def _prompt(
    text: str,
    entity: Entity,
    spec: ShapeSpec,
    position: str,
    template: str,
    heldout: set[str],
    validation: set[str],
) -> dict[str, Any]:
    """One prompts.jsonl / prompts_robust.jsonl record: the text and what a correct image shows."""
    return {
        "text": text,
        "entity": entity.name,
        "colour": entity.colour,
        "shape": entity.shape,
        "background": spec.background,
        "position": position if "{pos}" in template else None,
        "category": entity.category,
        "split": entity_split(entity.name, heldout, validation),
    }


def evaluation_prompts(
    cfg: KShapesConfig, heldout: set[str], validation: set[str] = frozenset()
) -> list[dict[str, Any]]:
    """Prompts on the evaluation templates (the training captions' own sentence shapes)."""
    rng = np.random.default_rng([cfg.seed, 99])
    prompts = []
    for entity in ENTITIES:
        for k in range(cfg.prompts_per_entity):
            spec, position = _spec(rng, entity.shape, entity.colour, cfg.layout)
            template = PROMPT_TEMPLATES[k % len(PROMPT_TEMPLATES)]
            text = template.format(bg=spec.background, pos=position, e=entity.name)
            prompts.append(_prompt(text, entity, spec, position, template, heldout, validation))
    return prompts


ATTRIBUTE_STREAMS = {"attribute": 97, "attribute_val": 96}
"""Each attribute split's random stream (``default_rng([seed, N])``): the test captions and the
validation captions draw their order, backgrounds and positions apart."""


def attribute_prompts(cfg: KShapesConfig, split: str = "attribute") -> list[dict[str, Any]]:
    """Attribute-caption prompts (written to prompts_attribute.jsonl): every colour × shape pair,
    ``prompts_per_entity`` prompts each, on captions.ATTRIBUTE_PROMPT_TEMPLATES (which name colour,
    shape, background and position), with a background the colour may be drawn on and a position of
    ``cfg.layout``. Split "attribute" is the test set; "attribute_val" the same pairs on their own
    backgrounds and positions, to choose a model or a CFG scale on (never on the test set). Each
    split has its own stream (:data:`ATTRIBUTE_STREAMS`): a function of the kshapes config alone, so
    a folder written before this file existed gets the same prompts from its kshapes.yaml
    (``rapiddiff eval knowledge --splits attribute`` does that)."""
    if split not in ATTRIBUTE_STREAMS:
        raise ValueError(f"attribute split {split!r}: choose from {', '.join(ATTRIBUTE_STREAMS)}")
    rng = np.random.default_rng([cfg.seed, ATTRIBUTE_STREAMS[split]])
    pairs = [(c, s) for c in COLOURS for s in SHAPES]
    # Every pair once, in a seeded order, then again: the first N prompts (``--limit N``) are a
    # spread of colours and shapes, not all red.
    order = [int(i) for i in rng.permutation(len(pairs))]
    prompts = []
    for k in range(cfg.prompts_per_entity):
        for i in order:
            colour, shape = pairs[i]
            position = _pick(rng, LAYOUTS[cfg.layout])[0]
            background = _pick(rng, compatible_backgrounds(colour))
            template = ATTRIBUTE_PROMPT_TEMPLATES[(i + k) % len(ATTRIBUTE_PROMPT_TEMPLATES)]
            prompts.append(
                {
                    "text": template.format(bg=background, pos=position, c=colour, s=shape),
                    "entity": None,
                    "colour": colour,
                    "shape": shape,
                    "background": background,
                    "position": position,
                    "layout": cfg.layout,
                    "split": split,
                }
            )
    return prompts


def robust_prompts(
    cfg: KShapesConfig, heldout: set[str], validation: set[str] = frozenset()
) -> list[dict[str, Any]]:
    """Prompts whose wording no training caption uses (captions.ROBUST_TEMPLATES and
    DISTRACTOR_TEMPLATES): per entity one "sentence", one "alias" (entities with an alias), one
    "traditional" (OpenCC s2t of a sentence prompt) and one "distractor" prompt, whose second
    entity differs in colour and shape and is a seen one (its look is known from training)."""
    from opencc import OpenCC

    to_traditional = OpenCC("s2t")
    rng = np.random.default_rng([cfg.seed, 98])
    kg_only = heldout | validation
    prompts = []
    for k, entity in enumerate(ENTITIES):
        variants: list[tuple[str, str, str, str | None]] = [
            ("sentence", ROBUST_TEMPLATES[k % len(ROBUST_TEMPLATES)], entity.name, None)
        ]
        if entity.aliases:
            variants.append(
                ("alias", ROBUST_TEMPLATES[(k + 1) % len(ROBUST_TEMPLATES)], _pick(rng, entity.aliases), None)
            )
        variants.append(("traditional", ROBUST_TEMPLATES[(k + 2) % len(ROBUST_TEMPLATES)], entity.name, None))
        others = [
            e
            for e in ENTITIES
            if e.colour != entity.colour and e.shape != entity.shape and e.name not in kg_only
        ]
        variants.append(
            (
                "distractor",
                DISTRACTOR_TEMPLATES[k % len(DISTRACTOR_TEMPLATES)],
                entity.name,
                _pick(rng, others).name,
            )
        )
        for variant, template, surface, distractor in variants:
            spec, position = _spec(rng, entity.shape, entity.colour, cfg.layout)
            text = template.format(bg=spec.background, pos=position, e=surface, d=distractor)
            if variant == "traditional":
                text = to_traditional.convert(text)
            prompts.append(
                _prompt(text, entity, spec, position, template, heldout, validation)
                | {"variant": variant, **({"distractor": distractor} if distractor else {})}
            )
    return prompts


Job = tuple[ShapeSpec, str, str | None, int, int, str | None]


def _draw(job: Job) -> None:
    """Worker: draw one item at base size (and 4×) and write the PNGs (the hr one and the mask where
    a path is given)."""
    spec, path, hr_path, size, hr_scale, mask_path = job
    if mask_path is not None:
        # The base image's own supersampling (2·hr_scale with hr/, else 4): the same coverage.
        mask = render_mask(spec, size, supersample=2 * hr_scale if hr_scale else 4)
        mask.save(mask_path, format="PNG", compress_level=1)
    if hr_scale:
        # The hr image is drawn with 2× supersampling; the base image is its box-reduction, i.e.
        # the same drawing supersampled 2·hr_scale×, so the pair is exactly consistent. PNG level 1:
        # these flat images compress almost as well as at level 6, at half the time.
        hr = render(spec, size * hr_scale, supersample=2)
        if hr_path is not None:
            hr.save(hr_path, format="PNG", compress_level=1)
        hr.reduce(hr_scale).save(path, format="PNG", compress_level=1)
    else:
        render(spec, size, supersample=4).save(path, format="PNG", compress_level=1)


def _jobs(cfg: KShapesConfig, split: str, items: list[Item]) -> Iterator[Job]:
    for item in items:
        hr = str(cfg.out / "hr" / split / item.file_name) if cfg.writes_hr else None
        mask = str(cfg.out / split / MASKS / item.file_name) if cfg.masks else None
        yield item.spec, str(cfg.out / split / item.file_name), hr, cfg.size, cfg.hr_scale, mask


def generate_kshapes(cfg: KShapesConfig, *, overwrite: bool = False, progress: bool = True) -> dict[str, Any]:
    """Write the benchmark into ``cfg.out``; returns a summary (counts per split, held-out names)."""
    from tqdm.auto import tqdm

    out = cfg.out
    prepare_output_folder(out, OUTPUTS, overwrite, "kshapes")
    heldout_names = choose_heldout(cfg.heldout, cfg.seed)
    heldout = set(heldout_names)
    validation_names = choose_validation(cfg.validation_entities, cfg.seed, heldout)
    validation = set(validation_names)
    splits = {split: sample_split(cfg, split, heldout, heldout | validation) for split in SPLITS}

    for split in SPLITS:
        (out / split).mkdir(parents=True, exist_ok=True)
        if cfg.masks:
            (out / split / MASKS).mkdir(exist_ok=True)
        if cfg.writes_hr:
            (out / "hr" / split).mkdir(parents=True, exist_ok=True)
    jobs = [job for split in SPLITS for job in _jobs(cfg, split, splits[split])]
    workers = cfg.workers or min(8, os.cpu_count() or 1)
    bar = tqdm(total=len(jobs), desc="kshapes: drawing", unit="img", disable=not progress)
    if workers == 1 or len(jobs) < 200:
        for job in jobs:
            _draw(job)
            bar.update()
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            for _ in pool.map(_draw, jobs, chunksize=64):
                bar.update()
    bar.close()

    # Metadata last: a folder with metadata.jsonl is a finished split.
    for split, items in splits.items():
        rows = jsonl_text([item.metadata() for item in items])
        if cfg.masks:
            with_masks = [item.metadata() | {"mask": f"{MASKS}/{item.file_name}"} for item in items]
            atomic_write_text(out / split / "metadata.jsonl", jsonl_text(with_masks))
        else:
            atomic_write_text(out / split / "metadata.jsonl", rows)
        if cfg.writes_hr:
            atomic_write_text(out / "hr" / split / "metadata.jsonl", rows)

    triples = "".join("\t".join(t) + "\n" for t in kg_triples())
    atomic_write_text(
        out / "kg" / "triples.tsv", "# kshapes knowledge graph: head<TAB>relation<TAB>tail\n" + triples
    )
    aliases = "".join(f"{name}\t{'|'.join(al)}\n" for name, al in kg_aliases().items())
    atomic_write_text(out / "kg" / "aliases.tsv", aliases)
    entities = {
        e.name: {
            "colour": e.colour,
            "shape": e.shape,
            "category": e.category,
            "aliases": list(e.aliases),
            "facts": dict(e.facts),
            "heldout": e.name in heldout,
            "validation": e.name in validation,
        }
        for e in ENTITIES
    }
    atomic_write_text(out / "entities.json", json.dumps(entities, ensure_ascii=False, indent=1) + "\n")
    atomic_write_text(out / "heldout_entities.txt", "".join(f"{n}\n" for n in heldout_names))
    atomic_write_text(out / "validation_entities.txt", "".join(f"{n}\n" for n in validation_names))
    kg_only = {"heldout": heldout_names, "validation": validation_names, "seed": cfg.seed}
    atomic_write_text(out / "kg_only_entities.json", json.dumps(kg_only, ensure_ascii=False, indent=1) + "\n")
    atomic_write_text(out / "prompts.jsonl", jsonl_text(evaluation_prompts(cfg, heldout, validation)))
    atomic_write_text(out / "prompts_robust.jsonl", jsonl_text(robust_prompts(cfg, heldout, validation)))
    attribute = [row for split in ATTRIBUTE_STREAMS for row in attribute_prompts(cfg, split)]
    atomic_write_text(out / "prompts_attribute.jsonl", jsonl_text(attribute))
    save_config(cfg, out / "kshapes.yaml")

    summary = {
        "out": str(out),
        **{split: len(items) for split, items in splits.items()},
        "entities": len(ENTITIES),
        "heldout": heldout_names,
        "validation": validation_names,
        "triples": len(kg_triples()),
        "size": cfg.size,
        "hr_size": cfg.size * cfg.hr_scale if cfg.writes_hr else None,
    }
    log.info(
        "kshapes written to %s: %s",
        out,
        {k: v for k, v in summary.items() if k not in ("heldout", "validation")},
    )
    return summary
