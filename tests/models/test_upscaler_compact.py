"""Real-ESRGAN's compact upscaler: built as spandrel's class, saved, loaded back unchanged."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from rapiddiff.models.upscaler import (
    build_compact,
    build_rrdb,
    build_upscaler,
    load_upscaler,
    save_upscaler,
    upscale,
)


@pytest.fixture(scope="module")
def tiny_compact():
    torch.manual_seed(0)
    return build_compact(num_feat=8, num_conv=2).eval()


def test_save_load_round_trip_gives_identical_outputs(tiny_compact, tmp_path):
    image = torch.rand(1, 3, 12, 10, generator=torch.Generator().manual_seed(1))
    expected = upscale(tiny_compact, image)
    assert expected.shape == (1, 3, 48, 40)
    # The residual is not zero: the comparison checks the weights, not just the nearest-neighbour skip.
    nearest = torch.nn.functional.interpolate(image, scale_factor=4, mode="nearest")
    assert (expected - nearest).abs().mean() > 1e-3

    file = save_upscaler(tiny_compact, tmp_path / "upscaler")
    with safe_open(str(file), "pt") as f:
        assert f.metadata()["architecture"] == "Compact"
        assert {"body.0.weight", "body.1.weight"} <= set(f.keys())
    loaded = load_upscaler(tmp_path / "upscaler")
    assert type(loaded) is type(tiny_compact)
    assert loaded.scale == 4 and loaded.num_feat == 8 and loaded.num_conv == 2
    torch.testing.assert_close(upscale(loaded, image), expected, rtol=0, atol=0)


def test_realesrgan_params_ema_pth_loads(tiny_compact, tmp_path):
    # realesr-general-x4v3.pth and realesr-animevideov3.pth are {"params": ...} / {"params_ema": ...}.
    file = tmp_path / "realesr-general-x4v3.pth"
    torch.save({"params_ema": tiny_compact.state_dict()}, file)
    image = torch.rand(1, 3, 6, 6, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(upscale(load_upscaler(file), image), upscale(tiny_compact, image))


@pytest.mark.parametrize("scale", [2, 3])
def test_other_scales_load_back_with_their_scale(scale, tmp_path):
    net = build_compact(num_feat=4, num_conv=1, scale=scale)
    assert net.scale == scale
    loaded = load_upscaler(save_upscaler(net, tmp_path / "x.safetensors"))
    assert loaded.scale == scale
    assert loaded(torch.rand(1, 3, 5, 5)).shape == (1, 3, 5 * scale, 5 * scale)


def test_starts_from_nearest_neighbour_plus_a_learned_residual():
    net = build_compact(num_feat=4, num_conv=1)
    with torch.no_grad():
        net.body[-1].weight.zero_()
        net.body[-1].bias.zero_()
    x = torch.rand(1, 3, 7, 5)
    torch.testing.assert_close(net(x), torch.nn.functional.interpolate(x, scale_factor=4, mode="nearest"))


def test_dispatch_and_bad_settings():
    assert type(build_upscaler("compact", num_feat=4, num_conv=1)) is type(build_compact(4, 1))
    assert type(build_upscaler("rrdb", num_blocks=1, num_feat=8)) is type(build_rrdb(1, 8))
    with pytest.raises(ValueError, match=r"unknown upscaler architecture 'swinir'; valid: rrdb, compact"):
        build_upscaler("swinir")
    with pytest.raises(ValueError, match="num_conv=0"):
        build_compact(num_conv=0)
    with pytest.raises(ValueError, match="keep the channel count"):
        build_compact(in_channels=3, out_channels=1)


def test_init_keeps_the_conv_stack_alive_and_the_residual_small():
    # PyTorch's default init let the signal die through the stack (training crawled); He init keeps it.
    torch.manual_seed(0)
    net = build_compact(num_feat=16, num_conv=12).eval()
    x = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        features = x
        for layer in list(net.body)[:-1]:
            features = layer(features)
        first = net.body[1](net.body[0](x))
        assert features.std() > 0.3 * first.std()
        nearest = torch.nn.functional.interpolate(x, scale_factor=4, mode="nearest")
        residual = net(x) - nearest
    assert 1e-3 < residual.std() < 0.2  # starts near nearest-neighbour, but not exactly on it
