"""Two CPU processes through Lightning's DDP (gloo), launched the way a user launches it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.train.helpers import launch_train_unet, tiny_unet_args, write_imagefolder


@pytest.mark.slow
def test_unet_trains_with_ddp_on_two_cpu_processes(tmp_path: Path) -> None:
    data = write_imagefolder(tmp_path / "data", n=8)
    root = tmp_path / "run"
    args = [
        *tiny_unet_args(data, root, max_steps=2),
        "--trainer.strategy=ddp",
        "--trainer.devices=2",
        "--trainer.logger=false",
    ]
    result = launch_train_unet(tmp_path, args, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (root / "checkpoints" / "step=0000002.ckpt").is_file()
    assert (root / "model" / "unet" / "diffusion_pytorch_model.safetensors").is_file()


@pytest.mark.slow
def test_a_nan_on_one_rank_stops_both_at_the_deferred_check(tmp_path: Path) -> None:
    """speed.sync_every=2: rank 0 diverges at step 1, rank 1's own loss stays finite; both read the
    flag together at step 1's end (a collective), stop, and nothing after step 0 is saved."""
    data = write_imagefolder(tmp_path / "data", n=8)
    root = tmp_path / "run"
    args = [
        *tiny_unet_args(data, root, max_steps=4),
        "--checkpoint.every_n_train_steps=1",
        "--samples.every_n_steps=100",
        "--trainer.strategy=ddp",
        "--trainer.devices=2",
        "--trainer.logger=false",
        "--model.speed.sync_every=2",
        "--trainer.callbacks+=tests.train.helpers.PoisonWeights",
        "--trainer.callbacks.step=1",
        "--trainer.callbacks.rank=0",
    ]
    result = launch_train_unet(tmp_path, args, timeout=300)
    assert result.returncode != 0
    assert "at step 1" in result.stderr, result.stderr[-3000:]
    assert sorted(p.name for p in (root / "checkpoints").glob("step=*.ckpt")) == ["step=0000001.ckpt"]
    assert not (root / "model").exists()
