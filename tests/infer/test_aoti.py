"""AOTInductor packages of the fast path (rapiddiff.infer.fast_aoti): the key, the staleness decision,
corrupt files, and — slow, they compile C++ — a real package of the tiny model: output equal to the
uncompiled fast path, loaded by a new process, skipped with the reason when stale or corrupt."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rapiddiff.infer import fast_aoti
from rapiddiff.infer.accelerate import AccelerateConfig, accelerate
from rapiddiff.infer.accelerate_cli import parse_switches
from rapiddiff.infer.pipeline import RapidDiffusionPipeline

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
FIELDS = {
    "shapes": {"x": [2, 4, 8, 8], "context": [2, 77, 32], "t": "int64"},
    "switches": {"channels_last": True, "fuse_qkv": True, "attention": "default", "cross_kv_cache": True},
}


# ---- the key and the decision (no compiling) ---------------------------------------------------------
def _module() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3), torch.nn.GroupNorm(2, 8))


def _fake_package(
    folder: Path, module: torch.nn.Module, weights: str = "w0", key: dict | None = None
) -> tuple[Path, dict]:
    """A package file and its manifest as build_package writes them (the payload is not compiled:
    the decision looks at the manifest, the file's bytes and the module, never inside the archive)."""
    key = key or fast_aoti.package_key("unet", device=CPU, dtype=torch.float32, weights=weights, **FIELDS)
    path = fast_aoti.package_path(folder, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"PK not really a package " * 10)
    names = sorted(fast_aoti.live_constants(module))
    manifest = {
        "key": key,
        "size": path.stat().st_size,
        "sha256": fast_aoti._sha256(path),
        "constants": names,
        "constants_layout": fast_aoti.constants_layout(module, names),
        "weights_files": {},
    }
    fast_aoti.manifest_path(path).write_text(json.dumps(manifest))
    return path, key


def test_matching_package_passes_the_check(tmp_path):
    module = _module()
    path, key = _fake_package(tmp_path, module)
    assert (
        path.name
        == "unet-c2x77x32-x2x4x8x8-cpu-" + fast_aoti._slug(__import__("platform").machine()) + ".pt2"
    )
    assert fast_aoti.check_package(path, key, module) is None


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda k: k.update(torch="9.9.9+cu999"), "torch: "),
        (lambda k: k.update(cuda="13.1"), 'cuda: null → "13.1"'),
        (lambda k: k.update(device="NVIDIA H200", capability="sm_90"), "device: "),
        (lambda k: k.update(dtype="float16"), 'dtype: "float32" → "float16"'),
        (lambda k: k["shapes"].update(x=[4, 4, 8, 8]), "shapes.x: [2, 4, 8, 8] → [4, 4, 8, 8]"),
        (lambda k: k["switches"].update(fuse_qkv=False), "switches.fuse_qkv: true → false"),
        (lambda k: k["switches"].update(batch_time_proj=True), "switches.batch_time_proj: null → true"),
        (lambda k: k.update(weights="w1"), 'weights: "w0" → "w1"'),
        (lambda k: k.update(inductor={"max_autotune": True}), "inductor."),
    ],
)
def test_any_key_field_that_differs_makes_the_package_stale(tmp_path, change, expected):
    module = _module()
    path, key = _fake_package(tmp_path, module)
    wanted = json.loads(json.dumps(key))
    change(wanted)
    reason = fast_aoti.check_package(path, wanted, module)
    assert reason is not None and reason.startswith("stale (") and expected in reason, reason


def test_a_changed_module_layout_makes_the_package_stale(tmp_path):
    """The kernels assume each constant's shape, strides and dtype: channels_last weights differ."""
    module = _module()
    path, key = _fake_package(tmp_path, module)
    module.to(memory_format=torch.channels_last)
    reason = fast_aoti.check_package(path, key, module)
    assert reason is not None and "module layout: 1 of 4 constants differ, first 0.weight" in reason
    module = _module().double()
    assert "4 of 4 constants differ" in fast_aoti.check_package(path, key, module)


def test_the_manifest_lists_the_exported_programs_constants_without_loading_the_package():
    """build_package names the constants from torch.export's signature (opening a fresh CUDA package
    in the process that compiled it crashed on torch 2.11): parameters and buffers, by their names."""
    module = _module()
    with torch.no_grad():
        program = torch.export.export(module, (torch.randn(1, 4, 6, 6),), strict=False)
    assert fast_aoti.exported_constants(program) == sorted(module.state_dict())


