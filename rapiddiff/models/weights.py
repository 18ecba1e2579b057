"""Why a weight file does not load, in words a user can act on.

diffusers, transformers and Lightning report a bad weight file as "Unable to load weights" or as a
torch traceback that suggests ``weights_only=False`` (which would run the file's code). The two
common causes are told apart here, by reading the file itself:

- **truncated**: a safetensors file shorter than its header says, or a torch zip archive without
  its central directory (an interrupted download or copy) → copy or download it again;
- **a pickle that would run code**: a torch file whose pickle names Python callables beyond
  tensors and plain containers → it is refused; get a safetensors copy from its source.

:func:`check_weights_file` raises :class:`TruncatedWeightsError` or
:class:`~rapiddiff.utils.io.UnsafeCheckpointError`; :func:`diagnose` is the same check after a
loader has failed (it returns the error to show, or None when the file itself is fine).
"""

from __future__ import annotations

import contextlib
import json
import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path

from rapiddiff.utils.io import UnsafeCheckpointError, torch_load_tensors

PICKLE_FIX = (
    "rapiddiff loads only tensors (safetensors, or torch files that hold nothing but tensors), so "
    "nothing in a downloaded file can run. Get a .safetensors copy of these weights from their "
    "source; a file you made yourself: re-save its state dict with safetensors.torch.save_file."
)


class TruncatedWeightsError(ValueError):
    """A weight file is shorter than its own header says (an interrupted download or copy)."""


def check_weights_file(path: str | Path, label: str | None = None, *, unpickle: bool = True) -> None:
    """Raise a clear error if ``path`` is truncated or is a pickle that would run code.

    ``label`` names the file in the message (default: its path), e.g. ``"--ckpt_path X"`` or
    ``"model folder M: unet/diffusion_pytorch_model.bin"``. Reads the header (safetensors) or the
    archive index (torch zip), and for torch files unpickles with ``weights_only=True`` (which
    runs nothing); ``unpickle=False`` checks the structure only (cheap for a large checkpoint whose
    loader unpickles it anyway: see :func:`is_unsafe_pickle_error`).
    """
    path = Path(path)
    label = label or str(path)
    if not path.is_file():
        raise FileNotFoundError(f"{label}: file not found")
    size = path.stat().st_size
    with path.open("rb") as handle:
        head = handle.read(8)
    if path.suffix == ".safetensors":
        _check_safetensors(path, size, label)
        return
    if head[:4] == b"PK\x03\x04":  # torch.save's zip format (the default since torch 1.6)
        try:
            with zipfile.ZipFile(path):
                pass
        except zipfile.BadZipFile as err:
            raise TruncatedWeightsError(
                f"{label}: truncated or damaged ({size:,} bytes; its zip index is missing: {err}). "
                "It was probably cut short by an interrupted download, copy or save: copy or download "
                "it again (a checkpoint: resume from an earlier one)."
            ) from err
    elif size == 0:
        raise TruncatedWeightsError(f"{label}: the file is empty (0 bytes): copy or download it again")
    if unpickle:
        _check_pickle(path, label)


def unsafe_pickle_error(label: str, err: BaseException) -> UnsafeCheckpointError:
    """The refusal to show for torch's weights-only ``UnpicklingError`` ``err`` on file ``label``."""
    names = _unsafe_globals(str(err))
    return UnsafeCheckpointError(
        f"{label}: refused: it is a pickle that would run code when loaded"
        f"{f' (it calls {names})' if names else ''}. {PICKLE_FIX}"
    )


def diagnose(path: str | Path, label: str | None = None) -> Exception | None:
    """After a loader failed on ``path``: the truncated/unsafe error to show instead, or None when
    the file itself reads fine (the loader's own message is then the one to show)."""
    try:
        check_weights_file(path, label)
    except (TruncatedWeightsError, UnsafeCheckpointError, FileNotFoundError) as found:
        return found
    except ValueError:
        return None
    return None


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")


@contextlib.contextmanager
def explained(path: str | Path, label: str) -> Iterator[None]:
    """Run a library's loader on ``path`` (a weights file or a folder of them); where it fails
    because a file is truncated or a pickle that would run code, raise that, naming the file."""
    try:
        yield
    except Exception as err:  # transformers / diffusers raise many types for a bad file
        path = Path(path)
        files = sorted(p for p in path.rglob("*") if p.suffix in WEIGHT_SUFFIXES) if path.is_dir() else [path]
        for file in files:
            reason = diagnose(file, f"{label}: {file}")
            if reason is not None:
                raise reason from err
        raise


def is_unsafe_pickle_error(err: BaseException) -> bool:
    """True for torch's refusal to unpickle a non-tensor object under ``weights_only=True``."""
    text = str(err)
    return "Weights only load failed" in text or "Unsupported global" in text


def _check_safetensors(path: Path, size: int, label: str) -> None:
    def truncated(detail: str) -> TruncatedWeightsError:
        return TruncatedWeightsError(
            f"{label}: truncated: {detail}. It was probably cut short by an interrupted download or "
            "copy: copy or download it again."
        )

    if size < 8:
        raise truncated(f"{size} bytes, shorter than the 8-byte header length")
    with path.open("rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        if handle.read(1) != b"{":  # the JSON header: anything else is not safetensors at all
            raise ValueError(f"{label}: not a safetensors file (no JSON header)")
        handle.seek(8)
        if 8 + header_len > size:
            raise truncated(f"{size:,} bytes, but its header alone is {header_len:,}")
        try:
            header = json.loads(handle.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{label}: not a safetensors file (its header is not JSON: {err})") from err
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and "data_offsets" in v]
    expected = 8 + header_len + max(ends, default=0)
    if size < expected:
        raise truncated(f"{size:,} bytes, but its header says {expected:,}")


def _check_pickle(path: Path, label: str) -> None:
    import pickle

    try:
        torch_load_tensors(path, map_location="cpu", mmap=False)
    except pickle.UnpicklingError as err:
        if not is_unsafe_pickle_error(err):
            raise ValueError(f"{label}: not a readable torch file ({err})") from err
        raise unsafe_pickle_error(label, err) from err
    except (RuntimeError, EOFError) as err:
        text = str(err)
        if "central directory" in text or "EOF" in text or isinstance(err, EOFError):
            raise TruncatedWeightsError(
                f"{label}: truncated or damaged ({err}): copy or download it again"
            ) from err
        raise ValueError(f"{label}: not a readable torch file ({err})") from err


def _unsafe_globals(text: str) -> str:
    """The ``module.name`` torch's weights-only unpickler refused, from its message."""
    import re

    found = re.findall(r"Unsupported global: GLOBAL ([\w.]+)", text)
    found += re.findall(r"Trying to call reduce for ([\w.]+)", text)
    return ", ".join(dict.fromkeys(found))
