"""rapiddiff train vae / upscaler: run from their configs, learn, export what diffusers / spandrel load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rapiddiff.train import upscaler as upscaler_stage
from rapiddiff.train import vae as vae_stage
from tests.train.helpers import REPO, trainer_args, write_imagefolder, write_pairs


def vae_args(data: Path, root: Path, max_steps: int, *extra: str) -> list[str]:
    return [
        f"--config={REPO / 'configs/vae/kshapes.yaml'}",
        *trainer_args(root, max_steps),
        "--trainer.val_check_interval=2",
        "--model.vae=tiny",
        "--model.gan.start_step=1",
        "--model.gan.channels=8",
        "--model.gan.layers=2",
        "--model.num_samples=2",
        f"--data.train={data}",
        f"--data.val={data}",
        "--data.image_size=16",
        "--data.batch_size=2",
        "--data.num_workers=0",
        *extra,
    ]


def test_vae_runs_with_ssim_and_gan_and_exports_an_autoencoderkl(tmp_path: Path) -> None:
    from diffusers import AutoencoderKL

    data = write_imagefolder(tmp_path / "data")
    root = tmp_path / "run"
    cli = vae_stage.cli_main(vae_args(data, root, 3))
    assert cli.trainer.callback_metrics["val/psnr"] > 0
    vae = AutoencoderKL.from_pretrained(root / "model")
    assert vae.config.latent_channels == 4
    assert list(root.rglob("samples/step=*.png"))
    assert list(root.rglob("events.out.tfevents.*"))  # TensorBoard: losses, PSNR, sample grids


def test_exported_scaling_factor_is_one_over_the_training_latents_std(tmp_path: Path) -> None:
    """LDM recipe: the exported factor makes the training data's latents unit-std; a VAE folder
    being fine-tuned keeps its factor (a U-Net may depend on it); calibrate rewrites a folder's."""
    import json

    from diffusers import AutoencoderKL

    from rapiddiff.train.data import open_image_text_dataset

    data = write_imagefolder(tmp_path / "data", n=6)
    root = tmp_path / "run"
    vae_stage.cli_main(vae_args(data, root, 2))
    vae = AutoencoderKL.from_pretrained(root / "model")
    dataset = open_image_text_dataset(data, 16)
    # Independent measurement: every image, several posterior draws, no shared code path.
    with torch.no_grad():
        images = torch.stack([dataset[i]["pixel_values"] for i in range(len(dataset))])
        dist = vae.encode(images).latent_dist
        z = torch.cat([dist.sample(generator=torch.Generator().manual_seed(k)) for k in range(8)])
    factor = vae.config.scaling_factor
    assert factor != 0.18215
    assert abs(float((z * factor).std()) - 1.0) < 0.05, (factor, float(z.std()))
    assert json.loads((root / "model/config.json").read_text())["scaling_factor"] == pytest.approx(factor)

    # Fine-tuning a folder ("auto") keeps its factor.
    fixed = tmp_path / "fixed"
    vae.register_to_config(scaling_factor=0.5)
    vae.save_pretrained(fixed)
    vae_stage.cli_main(vae_args(data, tmp_path / "run2", 1, f"--model.vae={fixed}"))
    assert AutoencoderKL.from_pretrained(tmp_path / "run2/model").config.scaling_factor == 0.5

    # calibrate: --dry-run changes nothing; without it config.json gets the measured factor.
    vae_stage.cli_main(["calibrate", "--vae", str(fixed), "--data", str(data), "--dry-run"])
    assert AutoencoderKL.from_pretrained(fixed).config.scaling_factor == 0.5
    vae_stage.cli_main(["calibrate", "--vae", str(fixed), "--data", str(data)])
    assert abs(AutoencoderKL.from_pretrained(fixed).config.scaling_factor - factor) < 0.05 * factor


def test_vae_reconstruction_improves_when_overfitting() -> None:
    module = vae_stage.VAETraining(vae="tiny")
    images = torch.rand(2, 3, 16, 16) * 2 - 1
    batch = {"pixel_values": images}
    optimizer = torch.optim.AdamW(module.parameters(), lr=2e-3)
    losses = []
    for _ in range(30):
        torch.manual_seed(0)
        loss = module.training_step(batch, 0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], losses