class _Opened:
    """What open_package returns, as far as load_package uses it."""

    def __init__(self, names):
        self.names, self.loaded = names, None

    def get_constant_fqns(self):
        return list(self.names)

    def load_constants(self, constants, *, check_full_update, user_managed):
        self.loaded = (sorted(constants), check_full_update, user_managed)


def test_load_hands_the_package_only_constants_its_manifest_checked(tmp_path, monkeypatch):
    module = _module()
    path, _ = _fake_package(tmp_path, module)
    manifest = fast_aoti.read_manifest(path)
    opened = _Opened(manifest["constants"][:3])  # a package may read fewer than the export listed
    monkeypatch.setattr(fast_aoti, "open_package", lambda _path: opened)
    assert fast_aoti.load_package(path, module, manifest) is opened
    assert opened.loaded == (manifest["constants"][:3], True, True)
    stray = _Opened([*manifest["constants"], "lifted_tensor_0"])
    monkeypatch.setattr(fast_aoti, "open_package", lambda _path: stray)
    with pytest.raises(fast_aoti.PackageError, match="does not list \\(lifted_tensor_0\\); rebuild it"):
        fast_aoti.load_package(path, module, manifest)
    assert stray.loaded is None


def test_a_package_that_does_not_open_in_a_new_process_fails_the_build_with_the_reason(tmp_path, monkeypatch):
    """check_loads: what an unloadable archive prints, and a native crash named by its signal (the
    H100 image's packages died with SIGSEGV on load; the exporter now survives and says so)."""
    bad = tmp_path / "unet-bad.pt2"
    bad.write_bytes(b"PK not a package")
    with pytest.raises(
        fast_aoti.PackageError, match=r"unet-bad.pt2: the package was built but does not load .*exit 1"
    ):
        fast_aoti.check_loads(bad, "g++ (its C++ runs here)")
    crashed = subprocess.CompletedProcess(
        [], -11, "", "Fatal Python error: Segmentation fault\n  File x in open_package"
    )
    monkeypatch.setattr(fast_aoti.subprocess, "run", lambda *a, **k: crashed)
    with pytest.raises(fast_aoti.PackageError) as err:
        fast_aoti.check_loads(bad, "g++ (its C++ runs here)")
    assert "killed by SIGSEGV: Fatal Python error: Segmentation fault | File x in open_package" in str(
        err.value
    )
    assert "C++ compiler: g++ (its C++ runs here)" in str(err.value)


def test_the_inductor_override_enters_the_key_and_bad_json_is_named(tmp_path, monkeypatch):
    module = _module()
    path, _ = _fake_package(tmp_path, module)
    monkeypatch.setenv(fast_aoti.INDUCTOR_ENV, '{"aot_inductor.package_constants_in_so": true}')
    wanted = fast_aoti.package_key("unet", device=CPU, dtype=torch.float32, weights="w0", **FIELDS)
    assert wanted["inductor"]["aot_inductor.package_constants_in_so"] is True
    reason = fast_aoti.check_package(path, wanted, module)
    assert reason.startswith("stale (inductor.aot_inductor.package_constants_in_so: false → true")
    monkeypatch.setenv(fast_aoti.INDUCTOR_ENV, "[1]")
    with pytest.raises(fast_aoti.PackageError, match="RAPIDDIFF_AOTI_INDUCTOR: not a JSON object"):
        fast_aoti.inductor_configs()
    monkeypatch.delenv(fast_aoti.INDUCTOR_ENV)
    assert fast_aoti.inductor_configs() == fast_aoti.INDUCTOR_CONFIGS


