"""DeepCache (opt-in step caching): exact where it must be, cached where it says, and the same
option on every path that makes an image (pipeline, fast path, CLI + PNG metadata)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rapiddiff.cli import main
from rapiddiff.infer.pipeline import RapidDiffusionPipeline
from rapiddiff.infer.png import read_png_metadata
from rapiddiff.models.bundle import load_model_folder
from rapiddiff.models.deep_cache import DeepCache, deep_modules, full_steps
from tests.infer.helpers import psnr, task_inputs

GEN = {"seed": 3, "output_type": "np", "progress": False, "knowledge": False}


def _counting(module: torch.nn.Module) -> list[int]:
    """Calls of ``module``'s own computation (a hook on its first resnet, which it calls only when
    it really runs: a cached module returns its kept output without calling its children)."""
    calls = [0]
    module.resnets[0].register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.fixture
def pipe(tiny_model):
    return RapidDiffusionPipeline.from_pretrained(tiny_model)


def test_full_steps_inside_a_cached_run_are_the_exact_unet_bit_for_bit(tiny_folders):
    unet = load_model_folder(tiny_folders["clip"]).unet
    x, ctx = torch.randn(2, 4, 8, 8), torch.randn(2, 7, unet.config.cross_attention_dim)
    ts = [torch.tensor(900 - 100 * k) for k in range(4)]
    with torch.no_grad():
        exact = [unet(x * (k + 1), t, encoder_hidden_states=ctx).sample for k, t in enumerate(ts)]
        with DeepCache.of(unet).active(1) as step:  # N = 1: every evaluation is a full one
            same = []
            for k, t in enumerate(ts):
                step(k)
                same.append(unet(x * (k + 1), t, encoder_hidden_states=ctx).sample)
        with DeepCache.of(unet).active(2) as step:
            cached = []
            for k, t in enumerate(ts):
                step(k)
                cached.append(unet(x * (k + 1), t, encoder_hidden_states=ctx).sample)
            step(1)  # a cached step on the very input of the last full step gives its output
            again = unet(x * 3, ts[2], encoder_hidden_states=ctx).sample
        after = unet(x, ts[0], encoder_hidden_states=ctx).sample
    for a, b in zip(exact, same, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(cached[0], exact[0]) and torch.equal(cached[2], exact[2])
    assert not torch.allclose(cached[1], exact[1], atol=1e-4)  # the shallow branch ran on new input
    assert torch.equal(again, exact[2])
    assert torch.equal(after, exact[0])  # the wrappers are gone after the run
    assert all("forward" not in m.__dict__ for m in unet.modules())


def test_n1_is_the_exact_pipeline_and_n_gt_1_runs_the_full_unet_ceil_steps_over_n_times(pipe):
    exact = pipe("一个番茄", num_inference_steps=7, scheduler="ddim", **GEN)
    assert "deep_cache" not in exact.metadata[0]
    one = pipe("一个番茄", num_inference_steps=7, scheduler="ddim", deep_cache=1, **GEN)
    np.testing.assert_array_equal(one.images, exact.images)

    deep = _counting(pipe.unet.mid_block)
    shallow = [0]
    pipe.unet.down_blocks[0].resnets[0].register_forward_hook(
        lambda *_: shallow.__setitem__(0, shallow[0] + 1)
    )
    for n in (2, 3, 5):
        deep[0] = shallow[0] = 0
        out = pipe("一个番茄", num_inference_steps=7, scheduler="ddim", deep_cache=n, **GEN)
        assert deep[0] == math.ceil(7 / n) == len(full_steps(7, n)), n
        assert shallow[0] == 7  # the shallow branch runs at every step
        assert out.metadata[0]["deep_cache"] == n
        assert 15 < psnr(out.images, exact.images) < math.inf, n  # approximate, not broken
    # PNDM evaluates the U-Net len(timesteps) times (one more than the steps): the rule counts evaluations.
    for scheduler, evaluations in (("pndm", 8), ("dpm++", 7)):
        deep[0] = shallow[0] = 0
        pipe("一个番茄", num_inference_steps=7, scheduler=scheduler, deep_cache=3, **GEN)
        assert (deep[0], shallow[0]) == (math.ceil(evaluations / 3), evaluations), scheduler


def test_batches_img2img_inpaint_and_knowledge_work(pipe, knowledge_model, tmp_path):
    tasks = task_inputs(tmp_path)
    kw = {"num_inference_steps": 5, "output_type": "np", "progress": False, "knowledge": False}
    for task, extra in tasks.items():
        batch = pipe("一个番茄", seed=[4, 9], num_images_per_prompt=2, deep_cache=2, **kw, **extra)
        alone = pipe("一个番茄", seed=9, deep_cache=2, **kw, **extra)
        exact = pipe("一个番茄", seed=9, **kw, **extra)
        # An image depends on its seed and settings, not on its batch.
        np.testing.assert_allclose(batch.images[1], alone.images[0], atol=1e-5, err_msg=task)
        assert psnr(alone.images, exact.images) < math.inf, task
        assert batch.metadata[1]["deep_cache"] == 2
    know = RapidDiffusionPipeline.from_pretrained(knowledge_model)
    on = know("一个番茄", seed=1, deep_cache=3, **{**kw, "knowledge": True})
    off = know("一个番茄", seed=1, deep_cache=3, **kw)
    assert np.abs(on.images - off.images).max() > 1e-4 and on.metadata[0]["knowledge"]


def test_fast_path_runs_the_same_cached_steps(tiny_folders):
    """The GPU-resident loop (here: on the CPU, no graph) gives the eager loop's DeepCache image,
    run after run (its evaluation counter restarts with every run)."""
    from rapiddiff.infer.accelerate import AccelerateConfig, accelerate

    folder = tiny_folders["bert"]
    kw = {**GEN, "num_inference_steps": 6, "num_images_per_prompt": 2, "seed": [1, 2]}
    expected = RapidDiffusionPipeline.from_pretrained(folder)("一个番茄", deep_cache=3, **kw)
    fast = accelerate(
        RapidDiffusionPipeline.from_pretrained(folder),
        AccelerateConfig.off(loop="resident", fuse_qkv=True, cross_kv_cache=True),
    )
    deep = _counting(fast.unet.mid_block)
    for _ in range(2):
        deep[0] = 0
        out = fast("一个番茄", deep_cache=3, **kw)
        np.testing.assert_allclose(out.images, expected.images, atol=1e-5)
        assert deep[0] == math.ceil(7 / 3)  # PNDM: 7 evaluations for 6 steps
    exact = fast("一个番茄", **kw)  # its own loop (the key holds the interval): no cached step
    assert deep[0] == math.ceil(7 / 3) + 7 and np.abs(exact.images - expected.images).max() > 1e-4


def test_compiled_unet_traces_the_cached_steps_in_one_graph_each(tiny_folders):
    """torch.compile(fullgraph=True) — the fast path's setting — takes the wrapped modules (no graph
    break) and gives the eager DeepCache outputs."""
    import torch._dynamo.testing

    unet = load_model_folder(tiny_folders["clip"]).unet
    x, ctx = torch.randn(2, 4, 8, 8), torch.randn(2, 7, unet.config.cross_attention_dim)

    def run() -> list[torch.Tensor]:
        outs = []
        with DeepCache.of(unet).active(2) as step:
            for k in range(4):
                step(k)
                outs.append(unet(x * (k + 1), torch.tensor(900 - 100 * k), encoder_hidden_states=ctx).sample)
        return outs

    with torch.no_grad():
        expected = run()
        counter = (
            torch._dynamo.testing.CompileCounter()
        )  # dynamo's tracing (what fullgraph checks), no codegen
        unet.compile(backend=counter, fullgraph=True, dynamic=False)
        for _ in range(2):
            for a, b in zip(run(), expected, strict=True):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert counter.frame_count <= 3  # full and cached variants, not one per step


def test_cli_records_deep_cache_and_from_png_remakes_the_image(tiny_model, tmp_path, capsys):
    base = ["--model", str(tiny_model), "--steps", "4", "--device", "cpu", "--no-progress", "--seed", "5"]
    assert main(["generate", "一个番茄", *base, "--deep-cache", "2", "--out", str(tmp_path / "a")]) == 0
    first = next((tmp_path / "a").glob("*.png"))
    assert read_png_metadata(first)["deep_cache"] == 2
    assert main(["generate", "--from-png", str(first), "--out", str(tmp_path / "b"), "--no-progress"]) == 0
    again = next((tmp_path / "b").glob("*.png"))
    assert read_png_metadata(again)["deep_cache"] == 2
    from PIL import Image

    np.testing.assert_array_equal(np.asarray(Image.open(first)), np.asarray(Image.open(again)))
    assert main(["generate", "一个番茄", *base, "--out", str(tmp_path / "c")]) == 0
    exact = next((tmp_path / "c").glob("*.png"))
    assert "deep_cache" not in read_png_metadata(exact)
    capsys.readouterr()
    assert main(["generate", "一个番茄", *base, "--deep-cache", "0", "--out", str(tmp_path / "d")]) != 0
    assert "--deep-cache must be an integer ≥ 1" in capsys.readouterr().err
    assert not (tmp_path / "d").exists() or not any((tmp_path / "d").glob("*.png"))


def test_bad_values_and_unknown_unets_are_refused_clearly(pipe):
    for bad in (0, -2, 2.5, True, "3"):
        with pytest.raises(ValueError, match="deep_cache must be an integer ≥ 1"):
            pipe("一个番茄", num_inference_steps=2, deep_cache=bad, **GEN)
    with pytest.raises(ValueError, match="lacks down_blocks"):
        deep_modules(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"layer must be in 0\.\.0"):
        deep_modules(pipe.unet, layer=1)


def test_the_branch_is_the_first_down_layer_and_its_mirror(pipe):
    """Fresh on a cached step: conv_in, the first down block's layer 0 and the last up block's
    layers that read its skip states (SD 1.5: up layers 1 and 2 of 3); the rest is deep."""
    unet = pipe.unet
    deep = {id(m) for m in deep_modules(unet)}
    assert id(unet.mid_block) in deep and all(id(b) in deep for b in unet.up_blocks[:-1])
    assert all(id(b) in deep for b in unet.down_blocks[1:])
    fresh = [unet.down_blocks[0].resnets[0], *unet.up_blocks[-1].resnets, unet.conv_in]
    assert not any(id(m) in deep for m in fresh)
    from diffusers import UNet2DConditionModel

    sd = UNet2DConditionModel(
        block_out_channels=(32, 32, 32, 32), layers_per_block=2, cross_attention_dim=32, norm_num_groups=8
    )
    deep = {id(m) for m in deep_modules(sd)}
    last = sd.up_blocks[-1]
    assert id(last.resnets[0]) in deep and id(last.attentions[0]) in deep
    assert id(last.resnets[1]) not in deep and id(last.resnets[2]) not in deep
    assert id(sd.down_blocks[0].resnets[1]) in deep and id(sd.down_blocks[0].downsamplers[0]) in deep
    assert id(sd.down_blocks[0].resnets[0]) not in deep


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_graph_loop_gives_the_eager_deep_cache_image(tiny_folders, compiled):
    from rapiddiff.infer.accelerate import AccelerateConfig, accelerate

    folder = tiny_folders["bert"]
    kw = {**GEN, "num_inference_steps": 6, "num_images_per_prompt": 2, "seed": [1, 2]}
    eager = RapidDiffusionPipeline.from_pretrained(folder, device="cuda")
    expected = eager("一个番茄", deep_cache=3, **kw)
    config = AccelerateConfig() if compiled else AccelerateConfig(compile_unet=None, compile_vae=None)
    fast = accelerate(RapidDiffusionPipeline.from_pretrained(folder, device="cuda"), config)
    for _ in range(2):  # capture, then replay
        out = fast("一个番茄", deep_cache=3, **kw)
        assert psnr(out.images, expected.images) > 30
    assert fast.report["loop"] == "graph"
