"""DataModules: image–caption data (U-Net, fine-tune, VAE) and low/high-resolution pairs (upscaler).

Both train through :func:`rapiddiff.train.data_order.resumable_loader` (seeded order, exact resume).
Image–caption data comes from :class:`rapiddiff.data.loader.ImageTextDataset` (an imagefolder with
``metadata.jsonl`` or a CSV/TSV/JSONL/parquet file); items are ``{"pixel_values": [3, H, W] in
[-1, 1], "text": str, "index": int}``.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset

from rapiddiff.train.data_order import auto_num_workers, resumable_loader

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def open_image_text_dataset(source: str | Path, image_size: int, **options: Any) -> Dataset:
    """The data stage's ImageTextDataset (imagefolder + metadata.jsonl, or a table file)."""
    from rapiddiff.data.loader import ImageTextDataset

    return ImageTextDataset(source, image_size=image_size, **options)


def load_image(path: Path, size: int | None = None) -> torch.Tensor:
    """An RGB image as [3, H, W] in [-1, 1]; ``size`` resizes the shorter side and centre-crops."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as img:
        img = img.convert("RGB")
        if size is not None and img.size != (size, size):
            scale = size / min(img.size)
            w, h = max(size, round(img.width * scale)), max(size, round(img.height * scale))
            img = img.resize((w, h), Image.BICUBIC)
            left, top = (w - size) // 2, (h - size) // 2
            img = img.crop((left, top, left + size, top + size))
        array = np.asarray(img, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()  # (3, H, W)


class ImageTextData(pl.LightningDataModule):
    """Image–caption data for the U-Net, fine-tune and VAE stages.

    Args:
        train: training data (an imagefolder with metadata.jsonl, or a CSV/TSV/JSONL/parquet file).
        val: validation data (same formats); optional.
        image_size: images are resized and centre-cropped to this square size.
        batch_size: per process (the global batch is this × devices × gradient accumulation).
        num_workers: DataLoader worker processes; unset: the machine's (``auto_num_workers``).
        seed: seed of the data order (epoch e shuffles with seed + e).
        dataset_options: extra keyword arguments for ImageTextDataset (image_column, text_column,
            crop, hflip, verify, ...). Random crops and flips draw from torch's RNG in the
            loader workers, so a resumed run reproduces the data order but not those draws.
    """

    def __init__(
        self,
        train: str,
        val: str | None = None,
        image_size: int = 128,
        batch_size: int = 8,
        num_workers: int | None = None,
        seed: int = 0,
        dataset_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.train_source, self.val_source = train, val
        self.image_size, self.batch_size, self.num_workers, self.seed = (
            image_size,
            batch_size,
            auto_num_workers() if num_workers is None else num_workers,  # unset: follow the machine
            seed,
        )
        self.options = dict(dataset_options or {})
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None

    def setup(self, stage: str) -> None:
        if self.train_set is None:
            self.train_set = open_image_text_dataset(self.train_source, self.image_size, **self.options)
        if self.val_source and self.val_set is None:
            self.val_set = open_image_text_dataset(self.val_source, self.image_size, **self.options)

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        speed = getattr(self.trainer.lightning_module, "speed", None) if self.trainer is not None else None
        if getattr(speed, "gpu_data", False):
            # The model keeps the data on its device: the loader only draws positions (same order).
            return resumable_loader(
                Positions(self.train_set),
                self.trainer,
                batch_size=self.batch_size,
                seed=self.seed,
                collate_fn=collate_positions,
            )
        return resumable_loader(
            self.train_set,
            self.trainer,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            seed=self.seed,
        )

    def val_dataloader(self) -> DataLoader | list:
        if self.val_set is None:
            return []
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.num_workers)


class TokenMemo:
    """Tokens (and entity ids) per caption, memoised: linking costs ~0.2 ms a caption (jieba), which
    at large batches rivals a small model's step, and captions repeat every epoch. ``tokenize`` is a
    ``KnowledgeTextEncoder.tokenize``; the result equals calling it on the whole batch."""

    def __init__(self, tokenize: Any, max_size: int = 200_000) -> None:  # ~2 KB a caption
        self.tokenize, self.max_size = tokenize, max_size
        self.rows: dict[str, dict[str, torch.Tensor]] = {}

    def __call__(self, captions: list[str]) -> dict[str, torch.Tensor]:
        missing = list(dict.fromkeys(c for c in captions if c not in self.rows))
        if missing:
            if len(self.rows) + len(missing) > self.max_size:
                self.rows.clear()
            fresh = self.tokenize(missing)
            for row, caption in enumerate(missing):
                self.rows[caption] = {k: v[row] for k, v in fresh.items()}
        return {k: torch.stack([self.rows[c][k] for c in captions]) for k in self.rows[captions[0]]}


class Positions(Dataset):
    """Positions ``0 … len(source)-1`` of a dataset whose items the model holds on its device
    (``speed.gpu_data``); ``source`` stays reachable for the one pass that fills that cache."""

    def __init__(self, source: Dataset) -> None:
        self.source = source

    def __len__(self) -> int:
        return len(self.source)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> int:
        return i


def collate_positions(positions: list[int]) -> dict[str, torch.Tensor]:
    return {"position": torch.tensor(positions)}


# ----------------------------------------------------------------------------- paired images
class PairedImageDataset(Dataset):
    """Low/high-resolution pairs: the same file names in ``lr_dir`` and ``hr_dir`` (hr = scale × lr).

    kshapes writes ``DIR/train/`` and ``DIR/hr/train/``; any folder pair of that shape works.
    ``hr_subset=True`` pairs only the low-resolution images that have a partner (emoji-zh: a glyph
    with no matching SVG has no hr copy); an hr image without a low-resolution one stays an error.
    ``patch_size`` (low-resolution pixels) crops aligned random patches, with crop positions a
    function of (seed, epoch, index) so a resumed run crops the same patches; ``None`` keeps
    whole images. Items: ``{"lr": [3, h, w], "hr": [3, h·s, w·s]}`` in [0, 1], ``"index"``.
    Indices ≥ len are ``epoch * len + index`` (from :class:`~rapiddiff.train.data_order.ResumableSampler`).
    """

    epoch_indexed = True

    def __init__(
        self,
        lr_dir: str | Path,
        hr_dir: str | Path,
        *,
        scale: int = 4,
        patch_size: int | None = None,
        seed: int = 0,
        flips: bool = True,
        hr_subset: bool = False,
    ) -> None:
        self.lr_dir, self.hr_dir = Path(lr_dir), Path(hr_dir)
        for folder in (self.lr_dir, self.hr_dir):
            if not folder.is_dir():
                raise FileNotFoundError(f"image folder not found: {folder}")
        lows = {p.name for p in self.lr_dir.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES}
        highs = {p.name for p in self.hr_dir.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES}
        self.names = sorted(lows & highs)
        if not self.names:
            raise ValueError(
                f"no image file name appears in both {self.lr_dir} and {self.hr_dir}; the pairs must share names"
            )
        missing = sorted(highs - lows if hr_subset else lows ^ highs)
        if missing:
            raise ValueError(
                f"{len(missing)} images have no partner (e.g. {missing[0]}); {self.lr_dir} and "
                f"{self.hr_dir} must hold the same file names"
                + ("" if hr_subset else " (hr_subset=True pairs an hr folder that holds a subset on purpose)")
            )
        self.scale, self.patch_size, self.seed, self.flips = scale, patch_size, seed, flips

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, index: int) -> dict[str, Any]:
        epoch, index = divmod(index, len(self.names))
        name = self.names[index]
        lr = (load_image(self.lr_dir / name) + 1) / 2  # (3, h, w) in [0, 1]
        hr = (load_image(self.hr_dir / name) + 1) / 2  # (3, h·s, w·s)
        s = self.scale
        if hr.shape[-2:] != (lr.shape[-2] * s, lr.shape[-1] * s):
            raise ValueError(
                f"{self.hr_dir / name}: size {tuple(hr.shape[-2:])} is not {s}× {self.lr_dir / name} "
                f"({tuple(lr.shape[-2:])})"
            )
        rng = random.Random(hash((self.seed, epoch, index)))
        if self.patch_size is not None:
            p = self.patch_size
            h, w = lr.shape[-2:]
            if p > min(h, w):
                raise ValueError(f"patch_size={p} is larger than {self.lr_dir / name} ({h}×{w})")
            top, left = rng.randint(0, h - p), rng.randint(0, w - p)
            lr = lr[:, top : top + p, left : left + p]
            hr = hr[:, top * s : (top + p) * s, left * s : (left + p) * s]
        if self.flips and rng.random() < 0.5:
            lr, hr = lr.flip(-1), hr.flip(-1)
        return {"lr": lr, "hr": hr, "index": index}


class PairedImageData(pl.LightningDataModule):
    """Low/high-resolution image pairs for the upscaler.

    Args:
        train_lr: folder of low-resolution training images (e.g. ``kshapes/train``).
        train_hr: folder of the same images at ``scale``× (e.g. ``kshapes/hr/train``).
        val_lr: low-resolution validation images; optional.
        val_hr: their high-resolution partners.
        scale: upscaling factor between the two folders.
        patch_size: low-resolution crop size for training (None = whole images).
        batch_size: per process.
        num_workers: DataLoader worker processes; unset: the machine's (``auto_num_workers``).
        seed: seed of data order and crop positions.
        hr_subset: the hr folders may hold a subset of the low-resolution names (emoji-zh: glyphs
            without a matching SVG have no hr copy); only the pairs are used.
    """

    def __init__(
        self,
        train_lr: str,
        train_hr: str,
        val_lr: str | None = None,
        val_hr: str | None = None,
        scale: int = 4,
        patch_size: int | None = 32,
        batch_size: int = 16,
        num_workers: int | None = None,
        seed: int = 0,
        hr_subset: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.num_workers = auto_num_workers() if num_workers is None else num_workers  # unset: the machine's
        self.train_set: PairedImageDataset | None = None
        self.val_set: PairedImageDataset | None = None

    def setup(self, stage: str) -> None:
        hp = self.hparams
        if self.train_set is None:
            self.train_set = PairedImageDataset(
                hp.train_lr,
                hp.train_hr,
                scale=hp.scale,
                patch_size=hp.patch_size,
                seed=hp.seed,
                hr_subset=hp.hr_subset,
            )
        if hp.val_lr and self.val_set is None:
            if not hp.val_hr:
                raise ValueError("data.val_lr is set but data.val_hr is not: give both validation folders")
            self.val_set = PairedImageDataset(
                hp.val_lr, hp.val_hr, scale=hp.scale, patch_size=None, flips=False, hr_subset=hp.hr_subset
            )

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        return resumable_loader(
            self.train_set,
            self.trainer,
            batch_size=self.hparams.batch_size,
            num_workers=self.num_workers,
            seed=self.hparams.seed,
        )

    def val_dataloader(self) -> DataLoader | list:
        if self.val_set is None:
            return []
        return DataLoader(self.val_set, batch_size=1, num_workers=self.num_workers)
