"""FSDP (``--trainer.strategy=fsdp``): which parts are sharded, and a 2-process run on CPU (gloo)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rapiddiff.train import unet as unet_stage
from tests.train.helpers import launch_train_unet, tiny_unet_args, write_imagefolder


def _store(path: Path) -> Path:
    from rapiddiff.kg.store import KnowledgeStore

    KnowledgeStore.from_arrays(
        ["番茄", "红色", "圆形"],
        ["颜色", "形状"],
        torch.randn(3, 8, generator=torch.Generator().manual_seed(0)),
        torch.randn(2, 8, generator=torch.Generator().manual_seed(1)),
        triples=[(0, 0, 1), (0, 1, 2)],
    ).save(path)
    return path


def test_fsdp_units_hold_every_trained_weight_and_frozen_parts_stay_out(tmp_path: Path) -> None:
    module = unet_stage.LatentDiffusion(
        unet="tiny",
        vae="tiny",
        text_encoder="tiny",
        knowledge=str(_store(tmp_path / "kg")),
        trainable=["unet", "fusion"],
    )
    units, ignored = module.fsdp_units(), module.fsdp_ignored()
    unet = module.unet
    assert {id(b) for b in [*unet.down_blocks, unet.mid_block, *unet.up_blocks, unet]} <= {
        id(u) for u in units
    }
    assert any(u is module.text_encoder.fusion for u in units)
    assert any(m is module.vae for m in ignored) and any(m is module.text_encoder.text_model for m in ignored)
    in_units = {id(p) for u in units for p in u.parameters()}
    in_ignored = {id(p) for m in ignored for p in m.parameters()}
    trained = [p for p in module.parameters() if p.requires_grad]
    assert trained and all(id(p) in in_units for p in trained)
    assert not in_units & in_ignored
    assert all(not p.requires_grad for m in ignored for p in m.parameters())
    # Every weight is in a unit or ignored: the root unit holds none (no mixed dtypes to flatten).
    assert {id(p) for p in module.parameters()} == in_units | in_ignored


@pytest.mark.slow
def test_fsdp_trains_checkpoints_resumes_and_exports_on_two_cpu_processes(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from rapiddiff.models.bundle import load_model_folder

    data = write_imagefolder(tmp_path / "data", n=8)
    store = _store(tmp_path / "kg")
    root = tmp_path / "run"

    def train(steps: int, *extra: str) -> None:
        args = [
            *tiny_unet_args(data, root, max_steps=steps),
            "--trainer.strategy=fsdp",
            "--trainer.devices=2",
            "--trainer.logger=false",
            "--model.ema=null",
            f"--model.knowledge={store}",
            "--model.trainable=[unet,fusion]",
            "--samples.every_n_steps=1000",
            "--samples.at_end=false",
            *extra,
        ]
        result = launch_train_unet(tmp_path, args)
        assert result.returncode == 0, result.stderr[-3000:]

    train(2)
    train(3, "--ckpt_path=last")
    checkpoint = torch.load(root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] == 3
    state = checkpoint["state_dict"]
    assert any(k.startswith("text_encoder.fusion.") for k in state)
    assert not any("_fsdp_wrapped_module" in k or k.startswith("vae.") for k in state)
    exported = load_file(root / "model" / "unet" / "diffusion_pytorch_model.safetensors")
    assert exported.keys() == {k.removeprefix("unet.") for k in state if k.startswith("unet.")}
    for key, value in exported.items():
        assert torch.equal(value, state["unet." + key]), key
    bundle = load_model_folder(root / "model", load_upscaler=False)
    gates = bundle.text_encoder.fusion.gates
    torch.testing.assert_close(gates, state["text_encoder.fusion.gates"])
