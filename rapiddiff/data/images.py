"""Decode one image of an image–caption table, whatever form it comes in, to 8-bit RGB.

An image cell may be a path (relative to the table's folder, or absolute), a base64 string
(standard or URL-safe alphabet, as Chinese-CLIP's ``*_imgs.tsv`` and EasyNLP ship them), raw
bytes (a parquet binary column), or ``{"bytes": ..., "path": ...}`` (a ``datasets`` Image
feature written to parquet). Every failure raises :class:`BadImageError` with a short reason,
which the loader records instead of stopping.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

_BASE64 = re.compile(r"^[A-Za-z0-9+/\-_\s]+=*\s*$")
# Modes that hold an alpha channel or transparency: composited onto white, as a viewer shows them.
_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")


class BadImageError(ValueError):
    """An image cell that cannot be turned into pixels; ``str(err)`` is the reason."""


def describe(value: Any) -> str:
    """A short, loggable description of an image cell (never the whole base64 string)."""
    if isinstance(value, dict):
        value = value.get("path") or value.get("bytes")
    if isinstance(value, (bytes, bytearray)):
        return f"<{len(value)} bytes>"
    if isinstance(value, str) and len(value) > 200:
        return f"<base64, {len(value)} chars>"
    return str(value)


def image_source(value: Any, base_dir: Path) -> Path | bytes:
    """Where the image's bytes are: a file path or the bytes themselves."""
    if value is None:
        raise BadImageError("no image (empty cell)")
    if isinstance(value, dict):  # datasets' Image feature as stored in parquet/arrow
        if value.get("bytes"):
            return bytes(value["bytes"])
        value = value.get("path")
        if not value:
            raise BadImageError("image struct has neither bytes nor path")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if not isinstance(value, str):
        raise BadImageError(f"image cell of type {type(value).__name__} is neither a path nor base64")
    text = value.strip()
    if not text:
        raise BadImageError("no image (empty cell)")
    if len(text) < 4096:  # longer than any path (PATH_MAX): must be base64
        path = Path(text).expanduser()
        path = path if path.is_absolute() else base_dir / path
        try:
            if path.is_file():
                return path
        except OSError:  # "file name too long" and the like: not a path
            pass
        if not _BASE64.match(text) or len(text) < 64:
            raise BadImageError(f"missing file {path}")
    elif not _BASE64.match(text[:4096]):
        raise BadImageError("image cell is neither a file path nor base64")
    return decode_base64(text)


def decode_base64(text: str) -> bytes:
    cleaned = re.sub(r"\s+", "", text).replace("-", "+").replace("_", "/")  # URL-safe → standard
    cleaned += "=" * (-len(cleaned) % 4)
    try:
        return base64.b64decode(cleaned, validate=True)
    except (binascii.Error, ValueError) as err:
        raise BadImageError(f"invalid base64 ({err})") from err


def open_image(source: Path | bytes, draft_size: int | None = None) -> Image.Image:
    """Open lazily (header only); raises :class:`BadImageError`.

    ``draft_size``: let libjpeg decode a JPEG at 1/2, 1/4 or 1/8 scale as long as both sides stay
    at least this large (DCT-domain scaling, as ``Image.thumbnail`` does): a 1600×1200 photo
    bound for 256² decodes ~4× faster, within ~1 grey level of full decoding + resizing.
    """
    try:
        image = Image.open(source if isinstance(source, Path) else io.BytesIO(source))
        if draft_size and image.format == "JPEG":
            image.draft(image.mode, (draft_size, draft_size))
        return image
    except UnidentifiedImageError as err:
        raise BadImageError("not an image file (unidentified format)") from err
    except Image.DecompressionBombError as err:
        raise BadImageError(f"image too large ({err})") from err
    except OSError as err:
        raise BadImageError(f"cannot open ({err})") from err


def to_rgb(image: Image.Image) -> Image.Image:
    """Decode fully, apply EXIF orientation, and convert any mode to 8-bit RGB.

    Alpha is composited onto white; 16/32-bit and float images are scaled into 0–255 (a plain
    ``convert("RGB")`` clips a 16-bit image to white); CMYK, YCbCr, palette and 1-bit go through
    Pillow's converters.
    """
    try:
        with warnings.catch_warnings():
            # Pillow warns about palette images with transparency; we handle it just below.
            warnings.simplefilter("ignore", UserWarning)
            image.load()
            if image.getexif().get(0x0112, 1) != 1:  # no copy when there is nothing to turn
                image = ImageOps.exif_transpose(image)
            if image.mode == "P" and "transparency" in image.info:
                image = image.convert("RGBA")
    except Image.DecompressionBombError as err:
        raise BadImageError(f"image too large ({err})") from err
    except (OSError, SyntaxError, ValueError) as err:
        # Truncated files raise OSError ("image file is truncated"), broken headers SyntaxError.
        raise BadImageError(f"corrupt or truncated image ({err})") from err
    mode = image.mode
    if mode == "RGB":
        return image
    if mode in _ALPHA_MODES:
        rgba = image.convert("RGBA")
        canvas = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(canvas, rgba).convert("RGB")
    if mode.startswith("I;16") or mode in ("I", "F"):
        array = np.asarray(image, dtype=np.float64)
        top = 65535.0 if mode.startswith("I;16") or array.max() > 255 else 255.0
        if array.max() > top:
            top = float(array.max())
        grey = np.clip(array / top * 255.0 + 0.5, 0, 255).astype(np.uint8)
        return Image.fromarray(grey, mode="L").convert("RGB")
    return image.convert("RGB")


def load_rgb(value: Any, base_dir: str | os.PathLike[str]) -> Image.Image:
    """An image cell → decoded 8-bit RGB PIL image (raises :class:`BadImageError`)."""
    return to_rgb(open_image(image_source(value, Path(base_dir))))
