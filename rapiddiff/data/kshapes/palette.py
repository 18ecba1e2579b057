"""The kshapes vocabulary: object colours, background shades, shapes and positions.

Object colours are saturated and far apart in CIELAB; backgrounds are a disjoint set of light
and dark shades, and an object is only ever drawn on a background at least
:data:`MIN_CONTRAST` ΔE away from it, so the object's colour can always be read back off the
image. Every name here is a KG entity (DESIGN.md: attribute words are entities too).
"""

from __future__ import annotations

import numpy as np

# name → sRGB. Chosen to be pairwise ≥ ~39 ΔE76 apart (checked in tests/data/test_kshapes.py).
COLOURS: dict[str, tuple[int, int, int]] = {
    "红色": (215, 35, 35),
    "橙色": (245, 140, 20),
    "黄色": (245, 215, 35),
    "绿色": (40, 160, 60),
    "蓝色": (30, 90, 225),
    "紫色": (150, 40, 170),
    "白色": (250, 250, 250),
    "黑色": (25, 25, 25),
}

# name → (sRGB, tone). Light and dark shades, none of them close to an object colour.
BACKGROUNDS: dict[str, tuple[tuple[int, int, int], str]] = {
    "浅蓝色": ((170, 200, 235), "浅色"),
    "浅绿色": ((185, 228, 185), "浅色"),
    "米色": ((232, 220, 188), "浅色"),
    "粉色": ((242, 190, 208), "浅色"),
    "灰色": ((128, 128, 128), "中间色"),
    "深蓝色": ((28, 38, 92), "深色"),
    "深绿色": ((22, 72, 44), "深色"),
}

SHAPES: tuple[str, ...] = ("圆形", "方形", "三角形", "星形", "椭圆形", "长条形")

# Positions as (name, x, y) centres in units of the image width/height.
LAYOUTS: dict[str, tuple[tuple[str, float, float], ...]] = {
    "row3": (("左边", 0.23, 0.5), ("中间", 0.5, 0.5), ("右边", 0.77, 0.5)),
    "grid9": (
        ("左上方", 0.23, 0.23),
        ("上方", 0.5, 0.23),
        ("右上方", 0.77, 0.23),
        ("左边", 0.23, 0.5),
        ("中间", 0.5, 0.5),
        ("右边", 0.77, 0.5),
        ("左下方", 0.23, 0.77),
        ("下方", 0.5, 0.77),
        ("右下方", 0.77, 0.77),
    ),
}

# The least CIELAB ΔE76 between an object colour and the background it is drawn on.
MIN_CONTRAST = 40.0


def srgb_to_lab(rgb: np.ndarray) -> np.ndarray:
    """sRGB in [0, 1] (..., 3) → CIELAB (D65) (..., 3).

    The standard formulas in numpy: scikit-image would do it too, but is not a dependency of
    the project for one 15-line conversion.
    """
    rgb = np.asarray(rgb, dtype=np.float32)
    linear = np.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
    matrix = np.array(
        [
            [0.4124564, 0.3575761, 0.1804375],
            [0.2126729, 0.7151522, 0.0721750],
            [0.0193339, 0.1191920, 0.9503041],
        ],
        dtype=np.float32,
    )
    xyz = linear @ matrix.T / np.array([0.95047, 1.0, 1.08883], dtype=np.float32)
    eps = 216 / 24389
    f = np.where(xyz > eps, np.cbrt(xyz), (24389 / 27 * xyz + 16) / 116)
    lab = np.stack(
        [116 * f[..., 1] - 16, 500 * (f[..., 0] - f[..., 1]), 200 * (f[..., 1] - f[..., 2])], axis=-1
    )
    return lab.astype(np.float32)


def lab_of(rgb: tuple[int, int, int]) -> np.ndarray:
    return srgb_to_lab(np.array(rgb, dtype=np.float32) / 255.0)


COLOUR_LAB: dict[str, np.ndarray] = {name: lab_of(rgb) for name, rgb in COLOURS.items()}
BACKGROUND_LAB: dict[str, np.ndarray] = {name: lab_of(rgb) for name, (rgb, _) in BACKGROUNDS.items()}


def compatible_backgrounds(colour: str) -> list[str]:
    """Backgrounds an object of ``colour`` may be drawn on (in palette order)."""
    lab = COLOUR_LAB[colour]
    return [b for b, blab in BACKGROUND_LAB.items() if float(np.linalg.norm(lab - blab)) >= MIN_CONTRAST]
