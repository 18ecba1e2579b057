"""Training plumbing every stage shares (U-Net, fine-tune, VAE, upscaler, CLIP).

- :class:`RapidModule`: a LightningModule base that reseeds torch at every batch from
  ``(seed, rank, batch)`` and stops on a non-finite loss (:class:`NonFiniteLossError`; checked
  every step, or every ``sync_every`` steps and before every save: :class:`DeferredFiniteCheck`).
- Callbacks: :class:`RollingCheckpoint` (keep the last N, written atomically through
  :class:`AtomicCheckpointIO`), :class:`GracefulInterrupt` (Ctrl-C saves ``last.ckpt`` at the end of
  the step and exits), :class:`SampleGrid` (validation images to PNG and TensorBoard).
- :class:`ResumableSampler`: a seeded, rank-sharded sampler that resumes mid-epoch at the batch the
  checkpoint stopped at, so a resumed run sees the same data in the same order.
- :class:`OptimConfig` / :func:`configure_adamw`: AdamW + a diffusers LR schedule with warm-up.
- :func:`run_cli`: the LightningCLI every ``rapiddiff train <stage>`` runs (``--ckpt_path`` resumes,
  ``--output`` names the folder the final model is exported to).

Why a per-batch reseed: Lightning checkpoints hold no RNG state, so after a resume the noise,
timesteps, caption dropout and dropout masks would differ. Drawing them after
``torch.manual_seed(f(seed, rank, batch))`` makes them a function of the batch number alone, and a
resumed run reproduces the uninterrupted run's losses exactly (a test compares them).
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import signal
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from pytorch_lightning.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from pytorch_lightning.loggers import TensorBoardLogger
from pytorch_lightning.plugins.io import TorchCheckpointIO
from pytorch_lightning.strategies import FSDPStrategy
from torch.utils.data import DataLoader, Dataset, Sampler

from rapiddiff.models.weights import check_weights_file, is_unsafe_pickle_error, unsafe_pickle_error
from rapiddiff.utils.io import atomic_open
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)


# ----------------------------------------------------------------------------- non-finite loss
class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite; training stopped before the bad step changed any weight."""


def ensure_finite(loss: torch.Tensor, trainer: pl.Trainer | None, what: str = "loss") -> None:
    """Raise :class:`NonFiniteLossError` if ``loss`` is not finite on any rank.

    Checked before backward, so the weights in memory (and every checkpoint written so far) are
    the last good ones; no checkpoint of the bad state is written. One host sync a step, as
    diffusers' train_text_to_image.py does with ``loss.item()``.
    """
    finite = bool(torch.isfinite(loss.detach()).all())
    if trainer is not None and trainer.world_size > 1:
        # Every rank must stop together, or the others would wait forever in the next all-reduce.
        finite = bool(trainer.strategy.reduce_boolean_decision(finite, all=True))
    if not finite:
        step = trainer.global_step if trainer is not None else "?"
        raise NonFiniteLossError(
            f"{what} is {loss.detach().float().mean().item()} at step {step}: training stopped, nothing "
            f"of this step was saved.{_last_good(trainer)}{_ADVICE}"
        )


_ADVICE = (
    " Lower the learning rate, use bf16 instead of fp16, or clip gradients (--trainer.gradient_clip_val=1.0)."
)


def _last_good(trainer: pl.Trainer | None) -> str:
    if trainer is None or trainer.checkpoint_callback is None:
        return ""
    callback = trainer.checkpoint_callback
    last = getattr(callback, "last_model_path", "") or getattr(callback, "best_model_path", "")
    return f" The last good checkpoint is {last}; resume from it with --ckpt_path." if last else ""


