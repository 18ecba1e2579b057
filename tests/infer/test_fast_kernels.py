"""rapiddiff's own Triton kernels (issue 16): ``fuse_norm`` (GroupNorm + SiLU) and ``fuse_geglu``.

On a CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, read when Triton compiles
a kernel, so those checks run in a child process) against a float64 reference; Inductor's
access analysis of each kernel is checked as the device's torch runs it; the module swaps keep
weights, keys and the stock computation off CUDA. The ``gpu`` tests compare the fused U-Net and VAE
with the stock ones, eager and through torch.compile (where a first device run gave NaN)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("diffusers")

from rapiddiff.infer import fast_geglu, fast_norm
from rapiddiff.infer.accelerate import AccelerateConfig, accelerate, compile_cache_file

needs_triton = pytest.mark.skipif(fast_norm.triton is None, reason="Triton is not installed")

SMALL_UNET = {
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
SMALL_VAE = {
    "block_out_channels": (64, 64),
    "down_block_types": ("DownEncoderBlock2D",) * 2,
    "up_block_types": ("UpDecoderBlock2D",) * 2,
    "latent_channels": 4,
    "norm_num_groups": 32,
    "layers_per_block": 1,
}


def _child(code: str, timeout: int = 600, interpret: bool = True) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


# ---- the kernels -----------------------------------------------------------------------------------
@needs_triton
@pytest.mark.slow  # ~25 s: the interpreter runs each program in numpy
def test_kernels_match_a_float64_reference_in_the_interpreter():
    """Every case: rows that do not fill the last tile, with and without the addend and SiLU,
    float32 and float16; the GEGLU with M, N and K that do not fill their tiles."""
    out = _child(
        """
        import torch
        from rapiddiff.infer import fast_norm, fast_geglu
        torch.manual_seed(0)
        def rel(a, b):
            return float((a.double() - b).norm() / b.norm())
        cases = [((2, 128, 8, 8), 32, True, True, 64, torch.float32),
                 ((2, 192, 9, 7), 32, True, False, 16, torch.float32),
                 ((1, 64, 12, 12), 8, False, True, 32, torch.float32),
                 ((2, 128, 6, 5), 32, True, True, 16, torch.float16)]
        for shape, groups, add, silu, rows, dtype in cases:
            x = (torch.randn(shape) * 3 + 5).to(dtype).contiguous(memory_format=torch.channels_last)
            w, b = torch.randn(shape[1]).to(dtype), torch.randn(shape[1]).to(dtype)
            a = torch.randn(shape[0], shape[1]).to(dtype) if add else None
            y = fast_norm.launch(x, w, b, a, groups, 1e-5, silu, block_hw=rows)
            ref = fast_norm.reference(x.double(), w.double(), b.double(), a.double() if add else None, groups, 1e-5, silu)
            assert y.dtype == dtype and y.is_contiguous(memory_format=torch.channels_last)
            limit = 1e-5 if dtype == torch.float32 else 2e-3
            assert torch.isfinite(y).all() and rel(y, ref) < limit, (shape, rel(y, ref))
        for m, n, k, config in [(100, 40, 40, (32, 16, 16, 4, 2)), (64, 96, 64, (32, 32, 32, 4, 2))]:
            x = torch.randn(2, m // 2, k)
            w, b = torch.randn(2 * n, k) / k ** 0.5, torch.randn(2 * n)
            y = fast_geglu.launch(x, w, b, config=config)
            ref = fast_geglu.reference(x.double(), w.double(), b.double())
            assert y.shape == (2, m // 2, n) and rel(y, ref) < 1e-5, (m, n, k, rel(y, ref))
        print("ok")
        """
    )
    assert out.strip().endswith("ok")


@needs_triton
def test_inductor_sees_what_each_kernel_writes():
    """torch.compile finds a user kernel's outputs by tracing it to Triton IR; where that fails it
    assumes every argument is written (the first H100 run of fuse_norm: `(HW * CPG).to(...)` on
    scalars the device's torch 2.11 traces as constants, then NaN images). Checked both ways: scalars
    as runtime values (this torch) and as constants (the device's)."""
    out = _child(
        """
        import types
        import torch, triton, triton.runtime, triton.language as tl
        from triton.backends.compiler import GPUTarget
        from torch._higher_order_ops import triton_kernel_wrap as tkw
        from rapiddiff.infer import fast_norm, fast_geglu

        class Hopper:  # the analysis asks the active driver for a target; no GPU needed
            def get_current_target(self):
                return GPUTarget("cuda", 90, 32)
            def get_active_torch_device(self):
                return torch.device("cpu")
        triton.runtime.driver.set_active(Hopper())

        def constant_scalars(kernel, scalars):
            fn = kernel.fn
            copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
            copy.__annotations__ = {**fn.__annotations__, **{s: tl.constexpr for s in scalars}}
            return triton.jit(copy)

        n, c, hw, g = 2, 320, 4096, 32
        x = torch.empty(n, hw, c, dtype=torch.float16)
        part = lambda: torch.empty(n, 64, c)
        stats = torch.empty(n, g, 2)
        kernels = {
            "partial": (fast_norm.rapiddiff_gn_partial,
                        dict(x_ptr=x, add_ptr=torch.empty(n, c), mean_ptr=part(), m2_ptr=part(), HW=hw, C=c, NB=64,
                             HAS_ADD=True, BLOCK_HW=64, BLOCK_C=64),
                        {"mean_ptr", "m2_ptr"}),
            "combine": (fast_norm.rapiddiff_gn_combine,
                        dict(mean_ptr=part(), m2_ptr=part(), stat_ptr=stats, HW=hw, C=c, NB=64, CPG=10, G=g, eps=1e-5,
                             BLOCK_HW=64, BLOCK_NB=64, BLOCK_CPG=16),
                        {"stat_ptr"}),
            "apply": (fast_norm.rapiddiff_gn_apply,
                      dict(x_ptr=x, add_ptr=torch.empty(n, c), w_ptr=torch.empty(c), b_ptr=torch.empty(c), stat_ptr=stats,
                           y_ptr=torch.empty_like(x), HW=hw, C=c, CPG=10, G=g, NB=64, HAS_ADD=True, SILU=True,
                           BLOCK_HW=64, BLOCK_C=64),
                      {"y_ptr"}),
            "geglu": (fast_geglu.rapiddiff_geglu,
                      dict(x_ptr=torch.empty(8192, 320, dtype=torch.float16), w_ptr=torch.empty(2560, 320, dtype=torch.float16),
                           b_ptr=torch.empty(2560, dtype=torch.float16), y_ptr=torch.empty(8192, 1280, dtype=torch.float16),
                           M=8192, N=1280, K=320, BM=128, BN=64, BK=64, GROUP_M=8),
                      {"y_ptr"}),
        }
        for name, (kernel, kwargs, written) in kernels.items():
            scalars = [k for k, v in kwargs.items() if not isinstance(v, torch.Tensor)
                       and not kernel.params[kernel.arg_names.index(k)].is_constexpr]
            for label, k in (("runtime", kernel), ("constant", constant_scalars(kernel, scalars))):
                access = tkw.identify_accessed_tensors(k, kwargs, {})
                writes = {dep.name for dep in access.read_writes.writes}
                assert writes == written, (name, label, writes)
        print("ok")
        """,
        interpret=False,  # the analysis compiles the kernels to Triton IR (no GPU needed)
    )
    assert out.strip().endswith("ok")


@needs_triton
@pytest.mark.slow  # ~40 s
def test_fused_modules_compute_what_diffusers_does():
    """The swapped ResNet blocks, norms and GEGLU layers, their kernels run by the interpreter, give
    the stock U-Net's and VAE decoder's outputs (float32)."""
    out = _child(
        f"""
        import copy, torch
        from diffusers import AutoencoderKL, UNet2DConditionModel
        from rapiddiff.infer import fast_norm, fast_geglu
        # the CUDA-only gates opened for the CPU: the interpreter runs the real kernels
        fast_norm._fused_path = lambda x, g: not torch.is_grad_enabled() and fast_norm.supported(x, g)
        fast_norm.group_norm_act = lambda *args: fast_norm.launch(*args)
        fast_geglu.fused_class().forward = lambda self, h, *a, **k: fast_geglu.launch(
            h, self.proj.weight, self.proj.bias, config=(64, 64, 64, 4, 2))
        torch.manual_seed(0)
        unet = UNet2DConditionModel(**{SMALL_UNET!r}).eval()
        stock = copy.deepcopy(unet)
        counts = fast_norm.fuse_norms(unet)
        assert counts == {{"resnets": 8, "norms": 5, "skipped": 0}}, counts
        assert fast_geglu.fuse_geglu(unet) == 4
        x = torch.randn(2, 4, 16, 16).contiguous(memory_format=torch.channels_last)
        ctx, t = torch.randn(2, 7, 64), torch.tensor(300)
        with torch.no_grad():
            a, b = unet(x, t, encoder_hidden_states=ctx).sample, stock(x, t, encoder_hidden_states=ctx).sample
        assert float((a - b).norm() / b.norm()) < 1e-5
        vae = AutoencoderKL(**{SMALL_VAE!r}).eval()
        stock_vae = copy.deepcopy(vae)
        counts = fast_norm.fuse_norms(vae)
        assert counts == {{"resnets": 10, "norms": 4, "skipped": 0}}, counts
        z = torch.randn(1, 4, 8, 8)
        with torch.no_grad():
            a, b = vae.decode(z).sample, stock_vae.decode(z).sample
        assert float((a - b).norm() / b.norm()) < 1e-5
        print("ok")
        """
    )
    assert out.strip().endswith("ok")


# ---- the module swaps and the switches -----------------------------------------------------------
def _small_unet() -> torch.nn.Module:
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(**SMALL_UNET).eval()


def test_swaps_keep_weights_keys_and_types():
    from diffusers.models.activations import GEGLU
    from diffusers.models.resnet import ResnetBlock2D

    unet = _small_unet()
    before = {k: v.clone() for k, v in unet.state_dict().items()}
    counts = fast_norm.fuse_norms(unet)
    assert counts == {"resnets": 8, "norms": 5, "skipped": 0}  # 4 transformer norms + conv_norm_out
    assert fast_geglu.fuse_geglu(unet) == 4
    after = unet.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    resnets = [m for m in unet.modules() if isinstance(m, ResnetBlock2D)]
    assert len(resnets) == 8 and all(type(m) is fast_norm.fused_resnet_class() for m in resnets)
    assert all(type(m) is fast_geglu.fused_class() for m in unet.modules() if isinstance(m, GEGLU))
    # conv_norm_out takes the SiLU in; the U-Net's conv_act becomes a no-op
    assert unet.conv_norm_out.silu is True and isinstance(unet.conv_act, torch.nn.Identity)
    assert fast_norm.fuse_norms(unet) == {"resnets": 0, "norms": 0, "skipped": 0}  # idempotent


def test_a_resnet_block_of_another_kind_is_kept_stock():
    from diffusers.models.resnet import ResnetBlock2D

    block = ResnetBlock2D(in_channels=64, temb_channels=32, time_embedding_norm="scale_shift")
    holder = torch.nn.ModuleDict({"block": block})
    assert fast_norm.fuse_norms(holder)["skipped"] == 1 and type(block) is ResnetBlock2D


def test_off_cuda_the_swapped_modules_run_the_stock_computation():
    unet = _small_unet()
    stock = copy.deepcopy(unet)
    fast_norm.fuse_norms(unet)
    fast_geglu.fuse_geglu(unet)
    x = torch.randn(2, 4, 16, 16)
    ctx, t = torch.randn(2, 7, 64), torch.tensor(10)
    with torch.no_grad():
        torch.testing.assert_close(
            unet(x, t, encoder_hidden_states=ctx).sample, stock(x, t, encoder_hidden_states=ctx).sample
        )


def test_the_op_on_a_cpu_is_the_reference_and_traces():
    x = torch.randn(2, 64, 8, 8).contiguous(memory_format=torch.channels_last)
    w, b, a = torch.randn(64), torch.randn(64), torch.randn(2, 64)
    expected = fast_norm.reference(x, w, b, a, 32, 1e-5, True)
    torch.testing.assert_close(fast_norm.group_norm_act(x, w, b, a, 32, 1e-5, True), expected)
    schema = str(torch.ops.rapiddiff.group_norm_act.default._schema)
    assert "Tensor? addend" in schema and "bool silu" in schema
    xg, wg, bg = torch.randn(3, 5, 16), torch.randn(24, 16), torch.randn(24)
    torch.testing.assert_close(fast_geglu.geglu(xg, wg, bg), fast_geglu.reference(xg, wg, bg))


def test_switches_fall_back_off_cuda_and_key_the_caches(tiny_model):
    from rapiddiff.infer.pipeline import RapidDiffusionPipeline

    with pytest.raises(ValueError, match="fuse_norm must be true or false; got 'yes'"):
        AccelerateConfig(fuse_norm="yes")
    defaults = AccelerateConfig()
    assert defaults.fuse_norm is False and defaults.fuse_geglu is False  # off until measured to pay
    pipe = accelerate(
        RapidDiffusionPipeline.from_pretrained(tiny_model), fuse_norm=True, fuse_geglu=True, compile_unet=None
    )
    assert pipe.report["fuse_norm"].startswith("fallback: off (the kernels are Triton GPU kernels")
    assert pipe.report["fuse_geglu"].startswith("fallback: off")
    assert compile_cache_file("/c/cache.bin", AccelerateConfig(fuse_norm=True, fuse_geglu=True)) == (
        "/c/cache.fuse-norm.fuse-geglu.bin"
    )


# ---- on a GPU -----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fused_unet_and_decoder_match_stock_on_the_gpu(compiled):
    """float16 on CUDA at 32² latents (the kernels' smallest size): the fused U-Net and VAE decoder
    against the stock ones, finite and within half-precision rounding; compiled as the fast path does."""
    from diffusers import AutoencoderKL, UNet2DConditionModel

    torch.manual_seed(0)
    cuda = torch.device("cuda")
    unet = UNet2DConditionModel(**{**SMALL_UNET, "sample_size": 32}).to(cuda, torch.float16).eval()
    vae = AutoencoderKL(**SMALL_VAE).to(cuda, torch.float16).eval()
    for m in (unet, vae):
        m.to(memory_format=torch.channels_last)
    stock_unet, stock_vae = copy.deepcopy(unet), copy.deepcopy(vae)
    assert fast_norm.fuse_norms(unet)["resnets"] == 8 and fast_geglu.fuse_geglu(unet) == 4
    fast_norm.fuse_norms(vae)
    x = torch.randn(2, 4, 32, 32, device=cuda, dtype=torch.float16).contiguous(
        memory_format=torch.channels_last
    )
    ctx, t = torch.randn(2, 7, 64, device=cuda, dtype=torch.float16), torch.tensor(300, device=cuda)
    z = torch.randn(1, 4, 32, 32, device=cuda, dtype=torch.float16)
    run_unet = torch.compile(unet, fullgraph=True) if compiled else unet
    run_decode = torch.compile(vae.decode, fullgraph=True) if compiled else vae.decode
    with torch.no_grad():
        for _ in range(2):  # the second call runs the compiled code again (no recompile)
            a = run_unet(x, t, encoder_hidden_states=ctx).sample
            d = run_decode(z).sample
        b = stock_unet(x, t, encoder_hidden_states=ctx).sample
        e = stock_vae.decode(z).sample
    for ours, ref in ((a, b), (d, e)):
        assert torch.isfinite(ours).all()
        assert float((ours.float() - ref.float()).norm() / ref.float().norm()) < 2e-2


def test_a_layer_wrapped_after_the_swap_keeps_its_own_forward(monkeypatch):
    """A LoRA loaded after ``accelerate`` wraps conv1 in a module of its own: the fused forward must not
    read the wrapped layer's base weight and skip the side branch, so it runs the stock forward."""
    from diffusers.models.resnet import ResnetBlock2D

    monkeypatch.setattr(fast_norm, "_fused_path", lambda x, groups: fast_norm.supported(x, groups))
    monkeypatch.setattr(fast_norm, "group_norm_act", fast_norm.reference)

    class SideBranch(torch.nn.Module):  # stands in for a PEFT LoRA layer around the convolution
        def __init__(self, base: torch.nn.Conv2d) -> None:
            super().__init__()
            self.base_layer, self.weight, self.bias = base, base.weight, base.bias

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base_layer(x) + 1.0

    block = ResnetBlock2D(in_channels=64, temb_channels=32).eval()
    holder = torch.nn.ModuleDict({"block": block})
    fast_norm.fuse_norms(holder)
    x, temb = torch.randn(2, 64, 8, 8), torch.randn(2, 32)
    with torch.no_grad():
        fused_plain = block(x, temb)
        torch.testing.assert_close(fused_plain, ResnetBlock2D.forward(block, x, temb))  # the fused path ran
        block.conv1 = SideBranch(block.conv1)
        wrapped = block(x, temb)
        torch.testing.assert_close(wrapped, ResnetBlock2D.forward(block, x, temb))
    assert not torch.allclose(wrapped, fused_plain)  # the side branch counted
