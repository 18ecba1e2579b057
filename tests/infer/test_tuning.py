"""The convolution/GEMM tuning switches (issue 16): ``cudnn_benchmark``, ``fp16_accumulate`` and
``autotune`` — their validation, the cache and package keys they enter, the bench's
``rapiddiff+KEY=VALUE`` variants and time budget, and (slow: Inductor compiles C++) the tiny model
through ``autotune="convs"`` on a CPU. The GPU parity of each is in test_gpu_parity.py."""

from __future__ import annotations

import json
import logging
import threading
import types

import pytest
import torch

pytest.importorskip("diffusers")

from rapiddiff.infer import fast_aoti
from rapiddiff.infer.accelerate import (
    AUTOTUNE_MODES,
    AccelerateConfig,
    _aten_gemm_choices,
    accelerate,
    autotune_options,
    compile_cache_file,
    cudnn_benchmark_flag,
    fp16_accumulate_flag,
    gemms_on_aten,
)
from rapiddiff.infer.bench import (
    BenchConfig,
    parse_variant,
    plan_tasks,
    run_bench,
    run_in_fresh_thread,
)
from rapiddiff.infer.fast_plan import linear_plan
from rapiddiff.infer.pipeline import RapidDiffusionPipeline

KW = {"num_inference_steps": 3, "guidance_scale": 5.0, "seed": 0, "output_type": "np", "progress": False}


# ---- the switches --------------------------------------------------------------------------------
def test_bad_values_are_refused_naming_the_valid_ones():
    with pytest.raises(
        ValueError, match="autotune must be one of off, convs, gemm, all, pointwise; got 'conv'"
    ):
        AccelerateConfig(autotune="conv")
    with pytest.raises(ValueError, match="cudnn_benchmark must be true or false; got 'yes'"):
        AccelerateConfig(cudnn_benchmark="yes")
    with pytest.raises(ValueError, match="fp16_accumulate must be true or false; got 1"):
        AccelerateConfig(fp16_accumulate=1)
    with pytest.raises(ValueError, match="off, convs, gemm, all"):
        autotune_options("max")
    defaults = AccelerateConfig()
    assert defaults.autotune == "off" and defaults.cudnn_benchmark is False  # not measured yet: off
    assert defaults.fp16_accumulate is False  # a quality cost: opt-in


def test_autotune_options_exist_in_this_inductor_and_tell_the_modes_apart():
    import torch._inductor.config as inductor_config

    assert autotune_options("off") == {}
    assert autotune_options("pointwise") == {"coordinate_descent_tuning": True}  # no templates
    assert hasattr(inductor_config, "coordinate_descent_tuning")
    options = {mode: autotune_options(mode) for mode in ("convs", "gemm", "all")}
    for mode, opts in options.items():
        assert all(hasattr(inductor_config, k) for k in opts), (mode, opts)
        assert opts["max_autotune_gemm"] is True and "max_autotune" not in opts  # no pointwise tuning
        assert not any("cudagraph" in k for k in opts)  # never Inductor's CUDA graphs
    conv_backends = {m: set(o["max_autotune_conv_backends"].split(",")) for m, o in options.items()}
    assert conv_backends == {"convs": {"ATEN", "TRITON"}, "gemm": {"ATEN"}, "all": {"ATEN", "TRITON"}}
    # convs and all offer the same Inductor choices (convs filters GEMMs outside the config), so
    # their configs must still differ or Inductor's cache would hand one's graphs to the other.
    assert options["convs"] != options["all"]


def test_cudnn_flag_is_set_inside_and_restored_after():
    before = torch.backends.cudnn.benchmark
    with cudnn_benchmark_flag(True):
        assert torch.backends.cudnn.benchmark is True
    assert torch.backends.cudnn.benchmark == before
    with pytest.raises(KeyError), cudnn_benchmark_flag(not before):
        raise KeyError("boom")
    assert torch.backends.cudnn.benchmark == before


def test_fp16_accumulation_flag_is_set_inside_and_restored_after(monkeypatch):
    # A stand-in for torch.backends.cuda.matmul: the same test on every torch the project allows
    # (the flag exists from torch 2.7; older ones get the fallback tested below).
    matmul = types.SimpleNamespace(allow_fp16_accumulation=False)
    monkeypatch.setattr(torch.backends.cuda, "matmul", matmul)
    before = matmul.allow_fp16_accumulation
    with fp16_accumulate_flag(True):
        assert matmul.allow_fp16_accumulation is True
    assert matmul.allow_fp16_accumulation == before
    with pytest.raises(KeyError), fp16_accumulate_flag(not before):
        assert matmul.allow_fp16_accumulation == (not before)
        raise KeyError("boom")
    assert matmul.allow_fp16_accumulation == before


