"""Checkpoint I/O: atomic writes, the rolling set kept on disk, ``--ckpt_path`` resolution."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.cli import SaveConfigCallback
from pytorch_lightning.plugins.io import TorchCheckpointIO

from rapiddiff.models.weights import check_weights_file
from rapiddiff.utils.io import atomic_open
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to a temporary file in the checkpoint's folder, fsync, then ``os.replace``.

    Lightning's own save goes through an fsspec transaction whose temporary file lives in the
    system temp folder; when that is another filesystem, the final ``shutil.move`` is a copy that
    a crash can leave half-written (and nothing is fsynced). Local paths here are always atomic.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO takes no storage_options")
        if "://" in str(path):  # remote storage: Lightning's fsspec path
            super().save_checkpoint(checkpoint, path)
            return
        with atomic_open(path, "wb") as handle:
            torch.save(without_oversized_views(checkpoint), handle)


def without_oversized_views(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` with every tensor that views part of a larger storage replaced by its own copy.

    ``torch.save`` writes a view's whole storage. FSDP's full optimizer state on one process is made
    of views into per-unit flat buffers, one buffer per view once saved: a 11 MB checkpoint became
    442 MB. Containers are rebuilt with their types (Lightning's own ``apply_to_collection``); a view
    met twice is copied once, so it stays one tensor in the file.
    """
    from lightning_utilities.core.apply_func import apply_to_collection

    copies: dict[int, torch.Tensor] = {}

    def own_storage(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.layout != torch.strided or tensor.is_meta:  # no storage to compare
            return tensor
        if tensor.untyped_storage().nbytes() <= tensor.numel() * tensor.element_size():
            return tensor
        if id(tensor) not in copies:
            copies[id(tensor)] = tensor.clone()
        return copies[id(tensor)]

    return apply_to_collection(checkpoint, torch.Tensor, own_storage)


class RollingCheckpoint(ModelCheckpoint):
    """Save every N optimizer steps, keep the newest ``save_top_k``, and always ``last.ckpt``.

    Defaults to ``<trainer.default_root_dir>/checkpoints`` (not the logger's versioned folder), so
    ``--ckpt_path last`` finds the previous run's checkpoint.
    """

    def __init__(
        self,
        dirpath: str | None = None,
        every_n_train_steps: int = 500,
        save_top_k: int = 3,
        save_last: bool = True,
        filename: str = "step={step:07d}",
    ) -> None:
        super().__init__(
            dirpath=dirpath,
            filename=filename,
            monitor="step",  # newest wins: "the last N kept"
            mode="max",
            save_top_k=save_top_k,
            save_last=save_last,
            every_n_train_steps=every_n_train_steps,
            auto_insert_metric_name=False,
        )

    resuming = False
    """Set by :func:`~rapiddiff.train.lightning_cli.run_cli`: this run continues the folder's checkpoints."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.dirpath is None:
            self.dirpath = checkpoint_dir(trainer)
        super().setup(trainer, pl_module, stage)

    def _ModelCheckpoint__warn_if_dir_not_empty(self, dirpath: Any) -> None:
        # Lightning warns on any file in the folder, and our resolved config.yaml is always there;
        # a resume reuses the folder on purpose. Warn only when a new run lands beside old checkpoints.
        if self.save_top_k == 0 or self.resuming or not dirpath:
            return
        old = sorted(Path(dirpath).glob("*.ckpt")) if Path(dirpath).is_dir() else []
        if old:
            log.warning(
                "%s already holds %d checkpoint(s) of an earlier run (e.g. %s), and this run does not "
                "resume: it writes beside them. Resume with --ckpt_path last, or set another "
                "trainer.default_root_dir.",
                dirpath,
                len(old),
                old[-1].name,
            )


def checkpoint_dir(trainer: pl.Trainer) -> str:
    callback = trainer.checkpoint_callback
    if callback is not None and callback.dirpath:
        return str(callback.dirpath)
    return os.path.join(trainer.default_root_dir, "checkpoints")


class SaveConfigBesideCheckpoints(SaveConfigCallback):
    """LightningCLI's resolved config, written to the log folder and beside the checkpoints."""

    def save_config(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.is_global_zero:
            folder = Path(checkpoint_dir(trainer))
            folder.mkdir(parents=True, exist_ok=True)
            self.parser.save(self.config, str(folder / self.config_filename), skip_none=False, overwrite=True)


CKPT_LAST, CKPT_LAST_OR_NEW = "last", "last-or-new"


def resolve_ckpt_path(value: str | None, folder: Path) -> str | None:
    """``--ckpt_path``: ``last`` must find ``folder/last.ckpt`` (a resume that finds nothing stops
    and names the folder), ``last-or-new`` starts a new run when there is none; a file is checked
    for truncation before Lightning reads it."""
    if not value:
        return None
    if value in (CKPT_LAST, CKPT_LAST_OR_NEW):
        last = folder / "last.ckpt"
        if last.is_file():
            log.info("resuming from %s", last)
            return str(last)
        if value == CKPT_LAST_OR_NEW:
            log.info("--ckpt_path last-or-new: no last.ckpt in %s yet: starting a new run", folder)
            return None
        raise FileNotFoundError(
            f"--ckpt_path last: no last.ckpt in {folder.resolve()} (the checkpoint folder: "
            "checkpoint.dirpath, or <trainer.default_root_dir>/checkpoints), so there is nothing to "
            "resume. Check trainer.default_root_dir, name a checkpoint file, or pass "
            "--ckpt_path last-or-new to start a new run when none exists yet."
        )
    if value in ("best", "hpc", "registry") or "://" in value:  # Lightning's own names, remote files
        return value
    check_weights_file(value, f"--ckpt_path {value}", unpickle=False)  # Lightning unpickles it next
    return value


def remove_stale_temporaries(folder: Path) -> list[Path]:
    """Delete ``.<name>.ckpt.*.tmp`` files that a crashed save left in the checkpoint folder.

    :class:`AtomicCheckpointIO` writes to such a file and renames it; one that is still there when a
    run starts belongs to a save that never finished (70–220 MB each for a U-Net).
    """
    removed = []
    for path in sorted(folder.glob(".*.ckpt.*.tmp")) if folder.is_dir() else []:
        size = path.stat().st_size
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
            log.warning(
                "removed %s (%.1f MB), left by a checkpoint save that did not finish", path, size / 1e6
            )
    return removed
