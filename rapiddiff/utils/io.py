"""File I/O that loses nothing and runs no one else's code.

- Writes are atomic: a temporary file in the same folder, fsync, then ``os.replace``; a crash
  leaves either the old file or the new one, never half of one.
- Weights load from safetensors, or from ``.pth``/``.ckpt`` through
  ``torch.load(weights_only=True)`` only. A file that needs arbitrary unpickling is refused with
  :class:`UnsafeCheckpointError`, which says why and what to do.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from rapiddiff.utils.logging import get_logger

SAFETENSORS_SUFFIXES = (".safetensors",)
PICKLE_SUFFIXES = (".pth", ".pt", ".ckpt", ".bin")


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint would need arbitrary code to be unpickled; it is refused."""


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "wb", encoding: str | None = None) -> Iterator[IO[Any]]:
    """Open a temporary sibling of ``path`` for writing; move it into place on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    # mkstemp makes the file private (0600); a written file should get the usual umask mode.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    try:
        with os.fdopen(fd, mode, encoding=encoding) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_folder(path: str | Path) -> Iterator[Path]:
    """A temporary sibling folder of ``path`` to write into; on success it replaces ``path`` (a whole
    folder: a LoRA or ControlNet export), on failure it is removed and ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def removed_if_failed(folder: str | Path | None) -> Iterator[None]:
    """Remove ``folder`` if the block raises and the folder did not exist before it: a command
    that fails leaves no empty or half-written output folder behind."""
    if folder is None:
        yield
        return
    folder = Path(folder)
    existed = folder.exists()
    try:
        yield
    except BaseException:
        if not existed and folder.is_dir():
            import shutil

            shutil.rmtree(folder, ignore_errors=True)
        raise


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    """The SHA-256 of a file (hex), read in ``chunk``-byte blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def read_json_object(file: str | Path) -> dict[str, Any]:
    """A JSON object file (a folder's settings file); ``{}`` when it does not exist. Errors name it."""
    file = Path(file)
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{file}: not valid JSON ({err}); fix it or delete it") from err
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_open(path, "wb") as handle:
        handle.write(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


# safetensors' dtype names (its format spec), for the streamed writer below.
_SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}  # fmt: skip


def save_safetensors(
    tensors: Mapping[str, Any], path: str | Path, metadata: dict[str, str] | None = None
) -> None:
    """Save a flat name → tensor mapping as safetensors, atomically (tensors made contiguous).

    Streamed: the header, then each tensor's bytes straight from its memory. safetensors' own
    ``save`` (and ``save_file``) first copy every tensor to ``bytes`` (``save`` the whole file
    too): 8 GB beside a 16 M × 64 KnowledgeStore table, which stopped its save on a 24 GiB machine.
    The bytes are the format's (8-byte little-endian header length, JSON header padded with
    spaces, raw little-endian data in offset order); ``safetensors.torch.load_file`` reads them.
    """
    import struct
    import sys

    import torch

    if sys.byteorder != "little":  # safetensors' data is little-endian; so is every machine we run on
        raise RuntimeError("save_safetensors writes raw little-endian bytes: not on a big-endian machine")
    if metadata is not None and not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"safetensors metadata values must be strings: {metadata}")
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    parts: list[torch.Tensor] = []
    offset = 0
    for name, tensor in tensors.items():
        t = tensor.detach().cpu().contiguous()
        dtype = _SAFETENSORS_DTYPES.get(str(t.dtype).removeprefix("torch."))
        if dtype is None:
            raise ValueError(
                f"{Path(path).name}: tensor {name!r} has dtype {t.dtype}, which safetensors cannot hold"
            )
        size = t.numel() * t.element_size()
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        parts.append(t)
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with atomic_open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(text)))
        handle.write(text)
        for t in parts:
            if t.numel():
                handle.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