def test_gemm_filter_keeps_only_aten_kernels_for_matrix_products(monkeypatch):
    cls = _aten_gemm_choices()
    if cls is None:
        pytest.skip("this torch has no InductorChoices.get_template_configs hook")
    from torch._inductor.choices import InductorChoices
    from torch._inductor.select_algorithm import ExternKernelChoice
    from torch._inductor.virtualized import V

    seen = []
    monkeypatch.setattr(
        InductorChoices,
        "get_template_configs",
        lambda self, ki, templates, op, *a, **k: seen.append(templates),
    )
    aten, triton = object.__new__(ExternKernelChoice), object()
    before = cls.dropped
    with gemms_on_aten():
        assert isinstance(V.choices, cls)
        V.choices.get_template_configs(None, [aten, triton], "addmm")
        V.choices.get_template_configs(None, [triton], "mm")  # addmm asks for its templates apart
        V.choices.get_template_configs(None, [aten, triton], "convolution")
    assert not isinstance(V.choices, cls)
    assert seen == [[aten], [], [aten, triton]]
    assert cls.dropped - before == 2


def test_report_fallbacks_on_cpu_and_without_compile(tiny_model):
    fast = accelerate(
        RapidDiffusionPipeline.from_pretrained(tiny_model),
        cudnn_benchmark=True,
        autotune="all",
        compile_unet=None,
        compile_vae=None,
    )
    assert fast.report["cudnn_benchmark"].startswith("fallback: off (cuDNN needs a CUDA device")
    assert fast.report["autotune"].startswith("fallback: off (compile_unet and compile_vae are None")
    fast = accelerate(RapidDiffusionPipeline.from_pretrained(tiny_model), autotune="convs", compile_vae=None)
    assert fast.report["autotune"].startswith("convs (Inductor max-autotune"), fast.report
    assert fast.report["autotune"].endswith("; U-Net)")
    assert accelerate(RapidDiffusionPipeline.from_pretrained(tiny_model)).report["autotune"] == "off"


def test_fp16_accumulate_falls_back_on_cpu_with_the_image_unchanged(tiny_model, caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("rapiddiff"), "propagate", True)  # for caplog
    switches = {"compile_unet": None, "compile_vae": None}
    want = accelerate(RapidDiffusionPipeline.from_pretrained(tiny_model), **switches)
    assert want.report["fp16_accumulate"] == "off"
    with caplog.at_level(logging.WARNING, logger="rapiddiff"):
        fast = accelerate(
            RapidDiffusionPipeline.from_pretrained(tiny_model), fp16_accumulate=True, **switches
        )
    reason = "fallback: off (cuBLAS fp16 accumulation needs a CUDA device; this is cpu)"
    assert fast.report["fp16_accumulate"] == reason
    assert any("fp16_accumulate" in r.getMessage() and reason in r.getMessage() for r in caplog.records)
    flag = getattr(torch.backends.cuda.matmul, "allow_fp16_accumulation", None)
    out, ref = fast(["一只熊猫"], **KW), want(["一只熊猫"], **KW)
    assert getattr(torch.backends.cuda.matmul, "allow_fp16_accumulation", None) == flag  # never touched
    torch.testing.assert_close(out.latents, ref.latents, atol=0, rtol=0)
    assert float(abs(out.images - ref.images).max()) == 0


def test_fp16_accumulate_falls_back_on_a_torch_without_the_flag(tiny_model, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda, "matmul", types.SimpleNamespace())  # torch < 2.7
    fast = accelerate(
        RapidDiffusionPipeline.from_pretrained(tiny_model),
        fp16_accumulate=True,
        compile_unet=None,
        compile_vae=None,
    )
    reason = (
        f"fallback: off (torch {torch.__version__} has no torch.backends.cuda.matmul.allow_fp16_accumulation)"
    )
    assert fast.report["fp16_accumulate"] == reason


# ---- the keys ---------------------------------------------------------------------------------------
def test_compile_cache_file_names_the_switches(tmp_path):
    path = str(tmp_path / "cache.bin")
    assert compile_cache_file(path, AccelerateConfig()) == path  # the default file is unchanged
    files = {
        compile_cache_file(path, AccelerateConfig(autotune=a, cudnn_benchmark=c))
        for a in AUTOTUNE_MODES
        for c in (False, True)
    }
    assert len(files) == 2 * len(AUTOTUNE_MODES)
    assert compile_cache_file(path, AccelerateConfig(fp16_accumulate=True)) == str(
        tmp_path / "cache.fp16-accumulate.bin"
    )
    assert compile_cache_file(path, AccelerateConfig(autotune="convs", cudnn_benchmark=True)) == str(
        tmp_path / "cache.autotune-convs.cudnn-benchmark.bin"
    )


