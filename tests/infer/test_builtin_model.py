"""The built-in kshapes model that ships in the package (``rapiddiff/assets/model/``).

These tests load the real model — what ``rapiddiff generate`` uses without ``--model``
(``$RAPIDDIFF_MODEL`` overrides it) — and check that it draws a seen entity in the colour its
knowledge graph gives, and that the CLI writes a reproducible PNG with it. A missing model FAILS:
the model is part of the package, so its absence is a packaging bug, not an optional extra.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from rapiddiff.cli import main
from rapiddiff.infer.generate_cli import DEFAULT_SAMPLING, default_model_dir, model_sampling_defaults
from rapiddiff.infer.png import read_png_metadata

# Seen entities (in the training captions of the kshapes chain, seed 0: choose_heldout(15, 0) holds
# out neither) with a colour the detector tells apart from the backgrounds: orange and red.
ENTITIES = ("橘子", "番茄")
BACKGROUND = "灰色"  # one of the kshapes training backgrounds, far from orange and red
SEEDS = (0, 1, 2)
MIN_CORRECT = 2  # of len(SEEDS), per entity: chance is about 1 in 8 colours per image
STEPS = 20  # PNDM; fewer leaves the colours of this small model unsettled (10 steps: ~1 in 3 right)


def _model_dir() -> Path:
    path = default_model_dir()
    if not (path / "model_index.json").is_file():
        pytest.fail(
            f"the built-in model is missing: {path}/model_index.json not found. It ships inside the "
            "package (rapiddiff/assets/model/, trained by benchmarks/kshapes_chain.py); copy the "
            "trained model folder there, or set RAPIDDIFF_MODEL to a model folder to test that one"
        )
    return path


@pytest.fixture(scope="module")
def pipe():
    """The loaded model, or None when it is missing (the test itself then fails, not the fixture)."""
    from rapiddiff.infer.pipeline import RapidDiffusionPipeline

    path = default_model_dir()
    if not (path / "model_index.json").is_file():
        return None
    return RapidDiffusionPipeline.from_pretrained(path, device="cpu")


def _kg_colour(pipe, name: str) -> str:
    """The entity's 颜色 fact, read from the model's own KnowledgeStore."""
    store = pipe.text_encoder.store
    assert store is not None, "the built-in model has no knowledge store (knowledge/store/)"
    entity = store.id_of(name)
    assert entity is not None, f"'{name}' is not an entity of the built-in model's knowledge store"
    colour_rel = store.relation_names.index("颜色")
    colours = [store.entity_names[tail] for rel, tail in store.facts(entity) if rel == colour_rel]
    assert len(colours) == 1, f"'{name}' should have one 颜色 fact in the store, has {colours}"
    return colours[0]


def test_seen_entities_are_drawn_in_their_kg_colour(pipe):
    from rapiddiff.data.kshapes import detect_attributes

    _model_dir()  # fails with a clear message when the model is missing

    prompts = [f"{BACKGROUND}背景上有一个{name}" for name in ENTITIES for _ in SEEDS]
    seeds = [s for _ in ENTITIES for s in SEEDS]
    # Guidance as `rapiddiff generate` uses it: the model folder's own, else the CLI's.
    guidance = {**DEFAULT_SAMPLING, **model_sampling_defaults(pipe.model_path)}["guidance_scale"]
    out = pipe(
        prompts,
        num_inference_steps=STEPS,
        guidance_scale=guidance,
        seed=seeds,
        scheduler="pndm",
        progress=False,
    )
    assert out.metadata[0]["knowledge"] is True
    found = [detect_attributes(image)["colour"] for image in out.images]
    for k, name in enumerate(ENTITIES):
        expected = _kg_colour(pipe, name)
        got = found[k * len(SEEDS) : (k + 1) * len(SEEDS)]
        correct = sum(colour == expected for colour in got)
        assert correct >= MIN_CORRECT, (
            f"'{prompts[k * len(SEEDS)]}' (seeds {SEEDS}): expected {expected} (the KG's colour) in at "
            f"least {MIN_CORRECT} of {len(SEEDS)} images, detected {got}"
        )


def test_generate_without_model_writes_a_reproducible_png(tmp_path):
    model_dir = _model_dir()
    prompt = f"{BACKGROUND}背景上有一个番茄"
    common = ["--steps", "2", "--device", "cpu", "--no-progress"]
    first, again = tmp_path / "first", tmp_path / "again"
    assert main(["generate", prompt, "--seed", "7", "--out", str(first), *common]) == 0
    files = sorted(first.glob("*.png"))
    assert [p.name for p in files] == ["00001-7.png"]

    meta = read_png_metadata(files[0])
    assert meta["prompt"] == prompt and meta["seed"] == 7 and meta["steps"] == 2
    defaults = {**DEFAULT_SAMPLING, **model_sampling_defaults(model_dir)}
    assert meta["scheduler"] == defaults["scheduler"] and meta["guidance"] == defaults["guidance_scale"]
    assert meta["knowledge"] is True
    assert Path(meta["model_path"]) == model_dir.resolve()
    image = Image.open(files[0])
    base = meta["height"], meta["width"]
    if meta["upscale"]:  # on by default when the model has an upscaler (the built-in one does)
        assert image.size == (4 * base[1], 4 * base[0])
    else:
        assert image.size == (base[1], base[0])

    # The settings in the PNG are enough to make the same image again.
    assert main(["generate", "--from-png", str(files[0]), "--out", str(again), *common]) == 0
    remade = sorted(again.glob("*.png"))
    assert [p.name for p in remade] == ["00001-7.png"]
    np.testing.assert_array_equal(np.asarray(Image.open(remade[0])), np.asarray(image))
