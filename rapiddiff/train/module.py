"""The LightningModule base every training stage shares.

Why a per-batch reseed: Lightning checkpoints hold no RNG state, so after a resume the noise,
timesteps, caption dropout and dropout masks would differ. Drawn after
``torch.manual_seed(f(seed, rank, batch))`` they are a function of the batch number alone, and a
resumed run reproduces the uninterrupted run's losses exactly (a test compares them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

from rapiddiff.train.finite import DeferredFiniteCheck
from rapiddiff.train.speed import GRAPH_WARMUP_STEPS


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
