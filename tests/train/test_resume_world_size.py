"""A U-Net-stage checkpoint written by 2 processes resumes on 1 (issue 13: "a checkpoint written on
2 GPUs resumes on 1"), checked on CPU: Lightning's DDP over gloo, 2 processes, launched as a user
launches it.

What a resume across a world-size change promises (:class:`ResumableSampler`'s contract): the global
step and the epoch go on, the optimizer, LR schedule and EMA come back as saved, the rest of the
epoch is the rest of the same order (each example of the epoch once across the switch, none
repeated, none skipped: the ones the 2-process run went on to see), later epochs use the resumed
run's own sharding, and the run exports a model that loads. The losses after the switch are not
those of the 2-process run (a step now averages over 2 examples instead of 4, and the per-batch
noise is drawn for rank 0 only); what must hold instead is that the 1-process continuation is
itself exact: resuming it again reproduces its losses. FSDP (RapidFSDPStrategy) runs on CPU with
gloo in this torch and is checked the same way (2 processes write, 1 FSDP process resumes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from pytorch_lightning.callbacks import Callback

from rapiddiff.train import unet as unet_stage
from tests.train.helpers import launch_train_unet, tiny_unet_args, write_imagefolder

N_IMAGES, BATCH = 8, 2  # 2 processes: 2 batches an epoch each; 1 process: 4


class RecordSamples(Callback):
    """Appends "rank step epoch loss key key ..." per optimizer step, a key per example of the
    batch (its per-channel pixel means: flips and the normalisation keep them), and on train start
    saves what the run restored (step, epoch, optimizer, LR schedule, EMA) to ``<path>.start.pt``."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.is_global_zero:
            scheduler = trainer.lr_scheduler_configs[0].scheduler
            torch.save(
                {
                    "global_step": trainer.global_step,
                    "epoch": trainer.current_epoch,
                    "optimizer": trainer.optimizers[0].state_dict(),
                    "lr_scheduler": scheduler.state_dict(),
                    "ema": pl_module.ema.state_dict() if pl_module.ema is not None else None,
                },
                f"{self.path}.start.pt",
            )

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        means = batch["pixel_values"].float().mean(dim=(2, 3))
        keys = " ".join(",".join(f"{v:.4f}" for v in row.tolist()) for row in means)
        with self.path.open("a", encoding="utf-8") as handle:
            line = f"{trainer.global_rank} {trainer.global_step} {trainer.current_epoch}"
            handle.write(f"{line} {float(outputs['loss']):.10g} {keys}\n")


def image_keys(folder: Path) -> list[np.ndarray]:
    """Each dataset image's per-channel mean in [-1, 1], in file order (= dataset index)."""
    names = sorted(p for p in folder.glob("*.png"))
    return [
        np.asarray(Image.open(p).convert("RGB"), dtype=np.float64).mean((0, 1)) / 127.5 - 1 for p in names
    ]


def read_steps(path: Path, keys: list[np.ndarray]) -> list[tuple[int, int, int, float, list[int]]]:
    """(rank, step, epoch, loss, dataset indices) per recorded step."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        rank, step, epoch, loss, *samples = line.split()
        indices = []
        for sample in samples:
            key = np.array([float(v) for v in sample.split(",")])
            distances = [float(np.abs(key - k).max()) for k in keys]
            assert min(distances) < 2e-3, f"a batch example matches no dataset image: {sample}"
            indices.append(int(np.argmin(distances)))
        rows.append((int(rank), int(step), int(epoch), float(loss), indices))
    return rows


def assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def run_args(data: Path, root: Path, steps: int, record: Path, *extra: str) -> list[str]:
    """A tiny U-Net stage run that checkpoints every step and records each rank's batches."""
    return [
        *tiny_unet_args(data, root, max_steps=steps),
        "--trainer.logger=false",
        "--checkpoint.every_n_train_steps=1",
        "--checkpoint.save_top_k=-1",
        "--samples.every_n_steps=1000",
        "--samples.at_end=false",
        "--trainer.callbacks+=tests.train.test_resume_world_size.RecordSamples",
        f"--trainer.callbacks.path={record}",
        *extra,
    ]


