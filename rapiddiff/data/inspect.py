"""``rapiddiff data inspect``: what is in an image–caption dataset, and what is wrong with it.

Counts, every skipped item with its reason, image-size and caption-length histograms (PNG), and,
given a KnowledgeStore, how much of the captions its entities cover. The histograms are drawn
with Pillow: a bar chart is a few rectangles, not worth a matplotlib dependency.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from rapiddiff.data.loader import ImageTextDataset, reason_kind
from rapiddiff.kg.linker import EntityLinker
from rapiddiff.kg.store import KnowledgeStore
from rapiddiff.utils.io import atomic_write_text, removed_if_failed
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)


def _font(size: int) -> Any:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1 has one fixed-size bitmap font
        return ImageFont.load_default()


def histogram_png(
    values: Sequence[float], path: str | Path, *, title: str, xlabel: str, bins: int = 30, width: int = 720
) -> dict[str, Any]:
    """Draw a histogram of ``values`` to ``path`` (PNG); returns its bin edges and counts."""
    values = np.asarray(values, dtype=np.float64)
    height, left, right, top, bottom = 420, 70, 20, 50, 60
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    draw.text((left, 14), title, fill="black", font=_font(18))
    if len(values) == 0:
        draw.text((left, height // 2), "no data", fill="grey", font=_font(16))
        image.save(path, format="PNG")
        return {"edges": [], "counts": []}
    lo, hi = float(values.min()), float(values.max())
    if hi == lo:
        lo, hi = lo - 0.5, hi + 0.5
    if np.all(values == np.round(values)) and hi - lo < bins:
        # Integers over a short range: one bar per value, not bars straddling two values.
        lo, hi = lo - 0.5, hi + 0.5
        bins = int(hi - lo)
    counts, edges = np.histogram(values, bins=bins, range=(lo, hi))
    plot_w, plot_h = width - left - right, height - top - bottom
    peak = max(1, int(counts.max()))
    bar_w = plot_w / len(counts)
    for i, count in enumerate(counts):
        x0 = left + i * bar_w
        y0 = top + plot_h * (1 - count / peak)
        draw.rectangle((x0 + 1, y0, x0 + bar_w - 1, top + plot_h), fill=(70, 110, 190))
    draw.line((left, top, left, top + plot_h, left + plot_w, top + plot_h), fill="black", width=1)
    small = _font(12)
    for frac in (0.0, 0.5, 1.0):  # y ticks
        y = top + plot_h * (1 - frac)
        draw.text((8, y - 7), f"{peak * frac:.0f}", fill="black", font=small)
    for k in range(5):  # x ticks
        frac = k / 4
        value = lo + (hi - lo) * frac
        x = left + plot_w * frac
        draw.line((x, top + plot_h, x, top + plot_h + 4), fill="black")
        label = f"{value:.0f}" if hi - lo >= 10 else f"{value:.2f}"
        draw.text((x - 12, top + plot_h + 8), label, fill="black", font=small)
    draw.text((left + plot_w // 2 - 40, height - 24), xlabel, fill="black", font=small)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format="PNG")
    return {"edges": [float(e) for e in edges], "counts": [int(c) for c in counts]}


def entity_coverage(texts: Sequence[str], store: Any, top: int = 20) -> dict[str, Any]:
    """How many captions mention an entity of ``store``, which entities, and how often."""

    linker = EntityLinker.from_store(store)
    mentions: Counter[int] = Counter()
    with_entity = 0
    for text in texts:
        spans = linker.link(text)
        with_entity += bool(spans)
        mentions.update(s.entity_id for s in spans)
    names = store.entity_names
    return {
        "captions": len(texts),
        "captions_with_entity": with_entity,
        "caption_coverage": with_entity / len(texts) if texts else 0.0,
        "mentions": int(sum(mentions.values())),
        "distinct_entities": len(mentions),
        "store_entities": len(names),
        "store_coverage": len(mentions) / len(names) if names else 0.0,
        "top_entities": [[names[i], n] for i, n in mentions.most_common(top)],
    }


def inspect_dataset(
    source: str | Path,
    *,
    out: str | Path | None = None,
    store: str | Path | None = None,
    image_size: int = 256,
    small_images: str = "upscale",
    progress: bool = True,
    **options: Any,
) -> dict[str, Any]:
    """Check every item of ``source`` (images fully decoded) and write the report to ``out``.

    ``out`` gets ``report.json``, ``skipped.jsonl``, ``image_sizes.png`` and
    ``caption_lengths.png``. Returns the report.
    """

    out_dir = Path(out) if out is not None else None
    skip_log = None
    if out_dir is not None:
        skip_log = out_dir / "skipped.jsonl"
        skip_log.unlink(missing_ok=True)
    with removed_if_failed(out_dir):
        dataset = ImageTextDataset(
            source,
            image_size=image_size,
            small_images=small_images,  # type: ignore[arg-type]
            verify="full",
            skip_log=skip_log,
            progress=progress,
            **options,
        )
        return _report(dataset, out_dir, image_size, store)


def _report(dataset: Any, out_dir: Path | None, image_size: int, store: str | Path | None) -> dict[str, Any]:
    sizes = np.array([dataset.image_sizes[r] for r in dataset.indices], dtype=np.int64).reshape(-1, 2)
    lengths = [len(t) for t in dataset.texts]
    reasons = Counter(reason_kind(reason) for _, reason in dataset.skipped)
    report: dict[str, Any] = {
        "source": str(dataset.table),
        "rows": len(dataset) + len(dataset.skipped),
        "usable": len(dataset),
        "skipped": len(dataset.skipped),
        "skipped_by_reason": dict(reasons.most_common()),
        "image_size": _summary(sizes.min(axis=1)) | {"name": "shorter side, px"},
        "image_width": _summary(sizes[:, 0]),
        "image_height": _summary(sizes[:, 1]),
        "distinct_sizes": [
            [f"{w}x{h}", n] for (w, h), n in Counter(map(tuple, sizes.tolist())).most_common(10)
        ],
        "caption_length": _summary(np.asarray(lengths)) | {"name": "characters"},
        "below_training_size": int((sizes.min(axis=1) < image_size).sum()) if len(sizes) else 0,
        "training_size": image_size,
    }
    if store is not None:
        report["entities"] = entity_coverage(dataset.texts, KnowledgeStore.load(store))
    if out_dir is not None:
        report["histograms"] = {
            "image_sizes": histogram_png(
                sizes.min(axis=1), out_dir / "image_sizes.png", title="image size", xlabel="shorter side (px)"
            ),
            "caption_lengths": histogram_png(
                lengths, out_dir / "caption_lengths.png", title="caption length", xlabel="characters"
            ),
        }
        atomic_write_text(out_dir / "report.json", json.dumps(report, ensure_ascii=False, indent=1) + "\n")
    return report


def _summary(values: np.ndarray) -> dict[str, Any]:
    if len(values) == 0:
        return {"count": 0}
    q = np.percentile(values, [0, 5, 50, 95, 100])
    return {
        "count": len(values),
        "mean": float(values.mean()),
        "min": float(q[0]),
        "p5": float(q[1]),
        "median": float(q[2]),
        "p95": float(q[3]),
        "max": float(q[4]),
    }


def format_report(report: dict[str, Any]) -> str:
    """A short human-readable summary of :func:`inspect_dataset`'s report."""
    lines = [
        f"{report['source']}: {report['rows']} rows, {report['usable']} usable, {report['skipped']} skipped",
    ]
    for reason, n in report["skipped_by_reason"].items():
        lines.append(f"  skipped  {n:6d}  {reason}")
    size, length = report["image_size"], report["caption_length"]
    if size.get("count"):
        lines.append(
            f"image shorter side: median {size['median']:.0f}px (p5 {size['p5']:.0f}, p95 {size['p95']:.0f}); "
            f"{report['below_training_size']} below the training size {report['training_size']}"
        )
    if length.get("count"):
        lines.append(
            f"caption length: median {length['median']:.0f} chars (p5 {length['p5']:.0f}, p95 {length['p95']:.0f})"
        )
    ent = report.get("entities")
    if ent:
        top = ", ".join(f"{n} {c}" for n, c in ent["top_entities"][:8])
        lines.append(
            f"entities: {ent['caption_coverage']:.1%} of captions mention one; {ent['distinct_entities']} of "
            f"{ent['store_entities']} store entities seen ({ent['store_coverage']:.1%}); top: {top}"
        )
    return "\n".join(lines)
