"""Callbacks every stage runs: Ctrl-C saves, frozen GC, sample grids, plain progress lines."""

from __future__ import annotations

import contextlib
import gc
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint, RichProgressBar

from rapiddiff.train.checkpoints import checkpoint_dir
from rapiddiff.train.module import RapidModule
from rapiddiff.utils.io import atomic_open
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)


class FrozenGC(Callback):
    """Moves every object alive at train start out of the cyclic GC's reach while training.

    The models, their parameters and modules, the data and Lightning live for the whole run; a full
    (generation-2) collection walks all of them: at SD 1.5 size a ~0.3 s host pause about once a
    minute, GPU-idle time for a host-bound step. Frozen, they are skipped (new objects are still
    collected); fork()ed loader workers also keep those pages shared. Unfrozen at train end or on an
    exception, so a failed run's objects can be collected again.
    """

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        gc.collect()
        gc.freeze()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        gc.unfreeze()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        gc.unfreeze()


class GracefulInterrupt(Callback):
    """Ctrl-C: finish the current step, save ``last.ckpt`` in the checkpoint folder, stop.

    A second Ctrl-C aborts at once (Python's usual KeyboardInterrupt, nothing saved). The saved
    state is at a step boundary, so resuming from it reproduces the uninterrupted run.
    """

    def __init__(self) -> None:
        self.requested = False
        self.interrupted = False
        self._previous: Any = None

    def _handler(self, signum: int, frame: Any) -> None:
        if self.requested:
            signal.signal(signal.SIGINT, self._previous or signal.default_int_handler)
            raise KeyboardInterrupt
        self.requested = True
        log.warning("Ctrl-C: saving a checkpoint at the end of this step (press again to abort now)")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            self._previous = signal.signal(signal.SIGINT, self._handler)
        except ValueError:  # not the main thread: leave signals alone
            self._previous = None
        every = max(1, getattr(pl_module, "sync_every", 1))
        if trainer.world_size > 1 and every > 1:
            throttle_sigterm_broadcast(trainer, every)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._previous is not None:
            with contextlib.suppress(ValueError):  # not the main thread
                signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        requested = self.requested
        if trainer.world_size > 1:  # all ranks save at the same step
            # A collective and a host sync: asked every `sync_every` steps only (the module's
            # setting), so a host-bound step does not wait on it (Ctrl-C saves that much later).
            if trainer.global_step % max(1, getattr(pl_module, "sync_every", 1)):
                return
            requested = bool(trainer.strategy.reduce_boolean_decision(requested, all=False))
        if not requested or self.interrupted:
            return
        path = Path(checkpoint_dir(trainer)) / "last.ckpt"
        trainer.save_checkpoint(str(path))
        if isinstance(trainer.checkpoint_callback, ModelCheckpoint):
            trainer.checkpoint_callback.last_model_path = str(path)
        log.warning("saved %s at step %d; resume with --ckpt_path %s", path, trainer.global_step, path)
        self.interrupted = True
        trainer.should_stop = True


def throttle_sigterm_broadcast(trainer: pl.Trainer, every: int) -> bool:
    """Lightning's SIGTERM agreement under DDP every ``every`` steps instead of every step.

    Lightning (2.5+) broadcasts rank 0's SIGTERM flag at the start of every training batch and reads
    it with ``.item()``: a collective and a host sync per step, which a host-bound step (a small
    U-Net) pays in full. Lightning has no setting for it, so the loop's own method is wrapped on this
    trainer's instance (not the class); every rank has the same global step, so all still call the
    collective together, and a SIGTERM is honoured up to ``every - 1`` steps later. Returns False
    (and changes nothing) where this Lightning has no such method.
    """
    loop = trainer.fit_loop.epoch_loop
    broadcast = getattr(loop, "_broadcast_sigterm_tensor", None)
    if broadcast is None or getattr(broadcast, "throttled", False):
        return broadcast is not None

    def every_n_steps() -> None:
        if trainer.global_step % every == 0:
            broadcast()

    every_n_steps.throttled = True  # type: ignore[attr-defined]
    loop._broadcast_sigterm_tensor = every_n_steps
    return True


