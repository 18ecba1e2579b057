"""Token merging (ToMe, opt-in): the merge itself, exact when off, deterministic, and the same
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
from rapiddiff.models.token_merge import (
    TokenMerge,
    destination_pattern,
    match,
    merge,
    merged_blocks,
    unmerge,
)
from tests.infer.helpers import psnr, task_inputs

GEN = {"seed": 3, "output_type": "np", "progress": False, "knowledge": False}


@pytest.fixture
def pipe(tiny_model):
    return RapidDiffusionPipeline.from_pretrained(tiny_model)


def test_destination_pattern_one_per_cell_fixed_per_index():
    for h, w in ((4, 4), (6, 8), (5, 7)):
        perm, num_dst = destination_pattern(h, w, 0)
        assert num_dst == (h // 2) * (w // 2)
        assert sorted(perm.tolist()) == list(range(h * w))  # a permutation of the tokens
        grid = torch.zeros(h * w, dtype=torch.int64)
        grid[perm[:num_dst]] = 1
        grid = grid.view(h, w)
        cells = grid[: h // 2 * 2, : w // 2 * 2].reshape(h // 2, 2, w // 2, 2).sum(dim=(1, 3))
        assert bool((cells == 1).all())  # exactly one destination in every full 2×2 cell
        assert int(grid.sum()) == num_dst  # the leftover row/column holds only sources
    assert torch.equal(destination_pattern(8, 8, 3)[0], destination_pattern(8, 8, 3)[0])
    assert len({tuple(destination_pattern(8, 8, i)[0][:16].tolist()) for i in range(6)}) > 1


def test_merge_then_unmerge_shapes_and_values():
    g = torch.Generator().manual_seed(0)
    h = w = 6
    perm, num_dst = destination_pattern(h, w, 1)
    x = torch.randn(3, h * w, 5, generator=g)
    for r in (0, 4, 18, 27):
        plan = match(x, perm, num_dst, r)
        merged = merge(x, plan)
        assert merged.shape == (3, h * w - r, 5)
        back = unmerge(merged, plan)
        assert back.shape == x.shape
        # the destinations are means of themselves and their sources; every token takes its row
        src_pos, dst_pos, unm, moved, dst_of, _ = plan
        kept = back.gather(1, src_pos[unm][..., None].expand(-1, -1, 5))
        torch.testing.assert_close(kept, x.gather(1, src_pos[unm][..., None].expand(-1, -1, 5)))
        if r:
            b, s = 1, 0
            d = int(dst_of[b, s])
            members = [int(dst_pos[d])] + [
                int(src_pos[moved[b, k]]) for k in range(r) if int(dst_of[b, k]) == d
            ]
            torch.testing.assert_close(back[b, int(src_pos[moved[b, s]])], x[b, members].mean(0))
    # Tokens equal within each cell merge into their own cell's destination: unmerge ∘ merge = id.
    cell = torch.randn(2, h // 2, w // 2, 5, generator=g)
    x = cell.repeat_interleave(2, 1).repeat_interleave(2, 2).reshape(2, h * w, 5)
    plan = match(x, perm, num_dst, 27)
    torch.testing.assert_close(unmerge(merge(x, plan), plan), x)


def test_ratio_0_is_the_exact_path_bit_for_bit_and_the_wrappers_leave(pipe):
    exact = pipe("一个番茄", num_inference_steps=4, **GEN)
    off = pipe("一个番茄", num_inference_steps=4, token_merge=0, **GEN)
    np.testing.assert_array_equal(off.images, exact.images)
    assert "token_merge" not in off.metadata[0]
    merged = pipe("一个番茄", num_inference_steps=4, token_merge=0.5, **GEN)
    assert all("forward" not in m.__dict__ for m in pipe.unet.modules())  # gone after the run
    after = pipe("一个番茄", num_inference_steps=4, **GEN)
    np.testing.assert_array_equal(after.images, exact.images)
    assert merged.metadata[0]["token_merge"] == 0.5


def test_merged_run_differs_but_stays_close_and_repeats_for_a_seed(pipe):
    blocks, level = merged_blocks(pipe.unet)
    assert level == 1 and len(blocks) == 3  # the tiny preset: no attention at its first level
    tokens: list[int] = []  # what each merged block's self-attention computes on (its query projection)
    for block in blocks:
        block.attn1.to_q.register_forward_hook(lambda _m, args, _o: tokens.append(args[0].shape[1]))
    exact = pipe("一个番茄", num_inference_steps=6, scheduler="ddim", **GEN)
    assert tokens == [16] * 6 * len(blocks)  # 8² latents: a 4×4 grid at level 1
    tokens.clear()
    out = pipe("一个番茄", num_inference_steps=6, scheduler="ddim", token_merge=0.5, **GEN)
    assert tokens == [8] * 6 * len(blocks)  # every evaluation, every block: 16 − int(0.5·16)
    again = pipe("一个番茄", num_inference_steps=6, scheduler="ddim", token_merge=0.5, **GEN)
    np.testing.assert_array_equal(out.images, again.images)  # deterministic for a seed (CPU)
    assert 20 < psnr(out.images, exact.images) < math.inf
    stronger = pipe("一个番茄", num_inference_steps=6, scheduler="ddim", token_merge=0.75, **GEN)
    assert psnr(stronger.images, out.images) < math.inf


def test_batches_img2img_inpaint_knowledge_and_lora_work(
    pipe, knowledge_model, tiny_folders, diffusers_lora, tmp_path
):
    tasks = task_inputs(tmp_path)
    kw = {"num_inference_steps": 5, "output_type": "np", "progress": False, "knowledge": False}
    for task, extra in tasks.items():
        batch = pipe("一个番茄", seed=[4, 9], num_images_per_prompt=2, token_merge=0.5, **kw, **extra)
        alone = pipe("一个番茄", seed=9, token_merge=0.5, **kw, **extra)
        exact = pipe("一个番茄", seed=9, **kw, **extra)
        # An image depends on its seed and settings, not on its batch.
        np.testing.assert_allclose(batch.images[1], alone.images[0], atol=1e-5, err_msg=task)
        assert psnr(alone.images, exact.images) < math.inf, task
        assert batch.metadata[1]["token_merge"] == 0.5
    know = RapidDiffusionPipeline.from_pretrained(knowledge_model)
    on = know("一个番茄", seed=1, token_merge=0.5, **{**kw, "knowledge": True})
    off = know("一个番茄", seed=1, token_merge=0.5, **kw)
    assert np.abs(on.images - off.images).max() > 1e-4 and on.metadata[0]["knowledge"]
    lora = RapidDiffusionPipeline.from_pretrained(tiny_folders["clip"])
    plain = lora("a tomato", seed=1, token_merge=0.5, **kw)
    lora.load_lora(diffusers_lora, scale=0.7)
    with_lora = lora("a tomato", seed=1, token_merge=0.5, **kw)
    assert np.abs(with_lora.images - plain.images).max() > 1e-4
    assert with_lora.metadata[0]["lora"] and with_lora.metadata[0]["token_merge"] == 0.5


def test_fast_path_resident_loop_gives_the_eager_merged_image(tiny_folders):
    """The GPU-resident loop (here: on the CPU, no graph) gives the eager loop's ToMe image, run
    after run (its evaluation counter restarts with every run), and its own loop for ratio 0."""
    from rapiddiff.infer.accelerate import AccelerateConfig, accelerate

    folder = tiny_folders["bert"]
    kw = {**GEN, "num_inference_steps": 6, "num_images_per_prompt": 2, "seed": [1, 2]}
    eager = RapidDiffusionPipeline.from_pretrained(folder)
    expected = eager("一个番茄", token_merge=0.5, **kw)
    exact = eager("一个番茄", **kw)
    fast = accelerate(
        RapidDiffusionPipeline.from_pretrained(folder),
        AccelerateConfig.off(loop="resident", fuse_qkv=True, cross_kv_cache=True),
    )
    for _ in range(2):
        out = fast("一个番茄", token_merge=0.5, **kw)
        np.testing.assert_allclose(out.images, expected.images, atol=1e-5)
    np.testing.assert_allclose(fast("一个番茄", **kw).images, exact.images, atol=1e-5)
    both = fast("一个番茄", token_merge=0.5, deep_cache=2, **kw)  # the two approximations compose
    np.testing.assert_allclose(
        both.images, eager("一个番茄", token_merge=0.5, deep_cache=2, **kw).images, atol=1e-5
    )


def test_compiled_unet_traces_the_merged_blocks_without_a_graph_break(tiny_folders):
    """torch.compile(fullgraph=True) — the fast path's setting — takes the wrapped blocks and gives
    the eager merged outputs, one trace for all evaluations (the pattern is a tensor input)."""
    import torch._dynamo.testing

    unet = load_model_folder(tiny_folders["clip"]).unet
    x, ctx = torch.randn(2, 4, 8, 8), torch.randn(2, 7, unet.config.cross_attention_dim)

    def run() -> list[torch.Tensor]:
        outs = []
        with TokenMerge.of(unet).active(0.5, (8, 8), x.device) as step:
            for k in range(4):
                step(k)
                outs.append(unet(x * (k + 1), torch.tensor(900 - 100 * k), encoder_hidden_states=ctx).sample)
        return outs

    with torch.no_grad():
        expected = run()
        exact = unet(x, torch.tensor(900), encoder_hidden_states=ctx).sample
        assert not torch.allclose(expected[0], exact, atol=1e-5)
        counter = torch._dynamo.testing.CompileCounter()
        unet.compile(backend=counter, fullgraph=True, dynamic=False)
        for _ in range(2):
            for a, b in zip(run(), expected, strict=True):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert counter.frame_count <= 2


def test_cli_records_token_merge_and_from_png_remakes_the_image(tiny_model, tmp_path, capsys):
    base = ["--model", str(tiny_model), "--steps", "4", "--device", "cpu", "--no-progress", "--seed", "5"]
    assert main(["generate", "一个番茄", *base, "--token-merge", "0.5", "--out", str(tmp_path / "a")]) == 0
    first = next((tmp_path / "a").glob("*.png"))
    assert read_png_metadata(first)["token_merge"] == 0.5
    assert main(["generate", "--from-png", str(first), "--out", str(tmp_path / "b"), "--no-progress"]) == 0
    again = next((tmp_path / "b").glob("*.png"))
    assert read_png_metadata(again)["token_merge"] == 0.5
    from PIL import Image

    np.testing.assert_array_equal(np.asarray(Image.open(first)), np.asarray(Image.open(again)))
    assert main(["generate", "一个番茄", *base, "--out", str(tmp_path / "c")]) == 0
    assert "token_merge" not in read_png_metadata(next((tmp_path / "c").glob("*.png")))
    capsys.readouterr()
    assert main(["generate", "一个番茄", *base, "--token-merge", "0.9", "--out", str(tmp_path / "d")]) != 0
    assert "--token-merge must be a number in [0, 0.75]" in capsys.readouterr().err
    assert not (tmp_path / "d").exists() or not any((tmp_path / "d").glob("*.png"))


def test_bad_ratios_and_unets_without_attention_are_refused_clearly(pipe):
    for bad in (-0.1, 0.8, 1, math.nan, True, "0.5"):
        with pytest.raises(ValueError, match=r"token_merge must be a number in \[0, 0.75\]"):
            pipe("一个番茄", num_inference_steps=2, token_merge=bad, **GEN)
    with pytest.raises(ValueError, match="lacks down_blocks"):
        merged_blocks(torch.nn.Linear(2, 2))
    unet = pipe.unet
    with torch.no_grad(), TokenMerge.of(unet).active(0.5, (16, 16), "cpu") as step:
        step(0)
        with pytest.raises(ValueError, match=r"got 16 tokens, expected 8×8"):
            unet(torch.randn(1, 4, 8, 8), 10, encoder_hidden_states=torch.randn(1, 7, 32))
    assert all("forward" not in m.__dict__ for m in unet.modules())
    from diffusers import UNet2DConditionModel

    plain = UNet2DConditionModel(
        block_out_channels=(32, 32),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        layers_per_block=1,
        cross_attention_dim=32,
        norm_num_groups=8,
    )
    with pytest.raises(ValueError, match="no self-attention transformer blocks"):
        TokenMerge.of(plain)


def test_sd15_layout_merges_the_first_level_only():
    """SD 1.x: the 64² level's five transformer blocks (tomesd's max_downsample=1), not the others."""
    from diffusers import UNet2DConditionModel

    sd = UNet2DConditionModel(
        block_out_channels=(32, 32, 32, 32), layers_per_block=2, cross_attention_dim=32, norm_num_groups=8
    )
    blocks, level = merged_blocks(sd)
    first = [tb for a in sd.down_blocks[0].attentions for tb in a.transformer_blocks]
    last = [tb for a in sd.up_blocks[-1].attentions for tb in a.transformer_blocks]
    assert level == 0 and [id(b) for b in blocks] == [id(b) for b in first + last] and len(blocks) == 5
    heads = sd.down_blocks[0].attentions[0].transformer_blocks[0].attn1.heads
    # 64² latents at 0.5: the fast path times a backend for the 2,048-token self-attention too
    assert TokenMerge(sd).attention_shapes((64, 64), 0.5) == {(2048, 2048, heads, 32 // heads)}


@pytest.mark.gpu
def test_gpu_captured_unet_call_equals_the_eager_merged_call():
    """One merged U-Net evaluation recorded in a CUDA graph and replayed gives the eager merged
    output (fp16; the merge's atomic adds may reorder), far from the exact output."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        layers_per_block=1,
        cross_attention_dim=32,
        norm_num_groups=8,
        sample_size=16,
    )
    unet = unet.to("cuda", torch.float16).eval()
    x = torch.randn(2, 4, 16, 16, device="cuda", dtype=torch.float16)
    ctx = torch.randn(2, 7, 32, device="cuda", dtype=torch.float16)
    t = torch.tensor(500, device="cuda")

    def call() -> torch.Tensor:
        return unet(x, t, encoder_hidden_states=ctx).sample

    with torch.no_grad():
        exact = call()
        with TokenMerge.of(unet).active(0.5, (16, 16), x.device) as step:
            step(2)
            eager = call()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                call()  # warm-up outside the capture (cuBLAS handles)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static = call()
            graph.replay()
            torch.cuda.synchronize()
    assert float((static - eager).abs().max()) < 0.01
    assert float((eager - exact).abs().max()) > 0.02  # (0.06 on the CPU in float32)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_graph_loop_gives_the_eager_token_merge_image(tiny_folders, compiled):
    from rapiddiff.infer.accelerate import AccelerateConfig, accelerate

    folder = tiny_folders["bert"]
    kw = {**GEN, "num_inference_steps": 6, "num_images_per_prompt": 2, "seed": [1, 2]}
    eager = RapidDiffusionPipeline.from_pretrained(folder, device="cuda")
    expected = eager("一个番茄", token_merge=0.5, **kw)
    config = AccelerateConfig() if compiled else AccelerateConfig(compile_unet=None, compile_vae=None)
    fast = accelerate(RapidDiffusionPipeline.from_pretrained(folder, device="cuda"), config)
    for _ in range(2):  # capture, then replay
        out = fast("一个番茄", token_merge=0.5, **kw)
        assert psnr(out.images, expected.images) > 30
        assert out.metadata[0]["token_merge"] == 0.5
    assert fast.report["loop"] == "graph"
    # every one of PNDM's 7 evaluations took its own destination pattern on the GPU
    made = [key for key in TokenMerge.of(fast.unet)._patterns if key[2].startswith("cuda")]
    assert sorted(key[3] for key in made) == list(range(7))


def test_bench_times_the_tome_variant_beside_rapiddiff_with_its_price(tmp_path):
    from rapiddiff.infer.bench import BenchConfig, run_bench

    with pytest.raises(ValueError, match=r"token_merge must be a number in \[0, 0.75\]"):
        BenchConfig(token_merge=0.9)
    cfg = BenchConfig(
        preset="tiny",
        steps=2,
        batches=(1,),
        variants=("eager", "rapiddiff", "rapiddiff-tome"),
        dtype="float32",
        compile=False,
        min_run_time=0.05,
        out=str(tmp_path),
        device="cpu",
    )
    rows = {r["variant"]: r for r in run_bench(cfg)["rows"]}
    assert rows["rapiddiff"]["psnr_db"] > 35
    tome = rows["rapiddiff-tome"]
    assert tome["it_s"] > 0 and 10 < tome["psnr_db"] < math.inf  # approximate: not the eager image
    assert tome["note"].startswith("token_merge=0.5, PSNR vs rapiddiff ")
