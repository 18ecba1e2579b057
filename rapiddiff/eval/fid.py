"""``rapiddiff eval fid``: Fréchet distance between the features of two image folders.

- Standard FID: torch-fidelity's InceptionV3 ("inception-v3-compat", pool3, 2048-d), the
  network of the original TTUR code, with its TensorFlow-1.x-exact bilinear resize to 299².
  Its weights come from a local, SHA-256-checked file (:mod:`rapiddiff.eval.inception`).
- Offline variant: any callable images → features, e.g. the project's own CLIP image tower
  (``--extractor clip``). Its number is labelled ``FID-CLIP(rapiddiff image tower)``, never
  plain "FID": it is not comparable with published FID.

Statistics are float64 (mean, covariance with ddof = 1, as torch-fidelity, torchmetrics and
pytorch-fid compute them); the distance is torch-fidelity's ``fid_statistics_to_metric``,
which takes Tr √(Σ₁Σ₂) as the sum of square roots of the eigenvalues of Σ₁Σ₂ (the eigenvalue
method; torchmetrics does the same, pytorch-fid uses ``scipy.linalg.sqrtm``; tests check all three
agree to 1e-6).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rapiddiff.eval.common import (
    add_device_arguments,
    default_metric_path,
    list_images,
    metric_record,
    uint8_batches,
    write_json,
)
from rapiddiff.eval.inception import INCEPTION_FILE, load_inception, resolve_inception_weights
from rapiddiff.utils.device import resolve_device
from rapiddiff.utils.logging import get_logger

if TYPE_CHECKING:
    import numpy as np
    import torch

# Modules that load torch, numpy or PIL are imported inside the functions that use them:
# `rapiddiff eval --help` imports every eval module.

log = get_logger(__name__)

MIN_RELIABLE_IMAGES = 2048  # below the feature width, Σ is rank-deficient and FID is biased upwards
STATISTICS_METHOD = (
    "float64 mean and covariance (ddof=1); Tr sqrt(S1 S2) by the eigenvalue method "
    "(torch_fidelity.metric_fid.fid_statistics_to_metric)"
)


@dataclass
class FeatureExtractor:
    """Images → features, plus what a reader of the number must know about it.

    ``fn`` takes a uint8 tensor [B, 3, H, W] (any H, W) and returns features [B, D].
    """

    fn: Callable[[torch.Tensor], torch.Tensor]
    label: str  # the metric's name in tables: "FID" only for the standard InceptionV3
    extractor: str  # which network, which layer
    resize: str  # how images reach the network's input size
    library: str
    extra: dict[str, Any] = field(default_factory=dict)


def feature_statistics(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(μ, Σ) of features [N, D] in float64; Σ unbiased (ddof = 1)."""
    import numpy as np

    x = np.asarray(features, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 2:
        raise ValueError(f"need features [N >= 2, D], got shape {x.shape}")
    return x.mean(axis=0), np.cov(x, rowvar=False, ddof=1)


def frechet_distance(mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray) -> float:
    """‖μ₁ − μ₂‖² + Tr(Σ₁ + Σ₂ − 2 √(Σ₁Σ₂)), in float64, through torch-fidelity."""
    import numpy as np
    from torch_fidelity.metric_fid import KEY_METRIC_FID, fid_statistics_to_metric

    stats = [
        {"mu": np.asarray(mu, dtype=np.float64), "sigma": np.atleast_2d(np.asarray(s, dtype=np.float64))}
        for mu, s in ((mu1, sigma1), (mu2, sigma2))
    ]
    return float(fid_statistics_to_metric(stats[0], stats[1], verbose=False)[KEY_METRIC_FID])


def fid_from_features(real: np.ndarray, fake: np.ndarray) -> float:
    return frechet_distance(*feature_statistics(real), *feature_statistics(fake))


def extract_features(
    paths: Sequence[Path], extractor: FeatureExtractor, *, batch_size: int = 50, desc: str = "features"
) -> np.ndarray:
    """Features [N, D] (float64) of the image files, batch by batch, with a progress bar."""
    import numpy as np
    import torch
    from tqdm.auto import tqdm

    chunks = []
    with torch.inference_mode(), tqdm(total=len(paths), desc=desc, unit="img", leave=False) as bar:
        for files, batch in uint8_batches(paths, batch_size):
            feats = extractor.fn(batch)
            chunks.append(feats.detach().to("cpu", torch.float64).reshape(len(files), -1).numpy())
            bar.update(len(files))
    return np.concatenate(chunks)


def compute_fid(
    real: str | Path | Sequence[Path],
    fake: str | Path | Sequence[Path],
    extractor: FeatureExtractor,
    *,
    batch_size: int = 50,
) -> dict[str, Any]:
    """FID between two image folders (or file lists) → a metric record (see ``metric_record``)."""
    real_files = [Path(p) for p in real] if isinstance(real, (list, tuple)) else list_images(real)
    fake_files = [Path(p) for p in fake] if isinstance(fake, (list, tuple)) else list_images(fake)
    for name, files in (("real", real_files), ("fake", fake_files)):
        if len(files) < 2:
            raise ValueError(f"FID needs at least 2 {name} images, got {len(files)}")
    warnings = []
    smallest = min(len(real_files), len(fake_files))
    if smallest < MIN_RELIABLE_IMAGES:
        warnings.append(
            f"only {smallest} images in the smaller set (< {MIN_RELIABLE_IMAGES}): FID is biased upwards and "
            "noisy at this size; compare only numbers computed on the same number of images"
        )
        log.warning(warnings[-1])
    real_feats = extract_features(real_files, extractor, batch_size=batch_size, desc="real")
    fake_feats = extract_features(fake_files, extractor, batch_size=batch_size, desc="fake")
    value = fid_from_features(real_feats, fake_feats)
    if not math.isfinite(value):
        raise RuntimeError(f"{extractor.label} is not finite ({value}); the features contain NaN or Inf")
    details = {
        "library": extractor.library,
        "extractor": extractor.extractor,
        "resize": extractor.resize,
        "statistics": STATISTICS_METHOD,
        "feature_dim": int(real_feats.shape[1]),
        "n_real": len(real_files),
        "n_fake": len(fake_files),
        "real": str(real_files[0].parent),
        "fake": str(fake_files[0].parent),
        **extractor.extra,
    }
    return metric_record("fid", extractor.label, value, details=details, warnings=warnings)


# --- extractors ---------------------------------------------------------------------------------


def inception_extractor(
    weights: str | Path, *, device: torch.device | str = "cpu", **kwargs: Any
) -> FeatureExtractor:
    """The standard FID extractor (weights must already be resolved: see ``resolve_inception_weights``)."""
    import torch_fidelity

    model = load_inception(weights, device=device, **kwargs)

    def fn(images: torch.Tensor) -> torch.Tensor:
        (features,) = model(images.to(device))
        return features

    return FeatureExtractor(
        fn=fn,
        label="FID",
        extractor=f"InceptionV3 pool3 (2048-d), TF 2015-12-05 weights ({INCEPTION_FILE}, sha256 verified)",
        resize="bilinear to 299x299 inside the network, TensorFlow-1.x exact (torch-fidelity inception-v3-compat)",
        library=f"torch-fidelity {torch_fidelity.__version__}",
        extra={"weights": str(weights)},
    )


def clip_extractor(
    clip: Any, *, device: torch.device | str = "cpu", name: str = "rapiddiff image tower"
) -> FeatureExtractor:
    """FID-CLIP: features of the project's KnowledgeCLIP image tower (``encode_image``).

    ``clip`` is a KnowledgeCLIP (or anything with ``encode_image(pixels in [-1, 1])``).
    """
    import torch

    def fn(images: torch.Tensor) -> torch.Tensor:
        pixels = images.to(device, torch.float32) / 127.5 - 1.0  # uint8 → [-1, 1], the contract's range
        return clip.encode_image(pixels)

    size = getattr(clip, "image_size", "?")
    return FeatureExtractor(
        fn=fn,
        label=f"FID-CLIP({name})",
        extractor=f"KnowledgeCLIP.encode_image ({name}), L2-normalised embeddings",
        resize=f"KnowledgeCLIP's own preprocessing to {size}x{size}",
        library="rapiddiff (features) + torch-fidelity (distance)",
    )


def callable_extractor(fn: Callable[[torch.Tensor], torch.Tensor], name: str) -> FeatureExtractor:
    """Any images → features callable; labelled ``FID-<name>`` so it is never mistaken for FID."""
    return FeatureExtractor(
        fn=fn,
        label=f"FID-{name}",
        extractor=name,
        resize="the callable's own",
        library="rapiddiff + torch-fidelity",
    )


# --- CLI ----------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Fréchet distance between the features of two image folders. Default: standard FID "
        "(torch-fidelity InceptionV3, weights from a local sha256-checked file). "
        "--extractor clip: the offline FID-CLIP variant on rapiddiff's own CLIP image tower, "
        "labelled as such. Writes a JSON record with the number, the library, the resize mode and the extractor."
    )
    parser.add_argument(
        "--real", required=True, type=Path, help="folder of reference images (or an eval run)"
    )
    parser.add_argument(
        "--fake", required=True, type=Path, help="folder of generated images (or an eval run)"
    )
    parser.add_argument(
        "--extractor",
        choices=("inception", "clip"),
        default="inception",
        help="feature network (default: inception)",
    )
    parser.add_argument(
        "--inception-weights",
        type=Path,
        help="path to weights-inception-2015-12-05-6726825d.pth (default: $RAPIDDIFF_INCEPTION_WEIGHTS)",
    )
    parser.add_argument("--clip-model", type=Path, help="KnowledgeCLIP folder, for --extractor clip")
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument(
        "--out", type=Path, help="JSON result (default: FAKE/metrics/fid.json for a run, else FAKE.fid.json)"
    )
    add_device_arguments(parser, dtype=False)  # features in float32, statistics in float64


