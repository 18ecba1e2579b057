"""``batch_time_proj`` (issue 16): the ResNet blocks' time projections as one product.

The packed U-Net must give the stock U-Net's output (eager, compiled, and through ``accelerate``'s
GPU-resident loop), leave alone what it cannot reproduce, and key the compile cache by the switch."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("diffusers")

from rapiddiff.infer import fast_time
from rapiddiff.infer.accelerate import AccelerateConfig, accelerate, compile_cache_file

SMALL_UNET = {  # two levels, ResNet and transformer blocks: every kind of block the packing meets
    "sample_size": 16,
    "in_channels": 4,
    "out_channels": 4,
    "block_out_channels": (64, 128),
    "layers_per_block": 1,
    "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
    "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
    "cross_attention_dim": 64,
    "attention_head_dim": 8,
    "norm_num_groups": 32,
}


def _unet(**overrides):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(**{**SMALL_UNET, **overrides}).eval()


def _run(unet, t=None):
    t = torch.tensor(10) if t is None else t
    torch.manual_seed(1)
    x, ctx = torch.randn(2, 4, 16, 16), torch.randn(2, 7, 64)
    with torch.no_grad():
        return unet(x, t, encoder_hidden_states=ctx).sample


def test_packed_unet_computes_what_the_stock_one_does():
    from diffusers.models.resnet import ResnetBlock2D

    unet = _unet()
    stock = copy.deepcopy(unet)
    widths = [m.time_emb_proj.out_features for m in unet.modules() if isinstance(m, ResnetBlock2D)]
    assert fast_time.batch_time_proj(unet) == (8, None)
    assert fast_time.is_packed(unet)
    assert unet.time_embedding.weight.shape == (
        sum(widths),
        unet.time_embedding.embedding.linear_2.out_features,
    )
    slices = [m.time_emb_proj for m in unet.modules() if isinstance(m, ResnetBlock2D)]
    assert [s.width for s in slices] == widths and slices[-1].offset + widths[-1] == sum(widths)
    for t in (torch.tensor(10), torch.tensor([999, 1])):  # one t for the batch, or one per sample
        torch.testing.assert_close(_run(unet, t), _run(stock, t), rtol=1e-5, atol=1e-5)
    assert fast_time.batch_time_proj(unet) == (0, "already packed")


def test_packed_unet_traces_whole_under_torch_compile():
    unet = _unet()
    stock = copy.deepcopy(unet)
    fast_time.batch_time_proj(unet)
    compiled = torch.compile(unet, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(_run(compiled), _run(stock), rtol=1e-5, atol=1e-5)


def test_unet_it_cannot_reproduce_is_left_alone():
    from diffusers.models.resnet import ResnetBlock2D

    unet = _unet(class_embed_type="timestep")
    before = set(unet.state_dict())
    count, why = fast_time.batch_time_proj(unet)
    assert count == 0 and "class_embed_type='timestep'" in why
    assert set(unet.state_dict()) == before

    unet = _unet()

    class Wrapped(torch.nn.Linear):  # stands in for a LoRA layer around the projection
        pass

    block = next(m for m in unet.modules() if isinstance(m, ResnetBlock2D))
    old = block.time_emb_proj
    block.time_emb_proj = Wrapped(old.in_features, old.out_features)
    count, why = fast_time.batch_time_proj(unet)
    assert count == 0 and "not a plain nn.Linear" in why and not fast_time.is_packed(unet)


def test_switch_in_accelerate_gives_the_same_image_and_keys_the_cache(tiny_model, tmp_path):
    from rapiddiff.infer.pipeline import RapidDiffusionPipeline

    assert AccelerateConfig().batch_time_proj is True  # measured to pay
    assert AccelerateConfig.off().batch_time_proj is False  # the eager reference has every switch off
    with pytest.raises(ValueError, match="batch_time_proj must be true or false"):
        AccelerateConfig(batch_time_proj=1)
    kwargs = {"num_inference_steps": 3, "seed": 0, "output_type": "np"}
    images = []
    cache = tmp_path / "cache.bin"
    for on in (False, True):
        pipe = accelerate(
            RapidDiffusionPipeline.from_pretrained(tiny_model),
            compile_unet=None,
            compile_vae=None,
            batch_time_proj=on,
            compile_cache=str(cache),
        )
        assert pipe.report["batch_time_proj"].startswith("on (" if on else "off")
        assert pipe.report.status("batch_time_proj").on is on
        # The compile-cache name follows the switch as applied: a graph without it is another cache.
        name = "cache.bin" if on else "cache.no-batch-time-proj.bin"
        assert compile_cache_file(str(cache), pipe.report) == str(tmp_path / name)
        assert (
            pipe.report["compile_cache"]
            == f"missing: will write {tmp_path / name} after the first compiled run"
        )
        images.append(pipe("一只红色的番茄", **kwargs).images)
    assert abs(images[0] - images[1]).max() < 1e-4


@pytest.mark.gpu
def test_packed_unet_matches_stock_compiled_on_the_gpu():
    """float16 on CUDA through Inductor, as the fast path compiles it: the packed product and the
    slices fused into their consumers give the stock output within half-precision rounding."""
    cuda = torch.device("cuda")
    unet = _unet(sample_size=32).to(cuda, torch.float16).to(memory_format=torch.channels_last)
    stock = copy.deepcopy(unet)
    assert fast_time.batch_time_proj(unet) == (8, None)
    x = torch.randn(2, 4, 32, 32, device=cuda, dtype=torch.float16).contiguous(
        memory_format=torch.channels_last
    )
    ctx, t = torch.randn(2, 7, 64, device=cuda, dtype=torch.float16), torch.tensor(300, device=cuda)
    run = torch.compile(unet, fullgraph=True)
    with torch.no_grad():
        for _ in range(2):
            a = run(x, t, encoder_hidden_states=ctx).sample
        b = stock(x, t, encoder_hidden_states=ctx).sample
    assert torch.isfinite(a).all()
    assert float((a.float() - b.float()).norm() / b.float().norm()) < 1e-2