def test_lpips_is_refused_with_the_reason_and_missing_vae_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="LPIPS needs pretrained VGG weights"):
        vae_stage.VAELoss(perceptual="lpips")
    with pytest.raises(FileNotFoundError, match=r"no vae/config\.json"):
        vae_stage.load_vae(str(tmp_path))


def test_upscaler_runs_from_config_and_loads_back_through_spandrel(tmp_path: Path) -> None:
    from rapiddiff.models.upscaler import load_upscaler

    lr_dir, hr_dir = write_pairs(tmp_path / "pairs")
    root = tmp_path / "run"
    cli = upscaler_stage.cli_main(
        [
            f"--config={REPO / 'configs/upscaler/kshapes.yaml'}",
            *trainer_args(root, 3),
            "--trainer.val_check_interval=3",
            "--model.network.num_blocks=1",
            "--model.network.num_feat=8",
            "--model.gan.weight=0.1",
            "--model.gan.start_step=1",
            "--model.gan.channels=8",
            "--model.gan.layers=2",
            "--model.num_samples=2",
            f"--data.train_lr={lr_dir}",
            f"--data.train_hr={hr_dir}",
            f"--data.val_lr={lr_dir}",
            f"--data.val_hr={hr_dir}",
            "--data.patch_size=4",
            "--data.batch_size=2",
            "--data.num_workers=0",
        ]
    )
    metrics = cli.trainer.callback_metrics
    assert {"val/psnr", "val/psnr_bicubic", "val/psnr_gain"} <= set(metrics)
    net = load_upscaler(root / "model")
    out = net(torch.rand(1, 3, 8, 8))
    assert out.shape == (1, 3, 32, 32)
    assert list(root.rglob("samples/step=*.png"))


@pytest.mark.parametrize(
    "network",
    [
        upscaler_stage.RRDBConfig(num_blocks=1, num_feat=16),
        upscaler_stage.NetworkConfig(arch="compact", num_feat=16, num_conv=2),
    ],
    ids=["rrdb", "compact"],
)
def test_upscaler_loss_falls_when_overfitting_a_fixed_batch(tmp_path: Path, network) -> None:
    from rapiddiff.train.data import PairedImageDataset

    lr_dir, hr_dir = write_pairs(tmp_path / "pairs", n=2)
    pairs = PairedImageDataset(lr_dir, hr_dir, flips=False)
    low = torch.stack([pairs[i]["lr"] for i in range(2)])
    high = torch.stack([pairs[i]["hr"] for i in range(2)])
    torch.manual_seed(0)
    module = upscaler_stage.UpscalerTraining(network)
    optimizer = torch.optim.Adam(module.parameters(), lr=2e-3)
    losses = []
    for _ in range(40):
        loss = module.training_step({"lr": low, "hr": high}, 0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_paired_folders_must_match(tmp_path: Path) -> None:
    from rapiddiff.train.data import PairedImageDataset

    lr_dir, hr_dir = write_pairs(tmp_path / "pairs", n=2)
    (hr_dir / "0001.png").rename(hr_dir / "other.png")
    with pytest.raises(ValueError, match="no partner"):
        PairedImageDataset(lr_dir, hr_dir)


def test_hr_subset_pairs_only_the_names_both_folders_hold(tmp_path: Path) -> None:
    from rapiddiff.train.data import PairedImageDataset

    lr_dir, hr_dir = write_pairs(tmp_path / "pairs", n=3)
    (hr_dir / "0001.png").unlink()  # emoji-zh: a glyph without a matching SVG has no hr copy
    with pytest.raises(ValueError, match="hr_subset=True"):
        PairedImageDataset(lr_dir, hr_dir)
    assert PairedImageDataset(lr_dir, hr_dir, hr_subset=True).names == ["0000.png", "0002.png"]
    (hr_dir / "0000.png").rename(hr_dir / "stray.png")  # an hr image without a base one: still an error
    with pytest.raises(ValueError, match="no partner"):
        PairedImageDataset(lr_dir, hr_dir, hr_subset=True)
