"""File I/O that loses nothing and runs no one else's code.

- Writes are atomic: a temporary file in the same folder, fsync, then ``os.replace``; a crash
  leaves either the old file or the new one, never half of one.
- Weights load from safetensors, or from ``.pth``/``.ckpt`` through
  ``torch.load(weights_only=True)`` only. A file that needs arbitrary unpickling is refused with
  :class:`UnsafeCheckpointError`, which says why and what to do.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

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


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_open(path, "wb") as handle:
        handle.write(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


def save_safetensors(
    tensors: Mapping[str, Any], path: str | Path, metadata: dict[str, str] | None = None
) -> None:
    """Save a flat name → tensor mapping as safetensors, atomically (tensors made contiguous)."""
    from safetensors.torch import save

    data = save({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, metadata=metadata)
    atomic_write_bytes(path, data)


def load_weights(path: str | Path, device: str = "cpu") -> dict[str, Any]:
    """Load a state dict from safetensors or a weights-only torch pickle; never run code.

    Raises :class:`FileNotFoundError` for a missing file and :class:`UnsafeCheckpointError` for
    a pickle that holds anything but tensors and plain containers.
    """
    import torch

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
        state = torch.load(str(path), map_location=device, weights_only=True)
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
