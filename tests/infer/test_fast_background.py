"""Packages by default (rapiddiff.infer.fast_background): with aoti="auto" a matching package is
loaded, a missing or stale one is built by a background process while this one runs torch.compile,
a build already running or one that failed for the same key is not started again.

The boundary faked is the one a CPU test cannot cross in seconds: the builder process (``spawn``)
and the AOTInductor build/load (a fake package "loads" as the module itself, so the images are the
real ones). The real build and load are covered by tests/infer/test_aoti.py (slow, and on the GPU).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from rapiddiff.infer import accelerate_cli, fast_aoti, fast_background, fast_packages
from rapiddiff.infer.accelerate import accelerate
from rapiddiff.infer.fast_background import BackgroundBuilds, BuildRequest, export_argv
from rapiddiff.infer.fast_config import AccelerateConfig
from rapiddiff.infer.fast_packages import default_package_dir, export_switches
from rapiddiff.infer.pipeline import RapidDiffusionPipeline

KW = {"num_inference_steps": 2, "guidance_scale": 5.0, "seed": 0, "output_type": "np", "progress": False}
NO_COMPILE = {"compile_unet": None, "compile_vae": None}


class FakeProc:
    def __init__(self, pid: int = 999_999_999, done: bool = True) -> None:
        self.pid, self.done = pid, done

    def poll(self):
        return 0 if self.done else None

    def wait(self):
        return 0


class Boundary:
    """Records the builder processes started and the packages built/loaded."""

    def __init__(self, monkeypatch) -> None:
        self.spawned: list[list[str]] = []
        self.built: list[str] = []
        monkeypatch.setattr(fast_background, "BACKGROUND_DEVICES", ("cpu",))
        monkeypatch.setattr(fast_background, "spawn", self.spawn)
        monkeypatch.setattr(fast_aoti, "build_package", self.build)
        monkeypatch.setattr(fast_aoti, "load_package", lambda path, module, manifest: module)
        monkeypatch.setattr(fast_aoti, "check_loads", lambda *a, **k: None)

    def spawn(self, argv, folder):
        self.spawned.append(argv)
        return FakeProc()

    def build(self, path, module, args, key, files=None, extra=None):
        """A package file and manifest as build_package writes them (the payload never runs)."""
        self.built.append(path.name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"fake package")
        names = sorted(fast_aoti.live_constants(module))
        manifest = {
            "key": key,
            "size": path.stat().st_size,
            "sha256": fast_aoti._sha256(path),
            "constants": names,
            "constants_layout": fast_aoti.constants_layout(module, names),
            "weights_files": files or {},
            **(extra or {}),
        }
        fast_aoti.manifest_path(path).write_text(json.dumps(manifest))
        return manifest


@pytest.fixture
def model(tiny_model, tmp_path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    return folder


def _run(model: Path, mode: str = "auto", **switches):
    pipe = accelerate(RapidDiffusionPipeline.from_pretrained(model), aoti=mode, **NO_COMPILE, **switches)
    return pipe, pipe(["一只熊猫"], **KW)


def test_missing_builds_in_the_background_present_loads_stale_rebuilds(model, monkeypatch):
    seam = Boundary(monkeypatch)
    eager = RapidDiffusionPipeline.from_pretrained(model)(["一只熊猫"], **KW)

    # Missing: this process runs without packages (same image), one builder process is started.
    pipe, out = _run(model)
    assert "building in the background" in pipe.report["aoti_unet"], pipe.report
    assert (
        "no package unet-" in pipe.report["aoti_unet"]
        and "no package decoder-" in pipe.report["aoti_decoder"]
    )
    assert seam.built == [] and len(seam.spawned) == 1
    keys, *argv = seam.spawned[0]
    assert argv[:5] == ["export", "--model", str(model), "--dir", str(model / "accelerated")]
    size = str(pipe.default_size)
    assert argv[5:] == ["--device", "cpu", "--batch", "1", "--height", size, "--width", size,
                        "--guidance", "2", "--scheduler", "pndm",
                        "--switches", "compile_unet=none", "compile_vae=none"]  # fmt: skip
    assert len(json.loads(keys)) == 1
    assert abs(out.images[0] - eager.images[0]).max() < 1e-4

    # What the builder process does (the export's own code, aoti="build"), then the next process loads.
    _run(model, "build")
    assert len(seam.built) == 2
    pipe, out = _run(model)
    assert pipe.report["aoti_unet"].startswith("loaded unet-"), pipe.report
    assert pipe.report["aoti_decoder"].startswith("loaded decoder-"), pipe.report
    assert len(seam.spawned) == 1 and abs(out.images[0] - eager.images[0]).max() < 1e-4

    # Stale (new weights saved over the old): rebuilt in the background, the reason in the report.
    weights = next((model / "unet").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes())
    os.utime(weights, ns=(10**18, 10**18))
    from safetensors.torch import load_file, save_file

    tensors = load_file(weights)
    first = sorted(tensors)[0]
    save_file({**tensors, first: tensors[first] + 1}, weights)
    pipe, _ = _run(model)
    assert (
        "stale (weights: " in pipe.report["aoti_unet"]
        and "building in the background" in pipe.report["aoti_unet"]
    )
    assert pipe.report["aoti_decoder"].startswith("loaded"), pipe.report  # its weights did not change
    assert len(seam.spawned) == 2


def test_a_running_build_or_a_failed_one_is_not_started_again(model, monkeypatch):
    seam = Boundary(monkeypatch)
    folder = model / "accelerated"
    folder.mkdir()
    (folder / fast_background.LOCK).write_text(json.dumps({"pid": os.getpid(), "started": 1e12}))
    pipe, _ = _run(model)
    assert f"pid {os.getpid()}" in pipe.report["aoti_unet"] and seam.spawned == []
    # A dead build's lock is taken over.
    (folder / fast_background.LOCK).write_text(json.dumps({"pid": 999_999_999, "started": 1e12}))
    _run(model)
    assert len(seam.spawned) == 1
    # That build ended and left no package for these keys: the next process says so, starts nothing.
    keys = json.loads(seam.spawned[0][0])
    (folder / fast_background.LOCK).unlink(missing_ok=True)
    (folder / fast_background.LAST).write_text(json.dumps({"rc": 1, "keys": keys}))
    pipe, _ = _run(model)
    assert (
        "ended with exit 1" in pipe.report["aoti_unet"]
        and "accelerate export export" not in pipe.report["aoti_unet"]
    )
    assert "rapiddiff accelerate export --model" in pipe.report["aoti_unet"]
    assert len(seam.spawned) == 1
    # Other switches are another key: a build of its own, with those switches.
    _run(model, cross_kv_cache=False)
    assert len(seam.spawned) == 2 and "cross_kv_cache=false" in seam.spawned[1]


def test_no_packages_means_none_and_cpu_does_not_build_by_default(model, monkeypatch):
    spawned = []
    monkeypatch.setattr(fast_background, "spawn", lambda argv, folder: spawned.append(argv))
    pipe, _ = _run(model, "off")
    assert pipe.report["aoti"] == "off"
    pipe, _ = _run(model)  # auto on a CPU: what exists is loaded, nothing is built
    assert pipe.report["aoti"].startswith("load (") and spawned == []


def test_requests_arriving_while_a_build_runs_start_together_when_it_ends(tmp_path, monkeypatch):
    procs, started = [FakeProc(1, done=False), FakeProc(2, done=False)], []

    def spawn(argv, folder):
        started.append(argv)
        return procs[len(started) - 1]

    monkeypatch.setattr(fast_background, "spawn", spawn)
    monkeypatch.setattr(fast_background.threading, "Thread", _NoThread)
    builds = BackgroundBuilds(tmp_path, unet_params=860_000_000)
    req = BuildRequest("m", str(tmp_path), "cuda:0", 512, 512, True, "pndm", (), 1, keys="a")
    assert "about 3 min" in str(builds.request(req))
    for batch, key in ((2, "b"), (4, "c")):
        status = builds.request(
            BuildRequest("m", str(tmp_path), "cuda:0", 512, 512, True, "pndm", (), batch, keys=key)
        )
        assert "being built in the background (pid 1" in str(status)
    assert len(started) == 1 and builds.running() == 1
    procs[0].done = True
    (tmp_path / fast_background.LOCK).unlink()  # what the builder does when it ends
    _NoThread.last.run()  # the waiter: our build ended
    assert len(started) == 2 and started[1][
        started[1].index("--batch") + 1 : started[1].index("--height")
    ] == ["2", "4"]
    assert json.loads(started[1][0]) == ["b", "c"]


class _NoThread:
    last = None

    def __init__(self, target, args, **kwargs):
        self.target, self.args = target, args

    def start(self):
        _NoThread.last = self

    def run(self):
        self.target(*self.args)


def test_builder_process_records_its_outcome_and_removes_the_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(accelerate_cli, "run", lambda args: 1)
    monkeypatch.setattr(fast_background.os, "nice", lambda n: 0)
    (tmp_path / fast_background.LOCK).write_text("{}")
    argv = ['["k1"]', "export", "--model", "m", "--dir", str(tmp_path), "--batch", "1", "2"]
    assert fast_background.main(argv) == 1
    last = json.loads((tmp_path / fast_background.LAST).read_text())
    assert last["rc"] == 1 and last["keys"] == ["k1"] and not (tmp_path / fast_background.LOCK).exists()
    assert fast_background.failed_before(tmp_path, "k1") and not fast_background.failed_before(tmp_path, "k2")


def test_export_arguments_and_package_folder(tmp_path, monkeypatch):
    config = AccelerateConfig(fuse_qkv=False, compile_vae=None, max_graphs=5, aoti="auto", compile_cache="x")
    assert export_switches(config) == ("fuse_qkv=false", "compile_vae=none", "max_graphs=5")
    req = BuildRequest("m", "d", "cuda:1", 256, 384, False, None, (), 4)
    assert export_argv([req]) == ["export", "--model", "m", "--dir", "d", "--device", "cuda:1", "--batch", "4",
                                  "--height", "256", "--width", "384", "--guidance", "1"]  # fmt: skip
    assert fast_background.estimate_s(860_000_000) == pytest.approx(182.0)
    # A writable model folder keeps its packages; the shipped model's go to the user cache.
    assert default_package_dir(tmp_path) == tmp_path.resolve() / "accelerated"
    monkeypatch.setenv("RAPIDDIFF_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(fast_packages, "shipped_model_dir", lambda: tmp_path)
    shipped = default_package_dir(tmp_path)
    assert shipped.parent == tmp_path / "cache" / "accelerated" and shipped.name.startswith(
        tmp_path.name + "-"
    )
    assert (
        torch.__version__
    )  # the key's torch field (fast_aoti.package_key) is what makes a new torch rebuild


@pytest.mark.gpu
def test_cuda_first_process_builds_in_the_background_and_the_next_loads(model):
    """The real thing on a GPU: no fakes. The first fast path starts the export process and runs
    torch.compile; once that process ends, a new fast path loads both packages (same image)."""
    import time

    kw = {**KW, "num_inference_steps": 5}
    first = accelerate(RapidDiffusionPipeline.from_pretrained(model, device="cuda"), aoti="auto")
    want = first(["一只熊猫"], **kw)
    assert "building in the background" in first.report["aoti_unet"], first.report
    deadline = time.monotonic() + 900
    while (model / "accelerated" / fast_background.LOCK).exists() and time.monotonic() < deadline:
        time.sleep(2)
    last = json.loads((model / "accelerated" / fast_background.LAST).read_text())
    assert last["rc"] == 0, (model / "accelerated" / fast_background.LOG).read_text()[-3000:]
    fast = accelerate(RapidDiffusionPipeline.from_pretrained(model, device="cuda"), aoti="auto")
    out = fast(["一只熊猫"], **kw)
    assert fast.report["aoti_unet"].startswith("loaded") and fast.report["aoti_decoder"].startswith("loaded")
    rel = float((out.latents - want.latents).norm() / want.latents.norm())
    assert rel < 2e-2, rel
