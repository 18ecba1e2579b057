"""``rapiddiff generate`` end to end through ``rapiddiff.cli.main`` on a tiny model folder."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import numpy as np
import pytest
import torch
from PIL import Image

from rapiddiff.cli import main
from rapiddiff.infer import generate_cli
from rapiddiff.infer.png import read_png_metadata
from rapiddiff.models import builtin
from rapiddiff.models.presets import write_tiny_sd_folder

FAST = ["--steps", "2", "--device", "cpu", "--no-progress"]


@pytest.fixture(scope="module")
def model(tiny_model):
    """The shared Taiyi-style tiny folder (tests/conftest.py), read only here."""
    return str(tiny_model)


def _pngs(folder):
    return sorted(p for p in folder.glob("*.png") if "grid" not in p.name)


def test_writes_pngs_with_settings_and_a_grid(model, tmp_path):
    out = tmp_path / "out"
    rc = main(
        [
            "generate",
            "蓝色背景上有一个番茄",
            "--model",
            model,
            "--num-images",
            "3",
            "--batch-size",
            "2",
            "--seed",
            "5",
            "--size",
            "12x8",
            "--negative",
            "模糊",
            "--scheduler",
            "ddim",
            "--out",
            str(out),
            *FAST,
        ]
    )
    assert rc == 0
    files = _pngs(out)
    assert [p.name for p in files] == ["00001-5.png", "00002-6.png", "00003-7.png"]
    meta = read_png_metadata(files[1])
    assert meta["prompt"] == "蓝色背景上有一个番茄" and meta["negative_prompt"] == "模糊"
    assert (meta["seed"], meta["steps"], meta["scheduler"], meta["height"], meta["width"]) == (
        6,
        2,
        "ddim",
        8,
        12,
    )
    with Image.open(files[0]) as im:
        assert im.size == (12, 8)  # --size is WxH, as the OpenAI images API's "WIDTHxHEIGHT"
    with Image.open(out / "00001-grid.png") as grid:
        assert grid.size == (2 + 2 * (12 + 2), 2 + 2 * (8 + 2))  # 2×2 cells, 2-pixel gaps
    # A second run numbers on; nothing is overwritten.
    assert main(["generate", "猫", "--model", model, "--seed", "1", "--out", str(out), *FAST]) == 0
    assert _pngs(out)[-1].name == "00004-1.png"


def test_from_png_regenerates_the_same_image(model, tmp_path):
    main(
        [
            "generate",
            "一只熊猫",
            "--model",
            model,
            "--seed",
            "9",
            "--guidance",
            "3",
            "--out",
            str(tmp_path / "a"),
            *FAST,
        ]
    )
    first = _pngs(tmp_path / "a")[0]
    # The model path comes from the PNG itself.
    assert main(["generate", "--from-png", str(first), "--out", str(tmp_path / "b"), "--no-progress"]) == 0
    again = _pngs(tmp_path / "b")[0]
    np.testing.assert_array_equal(np.asarray(Image.open(again)), np.asarray(Image.open(first)))
    assert read_png_metadata(again)["guidance"] == 3.0


def test_prompts_file(model, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("番茄\n\n香蕉\n", encoding="utf-8")
    assert (
        main(["generate", "--prompts", str(prompts), "--model", model, "--out", str(tmp_path / "o"), *FAST])
        == 0
    )
    assert [read_png_metadata(p)["prompt"] for p in _pngs(tmp_path / "o")] == ["番茄", "香蕉"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--scheduler", "euler"], "unknown scheduler 'euler'; choose one of: pndm, ddim, dpm++, unipc"),
        (["--dtype", "fp8"], "unknown dtype 'fp8'; choose one of"),
        (["--size", "18"], "height 18 → nearest valid: 16 or 20"),
        (["--upscale"], "no upscaler"),
        (["--guidance", "nan"], "guidance_scale must be a finite number, got nan"),
    ],
)
def test_bad_settings_are_clear_errors(model, tmp_path, capsys, extra, message):
    assert main(["generate", "x", "--model", model, "--out", str(tmp_path), *FAST, *extra]) == 2
    assert message in capsys.readouterr().err


def test_unsafe_upscaler_pickle_is_refused(model, tmp_path, capsys):
    class Payload:
        def __reduce__(self):
            return (print, ("code ran",))

    evil = tmp_path / "RealESRGAN_x4plus.pth"
    torch.save({"params_ema": {}, "x": Payload()}, evil)
    assert (
        main(["generate", "x", "--model", model, "--upscaler", str(evil), "--out", str(tmp_path), *FAST]) == 2
    )
    assert "refused" in capsys.readouterr().err


def test_unwritable_output_fails_before_loading(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    # The model does not exist either: the output check must come first.
    rc = main(["generate", "x", "--model", str(tmp_path / "none"), "--out", str(blocker / "out"), *FAST])
    assert rc == 2
    err = capsys.readouterr().err
    assert "output folder" in err and "not writable" in err


def test_missing_default_model_says_how_to_pass_one(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(builtin, "assets_root", lambda: tmp_path / "assets")  # a package without models
    assert main(["generate", "x", "--out", str(tmp_path), *FAST]) == 2
    err = capsys.readouterr().err
    assert "no built-in model" in err and "--model DIR" in err


def test_empty_prompt_warns_and_generates(model, tmp_path, caplog):
    assert main(["generate", "", "--model", model, "--out", str(tmp_path), *FAST]) == 0
    assert "unconditionally" in caplog.text
    assert len(_pngs(tmp_path)) == 1


def test_fast_flag(model, tmp_path, capsys, monkeypatch):
    name = "rapiddiff.infer.accelerate"
    monkeypatch.setitem(sys.modules, name, None)  # as if the module were not installed
    # --fast twice: on this CPU one --fast alone runs eager (tests/infer/test_generate_cli_ux.py)
    assert main(["generate", "x", "--model", model, "--fast", "--fast", "--out", str(tmp_path), *FAST]) == 2
    assert "not available" in capsys.readouterr().err

    # With the module present, its stage replaces the pipeline's denoise stage; the rest stays the pipeline's.
    calls = []

    def accelerate(pipe, **switches):
        def denoiser(job, decode):
            n, _, h, w = job.latents.shape
            calls.append((pipe, n, decode))
            return job.latents, torch.full((n, 3, h * 2, w * 2), 0.5)

        pipe.denoiser = denoiser
        return pipe

    fake = types.ModuleType(name)
    fake.__spec__ = importlib.machinery.ModuleSpec(name, None)
    fake.accelerate = accelerate
    monkeypatch.setitem(sys.modules, name, fake)
    out = tmp_path / "fast"
    fast = ["--fast", "--fast"]
    assert main(["generate", "x", "--model", model, *fast, "--seed", "3", "--out", str(out), *FAST]) == 0
    assert len(calls) == 1 and hasattr(calls[0][0], "denoise") and calls[0][1:] == (1, True)
    image = _pngs(out)[0]
    assert np.asarray(Image.open(image)).max() == 128 and read_png_metadata(image)["seed"] == 3


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    for flag in ("--from-png", "--scheduler", "--no-knowledge", "--upscale", "--prompts", "--fast"):
        assert flag in text


def test_model_folder_sampling_defaults_apply_unless_flags_say_otherwise(tmp_path):
    import json

    folder = write_tiny_sd_folder(tmp_path / "sd", text="bert")
    info = folder / "rapiddiff.json"
    data = json.loads(info.read_text("utf-8")) if info.exists() else {}
    data["sampling"] = {"num_inference_steps": 3, "guidance_scale": 2.0, "scheduler": "ddim", "eta": 1}
    info.write_text(json.dumps(data), "utf-8")
    assert generate_cli.model_sampling_defaults(folder) == {
        "num_inference_steps": 3,
        "guidance_scale": 2.0,
        "scheduler": "ddim",
    }  # only the keys it may set
    common = ["generate", "一个番茄", "--model", str(folder), "--seed", "1", "--size", "8"]
    assert main([*common, "--out", str(tmp_path / "a"), "--device", "cpu", "--no-progress"]) == 0
    meta = read_png_metadata(_pngs(tmp_path / "a")[0])
    assert (meta["steps"], meta["guidance"], meta["scheduler"]) == (3, 2.0, "ddim")
    assert main([*common, "--out", str(tmp_path / "b"), "--steps", "2", "--guidance", "4", *FAST[2:]]) == 0
    meta = read_png_metadata(_pngs(tmp_path / "b")[0])
    assert (meta["steps"], meta["guidance"], meta["scheduler"]) == (2, 4.0, "ddim")


@pytest.mark.parametrize(
    ("info", "message"),
    [
        ('{"sampling": {"num_inference_steps": "many"}}', "num_inference_steps must be an integer"),
        ('{"sampling": {"scheduler": "euler"}}', "sampling.scheduler: unknown scheduler 'euler'"),
        ('{"sampling": [25]}', "sampling must be an object"),
        ("{not json", "rapiddiff.json: not valid JSON"),
    ],
)
def test_bad_model_sampling_defaults_name_the_file(tmp_path, capsys, info, message):
    folder = write_tiny_sd_folder(tmp_path / "sd", text="bert")
    (folder / "rapiddiff.json").write_text(info, "utf-8")
    assert main(["generate", "x", "--model", str(folder), "--out", str(tmp_path / "o"), *FAST]) == 2
    assert message in capsys.readouterr().err


def test_an_error_inside_the_batch_loop_prints_below_a_cleared_progress_bar(model, tmp_path, capsys):
    """The pipeline checks --guidance; its error must not share a line with the images bar, nor be
    followed by the bar drawn again."""
    import gc

    args = ["generate", "x", "--model", model, "--out", str(tmp_path), "--device", "cpu", "--guidance", "nan"]
    assert main(args) == 2
    gc.collect()  # an unclosed bar would draw itself again when collected
    err = capsys.readouterr().err
    assert "images:" in err  # the bar was shown
    tail = err[err.rindex("images:") :]
    assert "\r" in tail and "guidance_scale must be a finite number" in tail.split("\r")[-1]


def test_list_models_names_each_builtin_and_needs_no_prompt(capsys):
    assert main(["generate", "--list-models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(builtin.builtin_names())
    kshapes = next(line for line in lines if line.startswith("builtin:kshapes"))
    assert "66 entities" in kshapes and " MB" in kshapes and "licence: Apache-2.0" in kshapes
    assert sum("(default)" in line for line in lines) == 1


def test_an_unknown_builtin_name_lists_the_valid_ones(tmp_path, capsys):
    assert main(["generate", "x", "--model", "builtin:kshape", "--out", str(tmp_path), *FAST]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'builtin:kshapes'" in err and "--list-models" in err
