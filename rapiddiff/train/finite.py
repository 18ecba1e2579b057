"""Stop training on a NaN or infinite loss before the bad step changes a weight.

Checked every step (:func:`ensure_finite`) or read every N steps and before every save
(:class:`DeferredFiniteCheck`), so no checkpoint ever holds a diverged state.
"""

from __future__ import annotations

import pytorch_lightning as pl
import torch


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
