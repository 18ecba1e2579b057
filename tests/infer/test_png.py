"""PNG text chunks: settings round-trip, and an image regenerates from its own metadata."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from rapiddiff import __version__
from rapiddiff.infer.pipeline import RapidDiffusionPipeline
from rapiddiff.infer.png import generation_kwargs, read_png_metadata, save_png
from rapiddiff.models.presets import write_tiny_sd_folder


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    return RapidDiffusionPipeline.from_pretrained(
        write_tiny_sd_folder(tmp_path_factory.mktemp("m") / "sd", text="bert")
    )


def test_metadata_round_trips_with_types(tmp_path):
    meta = {
        "prompt": "蓝色背景上有一个番茄",
        "negative_prompt": "模糊",
        "seed": 42,
        "steps": 20,
        "guidance": 7.5,
        "scheduler": "ddim",
        "knowledge": False,
        "model": "kshapes",
        "model_path": None,
    }
    path = save_png(Image.new("RGB", (4, 4)), tmp_path / "a.png", meta)
    back = read_png_metadata(path)
    assert back == {**meta, "rapiddiff_version": __version__}
    # Each setting is also a plain text chunk any viewer shows.
    with Image.open(path) as im:
        assert im.text["prompt"] == "蓝色背景上有一个番茄" and im.text["seed"] == "42"
        assert im.text["parameters"].splitlines() == [
            "蓝色背景上有一个番茄",
            "Negative prompt: 模糊",
            "Steps: 20, Sampler: ddim, CFG scale: 7.5, Seed: 42, Model: kshapes",
        ]


def test_text_chunks_alone_are_parsed(tmp_path):
    info = PngInfo()
    for key, value in {
        "prompt": "猫",
        "seed": "7",
        "steps": "3",
        "guidance": "2.5",
        "knowledge": "false",
    }.items():
        info.add_itxt(key, value)
    path = tmp_path / "b.png"
    Image.new("RGB", (2, 2)).save(path, pnginfo=info)
    kwargs = generation_kwargs(read_png_metadata(path))
    assert kwargs["seed"] == 7 and kwargs["num_inference_steps"] == 3 and kwargs["guidance_scale"] == 2.5
    assert kwargs["knowledge"] is False and kwargs["scheduler"] == "pndm"


def test_foreign_png_and_bad_files(tmp_path):
    plain = tmp_path / "plain.png"
    Image.new("RGB", (2, 2)).save(plain)
    assert read_png_metadata(plain) == {}
    with pytest.raises(ValueError, match="lacks prompt, seed, steps, guidance"):
        generation_kwargs({})
    (tmp_path / "x.png").write_text("not a png")
    with pytest.raises(ValueError, match="not an image"):
        read_png_metadata(tmp_path / "x.png")


def test_regenerates_the_same_pixels(pipe, tmp_path):
    out = pipe(
        "一只熊猫",
        "模糊",
        num_inference_steps=3,
        guidance_scale=5.0,
        seed=123,
        scheduler="dpm++",
        height=12,
        width=20,
        progress=False,
    )
    path = save_png(out.images[0], tmp_path / "p.png", out.metadata[0])
    again = pipe(**generation_kwargs(read_png_metadata(path)), progress=False)
    with Image.open(path) as saved:
        np.testing.assert_array_equal(np.asarray(again.images[0]), np.asarray(saved))
    assert again.images[0].size == (20, 12)
    other = pipe(**{**generation_kwargs(read_png_metadata(path)), "seed": 124}, progress=False)
    assert not np.array_equal(np.asarray(other.images[0]), np.asarray(again.images[0]))
