"""FSDP over the module's own units, and getting whole weights back out for export."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import FSDPStrategy

from rapiddiff.train.checkpoints import AtomicCheckpointIO
from rapiddiff.train.module import RapidModule


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


def fsdp_strategy_named(strategy: Any) -> Any:
    """``fsdp`` (the name) → :class:`RapidFSDPStrategy`; anything else unchanged."""
    return RapidFSDPStrategy() if isinstance(strategy, str) and strategy.lower() == "fsdp" else strategy


def unwrapped_for_export(trainer: pl.Trainer, model: RapidModule) -> RapidModule | None:
    """The module to export from on rank 0 (None on the others): ``model`` itself, or under FSDP a
    plain copy with the gathered full weights (every rank must call this: it is a collective)."""
    if isinstance(trainer.strategy, FSDPStrategy):
        state = trainer.strategy.lightning_module_state_dict()  # full, on rank 0 (CPU)
        return model.unshard_for_export(state) if trainer.is_global_zero else None
    return model if trainer.is_global_zero else None


def brings_own_checkpoint_io(trainer_config: dict[str, Any]) -> bool:
    """FSDP/DeepSpeed bring their own checkpoint IO (:class:`RapidFSDPStrategy` sets the atomic one
    for its full-state files); leave theirs alone."""
    strategy = trainer_config.get("strategy")
    name = strategy if isinstance(strategy, str) else type(strategy).__name__
    return any(key in str(name).lower() for key in ("fsdp", "deepspeed"))
