"""The U-Net stage keeps Python's cyclic GC off its long-lived objects while it trains, and only then."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import pytorch_lightning as pl

from rapiddiff.train import unet as unet_stage
from rapiddiff.train.data import ImageTextData
from rapiddiff.train.finite import NonFiniteLossError
from tests.train.helpers import PoisonWeights, write_imagefolder


class FreezeCounts(pl.Callback):
    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.counts.append(gc.get_freeze_count())


def fit(data: Path, root: Path, *callbacks: pl.Callback) -> None:
    module = unet_stage.LatentDiffusion(unet="tiny", vae="tiny", text_encoder="tiny", ema=None)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        default_root_dir=root,
        callbacks=list(callbacks),
    )
    datamodule = ImageTextData(str(data), image_size=16, batch_size=2, num_workers=0)
    trainer.fit(module, datamodule=datamodule)


def test_objects_are_frozen_while_training_and_released_after(tmp_path: Path) -> None:
    data = write_imagefolder(tmp_path / "data")
    assert gc.get_freeze_count() == 0
    counts = FreezeCounts()
    fit(data, tmp_path / "run", counts)
    assert len(counts.counts) == 3 and min(counts.counts) > 1000  # the models' objects, every step
    assert gc.get_freeze_count() == 0


def test_a_failed_run_unfreezes(tmp_path: Path) -> None:
    data = write_imagefolder(tmp_path / "data")
    with pytest.raises(NonFiniteLossError):
        fit(data, tmp_path / "run", PoisonWeights(step=1))
    assert gc.get_freeze_count() == 0  # the failed run's objects can be collected again
