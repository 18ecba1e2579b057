"""Compose one training image: an emoji's artwork on a background shade, at a position and size.

Backgrounds and positions are kshapes' (palette.BACKGROUNDS, LAYOUTS), so captions share words.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

from rapiddiff.data.kshapes.palette import BACKGROUNDS, LAYOUTS

# Size word → object width in units of the image width (the middle size is not named in captions).
SIZES: dict[str, float] = {"小": 0.30, "": 0.38, "大": 0.46}

# {bg}: background, {pos}: position, {sz}: size word ("" for the middle size), {e}: the zh name.
CAPTION_TEMPLATES: tuple[str, ...] = (
    "{bg}背景上{pos}有一个{sz}{e}",
    "{pos}有一个{sz}{e}",
    "{bg}背景的{pos}有一个{sz}{e}",
    "一个{sz}{e}在{bg}背景的{pos}",
    "{sz}{e}，{bg}背景",
    "画面{pos}是一个{sz}{e}",
)
# Evaluation prompts name background and position (and size where it is not the middle one).
PROMPT_TEMPLATES: tuple[str, ...] = ("{bg}背景上{pos}有一个{sz}{e}", "{bg}背景的{pos}有一个{sz}{e}")


def caption_vocabulary() -> list[str]:
    """Every caption's words besides the entity's name (an alias must occur in none of them)."""
    fixed = [t.format(bg="", pos="", sz="", e="") for t in CAPTION_TEMPLATES]
    return [*fixed, *BACKGROUNDS, *(p for p, _, _ in LAYOUTS["row3"]), *(s for s in SIZES if s)]


@dataclass(frozen=True)
class Placement:
    """Everything that decides an image's pixels besides the artwork."""

    background: str
    position: str
    size: str
    x: float  # centre, in units of the width
    y: float
    scale: float  # object width in units of the image width
    background_shift: tuple[int, int, int] = (0, 0, 0)


def sample_placement(rng: np.random.Generator) -> Placement:
    names = list(BACKGROUNDS)
    background = names[int(rng.integers(len(names)))]
    position, x, y = LAYOUTS["row3"][int(rng.integers(3))]
    size = list(SIZES)[int(rng.integers(len(SIZES)))]
    return Placement(
        background=background,
        position=position,
        size=size,
        x=round(x + float(rng.uniform(-0.02, 0.02)), 4),
        y=round(y + float(rng.uniform(-0.06, 0.06)), 4),
        scale=round(SIZES[size] * float(rng.uniform(0.95, 1.05)), 4),
        background_shift=tuple(int(v) for v in rng.integers(-4, 5, size=3)),  # type: ignore[arg-type]
    )


def compose(glyph: Image.Image, place: Placement, size: int) -> Image.Image:
    """An RGB ``size``² image: the RGBA ``glyph`` resized (Lanczos) and alpha-composited."""
    rgb = tuple(
        min(255, max(0, c + d))
        for c, d in zip(BACKGROUNDS[place.background][0], place.background_shift, strict=True)
    )
    canvas = Image.new("RGBA", (size, size), (*rgb, 255))
    side = max(1, round(place.scale * size))
    art = glyph.convert("RGBA").resize((side, side), Image.Resampling.LANCZOS)
    left, top = round(place.x * size - side / 2), round(place.y * size - side / 2)
    canvas.alpha_composite(art, (left, top))
    return canvas.convert("RGB")
