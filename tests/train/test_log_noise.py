"""A tiny ``rapiddiff train unet`` run, fresh and resumed, prints no noise: no warning about the
checkpoint folder we reuse on purpose, no ``Epoch 2/-2``, no routine line logged as a WARNING."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest

from rapiddiff.cli import main
from rapiddiff.train.checkpoints import RollingCheckpoint
from tests.train.helpers import rapiddiff_log, tiny_unet_args, write_imagefolder

NOISE = (
    "exists and is not empty",
    "/-2",
    "/-1",
    "module(s) in eval mode",
    "across ranks is zero",
    "holds 1 checkpoint",
    "litlogger",
)


def _run(args: list[str], caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture) -> str:
    with warnings.catch_warnings(record=True) as caught, rapiddiff_log(caplog):
        warnings.simplefilter("always")
        assert main(["train", "unet", *args]) == 0
    out, err = capfd.readouterr()
    return "\n".join([out, err, caplog.text, *(str(w.message) for w in caught)])


@pytest.mark.slow  # two tiny fits: ~20 s of CPU
def test_a_fresh_and_a_resumed_run_print_no_noise(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture
) -> None:
    data = write_imagefolder(tmp_path / "data", n=4)
    root = tmp_path / "run"
    # As a user runs it: the progress bar on (tests turn it off elsewhere).
    base = [a for a in tiny_unet_args(data, root, 1) if "enable_progress_bar" not in a]
    fresh = _run([*base, "--checkpoint.every_n_train_steps=1", "--samples.every_n_steps=1"], caplog, capfd)
    assert "step 1/1" in fresh  # the bar counts steps (max_steps ends the run)
    assert [n for n in NOISE if n in fresh] == []
    drawn = [r for r in caplog.records if "sample grid drawn in" in r.getMessage()]
    assert drawn and all(r.levelno == logging.INFO for r in drawn)
    caplog.clear()
    resumed = [
        *[a for a in base if not a.startswith("--trainer.max_steps")],
        "--trainer.max_steps=2",
        "--ckpt_path=last",
        "--samples.at_end=false",
    ]
    again = _run(resumed, caplog, capfd)
    assert "resuming from" in again
    assert [n for n in NOISE if n in again] == []


def test_a_new_run_beside_old_checkpoints_is_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / "config.yaml").write_text("x: 1\n", encoding="utf-8")
    callback = RollingCheckpoint(dirpath=str(folder))
    warn = callback._ModelCheckpoint__warn_if_dir_not_empty
    with rapiddiff_log(caplog):
        warn(str(folder))  # only our resolved config: nothing to say
        assert caplog.text == ""
        (folder / "step=0000002.ckpt").write_bytes(b"")
        callback.resuming = True
        warn(str(folder))  # a resume reuses the folder on purpose
        assert caplog.text == ""
        callback.resuming = False
        warn(str(folder))
    assert "holds 1 checkpoint(s) of an earlier run (e.g. step=0000002.ckpt)" in caplog.text
    assert "--ckpt_path last" in caplog.text


def test_lightning_cloud_tip_is_dropped_and_other_lines_kept() -> None:
    from pytorch_lightning.utilities.rank_zero import rank_zero_info

    from rapiddiff.train.lightning_cli import quiet_lightning_tips

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("pytorch_lightning.utilities.rank_zero")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        quiet_lightning_tips()
        quiet_lightning_tips()  # once is enough: no second filter
        rank_zero_info("💡 Tip: try installing [litlogger](https://pypi.org/project/litlogger/)")
        rank_zero_info("GPU available: False, used: False")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    assert seen == ["GPU available: False, used: False"]
    assert sum(type(f).__name__ == "_NoCloudTip" for f in logger.filters) == 1
