"""PNG files that carry how they were made, so any image can be regenerated.

Each setting is an iTXt chunk of its own (UTF-8, so Chinese prompts survive; any PNG viewer
shows them), and the chunk ``rapiddiff`` holds all of them as one JSON object with their types,
which :func:`read_png_metadata` prefers. :func:`generation_kwargs` turns what was read back into
``RapidDiffusionPipeline.__call__`` arguments.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rapiddiff.models.sampling import SamplingDefaults
from rapiddiff.utils.io import atomic_open

if TYPE_CHECKING:
    from PIL import Image

JSON_KEY = "rapiddiff"
# Settings whose text chunks are parsed back to numbers / booleans when the JSON chunk is absent.
_INTS = ("seed", "steps", "height", "width")
_FLOATS = ("guidance", "eta", "strength")
_BOOLS = ("knowledge", "upscale")


def save_png(image: Image.Image, path: str | Path, metadata: dict[str, Any]) -> Path:
    """Write ``image`` as PNG with ``metadata`` in text chunks (atomically); returns the path."""
    path = Path(path)
    with atomic_open(path, "wb") as handle:
        handle.write(png_bytes(image, metadata))
    make_readable(path)
    return path


def png_bytes(image: Image.Image, metadata: dict[str, Any]) -> bytes:
    """The PNG :func:`save_png` writes, in memory (the server answers with it, no file between)."""
    from PIL.PngImagePlugin import PngInfo

    from rapiddiff import __version__

    meta = {**metadata, "rapiddiff_version": metadata.get("rapiddiff_version", __version__)}
    info = PngInfo()
    for key, value in meta.items():
        if value is None:
            continue
        text = json.dumps(value) if isinstance(value, bool) else str(value)
        info.add_itxt(key, text)
    info.add_itxt(JSON_KEY, json.dumps(meta, ensure_ascii=False, sort_keys=True))
    if "prompt" in meta and "seed" in meta:
        info.add_itxt("parameters", _webui_parameters(meta))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", pnginfo=info)
    return buffer.getvalue()


def make_readable(path: Path) -> None:
    """Give the file the mode a plain ``open(..., "w")`` would (atomic writes start as 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _webui_parameters(meta: dict[str, Any]) -> str:
    """The one-chunk summary that Stable Diffusion web UIs write, so their PNG readers show ours too."""
    fields = [
        ("Steps", meta.get("steps")),
        ("Sampler", meta.get("scheduler")),
        ("CFG scale", meta.get("guidance")),
        ("Seed", meta.get("seed")),
        ("Size", f"{meta['width']}x{meta['height']}" if "width" in meta and "height" in meta else None),
        ("Model", meta.get("model")),
    ]
    lines = [str(meta["prompt"])]
    if meta.get("negative_prompt"):
        lines.append(f"Negative prompt: {meta['negative_prompt']}")
    lines.append(", ".join(f"{k}: {v}" for k, v in fields if v is not None))
    return "\n".join(lines)


def read_png_metadata(path: str | Path) -> dict[str, Any]:
    """The settings a PNG was made with (empty dict for a PNG without them)."""
    from PIL import Image, UnidentifiedImageError

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"image not found: {path}")
    try:
        with Image.open(path) as image:
            image.load()
            chunks = dict(getattr(image, "text", {}) or {})
    except UnidentifiedImageError as err:
        raise ValueError(f"{path}: not an image file PIL can read") from err
    if JSON_KEY in chunks:
        try:
            return json.loads(chunks[JSON_KEY])
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: its '{JSON_KEY}' text chunk is not valid JSON ({err})") from err
    meta: dict[str, Any] = {}
    for key, text in chunks.items():
        if key == "parameters":
            continue  # the web-UI summary repeats the chunks above
        try:
            if key in _INTS:
                meta[key] = int(text)
            elif key in _FLOATS:
                meta[key] = float(text)
            elif key in _BOOLS:
                meta[key] = text.strip().lower() in ("true", "1", "yes")
            else:
                meta[key] = text
        except ValueError as err:
            raise ValueError(f"{path}: text chunk {key}={text!r} is not a valid {key}") from err
    return meta


