"""The LightningCLI every ``rapiddiff train <stage>`` runs: parse, fit, export.

``--ckpt_path`` resumes, ``--output`` names the folder the final model is exported to; unset
trainer settings follow the machine (:func:`auto_precision`).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ProgressBar
from pytorch_lightning.cli import LightningArgumentParser, LightningCLI
from pytorch_lightning.loggers import TensorBoardLogger
from pytorch_lightning.plugins.io import TorchCheckpointIO

from rapiddiff.data.licenses import copy_licenses_of_sources
from rapiddiff.models.weights import is_unsafe_pickle_error, unsafe_pickle_error
from rapiddiff.train.callbacks import GracefulInterrupt, PlainProgress, SampleGrid, StepProgressBar
from rapiddiff.train.checkpoints import (
    AtomicCheckpointIO,
    RollingCheckpoint,
    SaveConfigBesideCheckpoints,
    checkpoint_dir,
    remove_stale_temporaries,
    resolve_ckpt_path,
)
from rapiddiff.train.fsdp import brings_own_checkpoint_io, fsdp_strategy_named, unwrapped_for_export
from rapiddiff.train.module import RapidModule
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)


def auto_precision(accelerator: Any) -> str:
    """``trainer.precision`` when unset: bf16-mixed on a GPU that has bf16, 16-mixed on an older
    GPU, 32-true on a CPU (where bf16 autocast is slow and fp16 unsupported)."""
    name = str(accelerator or "auto").lower()
    if name in ("auto", "gpu", "cuda") and torch.cuda.is_available():
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    return "32-true"


def adapted_log_interval(log_every_n_steps: int, max_steps: int | None) -> int:
    """A short run logs its loss: at most a tenth of ``max_steps`` between logged steps."""
    if max_steps is None or max_steps <= 0:
        return log_every_n_steps
    return max(1, min(log_every_n_steps, max_steps // 10))


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
        if not any(isinstance(p, TorchCheckpointIO) for p in plugins) and not brings_own_checkpoint_io(
            config
        ):
            plugins.append(AtomicCheckpointIO())
        self.interrupt = GracefulInterrupt()
        callbacks = config.get("callbacks") or []
        callbacks = [*(callbacks if isinstance(callbacks, list) else [callbacks]), self.interrupt]
        callbacks += step_progress_bar(config, callbacks)
        kwargs = {"plugins": plugins, "callbacks": callbacks, "use_distributed_sampler": False, **kwargs}
        if fsdp_strategy_named(config.get("strategy")) is not config.get("strategy"):
            kwargs["strategy"] = fsdp_strategy_named(config.get("strategy"))
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


# Lightning's warnings about what the stages do on purpose: frozen parts (VAE, text tower) stay in
# eval mode, and a stage without validation data returns no validation loader.
INTENDED = (r"Found \d+ module\(s\) in eval mode", r"Total length of `list` across ranks is zero")


class _NoCloudTip(logging.Filter):
    """Drops the advert for Lightning's cloud logger that every trainer prints at start."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in record.getMessage()


def quiet_lightning_tips() -> None:
    """Install :class:`_NoCloudTip` on the loggers Lightning's rank-zero messages go through (once)."""
    for name in ("pytorch_lightning.utilities.rank_zero", "lightning_fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoCloudTip) for f in logger.filters):
            logger.addFilter(_NoCloudTip())


def step_progress_bar(config: dict[str, Any], callbacks: list[Any]) -> list[Any]:
    """The progress bar labelled with steps (:class:`StepProgressBar`), unless the config turns the
    bar off, brings its own, or rich is not installed (Lightning's tqdm bar shows no epoch total)."""
    from pytorch_lightning.callbacks.progress.rich_progress import _RICH_AVAILABLE

    if config.get("enable_progress_bar") is False or not _RICH_AVAILABLE:
        return []
    if any(isinstance(c, ProgressBar) for c in callbacks):
        return []
    return [StepProgressBar()]


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
    quiet_lightning_tips()
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
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, RollingCheckpoint):
            callback.resuming = ckpt_path is not None
    if ckpt_path is not None:
        continue_logger_versions(trainer)
    try:
        with warnings.catch_warnings():
            for message in INTENDED:
                warnings.filterwarnings("ignore", message=message)
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
        for data_dir in copy_licenses_of_sources(data_sources(cli.datamodule), path):
            log.info("licences and attribution of %s copied into %s", data_dir, path)
        log.info("saved the trained model to %s", path)
    trainer.strategy.barrier("export")
    cli.exported = Path(output)  # type: ignore[attr-defined]
    return cli


def data_sources(datamodule: Any) -> list[str]:
    """The training and validation paths a data module reads (whatever its kind)."""
    names = ("train_source", "val_source", "train_lr", "train_hr", "val_lr", "val_hr")
    values = [getattr(datamodule, n, None) for n in names]
    values += [getattr(datamodule, "hparams", {}).get(n) for n in names]
    return [v for v in values if isinstance(v, str | Path)]


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
