"""Sampling presets (``--preset NAME``): one table beside SamplingDefaults, listed in --help, what
they set replaces the model's defaults, and a flag given beside one wins."""

from __future__ import annotations

import argparse

import pytest

from rapiddiff.infer import generate_cli
from rapiddiff.models import sampling
from rapiddiff.models.sampling import PRESETS, SamplingPreset, preset


def _settings(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    generate_cli.register(parser)
    _, kwargs, _ = generate_cli._settings(parser.parse_args(["一只熊猫", *argv]))
    return kwargs


def test_a_preset_sets_sampler_steps_and_deep_cache_and_flags_win():
    fast = PRESETS["fast"]
    kwargs = _settings("--preset", "fast")
    assert kwargs["num_inference_steps"] == fast.num_inference_steps
    assert kwargs["scheduler"] == fast.scheduler and kwargs["deep_cache"] == fast.deep_cache
    kwargs = _settings("--preset", "fast", "--steps", "7", "--scheduler", "ddim", "--deep-cache", "3")
    assert (kwargs["num_inference_steps"], kwargs["scheduler"], kwargs["deep_cache"]) == (7, "ddim", 3)
    assert "num_inference_steps" not in _settings()  # no preset: the model's own defaults


def test_help_lists_every_preset_and_what_it_sets(capsys):
    from rapiddiff.cli import main

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name, p in PRESETS.items():
        assert f"{name}: {p.scheduler}, {p.num_inference_steps} steps" in text
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "fast: " in " ".join(capsys.readouterr().out.split())


def test_presets_are_checked_and_unknown_names_listed():
    with pytest.raises(ValueError, match="unknown preset 'quick'; choose one of: fast"):
        preset("quick")
    with pytest.raises(ValueError, match="unknown scheduler"):
        SamplingPreset(num_inference_steps=10, scheduler="heun", deep_cache=1, summary="")
    with pytest.raises(ValueError, match="deep_cache"):
        SamplingPreset(num_inference_steps=10, scheduler="ddim", deep_cache=0, summary="")
    for p in PRESETS.values():  # every sampler a preset names can be built
        assert p.scheduler in sampling.SCHEDULERS


def test_serve_takes_a_preset_as_its_defaults():
    from rapiddiff.serve.config import ServeConfig

    assert ServeConfig(preset="fast").preset == "fast"
    with pytest.raises(ValueError, match="unknown preset"):
        ServeConfig(preset="quick")
