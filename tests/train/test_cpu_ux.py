"""Training as a user on a CPU sees it (issue 15 items 11, 12): precision and workers follow the
machine when unset, a short run logs its loss, log files get a plain progress line, the sample
grid says what it costs, and `rapiddiff train <stage> --help` answers without importing Lightning."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rapiddiff.cli import main
from rapiddiff.train.data_order import auto_num_workers
from rapiddiff.train.lightning_cli import auto_precision
from tests.train.helpers import REPO, rapiddiff_log, write_imagefolder
from tests.train.test_resume_and_weights import upscaler_args

PRESETS = sorted((REPO / "configs" / "finetune").glob("*.yaml"))


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_fine_tune_presets_leave_precision_and_workers_to_the_machine(path: Path) -> None:
    import yaml

    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert config["trainer"].get("precision") is None
    assert config["data"].get("num_workers") is None


def test_auto_precision_and_workers_follow_the_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert auto_precision("auto") == "32-true"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert auto_num_workers() == 1  # a 2-core CPU: one worker, one core for the step
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert auto_precision("auto") == "bf16-mixed"
    assert auto_precision("cpu") == "32-true"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert auto_num_workers() == 8


def test_a_short_cpu_run_logs_its_loss_shows_progress_and_the_grid_cost(
    tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "run"
    args = upscaler_args(tmp_path, root, 4)
    # As a user runs the preset: its own precision (unset), log interval (50) and worker count (unset).
    args = [a for a in args if not a.startswith(("--trainer.precision", "--trainer.log_every_n_steps"))]
    args = [a for a in args if not a.startswith("--data.num_workers")]
    csv = f'--trainer.logger+={{"class_path": "CSVLogger", "init_args": {{"save_dir": "{root}", "name": "csv"}}}}'
    with rapiddiff_log(caplog):
        assert main([*args, "--progress.every_n_steps=2", csv]) == 0
    out = capsys.readouterr().out  # not a terminal under pytest: the plain lines are on
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/4", "4/4"]
    assert all(" loss " in line and " it/s" in line and "ETA" in line for line in lines)
    metrics = (root / "csv" / "version_0" / "metrics.csv").read_text(encoding="utf-8")
    assert "train/loss" in metrics.splitlines()[0]
    assert sum(1 for row in metrics.splitlines()[1:] if row.split(",")[0]) >= 2  # logged, not silent
    assert "trainer.precision unset: 32-true" in caplog.text
    assert "step 4: drawing the sample grid" in caplog.text and "sample grid drawn in" in caplog.text


def test_the_diffusion_grid_names_its_cost(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from rapiddiff.models.presets import write_tiny_sd_folder
    from tests.train.test_finetune import finetune_args

    data = write_imagefolder(tmp_path / "data")
    base = write_tiny_sd_folder(tmp_path / "base")
    with rapiddiff_log(caplog):
        assert (
            main(
                [
                    "train",
                    "finetune",
                    *finetune_args("configs/finetune/lora.yaml", base, data, tmp_path / "run"),
                ]
            )
            == 0
        )
    assert "drawing the sample grid: 1 prompts × 1 seeds × 2 denoising steps" in caplog.text
    assert "--model.sampling.num_inference_steps" in caplog.text and "--samples.at_end=false" in caplog.text


@pytest.mark.parametrize("stage", ["finetune", "unet", "clip", "vae", "upscaler", "controlnet"])
def test_stage_help_is_fast_and_imports_no_lightning(stage: str) -> None:
    code = (
        "import sys; from rapiddiff.cli import main\n"
        f"try: main(['train', '{stage}', '--help'])\n"
        "except SystemExit: pass\n"
        "heavy = [m for m in ('torch', 'pytorch_lightning', 'diffusers', 'transformers') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "100"}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    elapsed = time.perf_counter() - started
    assert "HEAVY []" in done.stdout, done.stdout[-500:]
    assert "--trainer.max_steps" in done.stdout and "--ckpt_path" in done.stdout
    assert elapsed < 10  # loose: a loaded CI machine; BENCHMARKS.md has the measured time


def test_shipped_help_is_the_parsers_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rapiddiff.train import cli

    # The shipped file matches what LightningCLI prints now (else: python -m rapiddiff.train.cli
    # --write-help). In a clean interpreter: the help lists the Callback subclasses imported so far.
    code = "import sys; from rapiddiff.train.cli import generate_help; sys.stdout.write(generate_help('vae'))"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    live = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert cli.stage_help("vae") == live.stdout
    # A stale file (sources changed since it was written) is not used: the help is regenerated once
    # into the cache and read from there next time.
    monkeypatch.setattr(cli, "HELP_DIR", tmp_path / "none")
    monkeypatch.delenv("RAPIDDIFF_CACHE_DIR", raising=False)  # else it, not XDG_CACHE_HOME, decides
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(cli, "help_fingerprint", lambda: "changed")
    text = cli.stage_help("upscaler")
    assert "--data.patch_size" in text and (tmp_path / "cache/rapiddiff/help/upscaler-changed.txt").is_file()
    monkeypatch.setattr(cli, "generate_help", lambda stage: pytest.fail("regenerated a cached help"))
    assert cli.stage_help("upscaler") == text