def test_compile_cache_of_other_switches_is_not_loaded(tiny_model, tmp_path):
    path = tmp_path / "cache.bin"
    path.write_bytes(b"written by a process with the default switches")
    fast = accelerate(
        RapidDiffusionPipeline.from_pretrained(tiny_model), autotune="gemm", compile_cache=str(path)
    )
    assert (
        fast.report["compile_cache"]
        == f"missing: will write {tmp_path / 'cache.autotune-gemm.bin'} after the first compiled run"
    )


def _package_key(tiny_model, **switches) -> dict:
    fast = accelerate(RapidDiffusionPipeline.from_pretrained(tiny_model), **switches)
    denoiser = fast.denoiser
    plan = linear_plan(fast.scheduler, 3)
    fields = denoiser._aoti_fields(plan, (1, 4, 8, 8), (2, 77, 32))
    return {
        part: fast_aoti.package_key(part, device=torch.device("cpu"), dtype=torch.float32, weights="w", **f)
        for part, f in fields.items()
    }


def test_a_package_built_with_other_tuning_switches_is_stale(tiny_model, tmp_path):
    off = _package_key(tiny_model)
    convs = _package_key(tiny_model, autotune="convs")
    bench = _package_key(tiny_model, cudnn_benchmark=True)  # on a CPU it falls back: the key says off
    assert bench == off
    assert _package_key(tiny_model, fp16_accumulate=True) == off  # likewise
    assert off["unet"]["switches"]["fp16_accumulate"] is False
    assert off["decoder"]["switches"]["fp16_accumulate"] is False
    for part in ("unet", "decoder"):
        assert off[part]["switches"]["autotune"] == "off" and convs[part]["switches"]["autotune"] == "convs"
        assert convs[part]["inductor"]["max_autotune_gemm"] is True
        assert fast_aoti.package_path(tmp_path, off[part]) == fast_aoti.package_path(tmp_path, convs[part])
    # A package on disk built with autotune off: the convs key finds it stale, says why.
    path = fast_aoti.package_path(tmp_path, off["unet"])
    path.write_bytes(b"PK package bytes")
    manifest = {"key": off["unet"], "size": path.stat().st_size, "sha256": fast_aoti._sha256(path)}
    fast_aoti.manifest_path(path).write_text(json.dumps(manifest))
    assert fast_aoti.check_package(path, off["unet"]) is None
    reason = fast_aoti.check_package(path, convs["unet"])
    assert reason is not None and reason.startswith("stale (")
    assert 'switches.autotune: "off" → "convs"' in reason and "inductor.max_autotune_gemm" in reason


def test_conv_1x1_as_mm_is_an_inductor_option_in_the_report_cache_name_and_key(tiny_model, tmp_path):
    fast = accelerate(RapidDiffusionPipeline.from_pretrained(tiny_model), conv_1x1_as_mm=True)
    assert fast.report["conv_1x1_as_mm"].startswith("on (Inductor lowers 1×1 convolutions")
    assert fast.denoiser._compile_kwargs("default")["options"]["conv_1x1_as_mm"] is True
    eager = accelerate(
        RapidDiffusionPipeline.from_pretrained(tiny_model),
        conv_1x1_as_mm=True,
        compile_unet=None,
        compile_vae=None,
    )
    assert eager.report["conv_1x1_as_mm"].startswith("fallback: off (nothing is compiled")
    path = str(tmp_path / "cache.bin")
    assert compile_cache_file(path, AccelerateConfig(conv_1x1_as_mm=True)).endswith(
        "cache.conv-1x1-as-mm.bin"
    )
    off, on = _package_key(tiny_model), _package_key(tiny_model, conv_1x1_as_mm=True)
    for part in ("unet", "decoder"):
        assert (
            on[part]["inductor"]["conv_1x1_as_mm"] is True and "conv_1x1_as_mm" not in off[part]["inductor"]
        )
        assert on[part]["switches"]["autotune"] == "off"  # the option is not an autotune mode


