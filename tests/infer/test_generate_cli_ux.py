"""What `rapiddiff generate` tells a user: --size is WxH, --fast on a CPU warns and runs eager
unless given twice, a file given as --model is named as a file, --help names the model's own
knowledge mode."""

from __future__ import annotations

import argparse

import pytest

from rapiddiff.cli import build_parser, main
from rapiddiff.infer.generate_cli import parse_size
from tests.infer.test_generate_cli import FAST


def test_size_is_width_first():
    assert parse_size("192x128") == (128, 192)  # (height, width): 192 wide, 128 high
    assert parse_size("64") == (64, 64)
    with pytest.raises(argparse.ArgumentTypeError, match="use WIDTHxHEIGHT"):
        parse_size("wide")


@pytest.mark.parametrize(("times", "fast_used"), [(1, False), (2, True)])
def test_fast_on_a_cpu_warns_and_runs_eager_unless_given_twice(
    tiny_model, tmp_path, monkeypatch, logs, times, fast_used
):
    calls = []
    import rapiddiff.infer.accelerate as fast_path

    monkeypatch.setattr(fast_path, "accelerate", lambda pipe, **kw: calls.append(kw) or pipe)
    args = ["generate", "x", "--model", str(tiny_model), "--out", str(tmp_path), *FAST]
    assert main([*args, *["--fast"] * times]) == 0
    assert bool(calls) is fast_used
    assert ("--fast on a CPU" in logs.text) is not fast_used


def test_a_file_as_model_is_named_a_file(tiny_model, tmp_path, capsys):
    weights = tiny_model / "unet" / "diffusion_pytorch_model.safetensors"
    assert weights.is_file()
    assert main(["generate", "x", "--model", str(weights), "--out", str(tmp_path), *FAST]) == 2
    err = capsys.readouterr().err
    assert f"{weights} is a file, but a model folder is expected" in err and "not found" not in err


def test_help_names_the_models_own_knowledge_mode(monkeypatch):
    import re

    parser = build_parser()
    generate = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[
        "generate"
    ]
    text = re.sub(r"\s+", " ", generate.format_help())
    assert "the default)" not in text.split("--knowledge")[1].split("--no-grid")[0]
    assert "Default: the model's own mode" in text and "the default built-in model's: both" in text


def test_a_knowledge_mode_on_a_model_without_a_kg_is_warned_about(tiny_model, tmp_path, logs):
    args = ["generate", "x", "--model", str(tiny_model), "--out", str(tmp_path), *FAST]
    assert main([*args, "--knowledge", "both"]) == 0
    assert "knowledge 'both' asked for, but this model has no knowledge graph" in logs.text