class SampleGrid(Callback):
    """Every ``every_n_steps`` optimizer steps (and at the end): ``pl_module.sample_images()``
    as a PNG grid in ``<log_dir>/samples/step=NNNNNNN.png`` and as a TensorBoard image.

    Runs on every rank (a sharded model needs all of them to sample); rank 0 writes.
    """

    def __init__(self, every_n_steps: int = 500, nrow: int = 4, at_end: bool = True) -> None:
        if every_n_steps < 1:
            raise ValueError(f"SampleGrid.every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.nrow = nrow
        self.at_end = at_end
        self._last_step = -1
        self.saved: list[Path] = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step != self._last_step and step > 0 and step % self.every_n_steps == 0:
            self.log_grid(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.at_end and trainer.global_step != self._last_step:
            self.log_grid(trainer, pl_module)

    def log_grid(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Path | None:
        from torchvision.utils import make_grid

        self._last_step = trainer.global_step
        sampler = getattr(pl_module, "sample_images", None)
        if sampler is None:
            return None
        if isinstance(pl_module, RapidModule):
            pl_module.flush_finite_check()  # no grid of diverged weights (every rank runs this)
        was_training = pl_module.training
        pl_module.eval()
        started = time.perf_counter()
        if trainer.is_global_zero:
            log.info("step %d: drawing the sample grid%s", trainer.global_step, _grid_cost(pl_module))
        try:
            with torch.no_grad(), trainer.precision_plugin.forward_context():
                images = sampler()
        finally:
            pl_module.train(was_training)
        if trainer.is_global_zero:
            log.info(
                "step %d: sample grid drawn in %.1f s", trainer.global_step, time.perf_counter() - started
            )
        folder = Path(trainer.log_dir or trainer.default_root_dir) / "samples"  # log_dir is collective
        if images is None or not trainer.is_global_zero:
            return None
        grid = make_grid(images.detach().float().clamp(0, 1).cpu(), nrow=self.nrow, padding=2)  # (3, H', W')
        for logger in trainer.loggers:
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_image"):
                experiment.add_image("samples", grid, trainer.global_step)
        path = folder / f"step={trainer.global_step:07d}.png"
        save_png(grid, path)
        self.saved.append(path)
        return path


def _grid_cost(pl_module: pl.LightningModule) -> str:
    """What the grid costs and which settings change it (a diffusion model's sampling block)."""
    s = getattr(pl_module, "sampling", None)
    if s is None or not hasattr(s, "num_inference_steps"):
        return ""
    return (
        f": {len(s.prompts)} prompts × {len(s.seeds)} seeds × {s.num_inference_steps} denoising steps "
        "(fewer: --model.sampling.num_inference_steps / prompts / seeds; none at the end: "
        "--samples.at_end=false)"
    )


def save_png(image: torch.Tensor, path: Path) -> None:
    """A [3, H, W] tensor in [0, 1] as a PNG, written atomically."""
    from PIL import Image

    array = (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    with atomic_open(path, "wb") as handle:
        Image.fromarray(array).save(handle, format="PNG")


class PlainProgress(Callback):
    """One plain line every ``every_n_steps`` optimizer steps: step, loss, it/s, ETA.

    For log files, where a progress bar writes one frame at the end. ``enabled=None`` prints only
    when stdout is not a terminal. The loss is the value the module already logged (``train/loss``
    in ``trainer.callback_metrics``), read on the printing steps only: no extra device sync per step.
    ``every_n_steps=None`` follows ``trainer.log_every_n_steps``.
    """

    def __init__(self, every_n_steps: int | None = None, enabled: bool | None = None) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"progress.every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.enabled = enabled
        self.lines: list[str] = []
        self._start: tuple[float, int] | None = None
        self._printed: int | None = None  # the step last printed

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.enabled is None:
            self.enabled = not sys.stdout.isatty()
        self._start = (time.perf_counter(), trainer.global_step)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        every = self.every_n_steps or max(1, trainer.log_every_n_steps)
        last = trainer.max_steps is not None and step == trainer.max_steps
        due = step > 0 and (step % every == 0 or last)
        if not (self.enabled and trainer.is_global_zero and self._start and due):
            return
        if step == self._printed:
            return  # several batches per optimizer step (gradient accumulation)
        self._printed = step
        elapsed, done = time.perf_counter() - self._start[0], step - self._start[1]
        rate = done / elapsed if elapsed > 0 else 0.0
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        line = f"step {step}" + (f"/{total}" if total else "")
        loss = trainer.callback_metrics.get("train/loss")
        if loss is not None:
            line += f"  loss {float(loss):.4f}"
        line += f"  {rate:.2f} it/s"
        if total and rate > 0:
            line += f"  ETA {_duration((total - step) / rate)}"
        self.lines.append(line)
        print(line, flush=True)


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


class StepProgressBar(RichProgressBar):
    """Lightning's rich progress bar, labelled with steps when ``max_steps`` ends the run.

    Lightning labels it ``Epoch e/max_epochs - 1``, which reads ``Epoch 2/-2`` when max_epochs is
    unset (-1) and max_steps decides the end.
    """

    def _get_train_description(self, current_epoch: int) -> str:
        trainer = self.trainer
        if trainer.max_steps > 0 and (trainer.max_epochs is None or trainer.max_epochs < 0):
            return f"step {trainer.global_step}/{trainer.max_steps}"
        return super()._get_train_description(current_epoch)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.progress is not None and self.train_progress_bar_id is not None:
            description = self._get_train_description(trainer.current_epoch)
            self.progress.update(self.train_progress_bar_id, description=description)
