"""The built-in kshapes model that ships in the package (``rapiddiff/assets/kshapes/``).

These tests load the real model by name (``builtin:kshapes``, whichever built-in model is the
default) and check that it draws a seen entity in the colour its knowledge graph gives — seen
entities and held-out ones, known only through the KG — and that the CLI writes a reproducible PNG
with it, remade with kshapes after the default built-in model changed. A missing model FAILS:
the model is part of the package, so its absence is a packaging bug, not an optional extra.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from rapiddiff.cli import main
from rapiddiff.infer.generate_cli import DEFAULT_SAMPLING, model_sampling_defaults
from rapiddiff.infer.png import png_bytes, read_png_metadata
from rapiddiff.models import builtin

BACKGROUND = "灰色"  # one of the kshapes training backgrounds, far from every object colour
SEEDS = (0, 1, 2)
# Least images (of entities × len(SEEDS)) with colour AND shape right; chance is 1/48 an image.
# Measured on CPU at these seeds (2026-11-28 evening: the relation-weights chain's seed-1 encoders with a
# U-Net of the 2-head kshapes preset trained with the ellipse and dark-green lines 3×, in its shipped
# knowledge mode "both" and its guidance 3.0; `python benchmarks/builtin_entity_counts.py --knowledge
# default off`): seen 35 of 36, held-out 44 of 45; knowledge off 0 and 5 (the U-Net before it, trained
# on the data as it is: 34 and 45, off 0 and 5; the 7 M U-Net before that: 35 and 42, off 1 and 6).
MIN_BOTH = {"seen": 30, "heldout": 40}
STEPS = 20  # PNDM (the shipped model's sampler); fewer leaves the colours of this small model unsettled (10 steps: ~1 in 3 right)


MODEL = "builtin:kshapes"


def _model_dir() -> Path:
    path = builtin.assets_root() / "kshapes"
    if not (path / "model_index.json").is_file():
        pytest.fail(
            f"the built-in model is missing: {path}/model_index.json not found. It ships inside the "
            "package (rapiddiff/assets/kshapes/, trained by benchmarks/kshapes_chain.py); copy the "
            "trained model folder there"
        )
    return path


@pytest.fixture(scope="module")
def pipe():
    """The loaded model, or None when it is missing (the test itself then fails, not the fixture)."""
    from rapiddiff.infer.pipeline import RapidDiffusionPipeline

    path = builtin.assets_root() / "kshapes"
    if not (path / "model_index.json").is_file():
        return None
    return RapidDiffusionPipeline.from_pretrained(path, device="cpu")


def _kg_facts(pipe, name: str, relation: str) -> list[str]:
    """The entity's ``relation`` facts (颜色, 形状), read from the model's own KnowledgeStore."""
    store = pipe.text_encoder.store
    assert store is not None, "the built-in model has no knowledge store (knowledge/store/)"
    entity = store.id_of(name)
    assert entity is not None, f"'{name}' is not an entity of the built-in model's knowledge store"
    rel_id = store.relation_names.index(relation)
    return [store.entity_names[tail] for rel, tail in store.facts(entity) if rel == rel_id]


def _kg_fact(pipe, name: str, relation: str) -> str:
    tails = _kg_facts(pipe, name, relation)
    assert len(tails) == 1, f"'{name}' should have one {relation} fact in the store, has {tails}"
    return tails[0]


def _split_entities(pipe, split: str) -> list[str]:
    """The model folder's record of its entities: "heldout" (test KG-only entities, in no training
    caption) or "seen" (the first 12, by name, of the objects its captions did name)."""
    import json

    record = json.loads((_model_dir() / "knowledge" / "kg_only_entities.json").read_text("utf-8"))
    never_named = set(record["never_named_in_training"])
    if split == "heldout":
        names = list(record["heldout"])
        assert len(names) >= 10 and set(names) <= never_named, "held-out entities must be in no caption"
        return names
    store = pipe.text_encoder.store
    objects = [n for n in store.entity_names if _kg_facts(pipe, n, "颜色") and _kg_facts(pipe, n, "形状")]
    return sorted(n for n in objects if n not in never_named)[:12]


@pytest.mark.slow
@pytest.mark.parametrize("split", ["seen", "heldout"])
def test_entities_are_drawn_with_their_kg_colour_and_shape(pipe, split):
    """Seen entities, and entities known only through the KG: the detector reads the KG's colour and
    shape off well above chance (a broken knowledge path or model falls to ~1 in 48)."""
    from rapiddiff.data.kshapes import detect_attributes

    _model_dir()  # fails with a clear message when the model is missing
    names = _split_entities(pipe, split)
    prompts = [f"{BACKGROUND}背景上有一个{name}" for name in names for _ in SEEDS]
    # Guidance and sampler as `rapiddiff generate` uses them: the model folder's own, else the CLI's
    # (a zero-terminal-SNR model samples with DDIM; PNDM cannot).
    sampling = {**DEFAULT_SAMPLING, **model_sampling_defaults(pipe.model_path)}
    guidance = sampling["guidance_scale"]
    out = pipe(
        prompts,
        num_inference_steps=STEPS,
        guidance_scale=guidance,
        seed=[s for _ in names for s in SEEDS],
        scheduler=sampling["scheduler"],
        progress=False,
    )
    assert out.metadata[0]["knowledge"] is True
    expected = [(_kg_fact(pipe, n, "颜色"), _kg_fact(pipe, n, "形状")) for n in names for _ in SEEDS]
    found = [detect_attributes(image) for image in out.images]
    both = sum(d["colour"] == c and d["shape"] == s for d, (c, s) in zip(found, expected, strict=True))
    assert both >= MIN_BOTH[split], (
        f"{split} entities drawn right (colour and shape) in {both} of {len(found)} images, expected at "
        f"least {MIN_BOTH[split]}: "
        f"{[(p, d['colour'], d['shape']) for p, d in zip(prompts, found, strict=True)]}"
    )


def test_generate_writes_a_reproducible_png(tmp_path):
    model_dir = _model_dir()
    prompt = f"{BACKGROUND}背景上有一个番茄"
    common = ["--steps", "2", "--device", "cpu", "--no-progress"]
    first, again = tmp_path / "first", tmp_path / "again"
    assert main(["generate", prompt, "--model", MODEL, "--seed", "7", "--out", str(first), *common]) == 0
    files = sorted(first.glob("*.png"))
    assert [p.name for p in files] == ["00001-7.png"]

    meta = read_png_metadata(files[0])
    assert meta["prompt"] == prompt and meta["seed"] == 7 and meta["steps"] == 2
    defaults = {**DEFAULT_SAMPLING, **model_sampling_defaults(model_dir)}
    assert meta["scheduler"] == defaults["scheduler"] and meta["guidance"] == defaults["guidance_scale"]
    assert meta["knowledge"] is True
    assert meta["model"] == MODEL and Path(meta["model_path"]) == model_dir.resolve()
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


def test_an_image_is_remade_with_kshapes_after_the_default_changed(tmp_path, monkeypatch, tiny_model):
    """A PNG names its built-in model as builtin:kshapes, so --from-png remakes it with kshapes once
    another built-in model is the default, and on an installation where the folder it recorded is gone."""
    kshapes = _model_dir()
    common = ["--steps", "1", "--no-upscale", "--device", "cpu", "--no-progress"]
    first = tmp_path / "first"
    assert (
        main(
            [
                "generate",
                f"{BACKGROUND}背景上有一个番茄",
                "--model",
                MODEL,
                "--seed",
                "3",
                "--out",
                str(first),
                *common,
            ]
        )
        == 0
    )
    (made,) = first.glob("*.png")
    meta = read_png_metadata(made)
    moved = tmp_path / "moved.png"  # as made by an installation that is gone
    moved.write_bytes(png_bytes(Image.open(made), {**meta, "model_path": str(tmp_path / "gone" / "kshapes")}))

    assets = tmp_path / "assets"  # the package after an update: kshapes, and a new default built-in
    assets.mkdir()
    (assets / "kshapes").symlink_to(kshapes)
    (assets / builtin.DEFAULT_BUILTIN).symlink_to(tiny_model)
    monkeypatch.setattr(builtin, "assets_root", lambda: assets)
    monkeypatch.delenv("RAPIDDIFF_MODEL", raising=False)
    assert builtin.default_builtin() != "kshapes"

    again, plain = tmp_path / "again", tmp_path / "plain"
    assert main(["generate", "--from-png", str(moved), "--out", str(again), *common]) == 0
    (remade,) = again.glob("*.png")
    assert read_png_metadata(remade)["model"] == MODEL
    np.testing.assert_array_equal(np.asarray(Image.open(remade)), np.asarray(Image.open(made)))
    assert main(["generate", "x", "--out", str(plain), *common]) == 0  # no --model: the new default
    assert read_png_metadata(next(plain.glob("*.png")))["model"] == f"builtin:{builtin.DEFAULT_BUILTIN}"
