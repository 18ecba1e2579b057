"""The training data order: seeded, sharded across ranks, and resumable mid-epoch.

A resumed run sees the same examples in the same order, also on another number of processes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)


class ResumableSampler(Sampler[int]):
    """Seeded shuffle per epoch, sharded across ranks, positioned by the batches already trained.

    Epoch ``e`` uses the permutation of ``torch.Generator().manual_seed(seed + e)`` (padded so every
    rank gets the same count, as ``DistributedSampler`` does); rank ``r`` of ``w`` takes every w-th
    index. Each ``iter()`` asks ``position()`` how many batches this process has trained on so far
    and starts there: epoch = position // batches_per_epoch, skipping position % batches_per_epoch
    batches. Lightning restores its loop counters but not the data position of plain samplers,
    and its epoch counter is not reliable after a restart at an epoch's end; the batch count is.

    The checkpoint also holds the position in examples (:meth:`state_dict`, through
    :class:`ResumableLoader`): a run resumed with another number of processes (a checkpoint written
    on 2 GPUs, resumed on 1) or batch size goes on with the rest of the epoch's order, each example
    of the epoch once, and counts the batches after the checkpoint at its own size.

    Datasets with ``epoch_indexed = True`` receive ``epoch * len(dataset) + index`` (their random
    augmentation then depends on the epoch, also inside DataLoader workers, which hold copies).
    """

    def __init__(
        self,
        size: int,
        *,
        batch_size: int,
        position: Any = None,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = True,
        epoch_indexed: bool = False,
    ) -> None:
        if size < 1:
            raise ValueError("the dataset is empty: nothing to train on")
        self.size, self.batch_size, self.seed, self.shuffle = size, batch_size, seed, shuffle
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last
        self.position = position or (lambda: 0)
        self.epoch_indexed = epoch_indexed
        self.epoch = 0
        # Where counting starts: batch 0 = epoch 0, position 0, unless a checkpoint says otherwise.
        self._anchor = {"epoch": 0, "offset": 0, "batches": 0}

    def batches_per_epoch(self) -> int:
        n = len(self)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Lightning calls this; the epoch actually used comes from ``position()`` (see above)."""

    def _order(self, epoch: int) -> list[int]:
        """Epoch ``epoch``'s order of the whole dataset (the same for every world size)."""
        if self.shuffle:
            return torch.randperm(
                self.size, generator=torch.Generator().manual_seed(self.seed + epoch)
            ).tolist()
        return list(range(self.size))

    def _remaining(self, epoch: int, offset: int) -> list[int]:
        """What is left of epoch ``epoch`` after its first ``offset`` positions, padded with the
        order's head to a multiple of the world size (as ``DistributedSampler`` pads), all ranks."""
        order = self._order(epoch)
        rest = order[offset:]
        pad = -len(rest) % self.world_size
        while pad > 0:  # cyclic, as DistributedSampler does when the padding exceeds the dataset
            rest += order[:pad]
            pad = -len(rest) % self.world_size
        return rest

    def _batches_left(self, offset: int) -> int:
        """Batches per rank in what is left of an epoch after ``offset`` positions."""
        per_rank = math.ceil((self.size - offset) / self.world_size)
        return per_rank // self.batch_size if self.drop_last else math.ceil(per_rank / self.batch_size)

    def locate(self, done: int) -> tuple[int, int]:
        """(epoch, positions of its order already consumed by all ranks) after ``done`` batches of
        this process. Counted from the loaded checkpoint's anchor (see :meth:`load_state_dict`): the
        batches before it may have been drawn by another number of processes."""
        epoch, offset, since = self._anchor["epoch"], self._anchor["offset"], done - self._anchor["batches"]
        if since < 0:
            raise RuntimeError(
                f"the data position went back: {done} batches trained, the checkpoint says {self._anchor['batches']}"
            )
        step = self.batch_size * self.world_size  # positions all ranks consume per batch
        left = self._batches_left(offset)
        if since < left:
            return epoch, offset + since * step
        since -= left
        per_epoch = max(self._batches_left(0), 1)
        return epoch + 1 + since // per_epoch, (since % per_epoch) * step

    def __iter__(self) -> Iterator[int]:
        # Computed here, not lazily: DataLoader calls iter() when the epoch starts.
        self.epoch, offset = self.locate(int(self.position()))
        indices = self._remaining(self.epoch, offset)[self.rank :: self.world_size]
        if self.epoch_indexed:
            indices = [self.epoch * self.size + i for i in indices]
        return iter(indices)

    def state_dict(self) -> dict[str, int]:
        """Where the data stands, in positions of the epoch's order (not in this process's batches):
        a run with another number of processes or batch size resumes from it without repeating or
        skipping an example of the epoch."""
        done = int(self.position())
        epoch, offset = self.locate(done)
        return {
            "epoch": epoch,
            "offset": offset,
            "batches": done,
            "size": self.size,
            "seed": self.seed,
            "world_size": self.world_size,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict[str, int]) -> bool:
        """Resume from :meth:`state_dict`'s anchor: the batches trained after it (this run's) are
        counted at this run's world size and batch size. True when those differ from the writer's."""
        if int(state["size"]) != self.size or int(state["seed"]) != self.seed:
            log.warning(
                "the checkpoint's data had %d examples (seed %d), this run's %d (seed %d): the data "
                "order restarts from the batch count, not from where the checkpoint stopped",
                state["size"],
                state["seed"],
                self.size,
                self.seed,
            )
            return False
        self._anchor = {k: int(state[k]) for k in ("epoch", "offset", "batches")}
        changed = int(state["world_size"]) != self.world_size or int(state["batch_size"]) != self.batch_size
        if changed:
            log.info(
                "data order: resuming epoch %d at example %d of %d (written by %d process(es) × batch %d, "
                "read by %d × %d)",
                state["epoch"],
                state["offset"],
                self.size,
                state["world_size"],
                state["batch_size"],
                self.world_size,
                self.batch_size,
            )
        return changed

    def __len__(self) -> int:
        return math.ceil(self.size / self.world_size)