class DeferredFiniteCheck:
    """:func:`ensure_finite` with the host reading the answer every ``every`` steps, not every step.

    Each step only queues ``flag |= !isfinite(loss)`` (and the first bad step's number) on the
    device, so the host goes on to the next step while the GPU works; a host-bound step (a small
    U-Net) loses its one per-step wait. :meth:`flush` reads the flag — every ``every`` steps, and
    before anything is saved (checkpoints, the export at the end), so no checkpoint ever holds a
    step at or after a non-finite loss: the run still stops with the last good checkpoint, only up
    to ``every - 1`` steps later. The weights in memory after the bad step are not kept.
    """

    def __init__(self, every: int) -> None:
        if every < 1:
            raise ValueError(f"the finite check runs every N >= 1 steps, got {every}")
        self.every = every
        self._bad: torch.Tensor | None = None  # bool, sticky
        self._first: torch.Tensor | None = None  # int64, the first bad step (-1: none)
        self._value: torch.Tensor | None = None  # the first bad loss
        self._pending = False

    def update(self, loss: torch.Tensor, trainer: pl.Trainer | None, what: str = "loss") -> None:
        step = trainer.global_step if trainer is not None else 0
        if self.every == 1:
            ensure_finite(loss, trainer, what)
            return
        value = loss.detach().float().mean()
        bad = ~torch.isfinite(value)
        if self._bad is None:
            self._bad, self._first, self._value = bad, torch.where(bad, step, -1), value
        else:
            new = bad & ~self._bad
            self._first = torch.where(new, step, self._first)
            self._value = torch.where(new, value, self._value)
            self._bad = self._bad | bad
        self._pending = True
        if (step + 1) % self.every == 0:
            self.flush(trainer, what)

    def flush(self, trainer: pl.Trainer | None, what: str = "loss") -> None:
        """Read the flag (one host sync; a collective on several ranks: every rank must call it)."""
        if not self._pending or self._bad is None:
            return
        self._pending = False
        bad = bool(self._bad)
        if trainer is not None and trainer.world_size > 1:
            bad = not bool(trainer.strategy.reduce_boolean_decision(not bad, all=True))
        if not bad:
            return
        first = int(self._first) if self._first is not None else -1
        where = f"at step {first}" if first >= 0 else "on another rank, within the last steps"
        value = float(self._value) if first >= 0 and self._value is not None else float("nan")
        raise NonFiniteLossError(
            f"{what} is {value} {where} (checked every {self.every} steps): training stopped, nothing "
            f"from that step on was saved.{_last_good(trainer)}{_ADVICE}"
        )


