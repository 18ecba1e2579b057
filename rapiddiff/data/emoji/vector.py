"""Vector artwork for the hr/ copies: the same two styles as SVG, from Iconify JSON packages.

The 64 px PNGs cannot make an honest 4× copy (the object is up to 236 px wide at 512²), so the hr
images are drawn from SVG: ``@iconify-json/noto`` (Noto Emoji, Apache-2.0) and
``@iconify-json/twemoji`` (Twemoji, CC-BY 4.0) hold every icon's SVG body in ``icons.json`` and a
code point → icon map in ``chars.json``. An SVG is used only where it is the artwork of the PNG:
rendered at the PNG's size it must agree with it (:func:`agreement`), since a package's SVG can be
another revision of the design (Noto's redesigned buttons, fish, clown face) than the PNG.

Rasterised by resvg (PyPI ``resvg-py``, a self-contained wheel: ``pip install 'rapiddiff[emoji-hr]'``).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass

import numpy as np
from PIL import Image

from rapiddiff.data.emoji.packages import VECTOR_PACKAGES, Package

_TRANSFORMS = ("hFlip", "vFlip", "rotate")
_GREY = (128, 128, 128, 255)  # the agreement check composites both images on mid grey


class RasteriserMissingError(ImportError):
    """resvg-py, the SVG rasteriser of the hr/ copies, is not installed."""


@dataclass(frozen=True)
class IconSet:
    """One Iconify JSON package: ``svg(emoji_id)`` gives a square SVG document or a reason for none."""

    package: Package
    icons: dict
    aliases: dict
    chars: dict[str, str]
    width: float
    height: float

    @classmethod
    def read(cls, package: Package) -> IconSet:
        data = json.loads((package.root / "icons.json").read_text(encoding="utf-8"))
        chars = json.loads((package.root / "chars.json").read_text(encoding="utf-8"))
        return cls(package, data["icons"], data.get("aliases", {}), chars,
                   data.get("width", 16), data.get("height", 16))  # fmt: skip

    def svg(self, ident: str) -> tuple[str | None, str]:
        """(the SVG, "") or (None, why not) for an emoji id (lower-case code points joined by '-')."""
        bare = "-".join(p for p in ident.split("-") if p != "fe0f")  # chars.json has no VS16
        name = self.chars.get(ident) or self.chars.get(bare)
        if name is None:
            return None, f"no SVG in {self.package.name}"
        for _ in range(8):  # an alias names its parent (and may add a transform)
            if name not in self.aliases:
                break
            if any(k in self.aliases[name] for k in _TRANSFORMS):
                return None, f"{self.package.name}: {name} is a flipped/rotated alias"
            name = self.aliases[name]["parent"]
        icon = self.icons.get(name)
        if icon is None or any(icon.get(k) for k in _TRANSFORMS):
            return None, f"{self.package.name}: icon {name!r} missing or transformed"
        w, h = icon.get("width", self.width), icon.get("height", self.height)
        side = max(w, h)  # a narrow icon is centred in a square, as the PNGs centre it
        left, top = icon.get("left", 0) - (side - w) / 2, icon.get("top", 0) - (side - h) / 2
        return (
            '<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink" '
            f'viewBox="{left:g} {top:g} {side:g} {side:g}">{icon["body"]}</svg>'
        ), ""


def require_rasteriser() -> None:
    """Raise :class:`RasteriserMissingError` (saying what to install) where resvg-py is missing."""
    try:
        import resvg_py  # noqa: F401
    except ImportError as err:
        raise RasteriserMissingError(
            "the emoji hr/ copies need resvg-py: pip install 'rapiddiff[emoji-hr]' (or pass --no-hr-copies)"
        ) from err


def rasterise(svg: str, side: int) -> Image.Image:
    """An RGBA ``side``² rendering of a square SVG (resvg)."""
    require_rasteriser()
    import resvg_py

    png = bytes(resvg_py.svg_to_bytes(svg_string=svg, width=side, height=side))
    with Image.open(io.BytesIO(png)) as image:
        image = image.convert("RGBA")
    if image.size != (side, side):  # resvg keeps the aspect; the viewBox is square, so this is a guard
        image = image.resize((side, side), Image.Resampling.LANCZOS)
    return image


def _on_grey(image: Image.Image) -> np.ndarray:
    canvas = Image.new("RGBA", image.size, _GREY)
    canvas.alpha_composite(image.convert("RGBA"))
    return np.asarray(canvas.convert("RGB"), dtype=np.float64)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of two uint8-range arrays (inf where equal)."""
    mse = float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * float(np.log10(255**2 / mse))


def agreement(png: Image.Image, svg: str) -> tuple[float, float]:
    """How well an SVG matches a PNG, rendered at the PNG's size: (PSNR in dB with both on mid grey,
    IoU of their alpha > ½ masks). The same artwork reads 21–40 dB and IoU > 0.85; another revision
    of the design reads below 15 dB, or, where it is thin line art on little area (Noto's 🕸 is an
    octagon, its PNG a hexagon), a high PSNR but an IoU of 0.3–0.7."""
    drawn = rasterise(svg, png.width)
    a, b = np.asarray(png.convert("RGBA"))[..., 3] > 127, np.asarray(drawn)[..., 3] > 127
    iou = float((a & b).sum() / max(1, (a | b).sum()))
    return psnr(_on_grey(png), _on_grey(drawn)), iou


def license_text(package: Package) -> str:
    """The licence an Iconify package declares in info.json (these packages ship no licence file)."""
    info_path = package.root / "info.json"
    info = json.loads(info_path.read_text(encoding="utf-8")) if info_path.is_file() else {}
    lic, author = info.get("license", {}), info.get("author", {})
    return (
        f"{package.name} {package.version}: {info.get('name', '')} by {author.get('name', '?')} "
        f"({author.get('url', '')})\nLicence: {lic.get('title', '?')} (SPDX {lic.get('spdx', '?')}), "
        f"{lic.get('url', '')}\n"
    )


def vector_sets(packages: dict[str, Package]) -> dict[str, IconSet]:
    """Style → IconSet for the vector packages among ``packages``."""
    return {s: IconSet.read(packages[n]) for s, n in VECTOR_PACKAGES.items() if n in packages}
