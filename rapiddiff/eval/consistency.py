"""Render consistency: is a generated kshapes image as crisp and flat as the renders it learned from?

For each generated image, what the kshapes detector read off it (colour, shape, background, the
object's bounding-box centre and area) becomes a :class:`ShapeSpec`, drawn at the image's size by
kshapes' own renderer; the image is compared with that re-render by PSNR (RGB, data range 255)
and SSIM (Wang et al. 2004 with torchmetrics' settings: Gaussian window 11, σ 1.5, on RGB in
[0, 1]; computed in numpy, checked against torchmetrics in the tests). A model that draws the shape it meant crisply, in the palette colour, on a flat
background scores high; soft blobs, specks, mottled or framed backgrounds and off colours score low.

What the re-render cannot follow: rotation (kshapes draws every shape upright, so the detector's
``orientation`` is recorded but not drawn) and a shape's aspect when the model stretched it (the
scale comes from the area). Palette colours are drawn without the training renders' ±6 jitter, so a
kshapes render itself scores high but finite (tests: > 30 dB).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

# Modules that load torch, numpy or PIL are imported inside the functions that use them:
# `rapiddiff eval --help` imports every eval module.

PSNR_CAP = 100.0
"""PSNR of identical images (the MSE floor 1e-10 of [0, 1] data): JSON has no infinity."""
SSIM_WINDOW, SSIM_SIGMA = 11, 1.5
SSIM = "Wang et al. 2004 as torchmetrics' structural_similarity_index_measure (Gaussian 11, sigma 1.5)"


@cache
def unit_geometry(shape: str) -> tuple[float, float, float]:
    """(area, dx, dy) of ``shape`` drawn at scale 1: the fraction of the image it covers and its
    centroid's offset from its bounding-box centre (in image widths; a triangle's sits lower),
    measured on its render mask."""
    from rapiddiff.data.kshapes.render import ShapeSpec, render_mask

    mask = np.asarray(render_mask(ShapeSpec(shape, "黑色", "浅蓝色", 0.5, 0.5), 256), np.float64) / 255.0
    ys, xs = np.mgrid[0 : mask.shape[0], 0 : mask.shape[1]] + 0.5
    total = mask.sum()
    cx, cy = (mask * xs).sum() / total / 256, (mask * ys).sum() / total / 256
    return float(mask.mean()), float(cx - 0.5), float(cy - 0.5)


def rerender_spec(found: dict[str, Any]) -> dict[str, Any] | None:
    """The ShapeSpec fields (a JSON-ready dict) of what the detector read; None without a background.

    The scale follows from the object's area; its place from its centroid less the shape's own
    centroid offset (a mean over the object's pixels: a stray speck joined to the blob moves it
    less than it moves the bounding box), else from the bounding-box centre. No object found: the
    spec has ``shape`` None (the re-render is the flat background alone)."""
    if not found.get("background"):
        return None
    spec: dict[str, Any] = {"background": found["background"], "shape": None}
    if found.get("shape") and found.get("colour") and found.get("centre") and found.get("area"):
        area, dx, dy = unit_geometry(found["shape"])
        scale = min(4.0, max(0.2, math.sqrt(float(found["area"]) / area)))
        if found.get("centroid"):
            x, y = found["centroid"][0] - dx * scale, found["centroid"][1] - dy * scale
        else:
            x, y = found["centre"]
        spec.update(
            shape=found["shape"],
            colour=found["colour"],
            x=round(float(x), 4),
            y=round(float(y), 4),
            scale=round(scale, 4),
        )
    return spec


def rerender(spec: dict[str, Any], size: tuple[int, int]) -> Image.Image:
    """Draw :func:`rerender_spec`'s dict with kshapes' renderer at ``size`` (width, height)."""
    from rapiddiff.data.kshapes.palette import BACKGROUNDS
    from rapiddiff.data.kshapes.render import ShapeSpec, render

    side = max(size)
    if spec.get("shape") is None:
        image = Image.new("RGB", (side, side), BACKGROUNDS[spec["background"]][0])
    else:
        fields = ("shape", "colour", "background", "x", "y", "scale")
        image = render(ShapeSpec(**{k: spec[k] for k in fields}), side)
    return image if image.size == tuple(size) else image.resize(tuple(size), Image.Resampling.BICUBIC)


def psnr(a: Image.Image, b: Image.Image) -> float:
    """PSNR in dB of two RGB images of one size (data range 255), capped at :data:`PSNR_CAP`."""
    x = np.asarray(a.convert("RGB"), np.float64) / 255.0
    y = np.asarray(b.convert("RGB"), np.float64) / 255.0
    mse = max(float(np.mean((x - y) ** 2)), 1e-10)
    return min(PSNR_CAP, 10.0 * math.log10(1.0 / mse))


def ssim(a: Image.Image, b: Image.Image) -> float:
    """SSIM of two RGB images of one size (Wang et al. 2004, data range 1; see :data:`SSIM`).

    numpy/scipy, the formula of torchmetrics' ``structural_similarity_index_measure`` (Gaussian
    window 11, σ 1.5, K1 0.01, K2 0.03, reflected borders, mean over channels and pixels;
    tests/eval/test_consistency.py checks they agree): torchmetrics' own takes ~0.7 s an
    image on a busy CPU, this ~5 ms, and the evaluation scores thousands of images."""
    from scipy.ndimage import correlate1d

    x = np.asarray(a.convert("RGB"), np.float64) / 255.0
    y = np.asarray(b.convert("RGB"), np.float64) / 255.0
    offsets = np.arange(SSIM_WINDOW) - SSIM_WINDOW // 2
    kernel = np.exp(-(offsets**2) / (2 * SSIM_SIGMA**2))
    kernel /= kernel.sum()

    def blur(z: np.ndarray) -> np.ndarray:
        # "mirror" is torch's reflect padding: windows at the border see the image reflected.
        return correlate1d(correlate1d(z, kernel, axis=0, mode="mirror"), kernel, axis=1, mode="mirror")

    c1, c2 = 0.01**2, 0.03**2
    mx, my = blur(x), blur(y)
    vx, vy = np.maximum(blur(x * x) - mx * mx, 0.0), np.maximum(blur(y * y) - my * my, 0.0)
    cxy = blur(x * y) - mx * my
    index = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
    return float(index.mean())


def render_consistency(image: Image.Image, found: dict[str, Any]) -> dict[str, Any]:
    """``{"psnr", "ssim", "rerender"}`` of ``image`` against the re-render of ``found`` (the
    detector's reading of it); all None when the detector gave too little to draw."""
    spec = rerender_spec(found)
    if spec is None:
        return {"psnr": None, "ssim": None, "rerender": None}
    image = image.convert("RGB")
    target = rerender(spec, image.size)
    return {"psnr": round(psnr(image, target), 3), "ssim": round(ssim(image, target), 4), "rerender": spec}


def write_grid(
    runs: dict[str, Path],
    records: dict[str, Sequence[dict[str, Any]]],
    out: Path,
    *,
    per_group: int = 4,
    splits: Sequence[str] | None = None,
) -> Path | None:
    """A grid of generated | re-render pairs: one row per split × knowledge mode, ``per_group``
    pairs a row (the first images of the split, so every mode shows the same prompts), a label on
    the left. ``runs``: mode → run folder; ``records``: mode → its detection records. None when no
    record has a re-render."""
    from PIL import ImageDraw

    rows: list[tuple[str, list[tuple[Image.Image, Image.Image]]]] = []
    for mode, recs in records.items():
        order = splits or list(dict.fromkeys(r["split"] for r in recs))
        for split in order:
            pairs = []
            for r in [r for r in recs if r["split"] == split and r.get("rerender")][:per_group]:
                with Image.open(runs[mode] / r["file"]) as im:
                    generated = im.convert("RGB")
                pairs.append((generated, rerender(r["rerender"], generated.size)))
            if pairs:
                rows.append((f"{split} / {mode}", pairs))
    if not rows:
        return None
    tile = max(max(g.size) for _, pairs in rows for g, _ in pairs)
    label, gap = 110, 6
    width = label + per_group * (2 * tile + gap)
    grid = Image.new("RGB", (width, len(rows) * (tile + gap)), (255, 255, 255))
    draw = ImageDraw.Draw(grid)
    for i, (name, pairs) in enumerate(rows):
        top = i * (tile + gap)
        draw.text((4, top + tile // 2 - 6), name, fill=(0, 0, 0))
        for j, (generated, target) in enumerate(pairs):
            left = label + j * (2 * tile + gap)
            grid.paste(generated.resize((tile, tile)), (left, top))
            grid.paste(target.resize((tile, tile)), (left + tile, top))
    out.parent.mkdir(parents=True, exist_ok=True)
    grid.save(out)
    return out
