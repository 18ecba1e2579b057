"""Device and dtype from user strings, with errors that list the choices."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "float16", "bfloat16")
_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16", "float": "float32"}


def resolve_dtype(name: str | None, device: torch.device | str | None = None) -> torch.dtype:
    """``None``/"auto" → float16 on CUDA, float32 elsewhere; unknown names list the choices."""
    import torch

    if name is None or name == "auto":
        dev = torch.device(device) if device is not None else torch.device("cpu")
        return torch.float16 if dev.type == "cuda" else torch.float32
    key = _ALIASES.get(name, name)
    if key not in DTYPES:
        raise ValueError(
            f"unknown dtype '{name}'; choose one of: auto, {', '.join(DTYPES)} (or fp32, fp16, bf16)"
        )
    return getattr(torch, key)


def resolve_device(name: str | None = None) -> torch.device:
    """``None``/"auto" → cuda if available, else cpu; a CUDA request without CUDA is an error."""
    import torch

    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"unknown device '{name}'; use auto, cpu, cuda or cuda:N") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device '{name}' requested but CUDA is not available here; use --device cpu")
    return device