def test_corrupt_or_unexplained_files_are_rejected_with_the_file_named(tmp_path):
    module = _module()
    path, key = _fake_package(tmp_path, module)
    data = bytearray(path.read_bytes())
    data[5] ^= 0xFF  # same size, other bytes
    path.write_bytes(bytes(data))
    assert "corrupt: " + path.name in fast_aoti.check_package(path, key, module)
    path.write_bytes(bytes(data[:50]))  # truncated
    assert (
        fast_aoti.check_package(path, key, module)
        == f"corrupt: {path.name} has 50 bytes, its manifest says 240"
    )

    manifest = fast_aoti.manifest_path(path)
    manifest.write_text("{not json")
    assert f"{manifest}: unreadable manifest" in fast_aoti.check_package(path, key, module)
    manifest.unlink()
    assert f"{manifest} is missing" in fast_aoti.check_package(path, key, module)
    path.unlink()
    assert fast_aoti.check_package(path, key, module) == f"no package {path.name}"


def test_a_file_that_is_not_an_aoti_package_is_refused_by_the_loader(tmp_path):
    """Bytes that match their manifest but are no archive: the loader's error becomes one clear line."""
    module = _module()
    path, key = _fake_package(tmp_path, module)
    assert fast_aoti.check_package(path, key, module) is None  # the manifest vouches for these bytes
    with pytest.raises(
        fast_aoti.PackageError, match=r"not a loadable AOTInductor package .*accelerate export"
    ):
        fast_aoti.load_package(path, module, fast_aoti.read_manifest(path))


def test_weights_fingerprint_rehashes_only_changed_files(tmp_path):
    (tmp_path / "unet").mkdir()
    weights = tmp_path / "unet" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(b"a" * 1000)
    (tmp_path / "unet" / "config.json").write_text("{}")  # not weights: not hashed
    (tmp_path / "accelerated").mkdir()
    (tmp_path / "accelerated" / "x.pt").write_bytes(b"package")  # never part of the weights
    os.utime(weights, ns=(10**18, 10**18))
    digest, files = fast_aoti.weights_fingerprint(tmp_path, "unet")
    assert list(files) == ["unet/diffusion_pytorch_model.safetensors"]
    assert files["unet/diffusion_pytorch_model.safetensors"]["sha256"] == fast_aoti._sha256(weights)
    # Same size and mtime: the recorded hash is trusted (a new process does not re-read gigabytes).
    forged = {k: {**v, "sha256": "0" * 64} for k, v in files.items()}
    assert fast_aoti.weights_fingerprint(tmp_path, "unet", forged)[0] != digest
    # A rewritten file (other mtime) is hashed again, whatever the record says.
    weights.write_bytes(b"b" * 1000)
    os.utime(weights, ns=(2 * 10**18, 2 * 10**18))
    changed, _ = fast_aoti.weights_fingerprint(tmp_path, "unet", forged)
    assert changed != digest and changed == fast_aoti.weights_fingerprint(tmp_path, "unet")[0]
    weights.write_bytes(b"a" * 1000)
    os.utime(weights, ns=(3 * 10**18, 3 * 10**18))
    assert fast_aoti.weights_fingerprint(tmp_path, "unet", forged)[0] == digest
    with pytest.raises(fast_aoti.PackageError, match="no weights files"):
        (tmp_path / "empty").mkdir()
        fast_aoti.weights_fingerprint(tmp_path / "empty")


class _Recorder:
    def __init__(self) -> None:
        self.built: list[str] = []
        self.loaded: list[str] = []

    def build(self, path, module, args, key, files=None, extra=None):
        self.built.append(path.name)
        _fake_package(path.parent, module, key=key)
        return fast_aoti.read_manifest(path)

    def load(self, path, module, manifest):
        self.loaded.append(path.name)
        return lambda *a: "compiled"


