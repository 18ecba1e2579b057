"""Shared plumbing: atomic checkpoint writes and the resumable sampler."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rapiddiff.train.checkpoints import AtomicCheckpointIO
from rapiddiff.train.data_order import ResumableSampler
from rapiddiff.train.fsdp import RapidFSDPStrategy


def test_checkpoint_write_is_atomic(tmp_path: Path) -> None:
    io = AtomicCheckpointIO()
    path = tmp_path / "ckpts" / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}}, path)
    with pytest.raises(Exception):  # noqa: B017 - whatever torch.save raises for an unpicklable object
        io.save_checkpoint({"state_dict": {"w": torch.zeros(3)}, "bad": lambda: None}, path)
    assert torch.equal(
        torch.load(path, weights_only=True)["state_dict"]["w"], torch.ones(3)
    )  # old file intact
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]  # no temporary left behind


def test_checkpoint_saves_a_view_without_the_rest_of_its_storage(tmp_path: Path) -> None:
    """FSDP's optimizer state on one process views big flat buffers: the file holds only the views."""
    from collections import OrderedDict

    flat = torch.arange(1_000_000, dtype=torch.float32)
    view = flat[:4]
    state = OrderedDict(a=view, b=flat[10:14].view(2, 2), again=view, whole=torch.ones(4))
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(
        {"state_dict": state, "optimizer_states": [{"state": {0: state}}]}, path
    )
    assert path.stat().st_size < 100_000  # the 4 MB buffer is not in it
    loaded = torch.load(path, weights_only=True)
    assert isinstance(loaded["state_dict"], OrderedDict)
    assert torch.equal(loaded["state_dict"]["b"], torch.tensor([[10.0, 11.0], [12.0, 13.0]]))
    assert torch.equal(loaded["optimizer_states"][0]["state"][0]["a"], flat[:4])
    # A tensor met twice stays one tensor, and the caller's dict is untouched.
    assert loaded["state_dict"]["a"].untyped_storage().data_ptr() == (
        loaded["state_dict"]["again"].untyped_storage().data_ptr()
    )
    assert state["a"].untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


def test_fsdp_full_checkpoints_are_written_atomically() -> None:
    assert isinstance(RapidFSDPStrategy().checkpoint_io, AtomicCheckpointIO)
    assert not isinstance(RapidFSDPStrategy(state_dict_type="sharded").checkpoint_io, AtomicCheckpointIO)


def test_sampler_shards_ranks_and_resumes_at_a_batch() -> None:
    done = {"batches": 0}
    ranks = [
        ResumableSampler(10, batch_size=2, rank=r, world_size=2, seed=3, position=lambda: done["batches"])
        for r in range(2)
    ]
    epoch0 = [list(s) for s in ranks]
    assert len(epoch0[0]) == len(epoch0[1]) == 5
    assert set(epoch0[0]) | set(epoch0[1]) == set(range(10))
    done["batches"] = 2  # 2 of the 2 full batches per epoch: the next iter is epoch 1
    assert list(ranks[0]) != epoch0[0]
    done["batches"] = 3  # one batch into epoch 1
    epoch1 = ResumableSampler(10, batch_size=2, rank=0, world_size=2, seed=3, position=lambda: 2)
    assert list(ranks[0]) == list(epoch1)[2:]


def test_sigterm_broadcast_is_asked_every_n_steps_on_the_trainers_own_loop() -> None:
    from types import SimpleNamespace

    from pytorch_lightning.loops.training_epoch_loop import _TrainingEpochLoop

    from rapiddiff.train.callbacks import throttle_sigterm_broadcast

    # The method this wraps must still exist in the installed Lightning (else the per-step sync is back).
    assert hasattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor")
    asked: list[int] = []
    trainer = SimpleNamespace(global_step=0)
    loop = SimpleNamespace(_broadcast_sigterm_tensor=lambda: asked.append(trainer.global_step))
    trainer.fit_loop = SimpleNamespace(epoch_loop=loop)
    assert throttle_sigterm_broadcast(trainer, 3)
    assert throttle_sigterm_broadcast(trainer, 3)  # a second fit: not wrapped twice
    for step in range(8):
        trainer.global_step = step
        loop._broadcast_sigterm_tensor()
    assert asked == [0, 3, 6]
    bare = SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace()))
    assert not throttle_sigterm_broadcast(bare, 3)
