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


def _zero_last_conv(net: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        net.body[-1].weight.zero_()
        net.body[-1].bias.zero_()
    return net


@pytest.mark.parametrize("base", ["nearest", "bicubic"])
def test_a_zeroed_body_is_exactly_its_base_upsampling(base):
    x = torch.rand(2, 3, 7, 9, generator=torch.Generator().manual_seed(4))
    net = _zero_last_conv(build_compact(num_feat=4, num_conv=1, base=base))
    kwargs = {"align_corners": False} if base == "bicubic" else {}
    expected = torch.nn.functional.interpolate(x, scale_factor=4, mode=base, **kwargs)
    torch.testing.assert_close(net(x), expected, rtol=0, atol=0)
    # ... and the two bases are not the same thing on this image.
    other = torch.nn.functional.interpolate(x, scale_factor=4, mode="nearest")
    assert base == "nearest" or (net(x) - other).abs().max() > 0.05


def test_bicubic_base_starts_at_bicubic_and_nearest_keeps_its_small_residual():
    x = torch.rand(1, 3, 8, 8, generator=torch.Generator().manual_seed(5))
    bicubic = torch.nn.functional.interpolate(x, scale_factor=4, mode="bicubic", align_corners=False)
    torch.manual_seed(0)
    net = build_compact(num_feat=8, num_conv=2, base="bicubic")
    assert net.base == "bicubic"
    torch.testing.assert_close(net(x), bicubic, rtol=0, atol=0)  # step 0 IS bicubic (last conv zeroed)
    assert net.body[0].weight.std() > 0  # the rest of the stack is initialised, not zero
    assert build_compact(num_feat=8, num_conv=2).base == "nearest"  # Real-ESRGAN's, the default


def test_bicubic_base_is_recorded_and_loads_back(tmp_path):
    torch.manual_seed(0)
    net = build_compact(num_feat=8, num_conv=2, base="bicubic")
    torch.nn.init.normal_(net.body[-1].weight, std=0.05)  # a trained-looking residual
    file = save_upscaler(net, tmp_path / "upscaler")
    with safe_open(str(file), "pt") as f:
        assert f.metadata()["base"] == "bicubic"
    loaded = load_upscaler(tmp_path / "upscaler")
    assert loaded.base == "bicubic"
    x = torch.rand(1, 3, 10, 6, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(upscale(loaded, x), upscale(net.eval(), x), rtol=0, atol=0)
    # fp16 (the shipped model's upscaler) keeps the base through save/load too.
    half = load_upscaler(save_upscaler(loaded.half(), tmp_path / "half.safetensors"))
    assert half.base == "bicubic"


def test_files_without_a_base_load_as_nearest_exactly_as_spandrel_runs_them(tmp_path):
    # Files written before the switch (and every published Real-ESRGAN compact file) have no "base".
    from spandrel.architectures.Compact import Compact

    from rapiddiff.utils.io import save_safetensors

    torch.manual_seed(0)
    plain = Compact(num_feat=8, num_conv=2, upscale=4).eval()
    torch.nn.init.normal_(plain.body[-1].weight, std=0.05)
    old = tmp_path / "old.safetensors"
    save_safetensors(
        plain.state_dict(), old, metadata={"format": "pt", "architecture": "Compact", "scale": "4"}
    )
    pth = tmp_path / "realesr-animevideov3.pth"
    torch.save({"params": plain.state_dict()}, pth)
    x = torch.rand(1, 3, 9, 9, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = plain(x)
    for file in (old, pth):
        loaded = load_upscaler(file)
        assert loaded.base == "nearest", file
        torch.testing.assert_close(loaded(x), expected, rtol=0, atol=0)
        # Saved again, it stays nearest (the metadata now says so).
        assert (
            load_upscaler(save_upscaler(loaded, tmp_path / f"again_{file.stem}.safetensors")).base
            == "nearest"
        )


def test_tiled_equals_whole_with_the_bicubic_base():
    torch.manual_seed(0)
    net = build_compact(num_feat=4, num_conv=1, base="bicubic").eval()
    torch.nn.init.normal_(net.body[-1].weight, std=0.05)
    x = torch.rand(1, 3, 20, 18, generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(upscale(net, x, tile=8, tile_pad=8), upscale(net, x))


def test_bad_base_settings_and_metadata_are_errors(tmp_path):
    from rapiddiff.utils.io import save_safetensors

    with pytest.raises(
        ValueError, match=r"base='lanczos': the compact upscaler's base is one of nearest, bicubic"
    ):
        build_compact(num_feat=4, num_conv=1, base="lanczos")
    net = build_compact(num_feat=4, num_conv=1)
    bad = tmp_path / "bad.safetensors"
    save_safetensors(net.state_dict(), bad, metadata={"base": "bilinear"})
    with pytest.raises(
        ValueError, match=r"bad\.safetensors: metadata 'base'='bilinear' is not a compact-net base"
    ):
        load_upscaler(bad)
    rrdb = tmp_path / "rrdb.safetensors"
    save_safetensors(build_rrdb(1, 8).state_dict(), rrdb, metadata={"base": "bicubic"})
    with pytest.raises(
        ValueError, match=r"rrdb\.safetensors: metadata 'base'='bicubic' is a compact-net setting"
    ):
        load_upscaler(rrdb)


@pytest.mark.parametrize("base", ["bicubic", "nearest"])
def test_own_compact_file_loads_as_spandrels_registry_loads_it(monkeypatch, tmp_path, base):
    """A compact file rapiddiff saved (architecture Compact, a base recorded) is built by spandrel's
    CompactArch directly, without spandrel's registry: the same module (weights, dtype, base,
    scale, outputs) as through ``ModelLoader``'s detection. Other files still go through it."""
    from rapiddiff.models import upscaler as upscaler_module
    from rapiddiff.models.builtin import builtin_model_dir

    torch.manual_seed(1)
    net = build_compact(num_feat=8, num_conv=3, base=base)
    torch.nn.init.normal_(net.body[-1].weight, std=0.05)
    files = [
        save_upscaler(net, tmp_path / "up"),
        builtin_model_dir("kshapes") / "upscaler" / "upscaler.safetensors",
    ]
    direct = [load_upscaler(f) for f in files]
    calls = []
    monkeypatch.setattr(upscaler_module, "_load_own_compact", lambda *a: calls.append(a))  # → None
    through_registry = [load_upscaler(f) for f in files]
    assert len(calls) == len(files)
    x = torch.rand(1, 3, 9, 7, generator=torch.Generator().manual_seed(2))
    for ours, theirs in zip(direct, through_registry, strict=True):
        assert type(ours) is type(theirs) and ours.base == theirs.base and ours.scale == theirs.scale
        assert ours.training is theirs.training is False
        state, expected = ours.state_dict(), theirs.state_dict()
        assert list(state) == list(expected)
        assert all(state[k].dtype == expected[k].dtype and torch.equal(state[k], expected[k]) for k in state)
        assert torch.equal(upscale(ours.float(), x), upscale(theirs.float(), x))
    assert direct[0].base == base


def test_own_compact_file_loads_without_spandrels_registry(tmp_path):
    """In a fresh interpreter the built-in upscaler loads without importing spandrel's other
    architectures; a later ``import spandrel`` is the whole package."""
    import json
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import json, sys
        from rapiddiff.models.builtin import builtin_model_dir
        from rapiddiff.models.upscaler import load_upscaler
        net = load_upscaler(builtin_model_dir("kshapes") / "upscaler")
        others = sorted(m for m in sys.modules if m.startswith("spandrel.architectures.") and ".Compact" not in m)
        import spandrel
        from spandrel import MAIN_REGISTRY, ModelLoader
        print(json.dumps({"others": others, "base": net.base, "version": spandrel.__version__,
                          "registry": len(list(MAIN_REGISTRY)) > 30 and ModelLoader.__name__ == "ModelLoader",
                          "arch": spandrel.architectures.Compact.CompactArch.__name__}))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    checks = json.loads(done.stdout.strip().splitlines()[-1])
    assert checks["others"] == []
    assert checks["base"] == "bicubic" and checks["registry"] and checks["arch"] == "CompactArch"
    assert checks["version"]
