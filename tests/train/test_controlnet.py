"""rapiddiff train controlnet: zero convolutions at zero, runs from its shipped config, resumes
exactly, stops on NaN with the last good checkpoint, exports a folder diffusers loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from rapiddiff.train import controlnet as cn_stage
from rapiddiff.train.finite import NonFiniteLossError
from tests.train.helpers import REPO, read_losses, trainer_args, write_imagefolder


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_imagefolder(tmp_path_factory.mktemp("cn") / "data", n=4, size=16)


def cn_args(base: Path, data: Path, root: Path, max_steps: int, *extra: str) -> list[str]:
    """The shipped kshapes config on the tiny model: only sizes change (and the mask is made on
    the fly: the tiny data has no mask column)."""
    return [
        f"--config={REPO / 'configs/controlnet/kshapes.yaml'}",
        *trainer_args(root, max_steps),
        "--trainer.val_check_interval=null",
        f"--model.pretrained={base}",
        "--model.grid_images=2",
        "--model.sampling.num_inference_steps=2",
        "--model.cache_latents=false",
        f"--data.train={data}",
        "--data.val=null",
        "--data.image_size=16",
        "--data.batch_size=2",
        "--data.num_workers=0",
        "--data.control.column=null",
        *extra,
    ]


def test_zero_convolutions_start_at_zero_so_the_unet_output_is_unchanged(knowledge_model: Path) -> None:
    module = cn_stage.ControlNetTraining(pretrained=str(knowledge_model))
    net = module.controlnet
    zero = [*net.controlnet_down_blocks, net.controlnet_mid_block, net.controlnet_cond_embedding.conv_out]
    assert all(torch.count_nonzero(p) == 0 for m in zero for p in m.parameters())
    # The encoder copy is the U-Net's own (from_unet), and only the ControlNet trains.
    assert torch.equal(
        net.down_blocks[0].resnets[0].conv1.weight, module.unet.down_blocks[0].resnets[0].conv1.weight
    )
    assert {n.split(".")[0] for n, p in module.named_parameters() if p.requires_grad} == {"controlnet"}
    assert module.text_encoder.fusion is not None  # knowledge stays on, as the base has it
    x, t = torch.randn(2, 4, 8, 8), torch.tensor([10, 700])
    context = module.encode_text(["红色的圆形", "番茄"])
    control = torch.rand(2, 3, 16, 16)
    plain = module.unet(x, t, encoder_hidden_states=context).sample
    steered = cn_stage.controlled_model(module.unet, net, control)(x, t, context)
    assert torch.equal(plain, steered)


def test_runs_from_config_and_exports_a_controlnet_diffusers_loads(
    knowledge_model: Path, data: Path, tmp_path: Path
) -> None:
    root = tmp_path / "run"
    # bf16-mixed as on a GPU: the frozen U-Net, VAE and text tower run in bf16, the ControlNet in fp32.
    cn_stage.cli_main(cn_args(knowledge_model, data, root, 3, "--trainer.precision=bf16-mixed"))
    names = {p.name for p in (root / "checkpoints").glob("*.ckpt")}
    assert names >= {"step=0000002.ckpt", "last.ckpt"}
    grids = sorted(root.rglob("samples/step=*.png"))
    assert [g.name for g in grids] == ["step=0000002.png", "step=0000003.png"]
    with Image.open(grids[-1]) as grid:  # one row per item: control | with | without, 16² each
        assert grid.size == (3 * 16 + 4, 2 * 16 + 6)
    from diffusers import ControlNetModel

    net = ControlNetModel.from_pretrained(root / "model")
    assert (root / "model" / "diffusion_pytorch_model.safetensors").is_file()
    info = json.loads((root / "model" / cn_stage.CONTROLNET_INFO).read_text(encoding="utf-8"))
    assert info["conditioning"] == "mask" and info["base_model_path"] == str(knowledge_model)
    assert info["image_size"] == 16 and info["conditioning_channels"] == 3
    assert cn_stage.read_controlnet_info(root / "model") == info
    assert (root / "model" / "training_config.yaml").is_file()
    assert torch.count_nonzero(net.controlnet_mid_block.weight) > 0  # trained away from zero


@pytest.fixture(scope="module")
def uninterrupted(knowledge_model: Path, data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("whole")
    cn_stage.cli_main(
        cn_args(
            knowledge_model, data, root, 4,
            "--trainer.callbacks+=tests.train.helpers.RecordLosses", f"--trainer.callbacks.path={root / 'a.txt'}",
            "--model.control_dropout=0.5",
        )
    )  # fmt: skip
    return root


def test_resume_from_last_continues_the_same_steps_and_losses(
    knowledge_model: Path, data: Path, tmp_path: Path, uninterrupted: Path
) -> None:
    parts = tmp_path / "parts"
    record = "--trainer.callbacks+=tests.train.helpers.RecordLosses"
    common = ("--model.control_dropout=0.5",)
    cn_stage.cli_main(
        cn_args(
            knowledge_model, data, parts, 4, *common, record, f"--trainer.callbacks.path={tmp_path / 'b.txt'}",
            "--trainer.callbacks+=tests.train.helpers.SendCtrlC", "--trainer.callbacks.step=2",
        )
    )  # fmt: skip
    assert max(read_losses(tmp_path / "b.txt")) == 2 and not (parts / "model").exists()
    cn_stage.cli_main(
        cn_args(
            knowledge_model, data, parts, 4, *common, record, f"--trainer.callbacks.path={tmp_path / 'c.txt'}",
            "--ckpt_path=last",
        )
    )  # fmt: skip
    assert sorted(read_losses(tmp_path / "c.txt")) == [3, 4]
    resumed = {**read_losses(tmp_path / "b.txt"), **read_losses(tmp_path / "c.txt")}
    assert resumed == read_losses(uninterrupted / "a.txt")  # exactly: order, noise, dropouts, optimizer
    from safetensors.torch import load_file

    ours = load_file(parts / "model" / "diffusion_pytorch_model.safetensors")
    theirs = load_file(uninterrupted / "model" / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(
    knowledge_model: Path, data: Path, tmp_path: Path
) -> None:
    root = tmp_path / "run"
    args = cn_args(
        knowledge_model, data, root, 4,
        "--trainer.callbacks+=tests.train.helpers.PoisonWeights", "--trainer.callbacks.step=3",
    )  # fmt: skip
    with pytest.raises(NonFiniteLossError, match="step 3"):
        cn_stage.cli_main(args)
    assert {p.name for p in (root / "checkpoints").glob("*.ckpt")} == {"step=0000002.ckpt", "last.ckpt"}
    module = cn_stage.ControlNetTraining.load_from_checkpoint(root / "checkpoints" / "last.ckpt")
    assert all(torch.isfinite(p).all() for p in module.controlnet.parameters())
    assert torch.count_nonzero(module.controlnet.controlnet_mid_block.weight) > 0  # the trained weights
    assert not (root / "model").exists()


def test_a_typo_in_the_config_names_the_valid_key(
    knowledge_model: Path, data: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit):
        cn_stage.cli_main(cn_args(knowledge_model, data, tmp_path, 1, "--model.control_dropot=0.1"))
    assert "did you mean 'model.control_dropout'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"speed": {"cuda_graph": True}}, "speed.cuda_graph is not supported"),
        ({"control_dropout": 1.5}, r"control_dropout must be in \[0, 1\]"),
        ({"pretrained": None}, "model.pretrained is required"),
    ],
)
def test_bad_settings_raise_clear_errors(knowledge_model: Path, options: dict, match: str) -> None:
    from rapiddiff.train.speed import SpeedConfig

    if "speed" in options:
        options = {"speed": SpeedConfig(**options["speed"])}
    with pytest.raises(ValueError, match=match):
        cn_stage.ControlNetTraining(**{"pretrained": str(knowledge_model), **options})


def test_conditioning_embedding_lands_at_the_latent_size() -> None:
    assert cn_stage.conditioning_channels_for(8) == (16, 32, 96, 256)
    assert cn_stage.conditioning_channels_for(2) == (16, 32)
    with pytest.raises(ValueError, match="VAE factor"):
        cn_stage.conditioning_channels_for(3)


def test_loss_falls_when_overfitting_one_batch_through_the_controlnet_alone(
    knowledge_model: Path, data: Path
) -> None:
    from rapiddiff.train.controlnet_data import ControlImageTextData, ControlSource

    module = cn_stage.ControlNetTraining(
        pretrained=str(knowledge_model), loss=cn_stage.DiffusionLoss(caption_dropout=0.0)
    )
    dm = ControlImageTextData(
        str(data), image_size=16, batch_size=2, num_workers=0, control=ControlSource("mask")
    )
    dm.setup("fit")
    batch = next(iter(torch.utils.data.DataLoader(dm.train_set, batch_size=2)))
    unet_before = {k: v.clone() for k, v in module.unet.state_dict().items()}
    optimizer = torch.optim.AdamW(module.trainable_parameters(), lr=2e-3)
    losses = []
    for _ in range(25):
        torch.manual_seed(0)  # the same noise and timesteps every step: a fixed target
        loss = module.training_step(batch, 0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
    assert all(torch.equal(v, module.unet.state_dict()[k]) for k, v in unet_before.items())  # frozen


@pytest.mark.gpu
def test_trains_on_the_gpu_in_bf16_and_exports(knowledge_model: Path, data: Path, tmp_path: Path) -> None:
    root = tmp_path / "run"
    gpu = ("--trainer.accelerator=gpu", "--trainer.precision=bf16-mixed", "--model.speed.channels_last=true")
    cn_stage.cli_main(cn_args(knowledge_model, data, root, 4, *gpu))
    from diffusers import ControlNetModel

    net = ControlNetModel.from_pretrained(root / "model")
    assert all(p.dtype == torch.float32 for p in net.parameters())
    assert torch.count_nonzero(net.controlnet_mid_block.weight) > 0
