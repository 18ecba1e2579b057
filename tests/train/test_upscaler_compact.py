"""rapiddiff train upscaler with Real-ESRGAN's compact net: trains, logs the chain's tags, exports, fine-tunes."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from rapiddiff.train import upscaler as upscaler_stage
from tests.train.helpers import REPO, trainer_args, write_pairs


def compact_args(pairs: Path, root: Path, max_steps: int, *extra: str) -> list[str]:
    lr_dir, hr_dir = pairs / "train", pairs / "hr" / "train"
    return [
        f"--config={REPO / 'configs/upscaler/kshapes.yaml'}",  # arch: compact
        *trainer_args(root, max_steps),
        f"--trainer.val_check_interval={max_steps}",
        "--model.network.num_feat=8",
        "--model.network.num_conv=2",
        "--model.num_samples=2",
        f"--data.train_lr={lr_dir}",
        f"--data.train_hr={hr_dir}",
        f"--data.val_lr={lr_dir}",
        f"--data.val_hr={hr_dir}",
        "--data.patch_size=4",
        "--data.batch_size=2",
        "--data.num_workers=0",
        *extra,
    ]


def _scalars(root: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: set[str] = set()
    for events in root.rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        tags |= set(acc.Tags().get("scalars", []))
    return tags


def test_compact_trains_from_the_kshapes_config_and_fine_tunes_from_its_export(tmp_path: Path) -> None:
    from spandrel.architectures.Compact import Compact

    from rapiddiff.models.upscaler import load_upscaler

    write_pairs(tmp_path / "pairs")
    root = tmp_path / "run"
    cli = upscaler_stage.cli_main(compact_args(tmp_path / "pairs", root, 3))
    assert isinstance(cli.model.net, Compact)
    assert {"val/psnr", "val/psnr_bicubic"} <= set(cli.trainer.callback_metrics)
    # benchmarks/kshapes_chain.py reads these two TensorBoard tags.
    assert {"val/psnr", "val/psnr_bicubic"} <= _scalars(root)
    net = load_upscaler(root / "model")
    assert isinstance(net, Compact) and (net.num_feat, net.num_conv, net.scale) == (8, 2, 4)
    assert net.base == "bicubic"  # the kshapes config's; recorded in the file, read back
    assert net(torch.rand(1, 3, 8, 8)).shape == (1, 3, 32, 32)

    # pretrained: the exported compact file is the starting point (network options are not used).
    tuned_root = tmp_path / "tuned"
    cli = upscaler_stage.cli_main(
        compact_args(tmp_path / "pairs", tuned_root, 2, f"--model.pretrained={root / 'model'}")
    )
    start = net.state_dict()
    assert isinstance(cli.model.net, Compact)
    tuned = load_upscaler(tuned_root / "model")
    assert isinstance(tuned, Compact) and (tuned.num_feat, tuned.num_conv) == (8, 2)
    assert cli.model.net.base == tuned.base == "bicubic"  # the file's base, not model.network's default
    changed = [k for k, v in tuned.state_dict().items() if not torch.equal(v, start[k])]
    assert changed, "fine-tuning left every weight as loaded"


def test_network_options_per_architecture() -> None:
    rrdb = upscaler_stage.NetworkConfig()
    assert rrdb.arch == "rrdb"  # the default, for fine-tuning ESRGAN
    assert rrdb.build_kwargs() == {"num_feat": 32, "num_blocks": 6, "scale": 4}
    assert upscaler_stage.NetworkConfig(arch="compact").build_kwargs() == {
        "num_feat": 64,
        "num_conv": 16,
        "base": "nearest",  # Real-ESRGAN's; configs/upscaler/kshapes.yaml sets bicubic
        "scale": 4,
    }
    # An option of the other architecture is ignored, with a warning that names it.
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    upscaler_stage.log.addHandler(handler)
    try:
        kwargs = upscaler_stage.NetworkConfig(arch="compact", num_blocks=3, num_feat=8).build_kwargs()
        assert kwargs == {"num_feat": 8, "num_conv": 16, "base": "nearest", "scale": 4}
        assert upscaler_stage.NetworkConfig(num_conv=4).build_kwargs()["num_blocks"] == 6
        assert "base" not in upscaler_stage.NetworkConfig(base="bicubic").build_kwargs()
    finally:
        upscaler_stage.log.removeHandler(handler)
    assert any("num_blocks=3 is a rrdb option; ignored for arch compact" in m for m in messages), messages
    assert any("num_conv=4 is a compact option; ignored for arch rrdb" in m for m in messages), messages
    assert any("base=bicubic is a compact option; ignored for arch rrdb" in m for m in messages), messages
    with pytest.raises(ValueError, match=r"model.network.base='area'; valid: nearest, bicubic"):
        upscaler_stage.NetworkConfig(arch="compact", base="area")  # type: ignore[arg-type]


@pytest.mark.parametrize("base", ["nearest", "bicubic"])
def test_validation_at_step_0_is_bicubic_only_with_the_bicubic_base(tmp_path: Path, base: str) -> None:
    # The stage's own validation: with the bicubic base an untrained net scores exactly bicubic's
    # PSNR (val/psnr_gain 0), with nearest it starts below it on these smooth pairs.
    from rapiddiff.train.data import PairedImageDataset
    from rapiddiff.train.optim import psnr

    lr_dir, hr_dir = write_pairs(tmp_path / "pairs", n=2)
    pairs = PairedImageDataset(lr_dir, hr_dir, flips=False)
    low = torch.stack([pairs[i]["lr"] for i in range(2)])
    high = torch.stack([pairs[i]["hr"] for i in range(2)])
    torch.manual_seed(0)
    module = upscaler_stage.UpscalerTraining(
        upscaler_stage.NetworkConfig(arch="compact", num_feat=8, num_conv=2, base=base)
    )
    with torch.no_grad():
        ours = psnr(module.net(low).clamp(0, 1), high).mean()
    bicubic = psnr(module.bicubic(low), high).mean()
    if base == "bicubic":
        torch.testing.assert_close(ours, bicubic, rtol=0, atol=0)
    else:
        assert ours < bicubic - 0.5, (ours, bicubic)


def test_unknown_arch_names_the_valid_ones(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=r"'esrgan' is not an upscaler architecture; valid: rrdb, compact"):
        upscaler_stage.NetworkConfig(arch="esrgan")  # type: ignore[arg-type]
    write_pairs(tmp_path / "pairs", n=1)
    with pytest.raises(SystemExit):
        upscaler_stage.cli_main(
            compact_args(tmp_path / "pairs", tmp_path / "run", 1, "--model.network.arch=esrgan")
        )
    err = capsys.readouterr().err
    assert "esrgan" in err and "rrdb" in err and "compact" in err, err


def test_pixel_loss_is_l1_or_mse(tmp_path: Path) -> None:
    from rapiddiff.train.data import PairedImageDataset

    lr_dir, hr_dir = write_pairs(tmp_path / "pairs", n=2)
    pairs = PairedImageDataset(lr_dir, hr_dir, flips=False)
    batch = {
        "lr": torch.stack([pairs[i]["lr"] for i in range(2)]),
        "hr": torch.stack([pairs[i]["hr"] for i in range(2)]),
    }
    network = upscaler_stage.NetworkConfig(arch="compact", num_feat=4, num_conv=1)
    for name, fn in (("l1", torch.nn.functional.l1_loss), ("mse", torch.nn.functional.mse_loss)):
        torch.manual_seed(0)
        module = upscaler_stage.UpscalerTraining(network, pixel_loss=name)  # type: ignore[arg-type]
        with torch.no_grad():
            expected = fn(module.net(batch["lr"]), batch["hr"])
            torch.testing.assert_close(module.training_step(batch, 0), expected)
    with pytest.raises(ValueError, match=r"model.pixel_loss='l2'; valid: l1, mse"):
        upscaler_stage.UpscalerTraining(network, pixel_loss="l2")  # type: ignore[arg-type]
