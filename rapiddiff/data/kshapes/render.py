"""Draw one kshapes image: a single flat-coloured shape on a flat background.

Geometry is given in units of the image width, so the same :class:`ShapeSpec` renders at any
size; every size is drawn with supersampling and box-reduced (anti-aliased edges), so the 4×
image is the same drawing at 4× the resolution, not an upscale of the small one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from PIL import Image, ImageDraw

from rapiddiff.data.kshapes.palette import BACKGROUNDS, COLOURS

# Extent of each shape (width, height) in units of the image width at scale 1.
# Bars and ellipses lie horizontally; the triangle and the star point up.
STAR_INNER = 0.382  # inner/outer radius of a regular five-pointed star
SHAPE_SIZE: dict[str, tuple[float, float]] = {
    "圆形": (0.24, 0.24),
    "方形": (0.21, 0.21),
    "三角形": (0.28, 0.28 * math.sqrt(3) / 2),
    "星形": (0.30 * math.sin(math.radians(72)), 0.15 * (1 + math.cos(math.radians(36)))),
    "椭圆形": (0.30, 0.17),
    "长条形": (0.30, 0.09),
}


@dataclass(frozen=True)
class ShapeSpec:
    """Everything that decides an image's pixels."""

    shape: str
    colour: str
    background: str
    x: float  # centre of the shape's bounding box, in units of width
    y: float  # ... and of height
    scale: float = 1.0
    colour_shift: tuple[int, int, int] = (0, 0, 0)  # small per-image jitter of the object's RGB
    background_shift: tuple[int, int, int] = (0, 0, 0)


def _shift(rgb: tuple[int, int, int], delta: tuple[int, int, int]) -> tuple[int, int, int]:
    return tuple(min(255, max(0, c + d)) for c, d in zip(rgb, delta, strict=True))  # type: ignore[return-value]


def _polygon(spec: ShapeSpec, size: int) -> list[tuple[float, float]] | None:
    """Vertices in pixels for polygonal shapes; None for ellipses (drawn with ``ellipse``)."""
    w, h = (v * spec.scale * size for v in SHAPE_SIZE[spec.shape])
    cx, cy = spec.x * size, spec.y * size
    left, top = cx - w / 2, cy - h / 2
    if spec.shape in ("方形", "长条形"):
        return [(left, top), (left + w, top), (left + w, top + h), (left, top + h)]
    if spec.shape == "三角形":
        return [(cx, top), (left + w, top + h), (left, top + h)]
    if spec.shape == "星形":
        outer = 0.15 * spec.scale * size
        # Place the star so its bounding box (not its circumcentre) is centred on (cx, cy).
        oy = top + outer
        points = []
        for k in range(10):
            radius = outer if k % 2 == 0 else outer * STAR_INNER
            angle = math.radians(-90 + 36 * k)
            points.append((cx + radius * math.cos(angle), oy + radius * math.sin(angle)))
        return points
    return None


def render(spec: ShapeSpec, size: int, supersample: int = 4) -> Image.Image:
    """The RGB image of ``spec`` at ``size``×``size`` pixels."""
    background = _shift(BACKGROUNDS[spec.background][0], spec.background_shift)
    colour = _shift(COLOURS[spec.colour], spec.colour_shift)
    return _draw(spec, size, supersample, "RGB", background, colour)


def render_mask(spec: ShapeSpec, size: int, supersample: int = 4) -> Image.Image:
    """The object's coverage of each pixel ("L", 0 = background, 255 = object, between on edges):
    the same drawing as :func:`render`, so it tells which pixels of a render are the object."""
    return _draw(spec, size, supersample, "L", 0, 255)


def _draw(
    spec: ShapeSpec, size: int, supersample: int, mode: str, background: Any, colour: Any
) -> Image.Image:
    big = size * supersample
    image = Image.new(mode, (big, big), background)
    draw = ImageDraw.Draw(image)
    polygon = _polygon(spec, big)
    if polygon is None:
        w, h = (v * spec.scale * big for v in SHAPE_SIZE[spec.shape])
        cx, cy = spec.x * big, spec.y * big
        draw.ellipse((cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2), fill=colour)
    else:
        draw.polygon(polygon, fill=colour)
    return image.reduce(supersample) if supersample > 1 else image