def generation_kwargs(meta: dict[str, Any], where: str | Path = "the image") -> dict[str, Any]:
    """PNG metadata → ``RapidDiffusionPipeline.__call__`` keyword arguments that remake the image.

    An img2img / inpainting image names its init image and mask by path and sha256: a file that
    is missing or has changed since is refused (the image could not be remade from it).
    """
    missing = [k for k in ("prompt", "seed", "steps", "guidance") if k not in meta]
    if missing:
        raise ValueError(
            f"the image's metadata lacks {', '.join(missing)}: it was not written by rapiddiff generate"
        )
    kwargs: dict[str, Any] = {
        "prompt": meta["prompt"],
        "negative_prompt": meta.get("negative_prompt") or None,
        "seed": int(meta["seed"]),
        "num_inference_steps": int(meta["steps"]),
        "guidance_scale": float(meta["guidance"]),
        # Only images from before the sampler was recorded lack it: those used the library default.
        "scheduler": meta.get("scheduler", SamplingDefaults().scheduler),
        # a mode ("text", "both") when the image recorded one, else on/off
        "knowledge": meta["knowledge_mode"]
        if meta.get("knowledge") and meta.get("knowledge_mode")
        else bool(meta.get("knowledge", True)),
        "upscale": bool(meta.get("upscale", False)),
    }
    for key in ("height", "width"):
        if key in meta:
            kwargs[key] = int(meta[key])
    if meta.get("eta"):
        kwargs["eta"] = float(meta["eta"])
    for key, arg in (("init_image", "init_image"), ("mask", "mask_image")):
        if key in meta or f"{key}_sha256" in meta:
            kwargs[arg] = _checked_source(meta, key, where)
    if "strength" in meta:
        kwargs["strength"] = float(meta["strength"])
    # Recorded only when on; an image without it was made with plain guidance.
    kwargs["guidance_rescale"] = float(meta.get("guidance_rescale", 0.0))
    if meta.get("deep_cache"):  # an approximate image is remade with the same approximation
        kwargs["deep_cache"] = int(meta["deep_cache"])
    if meta.get("token_merge"):
        kwargs["token_merge"] = float(meta["token_merge"])
    if meta.get("control"):
        kwargs["control"] = _control_specs(meta["control"], where)
    return kwargs


def recorded_model(meta: dict[str, Any]) -> str | None:
    """The model an image names: ``builtin:NAME`` for a built-in model (found by name, whatever the
    default is now and wherever the package is installed), else its folder's absolute path."""
    from rapiddiff.models.builtin import is_builtin_spec

    model, path = meta.get("model"), meta.get("model_path")
    if is_builtin_spec(model):
        return str(model)
    # Images from before the built-in models had names: the one built-in then lived in assets/model.
    if path and Path(path).parts[-3:] == ("rapiddiff", "assets", "model"):
        return "builtin:kshapes"
    return path


def _control_specs(items: Any, where: str | Path) -> list[Any]:
    """The recorded ControlNet inputs → ControlSpecs, each control image checked as an init image is."""
    from rapiddiff.models.controlnet import ControlSpec

    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise ValueError(f"{where}: its 'control' setting is not a list of objects")
    specs = []
    for k, item in enumerate(items):
        what = f"control image {k + 1}" if len(items) > 1 else "control image"
        path = _checked_file(item.get("image"), item.get("image_sha256"), what, "--control-image", where)
        specs.append(
            ControlSpec(
                path,
                controlnet_conditioning_scale=float(item.get("scale", 1.0)),
                control_guidance_start=float(item.get("start", 0.0)),
                control_guidance_end=float(item.get("end", 1.0)),
            )
        )
    return specs


def _checked_source(meta: dict[str, Any], key: str, where: str | Path) -> str:
    """The recorded init image / mask path, if the file is still the one the image was made from."""
    flag = "--init-image" if key == "init_image" else "--mask"
    return _checked_file(meta.get(key), meta.get(f"{key}_sha256"), key.replace("_", " "), flag, where)


def _checked_file(path: str | None, digest: str | None, what: str, flag: str, where: str | Path) -> str:
    """``path`` if it is still the file (by sha256) an image was made from; else an error naming ``flag``."""
    from rapiddiff.utils.io import file_sha256

    if not path:
        raise ValueError(
            f"{where}: made from an in-memory {what} (no file recorded); give the file with {flag}"
        )
    if not Path(path).is_file():
        raise FileNotFoundError(
            f"{where}: its {what} {path} is missing; restore it or give another with {flag}"
        )
    if digest and file_sha256(path) != digest:
        raise ValueError(
            f"{where}: its {what} {path} has changed since (sha256 differs); "
            f"the image cannot be remade from it — restore the file or give one with {flag}"
        )
    return str(path)