def run(args: argparse.Namespace) -> int:

    # Everything that can fail without touching an image fails first: weights, folders, models.
    weights = resolve_inception_weights(args.inception_weights) if args.extractor == "inception" else None
    if args.extractor == "clip" and args.clip_model is None:
        raise ValueError("--extractor clip needs --clip-model DIR (a KnowledgeCLIP folder)")
    real_files, fake_files = list_images(args.real), list_images(args.fake)
    device = resolve_device(args.device)
    if args.extractor == "inception":
        extractor = inception_extractor(weights, device=device)
    else:
        from rapiddiff.models.clip import KnowledgeCLIP

        clip = KnowledgeCLIP.from_pretrained(args.clip_model).to(device).eval()
        extractor = clip_extractor(clip, device=device)
        extractor.extra["clip_model"] = str(args.clip_model)
    metric_name = "fid" if args.extractor == "inception" else "fid_clip"
    record = compute_fid(real_files, fake_files, extractor, batch_size=args.batch_size)
    record["metric"] = metric_name
    record["details"].update(real=str(args.real), fake=str(args.fake))
    out = args.out or default_metric_path(args.fake, metric_name)
    write_json(out, record)
    print(
        f"{record['label']}: {record['value']:.4f}  ({record['details']['n_real']} real, "
        f"{record['details']['n_fake']} fake) → {out}"
    )
    return 0