def torch_load_tensors(path: str | Path, **kwargs: Any) -> Any:
    """``torch.load(weights_only=True)`` without torch's "Detected pickle protocol 4" warning: its
    restricted unpickler reads protocol 4 (what ``pickle``'s default writes) and refuses whatever it
    cannot, so the warning only adds noise to every load of such a file."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected pickle protocol")
        return torch.load(str(path), weights_only=True, **kwargs)


def load_weights(path: str | Path, device: str = "cpu") -> dict[str, Any]:
    """Load a state dict from safetensors or a weights-only torch pickle; never run code.

    Raises :class:`FileNotFoundError` for a missing file and :class:`UnsafeCheckpointError` for
    a pickle that holds anything but tensors and plain containers.
    """

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file not found: {path}")
    if path.suffix in SAFETENSORS_SUFFIXES:
        from safetensors.torch import load_file

        try:
            return load_file(str(path), device=device)
        except Exception as err:  # safetensors raises its own SafetensorError for bad headers
            raise ValueError(f"{path}: not a valid safetensors file ({err})") from err
    try:
        state = torch_load_tensors(path, map_location=device)
    except Exception as err:
        if isinstance(err, FileNotFoundError):
            raise
        text = str(err)
        if "Weights only load failed" in text or "Unsupported global" in text or "weights_only" in text:
            raise UnsafeCheckpointError(
                f"{path}: refused: loading it would unpickle arbitrary Python objects, which can run "
                "code. Re-save it as safetensors from a trusted environment "
                "(safetensors.torch.save_file(state_dict, 'model.safetensors')), or as a plain "
                "state dict of tensors."
            ) from err
        raise ValueError(f"{path}: could not read weights ({err})") from err
    if not isinstance(state, dict):
        raise ValueError(
            f"{path}: expected a state dict (a mapping of names to tensors), got {type(state).__name__}"
        )
    return state


# ----------------------------------------------------------------------------- text files
class TextEncodingError(ValueError):
    """A text file that is neither UTF-8 nor unambiguous GB18030; the message names file and line."""


# Byte-order marks, longest first (the UTF-32 LE mark begins with the UTF-16 LE one).
_BOMS = (
    (b"\xff\xfe\x00\x00", "utf-32-le"),
    (b"\x00\x00\xfe\xff", "utf-32-be"),
    (b"\xef\xbb\xbf", "utf-8"),
    (b"\xff\xfe", "utf-16-le"),
    (b"\xfe\xff", "utf-16-be"),
    (b"\x84\x31\x95\x33", "gb18030"),
)


def _looks_chinese(text: str) -> bool:
    """Whether the non-ASCII characters of ``text`` are those of everyday Chinese writing.

    GB18030 decodes many byte sequences that were never GB18030 (UTF-8 or Latin-1 bytes decode
    to rare ideographs from its extensions), so a GB18030 reading is accepted only when at least
    90 % of its non-ASCII characters are in GB2312 — the 6,763 common hanzi and the CJK
    punctuation (，。“”《》·) that modern Chinese text is written with.
    """
    foreign = [c for c in text if ord(c) > 0x7F]
    if not foreign:
        return True
    common = 0
    for c in foreign:
        try:
            c.encode("gb2312")
            common += 1
        except UnicodeEncodeError:
            pass
    return common >= 0.9 * len(foreign)


def decode_text(data: bytes, path: str | Path) -> tuple[str, str]:
    """(text, encoding) of a text file's bytes: a byte-order mark decides; else UTF-8; else GB18030
    when it decodes strictly to Chinese text. Otherwise :class:`TextEncodingError` names the file,
    the first line that is not UTF-8, and the fix."""
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            try:
                return data[len(bom) :].decode(encoding), encoding
            except UnicodeDecodeError as err:
                line = data[: len(bom) + err.start].count(b"\n") + 1 if encoding == "utf-8" else None
                where = f"{path}:{line}" if line else str(path)
                raise TextEncodingError(
                    f"{where}: starts with a {encoding} byte-order mark but is not valid {encoding} "
                    f"({err.reason}); save it again as UTF-8"
                ) from err
    try:
        return data.decode("utf-8"), "utf-8"
    except UnicodeDecodeError as err:
        utf8_error = err
    try:
        text = data.decode("gb18030")
    except UnicodeDecodeError:
        text = None
    if text is not None and _looks_chinese(text):
        return text, "gb18030"
    start = data.rfind(b"\n", 0, utf8_error.start) + 1
    line = data.count(b"\n", 0, utf8_error.start) + 1
    byte = data[utf8_error.start : utf8_error.start + 1]
    raise TextEncodingError(
        f"{path}:{line}: not valid UTF-8 (byte {byte!r} at column {utf8_error.start - start + 1}), "
        "nor Chinese text in GB18030/GBK; save the file as UTF-8, e.g. "
        f"iconv -f <its encoding> -t UTF-8 {Path(path).name} > {Path(path).stem}.utf8{Path(path).suffix}"
    )


def read_text_lines(path: str | Path, *, what: str = "text") -> list[tuple[int, str]]:
    """(1-based line number, line) for every non-blank line of a text file, line endings removed.

    Encodings as :func:`decode_text` reads them (UTF-8 with or without a BOM, UTF-16/32 with a
    BOM, or GB18030/GBK Chinese text), so a prompt file saved by a Chinese Windows editor is read
    as written and any other non-UTF-8 file is refused with its file and line.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} file not found: {path}")
    text, encoding = decode_text(path.read_bytes(), path)
    if encoding == "gb18030":
        get_logger(__name__).info("%s: not UTF-8; read as GB18030 (Chinese text)", path)
    # splitlines() would also split on U+2028, U+001C... that may sit inside a line of text.
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return [(number, line) for number, line in enumerate(lines, start=1) if line.strip()]


def jsonl_text(rows: list[dict[str, Any]]) -> str:
    """Rows as JSON Lines, non-ASCII text kept readable."""
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def prepare_output_folder(out: Path, owned: tuple[str, ...], overwrite: bool, what: str) -> None:
    """Create ``out``; a non-empty one is refused unless ``overwrite``, which removes only the files
    and folders a generator ``owned`` (``what`` names the generator in the error)."""
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(
                f"{out} is not empty; choose a new --out folder, or pass --overwrite to replace the "
                f"{what} files in it"
            )
        for name in owned:
            target = out / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    out.mkdir(parents=True, exist_ok=True)
