"""The ESRGAN upscaler: every published checkpoint layout loads through spandrel; pickles with code do not."""

from __future__ import annotations

import re

import pytest
import torch

from rapiddiff.models.upscaler import build_rrdb, load_upscaler, save_upscaler, upscale
from rapiddiff.utils.io import UnsafeCheckpointError


def _old_to_basicsr(state: dict[str, torch.Tensor], scale: int = 4) -> dict[str, torch.Tensor]:
    """Rename ESRGAN old-arch keys to BasicSR / Real-ESRGAN's RRDBNet names (as their .pth files use)."""
    n_up = {2: 1, 4: 2}[scale]
    fixed = {
        "model.0": "conv_first",
        f"model.{3 * n_up + 2}": "conv_hr",
        f"model.{3 * n_up + 4}": "conv_last",
    }
    fixed.update({f"model.{3 * (i + 1)}": f"conv_up{i + 1}" for i in range(n_up)})
    n_blocks = 1 + max(int(m.group(1)) for k in state if (m := re.match(r"model\.1\.sub\.(\d+)\.RDB", k)))
    fixed[f"model.1.sub.{n_blocks}"] = "conv_body"
    out = {}
    for key, value in state.items():
        m = re.match(r"model\.1\.sub\.(\d+)\.RDB(\d)\.conv(\d)\.0\.(weight|bias)", key)
        if m:
            out[f"body.{m.group(1)}.rdb{m.group(2)}.conv{m.group(3)}.{m.group(4)}"] = value
            continue
        prefix, kind = key.rsplit(".", 1)
        out[f"{fixed[prefix]}.{kind}"] = value
    return out


@pytest.fixture(scope="module")
def tiny_rrdb():
    torch.manual_seed(0)
    net = build_rrdb(num_blocks=1, num_feat=8).eval()
    # Random init of ESRGAN scales residuals down; make the output depend visibly on all weights.
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return net


@pytest.fixture(scope="module")
def image():
    return torch.rand(1, 3, 12, 10, generator=torch.Generator().manual_seed(1))


def _formats(net, tmp_path):
    state = net.state_dict()
    new = _old_to_basicsr(state)
    files = {
        "safetensors": save_upscaler(net, tmp_path / "ours.safetensors"),
        "old_arch_pth": tmp_path / "esrgan_old.pth",
        "basicsr_pth": tmp_path / "basicsr.pth",
        "realesrgan_params_ema": tmp_path / "RealESRGAN_x4plus.pth",
    }
    torch.save(state, files["old_arch_pth"])
    torch.save(new, files["basicsr_pth"])
    torch.save(
        {"params_ema": new, "params": {k: v * 0 for k, v in new.items()}}, files["realesrgan_params_ema"]
    )
    return files


def test_every_format_loads_and_upscales_x4(tiny_rrdb, image, tmp_path):
    expected = upscale(tiny_rrdb, image)
    assert expected.shape == (1, 3, 48, 40)
    assert expected.std() > 1e-3  # not a constant image: the comparison below means something
    for name, file in _formats(tiny_rrdb, tmp_path).items():
        net = load_upscaler(file)
        assert net.scale == 4, name
        torch.testing.assert_close(upscale(net, image), expected, msg=f"{name} differs")


def test_folder_with_one_weights_file_loads(tiny_rrdb, image, tmp_path):
    path = save_upscaler(tiny_rrdb, tmp_path / "upscaler")
    assert path.name == "upscaler.safetensors"
    torch.testing.assert_close(
        upscale(load_upscaler(tmp_path / "upscaler"), image), upscale(tiny_rrdb, image)
    )


def test_tiled_equals_whole_with_enough_context(tiny_rrdb):
    x = torch.rand(1, 3, 20, 18, generator=torch.Generator().manual_seed(2))
    whole = upscale(tiny_rrdb, x)
    tiled = upscale(tiny_rrdb, x, tile=8, tile_pad=24)
    torch.testing.assert_close(tiled, whole)
    # Without context the seams show: the pad is what makes tiles agree.
    assert not torch.allclose(upscale(tiny_rrdb, x, tile=8, tile_pad=0), whole, atol=1e-4)


class _Payload:
    def __reduce__(self):
        return (print, ("this would run on load",))


def test_pickle_with_code_is_refused(tiny_rrdb, tmp_path):
    file = tmp_path / "evil.pth"
    torch.save({"params_ema": tiny_rrdb.state_dict(), "hook": _Payload()}, file)
    with pytest.raises(UnsafeCheckpointError, match="arbitrary"):
        load_upscaler(file)


def test_unknown_weights_and_bad_settings_are_errors(tmp_path):
    file = tmp_path / "linear.safetensors"
    from safetensors.torch import save_file

    save_file({"weight": torch.zeros(2, 2)}, str(file))
    with pytest.raises(ValueError, match="not an upscaler architecture"):
        load_upscaler(file)
    with pytest.raises(FileNotFoundError):
        load_upscaler(tmp_path / "missing.pth")
    with pytest.raises(ValueError, match="only 32"):
        build_rrdb(num_grow_ch=16)
    with pytest.raises(ValueError, match="does not recognise"):
        save_upscaler(torch.nn.Linear(2, 2), tmp_path / "x.safetensors")