def test_store_loads_a_match_and_rebuilds_or_skips_a_stale_package_with_the_reason(
    tmp_path, monkeypatch, caplog
):
    rec = _Recorder()
    monkeypatch.setattr(fast_aoti, "build_package", rec.build)
    monkeypatch.setattr(fast_aoti, "load_package", rec.load)
    module = _module()
    store = fast_aoti.PackageStore(tmp_path, None, "build")
    with caplog.at_level(logging.WARNING, logger="rapiddiff"):
        call, status, _ = store.resolve("unet", module, (), FIELDS, CPU, torch.float32)
    status = str(status)  # the rendered SwitchStatus
    assert call is not None and status.startswith("built unet-") and "(no package unet-" in status
    assert "aoti: building unet-" in caplog.text

    call, status, _ = store.resolve("unet", module, (), FIELDS, CPU, torch.float32)
    status = str(status)  # the rendered SwitchStatus
    assert status.startswith("loaded unet-") and len(rec.built) == 1 and len(rec.loaded) == 2

    # A switch changes: "load" keeps torch.compile and says why; "build" rebuilds and says why.
    other = {**FIELDS, "switches": {**FIELDS["switches"], "fuse_qkv": False}}
    loader = fast_aoti.PackageStore(tmp_path, None, "load")
    call, status, _ = loader.resolve("unet", module, (), other, CPU, torch.float32)
    status = str(status)  # the rendered SwitchStatus
    assert call is None and status.startswith(
        "fallback: torch.compile (stale (switches.fuse_qkv: true → false)"
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rapiddiff"):
        call, status, _ = store.resolve("unet", module, (), other, CPU, torch.float32)
    status = str(status)  # the rendered SwitchStatus
    assert "switches.fuse_qkv: true → false" in caplog.text and "switches.fuse_qkv" in status
    assert len(rec.built) == 2
    assert str(loader.resolve("unet", module, (), other, CPU, torch.float32)[1]).startswith("loaded")


def test_store_keys_packages_to_the_model_folders_weights(tmp_path, monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(fast_aoti, "build_package", rec.build)
    monkeypatch.setattr(fast_aoti, "load_package", rec.load)
    (tmp_path / "unet").mkdir()
    weights = tmp_path / "unet" / "model.safetensors"
    weights.write_bytes(b"x" * 64)
    store = fast_aoti.PackageStore(tmp_path / "accelerated", tmp_path, "load")
    digest, _ = fast_aoti.weights_fingerprint(tmp_path, "unet")
    _fake_package(tmp_path / "accelerated", _module(), weights=digest)
    assert str(store.resolve("unet", _module(), (), FIELDS, CPU, torch.float32)[1]).startswith("loaded")
    weights.write_bytes(b"y" * 64)  # fine-tuned weights saved over the old ones
    call, status, _ = store.resolve("unet", _module(), (), FIELDS, CPU, torch.float32)
    status = str(status)  # the rendered SwitchStatus
    assert call is None and f'weights: "{digest}" → ' in status


def test_config_and_switch_parsing():
    with pytest.raises(ValueError, match="aoti must be one of off, load, build, auto"):
        AccelerateConfig(aoti="yes")
    assert parse_switches(["fuse_qkv=false", "compile_unet=none", "max_graphs=3", "attention=flash"]) == {
        "fuse_qkv": False,
        "compile_unet": None,
        "max_graphs": 3,
        "attention": "flash",
    }
    with pytest.raises(ValueError, match="'aoti=build'"):
        parse_switches(["aoti=build"])
    with pytest.raises(ValueError, match="'fuse_qkv'"):
        parse_switches(["fuse_qkv"])
    with pytest.raises(ValueError, match="'fp8=true'"):  # a removed switch is named as unknown
        parse_switches(["fp8=true"])


def test_accelerate_says_why_it_cannot_use_packages(tiny_model):
    pipe = RapidDiffusionPipeline.from_pretrained(tiny_model)
    pipe.model_path = None  # e.g. a pipeline built in memory
    fast = accelerate(pipe, aoti="load", compile_unet=None, compile_vae=None)
    assert fast.report["aoti"].startswith("fallback: torch.compile (no model folder")
    pipe = RapidDiffusionPipeline.from_pretrained(tiny_model)
    fast = accelerate(pipe, aoti="load", loop="eager", compile_unet=None, compile_vae=None)
    assert "loop=eager" in fast.report["aoti"]
    pipe = RapidDiffusionPipeline.from_pretrained(tiny_model)
    fast = accelerate(pipe, aoti="load", compile_unet=None, compile_vae=None)
    assert (
        fast.report["aoti"].startswith("load (")
        and str(Path(tiny_model) / "accelerated") in fast.report["aoti"]
    )


# ---- a real package of the tiny model (compiles C++: slow) ------------------------------------------
KW = {"num_inference_steps": 3, "guidance_scale": 5.0, "seed": 0, "output_type": "np", "progress": False}
NO_COMPILE = {"compile_unet": None, "compile_vae": None}


@pytest.fixture(scope="module")
def exported(tiny_model, tmp_path_factory):
    """A copy of the tiny model with its packages built by `rapiddiff accelerate export` (a subprocess,
    as a user runs it), and the uncompiled fast path's output on the same call as the reference."""
    model = tmp_path_factory.mktemp("aoti") / "model"
    shutil.copytree(tiny_model, model)
    # Inductor keeps AOTI's precompiled headers (~440 MB) under the temp folder whatever
    # TORCHINDUCTOR_CACHE_DIR says: give the export a temp folder pytest cleans up.
    scratch = tmp_path_factory.mktemp("aoti-tmp")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TMPDIR": str(scratch)}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(scratch / "inductor")
    cmd = [
        sys.executable,
        "-m",
        "rapiddiff",
        "accelerate",
        "export",
        "--model",
        str(model),
        "--guidance",
        "5",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = accelerate(RapidDiffusionPipeline.from_pretrained(model), **NO_COMPILE)(["一只熊猫"], **KW)
    return model, proc.stdout, reference


@pytest.mark.slow
def test_export_writes_packages_whose_output_matches_the_fast_path(exported):
    model, stdout, reference = exported
    row = json.loads(stdout.strip().splitlines()[-1])
    assert row["aoti_unet"].startswith("built unet-") and row["aoti_decoder"].startswith("built decoder-")
    files = sorted(p.name for p in (model / "accelerated").iterdir())
    assert [f.rsplit(".", 1)[1] for f in files] == ["json", "pt2", "json", "pt2"], files
    manifest = json.loads(next((model / "accelerated").glob("unet-*.json")).read_text())
    assert manifest["key"]["torch"] == torch.__version__ and manifest["key"]["shapes"]["x"] == [2, 4, 8, 8]
    assert manifest["weights_files"] and manifest["constants"]

    fast = accelerate(RapidDiffusionPipeline.from_pretrained(model), aoti="load", **NO_COMPILE)
    out = fast(["一只熊猫"], **KW)
    assert fast.report["aoti_unet"].startswith("loaded unet-"), fast.report
    assert fast.report["aoti_decoder"].startswith("loaded decoder-"), fast.report
    assert torch.allclose(out.latents, reference.latents, atol=1e-4, rtol=1e-4)
    assert np.abs(out.images[0] - reference.images[0]).max() < 1e-4


@pytest.mark.slow
def test_a_new_process_loads_the_packages_and_gives_the_same_image(exported, tmp_path):
    model, _, reference = exported
    script = (
        "import sys, json, torch\n"
        "from rapiddiff.infer.accelerate import accelerate\n"
        "from rapiddiff.infer.pipeline import RapidDiffusionPipeline\n"
        f"pipe = accelerate(RapidDiffusionPipeline.from_pretrained(sys.argv[1]), aoti='load', **{NO_COMPILE!r})\n"
        f"out = pipe(['一只熊猫'], **{KW!r})\n"
        "torch.save(out.latents, sys.argv[2])\n"
        "print(json.dumps(pipe.report, ensure_ascii=False))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", script, str(model), str(tmp_path / "latents.pt")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["aoti_unet"].startswith("loaded") and report["aoti_decoder"].startswith("loaded"), report
    assert torch.allclose(torch.load(tmp_path / "latents.pt"), reference.latents, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_stale_or_corrupt_packages_are_skipped_with_the_reason(exported, tmp_path, caplog):
    model, _, reference = exported
    copy = tmp_path / "model"
    shutil.copytree(model, copy)

    def run(**switches):
        fast = accelerate(RapidDiffusionPipeline.from_pretrained(copy), aoti="load", **NO_COMPILE, **switches)
        return fast, fast(["一只熊猫"], **KW)

    # Another switch → another key: skipped (torch.compile instead), the same image all the same.
    fast, out = run(cross_kv_cache=False)
    assert "switches.cross_kv_cache: true → false" in fast.report["aoti_unet"], fast.report
    assert fast.report["aoti_decoder"].startswith("loaded")  # the decoder does not depend on it
    assert torch.allclose(out.latents, reference.latents, atol=1e-4, rtol=1e-4)
    # Another batch → another package name: none there yet.
    fast = accelerate(RapidDiffusionPipeline.from_pretrained(copy), aoti="load", **NO_COMPILE)
    fast(["一只熊猫", "两只熊猫"], **KW)
    assert "no package unet-c4x" in fast.report["aoti_unet"], fast.report
    # A corrupt package file.
    package = next((copy / "accelerated").glob("decoder-*.pt2"))
    package.write_bytes(package.read_bytes()[:-100])
    with caplog.at_level(logging.WARNING, logger="rapiddiff"):
        fast, out = run()
    assert f"corrupt: {package.name}" in fast.report["aoti_decoder"], fast.report
    assert "corrupt" in caplog.text
    assert np.abs(out.images[0] - reference.images[0]).max() < 1e-4
    # New weights saved over the old ones.
    weights = next((copy / "unet").glob("*.safetensors"))
    from safetensors.torch import load_file, save_file

    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1
    save_file(tensors, weights)
    fast, _ = run()
    assert "stale (weights: " in fast.report["aoti_unet"], fast.report


@pytest.mark.slow
def test_check_command_reports_each_package(exported):
    model, _, _ = exported
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "rapiddiff", "accelerate", "check", "--model", str(model), "--guidance", "5"]
    proc = subprocess.run([*cmd, "--batch", "1", "3"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 1, proc.stderr[-2000:]  # batch 3 has no package
    rows = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    assert rows[0]["aoti_unet"].startswith("loaded") and "no package unet-c6x" in rows[1]["aoti_unet"]


# ---- the CUDA path (graph-captured loop, fp16) -------------------------------------------------------
@pytest.mark.gpu
def test_cuda_packages_inside_the_captured_loop_match_torch_compile(tiny_model, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    kw = {**KW, "num_inference_steps": 5}
    compiled = accelerate(RapidDiffusionPipeline.from_pretrained(model, device="cuda"))
    want = compiled(["一只熊猫"], **kw)
    fast = accelerate(RapidDiffusionPipeline.from_pretrained(model, device="cuda"), aoti="build")
    first = fast(["一只熊猫"], **kw)
    again = fast(["一只熊猫"], **kw)  # the graph replay
    assert fast.report["aoti_unet"].startswith("built"), fast.report
    assert fast.report["loop"] == "graph", fast.report  # the packages were captured in the loop graph
    for out in (first, again):
        rel = float((out.latents - want.latents).norm() / want.latents.norm())
        assert rel < 2e-2, rel
    loaded = accelerate(RapidDiffusionPipeline.from_pretrained(model, device="cuda"), aoti="load")
    out = loaded(["一只熊猫"], **kw)
    assert loaded.report["aoti_unet"].startswith("loaded") and loaded.report["aoti_decoder"].startswith(
        "loaded"
    )
    assert torch.allclose(out.latents, first.latents, atol=1e-3, rtol=1e-3)


@pytest.mark.slow
def test_regional_compilation_matches_the_uncompiled_fast_path(tiny_model):
    """compile_regions: each transformer/ResNet block compiled alone; same output, said in the report."""
    reference = accelerate(RapidDiffusionPipeline.from_pretrained(tiny_model), **NO_COMPILE)(
        ["一只熊猫"], **KW
    )
    fast = accelerate(
        RapidDiffusionPipeline.from_pretrained(tiny_model), compile_regions=True, compile_vae=None
    )
    out = fast(["一只熊猫"], **KW)
    assert fast.report["compile_unet"].startswith("default, regional ("), fast.report
    blocks = sum(type(m).__name__ in ("BasicTransformerBlock", "ResnetBlock2D") for m in fast.unet.modules())
    assert f"({blocks} blocks)" in fast.report["compile_unet"] and blocks > 4
    assert torch.allclose(out.latents, reference.latents, atol=1e-4, rtol=1e-4)


def test_regional_compilation_lets_dynamo_keep_a_graph_per_block(tiny_model):
    """Every block of a class shares one forward; SD 1.5's distinct block shapes outnumber Dynamo's
    default recompile limit (8), which fullgraph=True turned into FailOnRecompileLimitHit on the H100.
    (Dynamo's own config.patch, not pytest's monkeypatch: undoing that hides the config entry.)"""
    config = torch._dynamo.config
    with config.patch(recompile_limit=1, accumulated_recompile_limit=1):
        fast = accelerate(
            RapidDiffusionPipeline.from_pretrained(tiny_model), compile_regions=True, compile_vae=None
        )  # compiling is lazy: nothing runs here
        blocks = sum(
            type(m).__name__ in ("BasicTransformerBlock", "ResnetBlock2D") for m in fast.unet.modules()
        )
        assert blocks > 1 and config.recompile_limit == blocks
        assert config.accumulated_recompile_limit == blocks
    with config.patch(recompile_limit=1000, accumulated_recompile_limit=1000):
        accelerate(RapidDiffusionPipeline.from_pretrained(tiny_model), compile_regions=True, compile_vae=None)
        assert config.recompile_limit == 1000  # a larger setting is kept


def test_generate_uses_packages_by_default_and_no_packages_turns_them_off(
    tiny_model, tmp_path, monkeypatch, capsys
):
    import importlib.machinery
    import types

    from rapiddiff.cli import main

    cli = ["generate", "x", "--model", str(tiny_model), "--steps", "2", "--device", "cpu", "--no-progress"]
    assert main([*cli, "--no-packages", "--out", str(tmp_path)]) == 2
    assert "--no-packages needs --fast" in capsys.readouterr().err
    seen = []

    def fake_accelerate(pipe, **switches):
        seen.append(switches)
        return pipe  # no denoiser swap: the eager loop runs

    name = "rapiddiff.infer.accelerate"
    fake = types.ModuleType(name)
    fake.__spec__ = importlib.machinery.ModuleSpec(name, None)
    fake.accelerate = fake_accelerate
    monkeypatch.setitem(sys.modules, name, fake)
    assert main([*cli, "--fast", "--fast", "--no-packages", "--out", str(tmp_path / "a")]) == 0
    assert main([*cli, "--fast", "--fast", "--out", str(tmp_path / "b")]) == 0
    assert seen == [{"aoti": "off"}, {"aoti": "auto"}]


def test_cold_start_benchmark_plans_the_key_comparison_first_and_summarises_failures():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "aoti_cold_start", REPO / "benchmarks" / "aoti_cold_start.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    plan = bench.plan_processes(["aoti", "compile", "regional"], 2)
    assert plan[:5] == [
        ("aoti", 0),
        ("compile-cold", 0),
        ("compile-cache", 0),
        ("compile-cache", 1),
        ("aoti", 1),
    ]
    assert plan[5:] == [("regional-cold", 0), ("regional-cache", 0), ("regional-cache", 1)]
    assert bench.plan_processes(["compile"], 1) == [("compile-cold", 0), ("compile-cache", 0)]
    assert bench.plan_processes(["aoti", "compile"], 2, grouped=True) == [
        ("aoti", 0),
        ("aoti", 1),
        ("compile-cold", 0),
        ("compile-cache", 0),
        ("compile-cache", 1),
    ]
    assert bench.plan_processes(["aoti", "compile"], 2, grouped=True, no_bytecode=True)[1:4] == [
        ("aoti", 1),
        ("aoti-nopyc", 0),
        ("compile-cold", 0),
    ]
    assert ("aoti-nopyc", 0) not in bench.plan_processes(["compile"], 2, no_bytecode=True)
    meta = {"device": "cpu", "torch": "x", "date": "d", "model": "m", "steps": 2, "guidance": 7.5}
    row = {"variant": "aoti", "imported_s": 1.0, "device_ready_s": 1.2, "classes_imported_s": 1.5}
    row |= {"loaded_s": 2.0, "accelerated_s": 2.5, "first_image_s": 4.0}
    row |= {"full_speed_s": 4.2, "it_s": 10.0, "report": {"aoti_unet": "loaded unet-x.pt2 (0.01 s)"}}
    text = bench.summary(
        {
            "meta": meta,
            "export": {"error": "boom: no compiler"},
            "processes": [row, {"variant": "compile-cold", "error": "Traceback ... OutOfMemoryError"}],
            "parity": {"aoti": {"latent_rel_err": 1e-3, "psnr_db": 50.0}},
        }
    )
    assert (
        "export: boom: no compiler" in text
        and "| aoti | 1.0 | 1.2 | 1.5 | 2.0 | 2.5 | 4.0 | 4.2 | 10.0 |" in text
    )
    assert "| compile-cold | failed: " in text and "OutOfMemoryError" in text
    assert "aoti vs compile-cache: latent rel. err 1.0e-03, image PSNR 50.0 dB" in text
