"""Read colour, shape, background and position back off a kshapes-style image.

This is how generated images are scored, so it must tolerate what a diffusion model draws:
soft edges, noise, a slightly off colour. The steps:

1. smooth lightly (noise), take the background as the median of the border frame;
2. seed the object as the largest blob far (ΔE > 18) from the background, take its colour
   as the median over the blob's interior (edges are mixed with the background);
3. re-segment each pixel as whichever of object / background colour it is nearer to (the
   half-way contour of a blurred edge is the true edge), keep the largest component, fill holes;
4. colour / background = nearest palette entry in CIELAB; shape = nearest prototype in a small
   feature space: elongation (from second moments), fill of the bounding box, solidity (area
   over convex-hull area); position = nearest layout centre to the blob's centroid.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from PIL import Image

from rapiddiff.data.kshapes.palette import BACKGROUND_LAB, COLOUR_LAB, LAYOUTS, srgb_to_lab
from rapiddiff.data.kshapes.render import SHAPE_SIZE, ShapeSpec, render

SEED_THRESHOLD = 18.0  # ΔE from the background that surely belongs to the object
MIN_AREA = 0.002  # blobs smaller than this fraction of the image are no object
ANALYSIS_SIZE = 256  # larger images are box-reduced to at most this size first


def radial_harmonics(mask: np.ndarray, bins: int = 48) -> np.ndarray:
    """Amplitudes of harmonics 3, 4, 5 of the boundary's distance from the centroid.

    A triangle's outline swings three times around its centre, a square's four times, a star's
    five: these survive blur that rounds corners and fills a star's notches.
    """
    from scipy import ndimage

    ys, xs = np.nonzero(mask)
    cy, cx = ys.mean(), xs.mean()
    boundary = mask & ~ndimage.binary_erosion(mask)
    by, bx = np.nonzero(boundary)
    angle = np.arctan2(by - cy, bx - cx)
    radius = np.hypot(by - cy, bx - cx) + 0.5
    index = ((angle + np.pi) / (2 * np.pi) * bins).astype(int) % bins
    profile = np.full(bins, np.nan)
    np.fmax.at(profile, index, radius)
    known = ~np.isnan(profile)
    if known.sum() < 4:
        return np.zeros(3)
    grid = np.arange(bins)
    profile = np.interp(grid, grid[known], profile[known], period=bins)
    spectrum = np.abs(np.fft.rfft(profile / profile.mean())) * 2 / bins
    return spectrum[3:6]


def _ideal_features() -> dict[str, np.ndarray]:
    """Features of each shape's ideal drawing, measured on a render (the prototypes)."""

    out = {}
    for shape in SHAPE_SIZE:
        image = render(ShapeSpec(shape, "黑色", "浅蓝色", 0.5, 0.5), 256)
        mask = np.asarray(image.convert("L")) < 100
        out[shape] = shape_features(mask)
    return out


_PROTOTYPES: dict[str, np.ndarray] = {}
# How much one unit of each feature counts (≈ the spread a generated image shows):
# log elongation, bounding-box fill, solidity, harmonics 3, 4, 5.
FEATURE_SCALE = np.array([0.25, 0.08, 0.10, 0.05, 0.05, 0.05])


def prototypes() -> dict[str, np.ndarray]:
    if not _PROTOTYPES:
        _PROTOTYPES.update(_ideal_features())
    return _PROTOTYPES


def _nearest(lab: np.ndarray, table: dict[str, np.ndarray]) -> str:
    return min(table, key=lambda k: float(np.linalg.norm(lab - table[k])))


def _largest_component(mask: np.ndarray) -> np.ndarray:
    from scipy import ndimage

    labels, n = ndimage.label(mask)
    if n == 0:
        return mask
    sizes = np.bincount(labels.ravel())
    sizes[0] = 0
    return labels == int(sizes.argmax())


def shape_features(mask: np.ndarray) -> np.ndarray:
    """(log elongation, bounding-box fill, solidity, harmonics 3-5) of a boolean mask."""
    from scipy import ndimage
    from scipy.spatial import ConvexHull, QhullError

    ys, xs = np.nonzero(mask)
    area = float(len(xs))
    fill = area / float((xs.max() - xs.min() + 1) * (ys.max() - ys.min() + 1))
    cov = np.cov(np.stack([xs, ys]).astype(np.float64))
    small, large = np.linalg.eigvalsh(cov)
    elongation = 0.5 * math.log(max(large, 1e-6) / max(small, 1e-6))
    # Solidity on pixel corners of the boundary: the hull of pixel centres would undercount.
    boundary = mask & ~ndimage.binary_erosion(mask)
    by, bx = np.nonzero(boundary)
    corners = np.concatenate([np.stack([bx + dx, by + dy], 1) for dx in (-0.5, 0.5) for dy in (-0.5, 0.5)])
    try:
        hull_area = ConvexHull(corners).volume  # in 2-D, "volume" is the area
        solidity = min(1.0, area / hull_area)
    except QhullError:  # a degenerate (one-line) blob
        solidity = 1.0
    return np.array([elongation, fill, solidity, *radial_harmonics(mask)])