# ----------------------------------------------------------------------------- the module base
class RapidModule(pl.LightningModule):
    """Base for rapiddiff's LightningModules: per-batch seeding, sample grids, export.

    Subclasses implement ``training_step`` and may implement :meth:`sample_images` (what
    :class:`SampleGrid` logs) and :meth:`export` (the final artefact, written by :func:`run_cli`).
    """

    seed: int = 0
    sync_every: int = 1
    """How often the host waits to read the non-finite-loss flag (:class:`DeferredFiniteCheck`)."""
    _finite: DeferredFiniteCheck | None = None

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        torch.manual_seed(batch_seed(self.seed, self.global_rank, self.trainer.fit_loop.total_batch_idx))

    def check_finite(self, loss: torch.Tensor, what: str = "loss") -> None:
        """Stop on a non-finite loss: now (``sync_every`` 1) or at the next read of the flag."""
        if self._finite is None or self._finite.every != self.sync_every:
            self._finite = DeferredFiniteCheck(self.sync_every)
        self._finite.update(loss, self._trainer, what)

    def flush_finite_check(self) -> None:
        """Read a deferred non-finite flag now (before a save). Every rank must call it."""
        if self._finite is not None:
            self._finite.flush(self._trainer)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.flush_finite_check()  # raises before the file is written

    def on_train_end(self) -> None:
        self.flush_finite_check()  # before run_cli exports the model

    # A stage with ``speed.cuda_graph`` sets ``_graphed`` (a :class:`rapiddiff.train.speed.GraphedLoss`)
    # at its first captured step; from then on the replay writes the gradients itself.
    _graphed: Any = None

    def _check_graph_trainer(self) -> None:
        """What ``speed.cuda_graph`` needs of the trainer in every stage (a stage adds its own
        device checks first)."""
        trainer = self.trainer
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                "speed.cuda_graph overwrites gradients every step: set accumulate_grad_batches: 1"
            )
        if str(trainer.precision).startswith("16"):
            raise ValueError("speed.cuda_graph does not capture fp16 loss scaling: use bf16-mixed or 32-true")

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        from rapiddiff.train.speed import GRAPH_WARMUP_STEPS

        if self._graphed is None or self.global_step < GRAPH_WARMUP_STEPS:
            super().backward(loss, *args, **kwargs)
        # else: the graph's replay already wrote the gradients.

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        if self._graphed is None:
            optimizer.zero_grad()
            return
        # The graph's gradients are its static buffers (overwritten by each replay): keep them.
        graph_owned = self._graphed.param_ids  # built once, not every step
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in graph_owned:
                    p.grad = None

    def configure_gradient_clipping(
        self,
        optimizer: Any,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        # Lightning refuses to clip for a fused AdamW under any AMP plugin (its check is about fp16
        # loss scaling, which the fused kernel would undo); bf16 and fp32 have no scaler, so the
        # clip is the same clip_grad_norm_ Lightning would run.
        fused = any(group.get("fused") for group in optimizer.param_groups)
        if not fused or not gradient_clip_val or str(self.trainer.precision).startswith("16"):
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if gradient_clip_algorithm in (None, "norm"):
            torch.nn.utils.clip_grad_norm_(params, gradient_clip_val)
        else:
            torch.nn.utils.clip_grad_value_(params, gradient_clip_val)

    def sample_images(self) -> torch.Tensor | None:
        """Images [N, 3, H, W] in [0, 1] for the validation grid (fixed inputs, fixed seeds)."""
        return None

    def export(self, path: Path) -> Path:
        """Write the trained model to ``path`` in its release format; returns the path."""
        raise NotImplementedError

    # FSDP (:class:`RapidFSDPStrategy`): which submodules become sharded units, which stay out.
    def fsdp_units(self) -> list[torch.nn.Module]:
        """Submodules each wrapped as one FSDP unit (trained ones); the rest go to the root unit."""
        return []

    def fsdp_ignored(self) -> list[torch.nn.Module]:
        """Submodules FSDP leaves alone (frozen ones: whole on every rank, not flattened)."""
        return []

    def unshard_for_export(self, state: dict[str, torch.Tensor]) -> RapidModule:
        """After an FSDP run: this module with its FSDP wrappers taken out and ``state`` (the gathered
        full state dict) put in place of the shards, ready for :meth:`export`. Ends FSDP use of it."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        for parent in list(self.modules()):
            for name, child in list(parent._modules.items()):
                if isinstance(child, FullyShardedDataParallel):
                    parent._modules[name] = child.module
        trained = {n for n, p in self.named_parameters() if p.requires_grad}
        missing = sorted(trained - set(state))
        if missing:
            raise RuntimeError(
                f"the gathered FSDP state lacks {len(missing)} trained weights (e.g. {missing[0]})"
            )
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name in state:  # the shard's view becomes the whole tensor again
                    param.data = state[name].to(param.device, param.dtype)
        return self


def batch_seed(seed: int, rank: int, batch: int) -> int:
    """A torch seed for one batch on one rank (ints hash deterministically in Python)."""
    return hash((int(seed), int(rank), int(batch))) & 0x7FFF_FFFF_FFFF_FFFF


# ----------------------------------------------------------------------------- checkpoints
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

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.dirpath is None:
            self.dirpath = checkpoint_dir(trainer)
        super().setup(trainer, pl_module, stage)


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


# ----------------------------------------------------------------------------- sample grids
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
            log.warning(
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


# ----------------------------------------------------------------------------- progress in log files
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


# ----------------------------------------------------------------------------- accelerator-aware defaults
def auto_precision(accelerator: Any) -> str:
    """``trainer.precision`` when unset: bf16-mixed on a GPU that has bf16, 16-mixed on an older
    GPU, 32-true on a CPU (where bf16 autocast is slow and fp16 unsupported)."""
    name = str(accelerator or "auto").lower()
    if name in ("auto", "gpu", "cuda") and torch.cuda.is_available():
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    return "32-true"


def auto_num_workers() -> int:
    """``data.num_workers`` when unset: on a GPU machine, the cores per GPU less one (at most 8);
    on a CPU, at most 2 and half the cores (the training step needs the rest: 1 on 2 cores)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if torch.cuda.is_available():
        return max(0, min(8, cpus // max(1, torch.cuda.device_count()) - 1))
    return min(2, cpus // 2)


def adapted_log_interval(log_every_n_steps: int, max_steps: int | None) -> int:
    """A short run logs its loss: at most a tenth of ``max_steps`` between logged steps."""
    if max_steps is None or max_steps <= 0:
        return log_every_n_steps
    return max(1, min(log_every_n_steps, max_steps // 10))


# ----------------------------------------------------------------------------- data order
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


# ----------------------------------------------------------------------------- optimisation
@dataclass(frozen=True)
class OptimConfig:
    """AdamW and its learning-rate schedule."""

    lr: float = 1e-4
    """Peak learning rate (after warm-up)."""
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 1e-2
    eps: float = 1e-8
    schedule: Literal[
        "constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial"
    ] = "constant_with_warmup"
    """A diffusers.optimization.get_scheduler name; stepped every optimizer step."""
    warmup_steps: int = 500
    """Linear warm-up from 0 to ``lr`` over this many optimizer steps."""
    fused: bool | None = None
    """torch's fused AdamW kernel: one kernel per step instead of foreach passes over the tensors.
    None (default): fused when every trained parameter is on a CUDA GPU (median +10.6 % images/s
    at SD 1.5 size over three H100 runs, -6.7 to +13.7 %: BENCHMARKS.md), else foreach; false: always foreach (the rounding of runs made
    before 2026-11-23; fused rounds differently, ~1e-4 relative on a loss); true: fused, an error
    where torch has no fused kernel for a parameter."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"OptimConfig.lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"OptimConfig.warmup_steps must be >= 0, got {self.warmup_steps}")


def use_fused_adamw(params: Sequence[Any]) -> bool:
    """OptimConfig.fused's default: fused AdamW where every parameter is a floating CUDA tensor."""
    tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    return bool(tensors) and all(p.is_cuda and p.is_floating_point() for p in tensors)


def configure_adamw(module: pl.LightningModule, params: Sequence[Any], cfg: OptimConfig) -> dict[str, Any]:
    """``configure_optimizers``' return value: AdamW over ``params`` + a per-step LR schedule."""
    from diffusers.optimization import get_scheduler

    if not params:
        raise ValueError("nothing to train: every parameter is frozen (check the `train` setting)")
    optimizer = torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=cfg.betas,
        weight_decay=cfg.weight_decay,
        eps=cfg.eps,
        fused=use_fused_adamw(params) if cfg.fused is None else cfg.fused or None,
    )
    total = module.trainer.estimated_stepping_batches if module._trainer is not None else 1
    total = int(total) if math.isfinite(total) else 10**9
    scheduler = get_scheduler(
        cfg.schedule, optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=max(total, 1)
    )
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def psnr(prediction: torch.Tensor, target: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """Peak signal-to-noise ratio per image [N], in dB (images in [0, data_range])."""
    mse = ((prediction.float() - target.float()) ** 2).flatten(1).mean(1)
    return 10 * torch.log10(data_range**2 / mse.clamp_min(1e-12))


# ----------------------------------------------------------------------------- logging
class RunTensorBoardLogger(TensorBoardLogger):
    """The default logger: TensorBoard in ``<save_dir or trainer.default_root_dir>/lightning_logs``.

    It is the trainer's default as a one-item list, so ``--trainer.logger+=CSVLogger`` adds to it
    (Lightning's implicit default is not a list: ``+=`` would replace it). A resumed run keeps
    writing into the newest version (see :func:`continue_logger_versions`).
    """

    def __init__(self, save_dir: str | None = None, name: str = "lightning_logs", **kwargs: Any) -> None:
        super().__init__(save_dir if save_dir is not None else ".", name=name, **kwargs)
        self.follows_trainer = save_dir is None


DEFAULT_LOGGER = {"class_path": f"{__name__}.RunTensorBoardLogger"}


def continue_logger_versions(trainer: pl.Trainer) -> None:
    """On resume: TensorBoard loggers without a fixed version keep writing into the newest existing
    ``version_N`` (one run, one curve); the resumed steps continue where the checkpoint stopped."""
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger) and logger._version is None:
            # The newest version_N that holds TensorBoard events (a CSVLogger may share the folder).
            runs = [
                p for p in Path(logger.root_dir).glob("version_*") if any(p.glob("events.out.tfevents.*"))
            ]
            numbers = [int(p.name[len("version_") :]) for p in runs if p.name[len("version_") :].isdigit()]
            if numbers:
                logger._version = max(numbers)
                log.info("TensorBoard: continuing %s", logger.log_dir)


# ----------------------------------------------------------------------------- the CLI
class HintingParser(LightningArgumentParser):
    """LightningCLI's parser with exact option names (no prefix matching: ``--trainer.max_step``
    is an error, not ``max_steps``) and errors that name the closest key and its group's keys."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def option_keys(self) -> list[str]:
        return [o[2:] for a in self._actions for o in a.option_strings if o.startswith("--")]

    def error(self, message: str, ex: Exception | None = None) -> Any:
        return super().error(message + key_hints(message, self.option_keys()), ex)


def key_hints(message: str, keys: Sequence[str]) -> str:
    """For each unknown key in a parser error ``message``: the closest valid key and its group's keys."""
    import difflib
    import re

    unknown = [
        f"{group}.{key}"
        for group, key in re.findall(r"Group '([\w.]+)' does not accept option '([\w.]+)'", message)
    ]
    listed = re.search(r"unrecognized arguments: (.*)", message)
    if listed:
        unknown += [t.split("=", 1)[0][2:] for t in listed.group(1).split() if t.startswith("--")]
    hints = []
    for key in dict.fromkeys(unknown):
        group, _, name = key.rpartition(".")
        siblings = (
            sorted(
                {
                    k[len(group) + 1 :]
                    for k in keys
                    if k.startswith(f"{group}.") and not any(c in k[len(group) + 1 :] for c in ".+")
                }
            )
            if group
            else []
        )
        close = difflib.get_close_matches(name, siblings, n=1, cutoff=0.5)
        best = (
            f"{group}.{close[0]}"
            if close
            else next(iter(difflib.get_close_matches(key, keys, n=1, cutoff=0.6)), None)
        )
        hint = f"\n  '{key}' is not a valid key"
        if best:
            hint += f": did you mean '{best}'?"
        if siblings:
            hint += f" Valid keys in {group}: {', '.join(siblings)}"
        hints.append(hint)
    return "".join(hints)


class RapidCLI(LightningCLI):
    """LightningCLI with rapiddiff's checkpoints, sample grids, Ctrl-C handling and export.

    ``links`` maps an attribute of the built model (``"model.image_size"``) to a data argument
    (``"data.image_size"``) that then follows it instead of being a second setting.
    """

    def __init__(self, *args: Any, links: dict[str, str] | None = None, **kwargs: Any) -> None:
        self.links = dict(links or {})
        kwargs.setdefault("parser_class", HintingParser)
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser: Any) -> None:
        for source, target in self.links.items():
            parser.link_arguments(source, target, apply_on="instantiate")
        parser.add_lightning_class_args(RollingCheckpoint, "checkpoint")
        parser.add_lightning_class_args(SampleGrid, "samples")
        parser.add_lightning_class_args(PlainProgress, "progress")
        parser.add_argument(
            "--ckpt_path",
            default=None,
            help="resume from this checkpoint file; 'last' = last.ckpt in the checkpoint folder (an "
            "error if there is none); 'last-or-new' = that, or a new run when there is none",
        )
        parser.add_argument(
            "--output",
            default=None,
            help="folder for the final model (default: <trainer.default_root_dir>/model)",
        )

    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        config = self._get(self.config_init, "trainer", default={})
        plugins = config.get("plugins") or []
        plugins = plugins if isinstance(plugins, list) else [plugins]
        if not any(isinstance(p, TorchCheckpointIO) for p in plugins) and not _sharded(config):
            plugins.append(AtomicCheckpointIO())
        self.interrupt = GracefulInterrupt()
        callbacks = config.get("callbacks") or []
        callbacks = [*(callbacks if isinstance(callbacks, list) else [callbacks]), self.interrupt]
        kwargs = {"plugins": plugins, "callbacks": callbacks, "use_distributed_sampler": False, **kwargs}
        if _fsdp_strategy(config.get("strategy")) is not config.get("strategy"):
            kwargs["strategy"] = _fsdp_strategy(config.get("strategy"))
        if config.get("precision") is None:  # unset: follow the accelerator
            kwargs["precision"] = auto_precision(config.get("accelerator"))
            log.info("trainer.precision unset: %s on this machine", kwargs["precision"])
        interval = config.get("log_every_n_steps")
        adapted = None if interval is None else adapted_log_interval(interval, config.get("max_steps"))
        if adapted != interval:
            kwargs["log_every_n_steps"] = adapted
            log.info(
                "logging every %d steps (a %s-step run)", kwargs["log_every_n_steps"], config["max_steps"]
            )
        trainer = super().instantiate_trainer(**kwargs)
        for logger in trainer.loggers:
            if isinstance(logger, RunTensorBoardLogger) and logger.follows_trainer:
                logger._root_dir = trainer.default_root_dir
        return trainer


class RapidFSDPStrategy(FSDPStrategy):
    """Lightning's FSDP over the module's own units (``--trainer.strategy=fsdp`` means this).

    The trained submodules the module names (:meth:`RapidModule.fsdp_units`: the U-Net's down/mid/up
    blocks and the U-Net, the knowledge fusion) become FSDP units; the frozen ones
    (:meth:`RapidModule.fsdp_ignored`: VAE, text tower, kept in the training dtype) stay whole on
    every rank, outside the flat parameters (which must share one dtype). Mixed precision is the
    single-GPU/DDP kind: fp32 parameters and gradient reduction, autocast compute, buffers untouched
    (the fusion's TransE tables and relation ids). Checkpoints hold the full state dict (one file, the
    trained weights under their plain names, written atomically, as the other strategies write them).
    """

    def __init__(self, **kwargs: Any) -> None:
        from torch.distributed.fsdp import MixedPrecision

        kwargs.setdefault("state_dict_type", "full")
        kwargs.setdefault("use_orig_params", True)  # frozen and trained weights may share a unit
        kwargs.setdefault("mixed_precision", MixedPrecision(reduce_dtype=torch.float32))
        if kwargs["state_dict_type"] == "full":  # one file from rank 0: written like the others
            kwargs.setdefault("checkpoint_io", AtomicCheckpointIO())
        super().__init__(**kwargs)

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        import functools

        from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

        module = self.lightning_module
        if isinstance(module, RapidModule) and "auto_wrap_policy" not in self.kwargs:
            units = {id(m) for m in module.fsdp_units()}
            ignored = module.fsdp_ignored()
            for part in ignored:  # FSDP moves only what it shards
                part.to(self.root_device)
            self.kwargs["auto_wrap_policy"] = functools.partial(
                lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in units
            )
            self.kwargs["ignored_modules"] = ignored
        if self.root_device.type != "cpu":
            return super()._setup_model(model)
        # On CPU (gloo; tests) FSDP wants the device itself: Lightning passes its index (None).
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=self.root_device,
            **self.kwargs,
        )


def _fsdp_strategy(strategy: Any) -> Any:
    """``fsdp`` (the name) → :class:`RapidFSDPStrategy`; anything else unchanged."""
    return RapidFSDPStrategy() if isinstance(strategy, str) and strategy.lower() == "fsdp" else strategy


def unwrapped_for_export(trainer: pl.Trainer, model: RapidModule) -> RapidModule | None:
    """The module to export from on rank 0 (None on the others): ``model`` itself, or under FSDP a
    plain copy with the gathered full weights (every rank must call this: it is a collective)."""
    if isinstance(trainer.strategy, FSDPStrategy):
        state = trainer.strategy.lightning_module_state_dict()  # full, on rank 0 (CPU)
        return model.unshard_for_export(state) if trainer.is_global_zero else None
    return model if trainer.is_global_zero else None


def _sharded(trainer_config: dict[str, Any]) -> bool:
    """FSDP/DeepSpeed bring their own checkpoint IO (:class:`RapidFSDPStrategy` sets the atomic one
    for its full-state files); leave theirs alone."""
    strategy = trainer_config.get("strategy")
    name = strategy if isinstance(strategy, str) else type(strategy).__name__
    return any(key in str(name).lower() for key in ("fsdp", "deepspeed"))


def run_cli(
    model_class: type[RapidModule],
    datamodule_class: type[pl.LightningDataModule],
    args: list[str] | None,
    *,
    description: str,
    trainer_defaults: dict[str, Any] | None = None,
    prog: str | None = None,
    links: dict[str, str] | None = None,
) -> RapidCLI:
    """Parse ``args``, fit, and export the final model when the run completed (not on Ctrl-C)."""
    defaults = {
        "max_steps": 1000,
        "log_every_n_steps": 10,
        "logger": [DEFAULT_LOGGER],
        **(trainer_defaults or {}),
    }
    with warnings.catch_warnings():
        # `rapiddiff train <stage>` hands LightningCLI its args while sys.argv holds the whole
        # command (which DDP's launcher must see unchanged); the warning about both is noise here.
        warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter.*")
        parser_kwargs = {"description": description, **({"prog": prog} if prog else {})}
        cli = _make_cli(model_class, datamodule_class, args, parser_kwargs, defaults, links)
    trainer, model = cli.trainer, cli.model
    for callback in trainer.checkpoint_callbacks:
        # Resolved now, not in setup: `--ckpt_path last` looks for last.ckpt before setup runs.
        if isinstance(callback, RollingCheckpoint) and callback.dirpath is None:
            callback.dirpath = os.path.join(trainer.default_root_dir, "checkpoints")
    folder = Path(checkpoint_dir(trainer))
    if trainer.is_global_zero:
        remove_stale_temporaries(folder)
    ckpt_path = resolve_ckpt_path(cli.config.get("ckpt_path"), folder)
    if ckpt_path is not None:
        continue_logger_versions(trainer)
    try:
        trainer.fit(model, datamodule=cli.datamodule, ckpt_path=ckpt_path)
    except Exception as err:
        if ckpt_path is not None and is_unsafe_pickle_error(err):
            raise unsafe_pickle_error(f"--ckpt_path {ckpt_path}", err) from err
        raise
    if cli.interrupt.interrupted:
        return cli
    output = cli.config.get("output") or os.path.join(trainer.default_root_dir, "model")
    exporter = unwrapped_for_export(trainer, model)
    if exporter is not None:
        path = exporter.export(Path(output))
        cli.parser.save(cli.config, str(Path(path) / "training_config.yaml"), skip_none=False, overwrite=True)
        log.info("saved the trained model to %s", path)
    trainer.strategy.barrier("export")
    cli.exported = Path(output)  # type: ignore[attr-defined]
    return cli


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


def _make_cli(
    model_class: type[RapidModule],
    datamodule_class: type[pl.LightningDataModule],
    args: list[str] | None,
    parser_kwargs: dict[str, Any],
    defaults: dict[str, Any],
    links: dict[str, str] | None = None,
) -> RapidCLI:
    return RapidCLI(
        model_class,
        datamodule_class,
        args=args,
        run=False,
        save_config_callback=SaveConfigBesideCheckpoints,
        save_config_kwargs={"overwrite": True},
        trainer_defaults=defaults,
        parser_kwargs=parser_kwargs,
        auto_configure_optimizers=False,
        links=links,
    )
