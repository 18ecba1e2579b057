"""rapiddiff bench on a tiny CPU run: every variant row, parity figures, files, the CLI."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("diffusers")

from rapiddiff.cli import COMMANDS, build_parser
from rapiddiff.infer.bench import BenchConfig, plan_tasks, psnr, run_bench


def test_config_rejects_unknown_names():
    with pytest.raises(ValueError, match="rapiddiff-tome"):
        BenchConfig(variants=("eager", "turbo"))
    with pytest.raises(ValueError, match="channels_last"):
        BenchConfig(switches=("warp",))
    assert "loop=graph" in BenchConfig(switches=("all",)).switches


def test_tasks_put_the_headline_first():
    cfg = BenchConfig(
        batches=(1, 8),
        variants=("recipe", "rapiddiff", "rapiddiff-tome"),
        switches=("fuse_qkv",),
        second_process=True,
    )
    names = [(t, a[0] if a else None, a[1] if a else None) for t, a in plan_tasks(cfg)]
    assert names[:3] == [("run", "eager", 1), ("run", "recipe", 1), ("run", "rapiddiff", 1)]
    assert names[3] == ("run", "rapiddiff-tome", 1) and names[4] == ("second_process", None, None)
    assert names[5:9] == [("run", v, 8) for v in ("eager", "recipe", "rapiddiff", "rapiddiff-tome")]
    assert names[9][1] == "switch"


def test_psnr():
    assert psnr([[0.5]], [[0.5]]) == math.inf
    assert psnr([[0.0]], [[0.1]]) == pytest.approx(20.0)


def test_tiny_run_writes_rows_parity_and_files(tmp_path, capsys):
    cfg = BenchConfig(
        preset="tiny",
        steps=2,
        batches=(1,),
        variants=("eager", "rapiddiff"),
        switches=("cross_kv_cache",),
        dtype="float32",
        compile=False,
        min_run_time=0.05,
        out=str(tmp_path),
        device="cpu",
    )
    result = run_bench(cfg)
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == {"eager", "rapiddiff", "switch:cross_kv_cache=True"}
    for name in ("rapiddiff", "switch:cross_kv_cache=True"):
        assert rows[name]["latent_rel_err"] < 1e-4 and rows[name]["psnr_db"] > 35
        assert rows[name]["it_s"] > 0 and rows[name]["e2e_s"] > 0
    assert "fallback" in rows["rapiddiff"]["note"]  # CPU: the graph loop and attention timing fall back
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert len(saved["rows"]) == 3 and saved["meta"]["config"]["preset"] == "tiny"
    table = (tmp_path / "bench.md").read_text()
    assert "| rapiddiff | 1 |" in table
    assert (tmp_path / "first_images.png").stat().st_size > 0


def test_cli_is_registered():
    assert COMMANDS["bench"][0] == "rapiddiff.infer.bench_cli"
    args = build_parser().parse_args(["bench", "--preset", "tiny", "--batch", "1", "2", "--no-compile"])
    assert args.batch == [1, 2] and args.no_compile


def test_tuned_variants_parse_by_field_type_and_name_what_is_wrong():
    from rapiddiff.infer.bench import parse_variant

    assert parse_variant("rapiddiff") == {}
    assert parse_variant("rapiddiff+compile_regions") == {"compile_regions": True}  # a bare KEY is true
    assert parse_variant("rapiddiff+fuse_qkv=false,max_graphs=3,compile_vae=none") == {
        "fuse_qkv": False,
        "max_graphs": 3,
        "compile_vae": None,
    }
    for name, error in [
        ("rapiddiff+fp8", "unknown switch 'fp8'"),  # a removed switch is unknown, not ignored
        ("rapiddiff+attention=fast", "attention must be one of auto"),
        ("rapiddiff+max_graphs", "max_graphs needs a value"),
        ("rapiddiff+fuse_qkv=maybe", "takes true or false"),
        ("rapiddiff+compile_cache=/x", "unknown switch 'compile_cache'"),  # the bench owns the cache
        ("rapiddiff+fuse_qkv,fuse_qkv=false", "given twice"),
    ]:
        with pytest.raises(ValueError, match=error):
            parse_variant(name)


def test_profile_takes_variants_and_buckets_cudnn_attention_as_attention():
    from rapiddiff.infer.bench import _family

    args = build_parser().parse_args(["bench", "--profile"])
    assert args.profile == []  # bare --profile: the rapiddiff row (bench_cli fills the default)
    args = build_parser().parse_args(["bench", "--profile", "rapiddiff", "rapiddiff+fuse_qkv=false"])
    assert args.profile == ["rapiddiff", "rapiddiff+fuse_qkv=false"]
    assert BenchConfig(profile_variants=("rapiddiff+fuse_qkv=false",)).profile_variants
    with pytest.raises(ValueError, match="profile variants are rapiddiff"):
        BenchConfig(profile_variants=("recipe",))
    # cuDNN names its attention kernel "..._sdpa_..._fprop_...": attention, not a convolution
    assert (
        _family("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64") == "attention"
    )
    assert _family("sm90_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc") == "convolution"
    assert _family("triton_per_fused_add_native_group_norm_silu_31") == "fused Triton (norms, elementwise)"


def test_profile_writes_each_variants_families_and_every_kernel(tmp_path):
    """On a CPU the profile is of operators (the device call reads the same files for kernels)."""
    import csv

    import torch

    from rapiddiff.infer.bench import profile_fast

    variants = ("rapiddiff+compile_unet=None,compile_vae=None", "rapiddiff+fuse_qkv=false,compile_unet=None")
    cfg = BenchConfig(preset="tiny", steps=2, dtype="float32", device="cpu", compile=False,
                      profile=True, profile_variants=variants, out=str(tmp_path))  # fmt: skip
    summary = profile_fast(cfg, torch.device("cpu"), tmp_path)
    assert all(f"{v}: CPU time (operators) of one image" in summary for v in variants)
    text = (tmp_path / "profile.txt").read_text()
    assert "convolution" in text and "  total " in text
    with open(tmp_path / "profile.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {r["variant"] for r in rows} == set(variants)  # commas inside a variant stay one field
    assert all(int(r["calls"]) > 0 and float(r["total_us"]) > 0 for r in rows)
    assert any(r["family"] == "convolution" for r in rows)


def test_profile_keeps_finished_variants_when_a_later_one_breaks_or_the_budget_is_spent(
    tmp_path, monkeypatch
):
    """A device call cut short must still bring back the profiles it finished."""
    import time

    import torch

    from rapiddiff.infer import bench

    variants = ("rapiddiff+compile_unet=None,compile_vae=None", "rapiddiff+fuse_qkv=false,compile_unet=None")
    cfg = BenchConfig(preset="tiny", steps=2, dtype="float32", device="cpu", compile=False,
                      profile=True, profile_variants=variants, out=str(tmp_path))  # fmt: skip
    built = []
    real_build = bench.build_pipeline

    def build_twice_then_break(*args, **kwargs):
        built.append(1)
        if len(built) == 2:
            raise RuntimeError("killed")
        return real_build(*args, **kwargs)

    monkeypatch.setattr(bench, "build_pipeline", build_twice_then_break)
    with pytest.raises(RuntimeError, match="killed"):
        bench.profile_fast(cfg, torch.device("cpu"), tmp_path)
    assert variants[0] in (tmp_path / "profile.csv").read_text()
    assert variants[1] not in (tmp_path / "profile.csv").read_text()

    built.clear()
    summary = bench.profile_fast(cfg, torch.device("cpu"), tmp_path / "late", deadline=time.perf_counter())
    assert not built and summary.count("not profiled (time budget") == 2


def test_a_task_still_running_after_its_time_prints_every_stack(capfd):
    """A device call's hang must leave where it hangs in the log."""
    import time

    from rapiddiff.infer.bench import stacks_if_stuck

    with stacks_if_stuck(0.05):
        time.sleep(0.5)
    err = capfd.readouterr().err
    assert "Timeout" in err and "test_a_task_still_running_after_its_time_prints_every_stack" in err
    with stacks_if_stuck(5.0):
        pass  # finished in time: the timer is cancelled
    with stacks_if_stuck(0):
        time.sleep(0.1)  # off
    time.sleep(0.2)
    assert capfd.readouterr().err == ""
    args = build_parser().parse_args(["bench", "--stacks-after-s", "60"])
    assert args.stacks_after_s == 60.0