class ResumableLoader(DataLoader):
    """A DataLoader whose :class:`ResumableSampler`'s position goes into the checkpoint (Lightning
    saves and restores the state of loaders that have ``state_dict``/``load_state_dict``)."""

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    trainer: pl.Trainer | None = None

    def load_state_dict(self, state: dict[str, int]) -> None:
        if not self.sampler.load_state_dict(state) or self.trainer is None:
            return
        # Another world or batch size: Lightning's count of batches done in this epoch (restored in
        # the old run's batches) decides where its epoch ends; recount it in this run's batches.
        sampler, trainer = self.sampler, self.trainer
        epoch, offset = sampler.locate(int(sampler.position()))
        per_epoch = sampler.batches_per_epoch()
        done = per_epoch if epoch > trainer.current_epoch else per_epoch - sampler._batches_left(offset)
        current = trainer.fit_loop.epoch_loop.batch_progress.current
        shift = max(done, 0) - current.ready  # all four counters, so Lightning's restart logic holds
        current.ready, current.started = current.ready + shift, current.started + shift
        current.processed, current.completed = current.processed + shift, current.completed + shift


def resumable_loader(
    dataset: Dataset,
    trainer: pl.Trainer | None,
    *,
    batch_size: int,
    num_workers: int = 0,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = True,
    collate_fn: Any = None,
) -> DataLoader:
    """A training DataLoader over :class:`ResumableSampler`, positioned where ``trainer`` resumes.

    Set ``use_distributed_sampler=False`` on the Trainer (:func:`run_cli` does): this sampler
    shards by rank itself.
    """
    rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def position() -> int:
        # Batches this process has trained on (restored from the checkpoint on resume).
        return trainer.fit_loop.epoch_loop.batch_progress.total.processed if trainer is not None else 0

    sampler = ResumableSampler(
        len(dataset),
        batch_size=batch_size,
        position=position,
        seed=seed,
        shuffle=shuffle,
        rank=rank,
        world_size=world,
        drop_last=drop_last,
        epoch_indexed=bool(getattr(dataset, "epoch_indexed", False)),
    )
    if len(sampler) < batch_size and drop_last:
        raise ValueError(
            f"{len(sampler)} examples per process but batch_size={batch_size}: lower the batch size "
            "or add data (drop_last would leave no batch)"
        )
    loader = ResumableLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        drop_last=drop_last,
        collate_fn=collate_fn,
        pin_memory=torch.cuda.is_available(),
    )
    loader.trainer = trainer
    return loader


def auto_num_workers() -> int:
    """``data.num_workers`` when unset: on a GPU machine, the cores per GPU less one (at most 8);
    on a CPU, at most 2 and half the cores (the training step needs the rest: 1 on 2 cores)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if torch.cuda.is_available():
        return max(0, min(8, cpus // max(1, torch.cuda.device_count()) - 1))
    return min(2, cpus // 2)