# ---- the bench's variants ----------------------------------------------------------------------------
def test_variant_grammar():
    assert parse_variant("rapiddiff") == {} and parse_variant("recipe") == {}
    assert parse_variant("rapiddiff+cudnn_benchmark") == {"cudnn_benchmark": True}
    assert parse_variant("rapiddiff+fp16_accumulate") == {"fp16_accumulate": True}
    assert parse_variant("rapiddiff+autotune=convs,cudnn_benchmark=false") == {
        "autotune": "convs",
        "cudnn_benchmark": False,
    }
    assert parse_variant("rapiddiff+compile_vae=none,max_graphs=3") == {"compile_vae": None, "max_graphs": 3}
    for bad, message in [
        (
            "turbo",
            "choose from eager, recipe, rapiddiff, rapiddiff-fp8, rapiddiff-tome or rapiddiff\\+KEY=VALUE",
        ),
        ("rapiddiff+", "choose from"),
        ("rapiddiff+warp=9", "unknown switch 'warp'.*autotune"),
        ("rapiddiff+autotune=max", "autotune must be one of off, convs, gemm, all"),
        ("rapiddiff+autotune", "autotune needs a value"),
        ("rapiddiff+cudnn_benchmark=maybe", "takes true or false"),
        ("rapiddiff+max_graphs=two", "takes an integer"),
        ("rapiddiff+autotune=all,autotune=convs", "given twice"),
        ("rapiddiff+compile_cache=/tmp/x", "unknown switch 'compile_cache'"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_variant(bad)
    with pytest.raises(ValueError, match="rapiddiff\\+autotune=fast"):
        BenchConfig(variants=("recipe", "rapiddiff+autotune=fast"))


def test_tuned_variants_run_in_the_given_order_after_the_reference():
    cfg = BenchConfig(
        batches=(1,),
        variants=("recipe", "rapiddiff", "rapiddiff+cudnn_benchmark", "rapiddiff+autotune=convs"),
    )
    assert [a[0] for _, a in plan_tasks(cfg)] == [
        "eager",
        "recipe",
        "rapiddiff",
        "rapiddiff+cudnn_benchmark",
        "rapiddiff+autotune=convs",
    ]


def test_fresh_thread_returns_or_raises():
    assert run_in_fresh_thread(lambda: threading.current_thread().name) == "bench-fresh-cudnn-cache"
    with pytest.raises(ZeroDivisionError):
        run_in_fresh_thread(lambda: 1 / 0)


def test_budget_skips_tasks_and_says_so(tmp_path, capsys):
    cfg = BenchConfig(
        preset="tiny",
        steps=2,
        batches=(1,),
        variants=("rapiddiff", "rapiddiff+autotune=convs"),
        dtype="float32",
        compile=False,
        min_run_time=0.05,
        out=str(tmp_path),
        device="cpu",
        budget_s=1e-9,  # spent before the first task starts
    )
    result = run_bench(cfg)
    assert result["rows"] == []
    assert result["skipped"] == [
        "eager at batch 1",
        "rapiddiff at batch 1",
        "rapiddiff+autotune=convs at batch 1",
    ]
    assert "skipped (time budget 0 s spent" in capsys.readouterr().out
    assert "Not started (time budget 0 s spent): eager at batch 1, " in (tmp_path / "bench.md").read_text()


def test_tuned_variant_row_on_cpu(tmp_path):
    """A tuned variant is a row like the others: its switches reach accelerate (the note shows them)."""
    cfg = BenchConfig(
        preset="tiny",
        steps=2,
        batches=(1,),
        variants=("rapiddiff+cudnn_benchmark,cross_kv_cache=false",),
        dtype="float32",
        compile=False,
        min_run_time=0.05,
        out=str(tmp_path),
        device="cpu",
    )
    rows = {r["variant"]: r for r in run_bench(cfg)["rows"]}
    row = rows["rapiddiff+cudnn_benchmark,cross_kv_cache=false"]
    assert row["latent_rel_err"] < 1e-4 and row["psnr_db"] > 35 and row["it_s"] > 0
    assert row["note"].startswith("own thread (empty cuDNN plan cache); ")
    assert "cudnn_benchmark=fallback: off (cuDNN needs a CUDA device" in row["note"]
    assert "cross_kv_cache" not in row["note"]  # off: the note lists what is not off


# ---- a real compile (CPU) -------------------------------------------------------------------------------
@pytest.mark.slow
def test_autotune_convs_gives_the_image_of_autotune_off_on_cpu(tiny_model):
    """Inductor's CPU backend takes the max-autotune patch (it has no Triton templates to offer, so the
    convolutions stay ATen): the compiled fast path gives the same image as with autotune off."""
    off = accelerate(RapidDiffusionPipeline.from_pretrained(tiny_model), compile_vae=None)
    want = off(["一只熊猫"], **KW)
    torch._dynamo.reset()
    fast = accelerate(RapidDiffusionPipeline.from_pretrained(tiny_model), autotune="convs", compile_vae=None)
    try:
        out = fast(["一只熊猫"], **KW)
    except Exception as err:
        pytest.skip(f"Inductor's CPU backend refused autotune=convs: {type(err).__name__}: {err}")
    finally:
        torch._dynamo.reset()
    assert fast.report["autotune"].startswith("convs ("), fast.report
    assert fast.report["compile_unet"] == "default"
    torch.testing.assert_close(out.latents, want.latents, atol=1e-4, rtol=1e-4)
    assert float(abs(out.images - want.images).max()) < 1e-3
