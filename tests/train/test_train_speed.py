"""The small-model speed switches train what the plain step trains.

On CPU the CUDA-graph step runs uncaptured (the same static buffers, backward hand-off and
gradient ownership); the ``gpu`` test captures it for real and compares against the plain step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rapiddiff.train import unet as unet_stage
from rapiddiff.train.speed import GRAPH_WARMUP_STEPS, SpeedConfig, lerp_ema
from tests.train.helpers import read_losses, tiny_unet_args, write_imagefolder

FAST = [
    "--model.cache_latents=true",
    "--model.speed.gpu_data=true",
    "--model.speed.foreach_ema=true",
    "--model.speed.cuda_graph=true",
]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_imagefolder(tmp_path_factory.mktemp("speed") / "data", n=6)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rapiddiff.kg.store import KnowledgeStore

    path = tmp_path_factory.mktemp("kg") / "kg"
    KnowledgeStore.from_arrays(
        ["番茄", "红色", "圆形", "方形"],
        ["颜色", "形状"],
        torch.randn(4, 8, generator=torch.Generator().manual_seed(0)),
        torch.randn(2, 8, generator=torch.Generator().manual_seed(1)),
        triples=[(0, 0, 1), (0, 1, 2)],
    ).save(path)
    return path


def losses(data: Path, root: Path, steps: int, *extra: str) -> dict[int, float]:
    record = root / "losses.txt"
    unet_stage.cli_main(
        [
            *tiny_unet_args(data, root, steps),
            "--trainer.callbacks+=tests.train.helpers.RecordLosses",
            f"--trainer.callbacks.path={record}",
            "--model.loss.caption_dropout=0.5",  # both branches of the dropout gather get used
            *extra,
        ]
    )
    return read_losses(record)


@pytest.mark.parametrize(
    ("shared", "fast_only"),
    [
        ([], ["--model.speed.cache_text=true"]),  # frozen text: caption states cached on the device
        (["--model.trainable=[unet,fusion]"], []),  # fusion trains through the graph's input gradient
    ],
    ids=["cache_text", "fusion"],
)
def test_fast_step_reproduces_the_plain_losses_and_weights(
    data: Path, store: Path, tmp_path: Path, shared: list[str], fast_only: list[str]
) -> None:
    from safetensors.torch import load_file

    steps = GRAPH_WARMUP_STEPS + 3  # eager warm-up steps, then the graph step
    shared = [f"--model.knowledge={store}", *shared]
    plain = losses(data, tmp_path / "plain", steps, *shared)
    fast = losses(data, tmp_path / "fast", steps, *shared, *FAST, *fast_only)
    assert sorted(fast) == sorted(plain) == list(range(1, steps + 1))
    for step in plain:
        assert fast[step] == pytest.approx(plain[step], rel=1e-4, abs=1e-6), step
    weights = "model/unet/diffusion_pytorch_model.safetensors"
    ours, theirs = load_file(tmp_path / "fast" / weights), load_file(tmp_path / "plain" / weights)
    # Adam divides by sqrt(v): a near-zero gradient that differs in its last bits moves a weight by
    # up to lr (2e-4) a step, so the weights agree to a few lr, not to rounding.
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-3, atol=2e-3)


def test_fast_step_resumes_exactly(data: Path, tmp_path: Path) -> None:
    # Stopped (Ctrl-C) after the graph was captured, resumed: the capture is rebuilt from the
    # restored state and the losses go on exactly as in the uninterrupted run.
    whole = losses(data, tmp_path / "whole", 6, *FAST)
    stop = ["--trainer.callbacks+=tests.train.helpers.SendCtrlC", "--trainer.callbacks.step=4"]
    first = losses(data, tmp_path / "parts", 6, *FAST, *stop)
    (tmp_path / "parts" / "losses.txt").unlink()
    rest = losses(data, tmp_path / "parts", 6, *FAST, "--ckpt_path=last")
    assert sorted(first) == [1, 2, 3, 4] and sorted(rest) == [5, 6]
    assert {**first, **rest} == whole


def test_lerp_ema_matches_diffusers_ema_and_shares_its_state() -> None:
    from diffusers.training_utils import EMAModel

    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    ours = lerp_ema(params, decay=0.99, use_ema_warmup=True, power=2 / 3, foreach=True)
    theirs = EMAModel(params, decay=0.99, use_ema_warmup=True, power=2 / 3, foreach=True)
    for _ in range(5):
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn_like(p))
        ours.step(params)
        theirs.step(params)
    for a, b in zip(ours.shadow_params, theirs.shadow_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    state = ours.state_dict()
    assert state.keys() == theirs.state_dict().keys()
    theirs.load_state_dict(state)  # a checkpoint of one resumes the other


@pytest.mark.parametrize(
    ("speed", "options", "match"),
    [
        (SpeedConfig(gpu_data=True), {}, "cache_latents"),
        (SpeedConfig(cache_text=True), {"cache_latents": True}, "gpu_data"),
        (
            SpeedConfig(gpu_data=True, cache_text=True),
            {"cache_latents": True, "trainable": ["unet", "text_encoder"]},
            "frozen text side",
        ),
        (SpeedConfig(cuda_graph=True, compile=True), {}, "choose one"),
    ],
)
def test_speed_switches_that_cannot_work_together_say_why(
    speed: SpeedConfig, options: dict, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        unet_stage.LatentDiffusion(unet="tiny", vae="tiny", text_encoder="tiny", speed=speed, **options)


@pytest.mark.gpu
def test_captured_step_matches_the_plain_step_on_the_gpu(data: Path, store: Path, tmp_path: Path) -> None:
    steps = GRAPH_WARMUP_STEPS + 5
    gpu = ["--trainer.accelerator=gpu", "--trainer.precision=bf16-mixed", f"--model.knowledge={store}"]
    fusion = "--model.trainable=[unet,fusion]"
    plain = losses(data, tmp_path / "plain", steps, *gpu, fusion)
    fast = losses(data, tmp_path / "fast", steps, *gpu, fusion, *FAST, "--model.optim.fused=true")
    for step in plain:
        assert fast[step] == pytest.approx(plain[step], rel=2e-2, abs=1e-4), step
