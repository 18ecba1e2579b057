"""kshapes: determinism, the held-out split, the KG files, and the detector's accuracy."""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFilter

from rapiddiff.data.kshapes import (
    BACKGROUNDS,
    COLOURS,
    ENTITIES,
    LAYOUTS,
    SHAPES,
    SMALL_PRESET,
    KShapesConfig,
    ShapeSpec,
    choose_heldout,
    choose_validation,
    detect_attributes,
    generate_kshapes,
    render,
)
from rapiddiff.data.kshapes.captions import (
    ATTRIBUTE_PROMPT_TEMPLATES,
    ATTRIBUTE_TEMPLATES,
    DISTRACTOR_TEMPLATES,
    ENTITY_TEMPLATES,
    PROMPT_TEMPLATES,
    ROBUST_TEMPLATES,
)
from rapiddiff.data.kshapes.palette import COLOUR_LAB, compatible_backgrounds


def _small(out: Path, **kw) -> KShapesConfig:
    return KShapesConfig(out=out, **{**SMALL_PRESET, **kw})


@pytest.fixture(scope="module")
def small_set(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("kshapes") / "a"
    generate_kshapes(_small(out, seed=5, workers=2), progress=False)
    return out


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_palette_colours_are_far_apart_and_every_colour_has_backgrounds():
    for a, b in itertools.combinations(COLOURS, 2):
        assert np.linalg.norm(COLOUR_LAB[a] - COLOUR_LAB[b]) > 38, (a, b)
    for colour in COLOURS:
        assert len(compatible_backgrounds(colour)) >= 3, colour
    assert not set(COLOURS) & set(BACKGROUNDS)


def test_entities_are_consistent():
    names = [e.name for e in ENTITIES]
    surfaces = names + [a for e in ENTITIES for a in e.aliases]
    assert 55 <= len(names) <= 70
    assert len(set(surfaces)) == len(surfaces), "a name or alias is used twice"
    assert all(e.colour in COLOURS and e.shape in SHAPES for e in ENTITIES)
    assert ("番茄", "红色", "圆形") in [(e.name, e.colour, e.shape) for e in ENTITIES]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_heldout_keeps_every_colour_and_shape_seen(seed):
    heldout = set(choose_heldout(15, seed))
    assert len(heldout) == 15
    seen = [e for e in ENTITIES if e.name not in heldout]
    for colour in COLOURS:
        assert sum(e.colour == colour for e in seen) >= 2, colour
    for shape in SHAPES:
        assert sum(e.shape == shape for e in seen) >= 2, shape
    assert choose_heldout(15, seed) == choose_heldout(15, seed)


def test_same_seed_gives_identical_files_whatever_the_workers(small_set, tmp_path):
    again = tmp_path / "b"
    generate_kshapes(_small(again, seed=5, workers=1), progress=False)
    first, second = _digest(small_set), _digest(again)
    # kshapes.yaml records out and workers, which differ here on purpose.
    first.pop("kshapes.yaml")
    second.pop("kshapes.yaml")
    assert first == second
    other = tmp_path / "c"
    generate_kshapes(_small(other, seed=6, train=20, val=5, test=5), progress=False)
    assert _digest(other)["train/metadata.jsonl"] != first["train/metadata.jsonl"]


def test_without_hr_copies_the_base_images_are_byte_identical(small_set, tmp_path):
    """The chain's U-Net calls regenerate the prep's data without hr/: they must train on the same bytes."""
    from rapiddiff.cli import main

    lean = tmp_path / "lean"
    args = ["data", "kshapes", "--out", str(lean), "--small", "--seed", "5", "--workers", "2"]
    assert main([*args, "--no-hr-copies"]) == 0
    assert not (lean / "hr").exists()
    full = {k: v for k, v in _digest(small_set).items() if not k.startswith("hr/") and k != "kshapes.yaml"}
    got = _digest(lean)
    got.pop("kshapes.yaml")
    assert got == full


def test_layout_and_heldout_entities_are_in_no_training_caption(small_set):
    heldout = (small_set / "heldout_entities.txt").read_text(encoding="utf-8").split()
    entities = json.loads((small_set / "entities.json").read_text(encoding="utf-8"))
    assert len(heldout) == 15 and all(entities[n]["heldout"] for n in heldout)
    forbidden = [s for n in heldout for s in [n, *entities[n]["aliases"]]]
    train = _read_jsonl(small_set / "train" / "metadata.jsonl")
    assert len(train) == SMALL_PRESET["train"]
    for row in train:
        assert not any(s in row["text"] for s in forbidden), row
        assert row["entity"] not in heldout
    kinds = {row["caption_type"] for row in train}
    assert kinds == {"entity", "attribute"}
    # Evaluation splits do show held-out entities: that is what they measure.
    test_rows = _read_jsonl(small_set / "val" / "metadata.jsonl") + _read_jsonl(
        small_set / "test" / "metadata.jsonl"
    )
    assert any(r["entity"] in heldout for r in test_rows)
    for split in ("train", "val", "test"):
        rows = _read_jsonl(small_set / split / "metadata.jsonl")
        assert rows == _read_jsonl(small_set / "hr" / split / "metadata.jsonl")
        for row in rows:
            if row["entity"]:
                assert (row["colour"], row["shape"]) == (
                    entities[row["entity"]]["colour"],
                    entities[row["entity"]]["shape"],
                )
            if row["caption_type"] == "attribute":
                assert row["colour"] in row["text"] and row["shape"] in row["text"]
            assert row["background"] in row["text"] or row["position"] in row["text"]


def test_images_are_rgb_at_base_and_4x_and_the_pair_is_consistent(small_set):
    rows = _read_jsonl(small_set / "train" / "metadata.jsonl")[:10]
    for row in rows:
        lr = Image.open(small_set / "train" / row["file_name"])
        hr = Image.open(small_set / "hr" / "train" / row["file_name"])
        assert lr.mode == hr.mode == "RGB"
        assert lr.size == (64, 64) and hr.size == (256, 256)
        diff = np.abs(np.asarray(hr.reduce(4), np.int16) - np.asarray(lr, np.int16))
        assert diff.max() <= 1
        got = detect_attributes(lr)
        assert (got["colour"], got["shape"], got["background"], got["position"]) == (
            row["colour"],
            row["shape"],
            row["background"],
            row["position"],
        )


def test_kg_files_and_prompts(small_set):
    from rapiddiff.kg.triples import read_aliases, read_triples

    triples = read_triples(small_set / "kg" / "triples.tsv")
    entities = json.loads((small_set / "entities.json").read_text(encoding="utf-8"))
    aliases = read_aliases(small_set / "kg" / "aliases.tsv", {h for h, _, _ in triples})
    assert aliases["番茄"] == ["西红柿"]
    facts = {(h, r): t for h, r, t in triples}
    for name, info in entities.items():
        assert facts[(name, "颜色")] == info["colour"]
        assert facts[(name, "形状")] == info["shape"]
        assert facts[(name, "类别")] == info["category"]
    assert {t for _, r, t in triples if r == "颜色"} == set(COLOURS)
    assert len({r for _, r, _ in triples}) >= 6
    prompts = _read_jsonl(small_set / "prompts.jsonl")
    heldout = set((small_set / "heldout_entities.txt").read_text(encoding="utf-8").split())
    assert {p["entity"] for p in prompts} == set(entities)
    validation = set((small_set / "validation_entities.txt").read_text(encoding="utf-8").split())
    for p in prompts:
        assert p["split"] == (
            "heldout" if p["entity"] in heldout else "val" if p["entity"] in validation else "seen"
        )
        assert p["entity"] in p["text"] and p["colour"] == entities[p["entity"]]["colour"]


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_validation_entities_are_disjoint_from_heldout_and_keep_attributes_seen(seed):
    heldout = choose_heldout(15, seed)
    validation = choose_validation(8, seed, heldout)
    assert len(validation) == 8 and not set(validation) & set(heldout)
    seen = [e for e in ENTITIES if e.name not in {*heldout, *validation}]
    for colour in COLOURS:
        assert sum(e.colour == colour for e in seen) >= 2, colour
    for shape in SHAPES:
        assert sum(e.shape == shape for e in seen) >= 2, shape
    assert choose_heldout(15, seed) == heldout  # adding a validation set leaves the test set as it was


def test_validation_entities_are_in_no_training_caption_and_recorded(small_set):
    validation = (small_set / "validation_entities.txt").read_text(encoding="utf-8").split()
    heldout = (small_set / "heldout_entities.txt").read_text(encoding="utf-8").split()
    entities = json.loads((small_set / "entities.json").read_text(encoding="utf-8"))
    assert len(validation) == 8 and all(entities[n]["validation"] for n in validation)
    assert json.loads((small_set / "kg_only_entities.json").read_text(encoding="utf-8")) == {
        "heldout": heldout,
        "validation": validation,
        "seed": 5,
    }
    forbidden = [s for n in validation for s in [n, *entities[n]["aliases"]]]
    for row in _read_jsonl(small_set / "train" / "metadata.jsonl"):
        assert not any(s in row["text"] for s in forbidden), row


def _literal_parts(template: str) -> list[str]:
    """The wording of a template between its {placeholders}."""
    import re

    return [part for part in re.split(r"\{\w+\}", template) if part]


def test_no_robust_template_wording_is_in_any_training_template():
    """The robustness set must be phrasing training never showed: every robust template has a
    piece of wording (between placeholders) that no training caption template contains, and no
    robust template is a training template, with {e} standing for "{c}的{s}" or "{c}{s}" too."""
    training = [*ATTRIBUTE_TEMPLATES, *ENTITY_TEMPLATES]
    as_entity = {t.replace("{c}的{s}", "{e}").replace("{c}{s}", "{e}") for t in training}
    for template in (*ROBUST_TEMPLATES, *DISTRACTOR_TEMPLATES):
        assert template not in as_entity, template
        new = [part for part in _literal_parts(template) if not any(part in t for t in training)]
        assert new, f"{template!r}: every piece of its wording is in a training template"
    # The evaluation-on-training-templates prompts do use training wording (they are the baseline).
    assert set(PROMPT_TEMPLATES) <= set(ENTITY_TEMPLATES)


def test_robust_prompts_cover_every_variant_and_are_no_training_caption(small_set):
    from opencc import OpenCC

    rows = _read_jsonl(small_set / "prompts_robust.jsonl")
    entities = json.loads((small_set / "entities.json").read_text(encoding="utf-8"))
    train_texts = {r["text"] for r in _read_jsonl(small_set / "train" / "metadata.jsonl")}
    assert {r["variant"] for r in rows} == {"sentence", "alias", "traditional", "distractor"}
    assert {r["split"] for r in rows} == {"seen", "heldout", "val"}
    to_simplified = OpenCC("t2s")
    for r in rows:
        info = entities[r["entity"]]
        assert (r["colour"], r["shape"]) == (info["colour"], info["shape"])
        assert r["text"] not in train_texts
        text = to_simplified.convert(r["text"]) if r["variant"] == "traditional" else r["text"]
        assert r["background"] in text
        if r["variant"] == "alias":
            assert any(a in text for a in info["aliases"])
        else:
            assert r["entity"] in text
        if r["variant"] == "traditional":
            assert r["text"] != text  # some character did change
        if r["variant"] == "distractor":
            d = entities[r["distractor"]]
            assert r["distractor"] in text and d["colour"] != info["colour"] and d["shape"] != info["shape"]
            assert not d["heldout"] and not d["validation"]


def test_attribute_prompts_cover_every_pair_and_name_all_four(small_set):
    """prompts_attribute.jsonl: every colour × shape pair, on training attribute templates that name
    background and position, a background the colour may be drawn on, a position of the layout; the
    same prompts come back from the folder's kshapes.yaml alone (how older folders get them)."""
    from rapiddiff.data.kshapes.generate import attribute_prompts
    from rapiddiff.utils.config import load_config

    written = _read_jsonl(small_set / "prompts_attribute.jsonl")
    cfg = load_config(KShapesConfig, small_set / "kshapes.yaml")
    rows = [r for r in written if r["split"] == "attribute"]
    val = [r for r in written if r["split"] == "attribute_val"]
    assert rows == attribute_prompts(cfg) and val == attribute_prompts(cfg, "attribute_val")
    assert len(written) == len(rows) + len(val)
    # The validation captions ask for the same pairs, on their own backgrounds and positions.
    assert sorted((r["colour"], r["shape"]) for r in val) == sorted((r["colour"], r["shape"]) for r in rows)
    assert len({r["text"] for r in rows} & {r["text"] for r in val}) < 0.2 * len(rows)  # few by chance
    with pytest.raises(ValueError, match="choose from attribute, attribute_val"):
        attribute_prompts(cfg, "val")
    assert {(r["colour"], r["shape"]) for r in rows} == set(itertools.product(COLOURS, SHAPES))
    assert len(rows) == len(COLOURS) * len(SHAPES) * cfg.prompts_per_entity
    assert set(ATTRIBUTE_PROMPT_TEMPLATES) <= set(ATTRIBUTE_TEMPLATES)
    assert all("{bg}" in t and "{pos}" in t for t in ATTRIBUTE_PROMPT_TEMPLATES)
    positions = {name for name, _, _ in LAYOUTS[cfg.layout]}
    for r in rows:
        assert r["split"] == "attribute" and r["entity"] is None and r["layout"] == cfg.layout
        assert r["background"] in compatible_backgrounds(r["colour"]) and r["position"] in positions
        assert r["text"] in {
            t.format(bg=r["background"], pos=r["position"], c=r["colour"], s=r["shape"])
            for t in ATTRIBUTE_PROMPT_TEMPLATES
        }
    assert len({r["background"] for r in rows}) > 3 and len({r["position"] for r in rows}) == 3
    first = rows[: len(COLOURS) * len(SHAPES)]  # each pair once, in a seeded order (for --limit)
    assert len({(r["colour"], r["shape"]) for r in first}) == len(first)
    assert len({r["colour"] for r in rows[:8]}) >= 4
    other = attribute_prompts(KShapesConfig(out=small_set, seed=cfg.seed + 1))
    assert other != rows  # a function of the seed


def test_detector_gives_the_geometry_a_re_render_needs():
    spec = ShapeSpec("三角形", "红色", "浅蓝色", 0.3, 0.6, scale=1.05)
    got = detect_attributes(render(spec, 128))
    assert abs(got["centre"][0] - 0.3) < 0.01 and abs(got["centre"][1] - 0.6) < 0.01
    assert got["centroid"][1] > got["centre"][1]  # a triangle's mass sits below its box's centre
    bar = detect_attributes(render(ShapeSpec("长条形", "蓝色", "米色", 0.5, 0.5), 128))
    assert min(bar["orientation"], 180 - bar["orientation"]) < 2  # bars lie horizontally
    empty = detect_attributes(Image.new("RGB", (64, 64), BACKGROUNDS["米色"][0]))
    assert empty["centre"] is None and empty["orientation"] is None


def _fresh_specs(n: int, seed: int, layout: str = "row3") -> list[tuple[ShapeSpec, str]]:
    rng = np.random.default_rng(seed)
    specs = []
    for _ in range(n):
        colour = str(rng.choice(list(COLOURS)))
        position, x, y = LAYOUTS[layout][int(rng.integers(len(LAYOUTS[layout])))]
        spec = ShapeSpec(
            shape=str(rng.choice(SHAPES)),
            colour=colour,
            background=str(rng.choice(compatible_backgrounds(colour))),
            x=x + rng.uniform(-0.02, 0.02),
            y=y + rng.uniform(-0.05, 0.05) * (layout == "row3"),
            scale=rng.uniform(0.9, 1.1),
            colour_shift=tuple(int(v) for v in rng.integers(-6, 7, 3)),
        )
        specs.append((spec, position))
    return specs


def _accuracy(images_and_specs, layout: str = "row3") -> float:
    right = 0
    for image, (spec, position) in images_and_specs:
        got = detect_attributes(image, layout=layout)
        right += (got["colour"], got["shape"], got["background"], got["position"]) == (
            spec.colour,
            spec.shape,
            spec.background,
            position,
        )
    return right / len(images_and_specs)


@pytest.mark.parametrize(("size", "n"), [(128, 200), (512, 50)])
def test_detector_reads_fresh_renders(size, n):
    specs = _fresh_specs(n, seed=1000 + size)
    assert _accuracy([(render(s, size), (s, p)) for s, p in specs]) >= 0.99


def test_detector_reads_a_grid_layout():
    specs = _fresh_specs(90, seed=7, layout="grid9")
    assert _accuracy([(render(s, 128), (s, p)) for s, p in specs], layout="grid9") >= 0.99


def test_detector_tolerates_blur_and_noise():
    rng = np.random.default_rng(3)
    specs = _fresh_specs(120, seed=11)
    degraded = []
    for spec, position in specs:
        image = render(spec, 128).filter(ImageFilter.GaussianBlur(1.0))
        noisy = np.asarray(image, np.float32) + rng.normal(0, 8, (128, 128, 3))
        degraded.append((Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)), (spec, position)))
    assert _accuracy(degraded) >= 0.97


def test_detector_reports_no_object_on_a_plain_background():
    got = detect_attributes(Image.new("RGB", (128, 128), BACKGROUNDS["灰色"][0]))
    assert got["colour"] is None and got["shape"] is None and got["background"] == "灰色"


def test_cli_writes_and_refuses_a_non_empty_folder(tmp_path, capsys):
    from rapiddiff.cli import main

    out = tmp_path / "ks"
    args = ["data", "kshapes", "--out", str(out), "--small", "--train", "12", "--val", "3", "--test", "3"]
    assert main(args) == 0
    assert len(list((out / "train").glob("*.png"))) == 12
    assert main(args) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main([*args, "--overwrite", "--train", "5"]) == 0
    assert len(list((out / "train").glob("*.png"))) == 5


def test_config_rejects_bad_values(tmp_path):
    with pytest.raises(ValueError, match="multiple of 8"):
        KShapesConfig(out=tmp_path, size=100)
