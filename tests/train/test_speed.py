"""Training speed switches: fused QKV trains the same function and saves back into diffusers' layout."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from diffusers import UNet2DConditionModel

from rapiddiff.models.presets import unet_config
from rapiddiff.train.speed import SpeedConfig, apply_speedups, unfuse_for_saving
from tests.train.helpers import REPO


def run(unet: torch.nn.Module) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 8, 8, generator=generator)
    context = torch.randn(2, 5, 32, generator=generator)
    return unet(x, torch.tensor([10, 700]), encoder_hidden_states=context).sample


def test_fused_qkv_matches_eager_and_unfuses_the_trained_weights(tmp_path: Path) -> None:
    eager = UNet2DConditionModel(**unet_config("tiny"))
    fused = apply_speedups(copy.deepcopy(eager), SpeedConfig(fuse_qkv=True, channels_last=True))
    torch.testing.assert_close(run(fused), run(eager), rtol=1e-4, atol=1e-5)
    trainable = [p for p in fused.parameters() if p.requires_grad]
    assert not any(
        n.endswith(("to_q.weight", "to_k.weight", "to_v.weight")) and p.requires_grad
        for n, p in fused.named_parameters()
        if ".attn1." in n
    )
    # One optimizer step on the fused model, then back to diffusers' layout: same function.
    optimizer = torch.optim.SGD(trainable, lr=0.1)
    run(fused).square().mean().backward()
    optimizer.step()
    with torch.no_grad():
        trained = run(fused)
    unfuse_for_saving(fused)
    fused.save_pretrained(tmp_path / "unet")
    reloaded = UNet2DConditionModel.from_pretrained(tmp_path / "unet")
    with torch.no_grad():
        torch.testing.assert_close(run(reloaded), trained, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(run(reloaded), run(eager))


def test_throughput_benchmark_runs_at_tiny_size(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench", REPO / "benchmarks" / "train_unet_throughput.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    report = bench.main(
        [
            "--out",
            str(tmp_path),
            "--size",
            "tiny",
            "--device",
            "cpu",
            "--precision",
            "32",
            "--batch",
            "2",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--variants",
            "reference,fuse_qkv",
        ]
    )
    saved = json.loads((tmp_path / "train_unet_throughput.json").read_text())
    assert [r["variant"] for r in saved["results"]] == ["reference", "fuse_qkv"]
    assert all(r["images_per_s"] > 0 for r in report["results"])
    assert (tmp_path / "train_unet_throughput.md").read_text().count("|") > 8
