"""Resuming and weight files a user hands in: `--ckpt_path last` that finds nothing stops, stale
temporary checkpoint files are cleaned, and a truncated or code-running weight file is named with
what to do (issue 15 items 4, 8, 10)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from rapiddiff.cli import main
from rapiddiff.models.bundle import load_model_folder
from rapiddiff.models.presets import write_tiny_sd_folder
from tests.train.helpers import REPO, rapiddiff_log, trainer_args, write_pairs


class RunsCode:
    """Unpickling this calls a function (harmless here; a real attack would call os.system)."""

    def __reduce__(self) -> tuple:
        return (print, ("this pickle ran code",))


def upscaler_args(tmp: Path, root: Path, max_steps: int = 1, *extra: str) -> list[str]:
    lr_dir, hr_dir = write_pairs(tmp / "pairs")
    return [
        "train",
        "upscaler",
        f"--config={REPO / 'configs/upscaler/kshapes.yaml'}",
        *trainer_args(root, max_steps, every=1),
        "--model.network.num_feat=8",
        "--model.network.num_conv=2",
        "--model.num_samples=1",
        f"--data.train_lr={lr_dir}",
        f"--data.train_hr={hr_dir}",
        "--data.val_lr=null",
        "--data.val_hr=null",
        "--data.patch_size=4",
        "--data.batch_size=2",
        "--data.num_workers=0",
        "--trainer.val_check_interval=null",
        *extra,
    ]


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


# ------------------------------------------------------------------------------- item 4
def test_ckpt_path_last_without_a_checkpoint_stops_and_names_the_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    root = tmp_path / "run"
    assert main(upscaler_args(tmp_path, root, 1, "--ckpt_path=last")) == 2
    err = capsys.readouterr().err
    assert f"--ckpt_path last: no last.ckpt in {root / 'checkpoints'}" in err
    assert "--ckpt_path last-or-new" in err
    assert not (root / "model").exists()  # nothing trained


def test_ckpt_path_last_or_new_starts_fresh_then_resumes(tmp_path: Path) -> None:
    root = tmp_path / "run"
    assert main(upscaler_args(tmp_path, root, 1, "--ckpt_path=last-or-new")) == 0
    last = root / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 1
    assert main(upscaler_args(tmp_path, root, 2, "--ckpt_path=last")) == 0  # resumes, not a new run
    assert torch.load(last, weights_only=True)["global_step"] == 2


# ------------------------------------------------------------------------------- item 10
def test_stale_temporary_checkpoints_are_removed_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "run"
    folder = root / "checkpoints"
    folder.mkdir(parents=True)
    stale = [folder / ".last.ckpt.k2j4_x.tmp", folder / ".step=0000500.ckpt.a8f1.tmp"]
    for path in stale:
        path.write_bytes(b"\0" * 1000)  # half a checkpoint from a crashed save
    keep = folder / "notes.tmp"
    keep.write_text("not ours")
    with rapiddiff_log(caplog):
        assert main(upscaler_args(tmp_path, root, 1)) == 0
    assert not any(p.exists() for p in stale) and keep.exists()
    assert f"removed {stale[0]}" in caplog.text and "did not finish" in caplog.text


# ------------------------------------------------------------------------------- item 8
def test_ckpt_path_that_would_run_code_is_refused_with_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    root = tmp_path / "run"
    assert main(upscaler_args(tmp_path, root, 1)) == 0
    state = torch.load(root / "checkpoints" / "last.ckpt", weights_only=True)
    evil = tmp_path / "evil.ckpt"
    torch.save({**state, "extra": RunsCode()}, evil)
    assert main(upscaler_args(tmp_path, root, 2, f"--ckpt_path={evil}")) == 2
    err = capsys.readouterr().err
    assert f"--ckpt_path {evil}: refused: it is a pickle that would run code" in err
    assert "print" in err and ".safetensors" in err
    assert "weights_only=False" not in err  # no advice to run the file's code
    assert "this pickle ran code" not in capsys.readouterr().out


def test_truncated_ckpt_path_is_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root = tmp_path / "run"
    assert main(upscaler_args(tmp_path, root, 1)) == 0
    cut = tmp_path / "cut.ckpt"
    shutil.copy(root / "checkpoints" / "last.ckpt", cut)
    truncate(cut)
    assert main(upscaler_args(tmp_path, root, 2, f"--ckpt_path={cut}")) == 2
    err = capsys.readouterr().err
    assert f"--ckpt_path {cut}: truncated" in err and "copy or download it again" in err


@pytest.fixture(scope="module")
def sd_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_sd_folder(tmp_path_factory.mktemp("sd") / "base", text="bert")


@pytest.mark.parametrize("part", ["unet", "vae", "text_encoder"])
def test_truncated_model_part_names_the_file(sd_folder: Path, tmp_path: Path, part: str) -> None:
    folder = shutil.copytree(sd_folder, tmp_path / "model")
    file = next((folder / part).glob("*.safetensors"))
    truncate(file)
    with pytest.raises(ValueError, match=rf"{part}/{file.name}: truncated: .* bytes, but its header says"):
        load_model_folder(folder)


@pytest.mark.parametrize("part", ["unet", "vae", "text_encoder"])
def test_pickled_model_part_that_would_run_code_is_refused(
    sd_folder: Path, tmp_path: Path, part: str, capsys: pytest.CaptureFixture
) -> None:
    from safetensors.torch import load_file

    folder = shutil.copytree(sd_folder, tmp_path / "model")
    file = next((folder / part).glob("*.safetensors"))
    state = load_file(file)
    file.unlink()
    name = "pytorch_model.bin" if part == "text_encoder" else "diffusion_pytorch_model.bin"
    torch.save({**state, "extra": RunsCode()}, folder / part / name)
    with pytest.raises(RuntimeError, match=rf"{part}/{name}: refused: it is a pickle that would run code"):
        load_model_folder(folder)
    assert "this pickle ran code" not in capsys.readouterr().out


# ------------------------------------------------------------------------------- item 13
def test_added_logger_keeps_tensorboard_and_a_resumed_run_continues_its_version(tmp_path: Path) -> None:
    root = tmp_path / "run"
    csv = f'--trainer.logger+={{"class_path": "CSVLogger", "init_args": {{"save_dir": "{root}"}}}}'
    assert main(upscaler_args(tmp_path, root, 1, csv)) == 0
    assert any(root.glob("lightning_logs/version_*/metrics.csv"))  # the CSV was added ...
    tensorboard = root / "lightning_logs"
    assert [p.name for p in tensorboard.glob("version_*") if any(p.glob("events.out.tfevents.*"))] == [
        "version_0"
    ]  # ... to TensorBoard, not instead of it
    assert main(upscaler_args(tmp_path, root, 2, "--ckpt_path=last")) == 0
    versions = sorted(p.name for p in tensorboard.glob("version_*") if any(p.glob("events.out.tfevents.*")))
    assert versions == ["version_0"]  # one run, one curve
    assert len(list((tensorboard / "version_0").glob("events.out.tfevents.*"))) == 2
