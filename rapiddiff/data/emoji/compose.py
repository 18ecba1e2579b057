"""Compose one training image: an emoji's artwork on a background shade, at a position and size.

Backgrounds and positions are kshapes' (palette.BACKGROUNDS, LAYOUTS), so captions share words.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
from PIL import Image

from rapiddiff.data.kshapes.palette import BACKGROUNDS, LAYOUTS

# Size word → object width in units of the image width (the middle size is not named in captions).
SIZES: dict[str, float] = {"小": 0.30, "": 0.38, "大": 0.46}
# What a caption says for a size: "的" keeps the size word apart from the name, since a bare one
# can make another word of it (一个小熊猫 is a red panda, 大 + 脑 is a brain).
SIZE_TEXT: dict[str, str] = {"小": "小的", "": "", "大": "大的"}

# {bg}: background, {pos}: position, {sz}: SIZE_TEXT ("" for the middle size), {e}: the zh name.
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


class CaptionIndex:
    """Whether a string can occur anywhere in a caption: inside the template text around the name,
    inside a name, or across the boundary of the two (大 + 脑 reads 大脑). Checked through the
    contexts of the name rather than by writing out every caption (templates × fills × names)."""

    def __init__(self, names: Iterable[str]) -> None:
        fills = [
            (t, bg, pos, sz)
            for t in CAPTION_TEMPLATES
            for bg in BACKGROUNDS
            for pos, _, _ in LAYOUTS["row3"]
            for sz in SIZES
        ]
        texts = {t.format(bg=bg, pos=pos, sz=SIZE_TEXT[sz], e="\0") for t, bg, pos, sz in fills}
        self.before = {t.split("\0")[0] for t in texts}
        self.after = {t.split("\0")[1] for t in texts}
        self.names = set(names)
        self.name_heads = {n[:i] for n in self.names for i in range(1, len(n) + 1)}
        self.name_tails = {n[i:] for n in self.names for i in range(len(n))}
        self.after_heads = {a[:i] for a in self.after for i in range(1, len(a) + 1)}
        self.before_tails = {b[i:] for b in self.before for i in range(len(b))}

    def _starts_a_caption_rest(self, text: str) -> bool:
        """``text`` is how some name, then the text after it, begins."""
        if text in self.name_heads:
            return True
        return any(text[:j] in self.names and text[j:] in self.after_heads for j in range(1, len(text)))

    def in_template(self, text: str) -> bool:
        """Whether ``text`` occurs in the caption words around the name (背景, 上, 左边, 浅蓝色)."""
        return any(text in c for c in (*self.before, *self.after))

    def contains(self, text: str, ignore: str | None = None) -> bool:
        """Whether ``text`` can occur in a caption (``ignore``: a name whose own captions do not count)."""
        if any(text in n for n in self.names if n != ignore) or any(
            text in c for c in (*self.before, *self.after)
        ):
            return True
        for k in range(1, len(text)):
            head, rest = text[:k], text[k:]
            if head in self.before_tails and self._starts_a_caption_rest(rest):
                return True  # begins in the text before the name
            if head in self.name_tails and rest in self.after_heads:
                return True  # begins inside the name, ends after it
        return False


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


def _background(place: Placement) -> tuple[int, int, int]:
    return tuple(  # type: ignore[return-value]
        min(255, max(0, c + d))
        for c, d in zip(BACKGROUNDS[place.background][0], place.background_shift, strict=True)
    )


def glyph_box(place: Placement, size: int) -> tuple[int, int, int]:
    """(left, top, side) in pixels of the artwork in a ``size``² image."""
    side = max(1, round(place.scale * size))
    return round(place.x * size - side / 2), round(place.y * size - side / 2), side


def compose(glyph: Image.Image, place: Placement, size: int) -> Image.Image:
    """An RGB ``size``² image: the RGBA ``glyph`` resized (Lanczos) and alpha-composited."""
    canvas = Image.new("RGBA", (size, size), (*_background(place), 255))
    left, top, side = glyph_box(place, size)
    art = glyph.convert("RGBA").resize((side, side), Image.Resampling.LANCZOS)
    canvas.alpha_composite(art, (left, top))
    return canvas.convert("RGB")


def compose_hr(draw: Callable[[int], Image.Image], place: Placement, size: int, scale: int) -> Image.Image:
    """The ``scale``× copy of :func:`compose`'s image: the same background, and the artwork drawn by
    ``draw(side)`` (an RGBA ``side``² image, e.g. an SVG rasterised at that size) in exactly
    ``scale`` × the base image's box, so box-reducing it lands on the base image's pixel grid."""
    canvas = Image.new("RGBA", (size * scale, size * scale), (*_background(place), 255))
    left, top, side = glyph_box(place, size)
    canvas.alpha_composite(draw(side * scale), (left * scale, top * scale))
    return canvas.convert("RGB")


def compose_mask(glyph: Image.Image, place: Placement, size: int) -> Image.Image:
    """The object mask of :func:`compose`'s image ("L"): the placed glyph's alpha (0 = background)."""
    canvas = Image.new("L", (size, size), 0)
    left, top, side = glyph_box(place, size)
    art = glyph.convert("RGBA").resize((side, side), Image.Resampling.LANCZOS)
    canvas.paste(art.getchannel("A"), (left, top))
    return canvas
