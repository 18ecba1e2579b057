"""The standard FID InceptionV3, from a local weights file that is checked before use.

torch-fidelity (and torchmetrics, which uses torch-fidelity's network) downloads
``weights-inception-2015-12-05-6726825d.pth`` from GitHub when it is not given a path, and
unpickles whatever file it is given with ``torch.load(weights_only=False)``. Neither is
acceptable here: there is no network, and a weights file must never run code. So:

- the file comes from ``--inception-weights`` / ``$RAPIDDIFF_INCEPTION_WEIGHTS`` (or torch
  hub's cache, where torch-fidelity would have put it);
- it must be byte-for-byte the published file: its SHA-256 is checked. The ``6726825d`` in the
  name is torch hub's convention (``load_state_dict_from_url(check_hash=True)``): the first
  8 hex digits of the file's SHA-256. The same bytes are published by pytorch-fid as
  ``pt_inception-2015-12-05-6726825d.pth`` (its TF → PyTorch port of the 2015-12-05 graph);
  95,628,359 bytes;
- torch-fidelity's own ``torch.load`` runs with weights-only loading forced
  (``TORCH_FORCE_WEIGHTS_ONLY_LOAD``, PyTorch's switch for exactly this), so nothing but
  tensors is ever unpickled.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from rapiddiff.utils.io import UnsafeCheckpointError, file_sha256

if TYPE_CHECKING:
    import torch

INCEPTION_FILE = "weights-inception-2015-12-05-6726825d.pth"
# torch_fidelity.feature_extractor_inceptionv3.URL_INCEPTION_V3 (a test checks they agree).
INCEPTION_URL = "https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/weights-inception-2015-12-05-6726825d.pth"
INCEPTION_SHA256 = "6726825d0af5f729cebd5821db510b11b1cfad8faad88a03f1befd49fb9129b2"
INCEPTION_BYTES = 95_628_359
WEIGHTS_ENV = "RAPIDDIFF_INCEPTION_WEIGHTS"


class MissingInceptionWeightsError(FileNotFoundError):
    """The FID InceptionV3 weights are not on this machine; the message says how to get them."""


def missing_weights_message(looked_at: list[str]) -> str:
    places = "; ".join(looked_at) if looked_at else "nowhere (no path given)"
    return (
        f"FID needs the InceptionV3 weights file {INCEPTION_FILE} and none was found (looked at: {places}). "
        f"Download it on a machine with internet from {INCEPTION_URL} "
        f"(sha256 {INCEPTION_SHA256}, {INCEPTION_BYTES:,} bytes; the same file is published by pytorch-fid as "
        "pt_inception-2015-12-05-6726825d.pth), copy it here, and pass its path with --inception-weights PATH "
        f"or set {WEIGHTS_ENV}=PATH. "
        "Without it, `rapiddiff eval fid --extractor clip --clip-model DIR` gives the offline FID-CLIP variant "
        "(not comparable with published FID)."
    )


def resolve_inception_weights(path: str | Path | None = None) -> Path:
    """Find the weights file: ``path``, else ``$RAPIDDIFF_INCEPTION_WEIGHTS``, else torch hub's cache.

    Raises :class:`MissingInceptionWeightsError` (before anything else is done) when none exists.
    """
    candidates: list[tuple[str, Path]] = []
    if path:
        candidates.append(("--inception-weights", Path(path)))
    elif os.environ.get(WEIGHTS_ENV):
        candidates.append((f"${WEIGHTS_ENV}", Path(os.environ[WEIGHTS_ENV])))
    else:
        hub = Path(os.environ.get("TORCH_HOME", Path.home() / ".cache" / "torch")) / "hub" / "checkpoints"
        candidates.append(("torch hub cache", hub / INCEPTION_FILE))
    for _, candidate in candidates:
        if candidate.is_file():
            return candidate
    raise MissingInceptionWeightsError(missing_weights_message([f"{src} {p}" for src, p in candidates]))


def verify_weights(path: Path, expected_sha256: str | None = None) -> str:
    """Check the file's SHA-256 (default: the published file's); a mismatch is an error."""
    expected_sha256 = expected_sha256 or INCEPTION_SHA256
    actual = file_sha256(path)
    if actual != expected_sha256:
        raise ValueError(
            f"{path}: sha256 {actual} is not that of {INCEPTION_FILE} ({expected_sha256}); the file is "
            f"damaged or a different network. Download it again from {INCEPTION_URL}."
        )
    return actual


@contextlib.contextmanager
def _weights_only_loads() -> Iterator[None]:
    # PyTorch's own switch: every torch.load inside runs as weights_only=True, whatever its caller
    # asked for (torch-fidelity asks for weights_only=False).
    previous = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"]
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = previous


def load_inception(
    path: str | Path, *, device: torch.device | str = "cpu", expected_sha256: str | None = None
) -> torch.nn.Module:
    """torch-fidelity's ``FeatureExtractorInceptionV3`` ("inception-v3-compat", pool3 2048-d
    features) with the verified weights; input uint8 [B, 3, H, W], any H, W."""
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    path = Path(path)
    verify_weights(path, expected_sha256)
    try:
        with _weights_only_loads():
            model = FeatureExtractorInceptionV3(
                "inception-v3-compat", ["2048"], feature_extractor_weights_path=str(path)
            )
    except Exception as err:
        if "weights_only" in str(err) or "Unsupported global" in str(err):
            raise UnsafeCheckpointError(f"{path}: refused: it holds more than tensors ({err})") from err
        raise
    return model.to(device).eval()