def launch(cwd: Path, argv: list[str]) -> None:
    """`python -m rapiddiff train unet ARGV` as a user launches it (several processes need their own)."""
    result = launch_train_unet(cwd, argv)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
def test_ddp_checkpoint_from_two_processes_resumes_on_one(tmp_path: Path) -> None:
    from rapiddiff.models.bundle import load_model_folder

    data = write_imagefolder(tmp_path / "data", n=N_IMAGES)
    keys = image_keys(data)
    assert min(float(np.abs(a - b).max()) for i, a in enumerate(keys) for b in keys[i + 1 :]) > 0.01
    two, one = tmp_path / "two", tmp_path / "one"

    def args(root: Path, steps: int, record: Path, *extra: str) -> list[str]:
        return run_args(data, root, steps, record, *extra)

    # 2 processes (DDP, gloo), 3 steps; the checkpoint at step 1 is mid-epoch (4 of 8 examples seen).
    launch(tmp_path, args(two, 3, tmp_path / "two.txt", "--trainer.strategy=ddp", "--trainer.devices=2"))
    written = two / "checkpoints" / "step=0000001.ckpt"
    checkpoint = torch.load(written, map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == 1 and checkpoint["epoch"] == 0
    two_steps = read_steps(tmp_path / "two.txt", keys)
    assert sorted((r, s) for r, s, *_ in two_steps) == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]

    # 1 process resumes that checkpoint and trains to step 5.
    unet_stage.cli_main(args(one, 5, tmp_path / "one.txt", f"--ckpt_path={written}"))
    start = torch.load(f"{tmp_path / 'one.txt'}.start.pt", weights_only=False)
    assert start["global_step"] == 1 and start["epoch"] == 0
    assert_same(start["optimizer"], checkpoint["optimizer_states"][0], "optimizer")
    assert start["optimizer"]["state"], "the optimizer state came back empty"
    assert_same(start["lr_scheduler"], checkpoint["lr_schedulers"][0], "lr_scheduler")
    assert_same(start["ema"], checkpoint["ema"], "ema")
    one_steps = read_steps(tmp_path / "one.txt", keys)
    assert [(r, s, e) for r, s, e, *_ in one_steps] == [(0, 2, 0), (0, 3, 0), (0, 4, 1), (0, 5, 1)]
    assert all(len(ix) == BATCH for *_, ix in one_steps)

    # Epoch 0: what the 2 processes saw by the checkpoint + what the 1 process saw after it =
    # every example once; and the rest is what the 2-process run itself went on to see.
    before = [i for r, s, e, loss, ix in two_steps if s == 1 for i in ix]
    after = [i for r, s, e, loss, ix in one_steps if e == 0 for i in ix]
    assert sorted(before + after) == list(range(N_IMAGES))
    assert sorted(after) == sorted(i for r, s, e, loss, ix in two_steps if s == 2 for i in ix)
    # Epoch 1, on 1 process: a fresh order, no example twice: the first half of the epoch's order,
    # which the 2 processes saw at their step 3.
    epoch1 = [i for r, s, e, loss, ix in one_steps if e == 1 for i in ix]
    assert len(set(epoch1)) == len(epoch1) == 2 * BATCH
    assert sorted(epoch1) == sorted(i for r, s, e, loss, ix in two_steps if s == 3 for i in ix)

    # A checkpoint written by the 2 processes at an epoch's end (step 2) resumes on 1 process in the
    # next epoch (Lightning's epoch counter too), at the start of that epoch's order.
    edge = tmp_path / "edge"
    unet_stage.cli_main(
        args(edge, 4, tmp_path / "edge.txt", f"--ckpt_path={two / 'checkpoints' / 'step=0000002.ckpt'}")
    )
    edge_steps = read_steps(tmp_path / "edge.txt", keys)
    assert [(r, s, e) for r, s, e, *_ in edge_steps] == [(0, 3, 1), (0, 4, 1)]
    assert [ix for *_, ix in edge_steps] == [ix for r, s, e, loss, ix in one_steps if e == 1]

    # The 1-process continuation is exact: resuming its own step-3 checkpoint (written on 1 process
    # after a 2→1 switch) gives the same examples and the same losses at steps 4 and 5.
    again = tmp_path / "again"
    (again / "checkpoints").mkdir(parents=True)
    resumed = again / "checkpoints" / "step=0000003.ckpt"
    resumed.write_bytes((one / "checkpoints" / "step=0000003.ckpt").read_bytes())
    unet_stage.cli_main(args(again, 5, tmp_path / "again.txt", f"--ckpt_path={resumed}"))
    again_steps = read_steps(tmp_path / "again.txt", keys)
    assert [row for row in one_steps if row[1] > 3] == again_steps

    # The exported model loads, and its U-Net is the EMA the last checkpoint holds.
    bundle = load_model_folder(one / "model", load_upscaler=False)
    last = torch.load(one / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert last["global_step"] == 5
    shadow = last["ema"]["shadow_params"]
    params = list(bundle.unet.parameters())
    assert len(params) == len(shadow)
    for p, s in zip(params, shadow, strict=True):
        torch.testing.assert_close(p.detach().float(), s.float(), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("size", "before", "after", "stop"),  # stop: batches before the checkpoint, mid-epoch
    [
        (8, (2, 2), (1, 2), 1),  # 2 processes → 1, same batch
        (24, (2, 2), (1, 2), 3),
        (12, (1, 2), (2, 2), 2),  # 1 → 2
        (12, (3, 1), (2, 3), 1),  # 3 → 2 and another batch size (drop_last leaves 3 out)
        (12, (3, 1), (2, 3), 2),
        (16, (2, 2), (2, 4), 1),  # same world, larger batch
    ],
)
def test_sampler_resumes_the_epoch_across_world_and_batch_size_changes(
    size: int, before: tuple[int, int], after: tuple[int, int], stop: int
) -> None:
    """The contract the slow test checks end to end, for more shapes: the examples seen before the
    checkpoint (all ranks) and after it (the new ranks) are each example of the epoch once, the next
    epoch is whole and new, and a checkpoint written after the switch resumes where it stopped."""
    from rapiddiff.train.data_order import ResumableSampler

    def ranks(world: int, batch: int, done: int, state: dict | None = None) -> list[ResumableSampler]:
        samplers = [
            ResumableSampler(size, batch_size=batch, position=lambda: done, rank=r, world_size=world)
            for r in range(world)
        ]
        for sampler in samplers:
            if state is not None:
                sampler.load_state_dict(state)
        return samplers

    def take(samplers: list[ResumableSampler], batches: int | None) -> list[int]:
        """What the ranks train on: their first ``batches`` batches, or every full batch (drop_last)."""
        out = []
        for sampler in samplers:
            indices = list(iter(sampler))
            full = len(indices) // sampler.batch_size if batches is None else batches
            out += indices[: full * sampler.batch_size]
        return out

    (w0, b0), (w1, b1) = before, after
    seen = take(ranks(w0, b0, 0), stop)
    state = ranks(w0, b0, stop)[0].state_dict()
    rest = take(ranks(w1, b1, stop, state), None)  # the rest of the epoch on the new ranks
    assert len(set(seen + rest)) == len(seen + rest)  # none twice
    if (size - len(seen)) % (w1 * b1) == 0:
        assert sorted(seen + rest) == list(range(size))  # none skipped
    else:  # drop_last leaves out less than one batch of every rank, as at any epoch's end
        assert size - w1 * b1 < len(seen + rest) < size
    left = len(rest) // (w1 * b1)
    new = ranks(w1, b1, stop + left, state)
    epoch1 = take(new, None)
    assert {s.epoch for s in new} == {1}
    assert sorted(epoch1) == list(range(size))
    # A checkpoint written after the switch (one batch into epoch 1) resumes at the same place.
    again = ranks(w1, b1, stop + left + 1, ranks(w1, b1, stop + left + 1, state)[0].state_dict())
    assert take(again, None) == take(ranks(w1, b1, stop + left + 1, state), None)
    assert sorted(take(again, None) + take(new, 1)) == list(range(size))


@pytest.mark.slow
def test_fsdp_checkpoint_from_two_processes_resumes_on_one(tmp_path: Path) -> None:
    """RapidFSDPStrategy on CPU (gloo): its checkpoint holds the full state dict and the full
    optimizer state (keyed by weight name), so 1 FSDP process resumes what 2 wrote."""
    from safetensors.torch import load_file

    from rapiddiff.models.bundle import load_model_folder

    data = write_imagefolder(tmp_path / "data", n=N_IMAGES)
    keys = image_keys(data)
    two, one = tmp_path / "two", tmp_path / "one"

    def args(root: Path, steps: int, record: Path, devices: int, *extra: str) -> list[str]:
        fsdp = [
            "--trainer.strategy=fsdp",
            f"--trainer.devices={devices}",
            "--model.ema=null",
        ]  # no EMA under FSDP
        return run_args(data, root, steps, record, *fsdp, *extra)

    launch(tmp_path, args(two, 2, tmp_path / "two.txt", 2))
    launch(
        tmp_path,
        args(one, 3, tmp_path / "one.txt", 1, f"--ckpt_path={two / 'checkpoints' / 'step=0000001.ckpt'}"),
    )

    checkpoint = torch.load(two / "checkpoints" / "step=0000001.ckpt", map_location="cpu", weights_only=False)
    start = torch.load(f"{tmp_path / 'one.txt'}.start.pt", weights_only=False)
    assert start["global_step"] == 1 and start["epoch"] == 0
    assert_same(start["lr_scheduler"], checkpoint["lr_schedulers"][0], "lr_scheduler")
    # One process writes a file the size two wrote, not the flat buffers its optimizer state views
    # (442 MB against 11 MB before the checkpoint IO copied such views).
    sizes = [(root / "checkpoints" / "last.ckpt").stat().st_size for root in (two, one)]
    assert sizes[1] < 1.2 * sizes[0]
    # The optimizer came back: every trained weight has its AdamW moments, one step old, and
    # they are the saved ones (the checkpoint keys them by weight name, the optimizer by position).
    saved = checkpoint["optimizer_states"][0]["state"]
    restored = start["optimizer"]["state"]
    assert len(restored) == len(saved) > 0
    assert {float(s["step"]) for s in restored.values()} == {1.0}
    saved_moments = sorted(float(s["exp_avg"].double().abs().sum()) for s in saved.values())
    restored_moments = sorted(float(s["exp_avg"].double().abs().sum()) for s in restored.values())
    assert restored_moments == pytest.approx(saved_moments, rel=1e-6)

    two_steps, one_steps = read_steps(tmp_path / "two.txt", keys), read_steps(tmp_path / "one.txt", keys)
    assert [(r, s, e) for r, s, e, *_ in one_steps] == [(0, 2, 0), (0, 3, 0)]
    before = [i for r, s, e, loss, ix in two_steps if s == 1 for i in ix]
    after = [i for r, s, e, loss, ix in one_steps for i in ix]
    assert sorted(before + after) == list(range(N_IMAGES))
    assert sorted(after) == sorted(i for r, s, e, loss, ix in two_steps if s == 2 for i in ix)

    last = torch.load(one / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert last["global_step"] == 3
    state = last["state_dict"]
    exported = load_file(one / "model" / "unet" / "diffusion_pytorch_model.safetensors")
    assert exported.keys() == {k.removeprefix("unet.") for k in state if k.startswith("unet.")}
    for key, value in exported.items():
        assert torch.equal(value, state["unet." + key]), key
    bundle = load_model_folder(one / "model", load_upscaler=False)
    torch.testing.assert_close(bundle.unet.conv_in.weight, state["unet.conv_in.weight"], rtol=0, atol=0)