def classify_shape(features: np.ndarray) -> str:
    """The shape whose ideal drawing's features are nearest (scaled by :data:`FEATURE_SCALE`)."""
    table = prototypes()
    return min(table, key=lambda s: float(np.sum(((features - table[s]) / FEATURE_SCALE) ** 2)))


def detect_attributes(image: Image.Image, *, layout: str = "row3") -> dict[str, Any]:
    """Colour, shape, background and position of the single object in ``image``.

    Returns ``{"colour", "shape", "background", "position"}`` as Chinese names (those of the KG;
    ``None`` for colour/shape/position when no object is found), ``"area"``, the object's
    fraction of the image, and its geometry in units of the image width/height (``None`` when no
    object): ``"centre"`` (x, y) of its bounding box (where :class:`ShapeSpec` puts a shape),
    ``"centroid"`` (x, y) and ``"orientation"``, its principal axis in degrees (0 = horizontal).
    These let the evaluation re-render what the detector read (rapiddiff.eval.consistency).
    ``"lab"`` is the object's CIELAB colour, the one its colour name is the nearest palette entry to
    (how far a miss lies from the asked colour: benchmarks/kshapes_miss_hues.py).
    """
    from scipy import ndimage

    image = image.convert("RGB")
    if max(image.size) > ANALYSIS_SIZE:
        # Shape and colour need no more than ANALYSIS_SIZE pixels; box-reducing a large image
        # first makes a 512² image as cheap to read as a 256² one (and averages its noise).
        factor = -(-max(image.size) // ANALYSIS_SIZE)
        image = image.reduce(factor)
    rgb = np.asarray(image, dtype=np.float32) / 255.0
    h, w = rgb.shape[:2]
    sigma = max(0.5, min(h, w) / 160)
    rgb = np.stack([ndimage.gaussian_filter(rgb[..., c], sigma) for c in range(3)], -1)
    lab = srgb_to_lab(rgb)

    frame = max(2, min(h, w) // 64)
    border = np.concatenate(
        [
            lab[:frame].reshape(-1, 3),
            lab[-frame:].reshape(-1, 3),
            lab[:, :frame].reshape(-1, 3),
            lab[:, -frame:].reshape(-1, 3),
        ]
    )
    bg = np.median(border, axis=0)
    result: dict[str, Any] = {
        "colour": None,
        "shape": None,
        "background": _nearest(bg, BACKGROUND_LAB),
        "position": None,
        "area": 0.0,
        "centre": None,
        "centroid": None,
        "orientation": None,
        "lab": None,
    }

    d_bg = np.linalg.norm(lab - bg, axis=-1)
    seed = ndimage.binary_opening(d_bg > SEED_THRESHOLD, iterations=max(1, min(h, w) // 128))
    seed = _largest_component(seed)
    if seed.sum() < MIN_AREA * h * w:
        return result
    core = ndimage.binary_erosion(seed, iterations=max(1, min(h, w) // 64))
    obj = np.median(lab[core if core.sum() >= 8 else seed], axis=0)

    mask = np.linalg.norm(lab - obj, axis=-1) < d_bg
    mask = ndimage.binary_fill_holes(_largest_component(mask))
    ys, xs = np.nonzero(mask)
    positions = LAYOUTS[layout]
    cx, cy = xs.mean() / w, ys.mean() / h
    cov = np.cov(np.stack([xs, ys]).astype(np.float64)) if len(xs) > 1 else np.eye(2)
    _, vectors = np.linalg.eigh(cov)
    axis = vectors[:, -1]  # the principal axis (largest eigenvalue)
    result.update(
        centre=[float(xs.min() + xs.max() + 1) / (2 * w), float(ys.min() + ys.max() + 1) / (2 * h)],
        centroid=[float(xs.mean() + 0.5) / w, float(ys.mean() + 0.5) / h],  # pixel centres
        orientation=float(np.degrees(np.arctan2(axis[1], axis[0])) % 180.0),
        colour=_nearest(obj, COLOUR_LAB),
        lab=[float(v) for v in obj],
        shape=classify_shape(shape_features(mask)),
        position=min(positions, key=lambda p: (p[1] - cx) ** 2 + (p[2] - cy) ** 2)[0],
        area=float(mask.sum()) / (h * w),
    )
    return result
