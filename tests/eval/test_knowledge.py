"""eval knowledge: the table from the real kshapes detector, and the command end to end."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from PIL import Image

from rapiddiff.cli import main
from rapiddiff.data.kshapes import COLOURS, ENTITIES, SHAPES, ShapeSpec, render
from rapiddiff.eval.knowledge import evaluate_knowledge, markdown_table, read_knowledge_prompts
from rapiddiff.eval.sample import SampleSettings


def _prompts(n_seen=2, n_heldout=2):
    rows = []
    for k, e in enumerate(ENTITIES[: n_seen + n_heldout]):
        rows.append(
            {
                "text": f"浅蓝色背景上有一个{e.name}",
                "entity": e.name,
                "colour": e.colour,
                "shape": e.shape,
                "split": "seen" if k < n_seen else "heldout",
            }
        )
    return rows


class OraclePipe:
    """Draws each prompt's entity with the kshapes renderer: right with knowledge; without it,
    held-out entities get the wrong shape (what a model that never saw them would do)."""

    def __init__(self, prompts):
        self.by_text = {p["text"]: p for p in prompts}
        self.text_encoder = SimpleNamespace(store=object())
        self.calls = []

    def __call__(self, prompts, *, seed, knowledge=True, **kwargs):
        self.calls.append(len(prompts))
        images = []
        for text in prompts:
            p = self.by_text[text]
            shape = p["shape"]
            if not knowledge and p["split"] == "heldout":
                shape = SHAPES[(SHAPES.index(shape) + 1) % len(SHAPES)]
            images.append(render(ShapeSpec(shape, p["colour"], "浅蓝色", 0.5, 0.5), 64))
        return SimpleNamespace(images=images, seeds=list(seed))


def test_accuracy_table_with_the_real_detector(tmp_path):
    prompts = _prompts()
    pipe = OraclePipe(prompts)
    record = evaluate_knowledge(
        pipe, prompts, tmp_path / "run", SampleSettings(model="oracle", images_per_prompt=2), batch_size=3
    )
    rows = {(r["split"], r["knowledge"]): r for r in record["table"]}
    assert set(rows) == {("seen", "on"), ("seen", "off"), ("heldout", "on"), ("heldout", "off")}
    for key in [("seen", "on"), ("seen", "off"), ("heldout", "on")]:
        assert (rows[key]["colour"], rows[key]["shape"], rows[key]["both"]) == (100.0, 100.0, 100.0), key
    assert (rows[("heldout", "off")]["colour"], rows[("heldout", "off")]["shape"]) == (100.0, 0.0)
    assert rows[("heldout", "on")]["images"] == 4 and rows[("heldout", "on")]["entities"] == 2
    assert record["value"] == 100.0 and not record["warnings"]
    assert pipe.calls == [3, 3, 2, 3, 3, 2]  # batched: 8 images per mode in calls of ≤ 3
    saved = json.loads((tmp_path / "run" / "metrics" / "knowledge.json").read_text())
    assert saved["table"] == record["table"]
    md = (tmp_path / "run" / "knowledge.md").read_text()
    assert md.startswith("| entities |") and "| heldout (2) | off | 4 | 100.0 | 0.0 | 0.0 | 0.0–49.0 |" in md
    detections = (tmp_path / "run" / "knowledge_off" / "detections.jsonl").read_text().splitlines()
    assert len(detections) == 8 and json.loads(detections[-1])["shape_ok"] is False


def test_prompt_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="rapiddiff data kshapes"):
        read_knowledge_prompts(tmp_path)
    (tmp_path / "prompts.jsonl").write_text(
        '{"text": "x", "entity": "番茄", "colour": "红色", "split": "seen"}\n'
    )
    with pytest.raises(ValueError, match="lacks shape"):
        read_knowledge_prompts(tmp_path)


def test_knowledge_command_end_to_end_on_a_tiny_model(tmp_path, tiny_model, capsys):
    kshapes = tmp_path / "kshapes"
    kshapes.mkdir()
    rows = _prompts()
    (kshapes / "prompts.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    out = tmp_path / "run"
    code = main(
        [
            "eval",
            "knowledge",
            "--model",
            str(tiny_model),
            "--kshapes",
            str(kshapes),
            "--out",
            str(out),
            "--steps",
            "2",
            "--images-per-prompt",
            "2",
            "--batch-size",
            "8",
            "--device",
            "cpu",
        ]
    )
    assert code == 0
    record = json.loads((out / "metrics" / "knowledge.json").read_text())
    assert record["details"]["settings"]["model"] == str(tiny_model)
    rows = {(r["split"], r["knowledge"]): r for r in record["table"]}
    assert len(rows) == 4 and all(r["images"] == 4 for r in rows.values())
    # This model has no KnowledgeStore: on and off are one encoder, so they must agree exactly.
    assert record["warnings"] and "no KnowledgeStore" in record["warnings"][0]
    for split in ("seen", "heldout"):
        on, off = rows[(split, "on")], rows[(split, "off")]
        assert (on["colour"], on["shape"], on["both"]) == (off["colour"], off["shape"], off["both"])
    printed = capsys.readouterr().out
    assert markdown_table(record["table"]) in printed and "Chance (uniform guess): colour 12.5 %" in printed
    assert len(list((out / "knowledge_on" / "images").glob("*.png"))) == 8


def test_fixed_batch_pipelines_get_full_batches_and_the_detector_runs_in_processes(tmp_path):
    prompts = _prompts()
    pipe = OraclePipe(prompts)
    pipe.fixed_batch = True  # as the fast path's sampler declares: one shape, one compiled loop
    record = evaluate_knowledge(
        pipe,
        prompts,
        tmp_path / "run",
        SampleSettings(model="oracle", images_per_prompt=2),
        batch_size=3,
        modes=("on",),
        workers=2,
    )
    assert pipe.calls == [3, 3, 3]  # the last batch of 2 padded to 3; its extra image dropped
    rows = {(r["split"], r["knowledge"]): r for r in record["table"]}
    assert rows[("heldout", "on")]["both"] == 100.0 and rows[("seen", "on")]["images"] == 4
    assert len(list((tmp_path / "run" / "knowledge_on" / "images").glob("*.png"))) == 8


def test_knowledge_switch_reaches_the_encoder_on_both_paths(tmp_path, knowledge_model):
    """With a KnowledgeStore, on and off differ for entity prompts; the fast-path adapter honours the switch."""
    import numpy as np

    from rapiddiff.eval.sample import load_pipeline
    from rapiddiff.infer.accelerate import accelerate

    kshapes = tmp_path / "kshapes"
    kshapes.mkdir()
    (kshapes / "prompts.jsonl").write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in _prompts(1, 1))
    )
    out = tmp_path / "run"
    args = [
        "eval",
        "knowledge",
        "--model",
        str(knowledge_model),
        "--kshapes",
        str(kshapes),
        "--out",
        str(out),
        "--steps",
        "2",
        "--images-per-prompt",
        "1",
        "--device",
        "cpu",
    ]
    assert main(args) == 0
    record = json.loads((out / "metrics" / "knowledge.json").read_text())
    assert record["warnings"] == []
    on = [np.asarray(Image.open(p), float) for p in sorted((out / "knowledge_on" / "images").glob("*.png"))]
    off = [np.asarray(Image.open(p), float) for p in sorted((out / "knowledge_off" / "images").glob("*.png"))]
    assert len(on) == len(off) == 2 and all(np.abs(a - b).max() > 0 for a, b in zip(on, off, strict=True))

    pipe = load_pipeline(knowledge_model, device="cpu", dtype="float32")
    fast = accelerate(
        pipe,
        dtype=None,
        compile_unet=None,
        compile_vae=None,
        loop="eager",
        attention="default",
        channels_last=False,
    )
    kw = dict(seed=[0], num_inference_steps=2, guidance_scale=7.5, progress=False)
    prompt = [_prompts(1, 1)[0]["text"]]
    for knowledge, want in ((True, on[0]), (False, off[0])):
        got = np.asarray(fast(prompt, knowledge=knowledge, **kw).images[0], float)
        np.testing.assert_allclose(got, want, atol=1)
    assert pipe.text_encoder.knowledge is True  # the switch is restored after the call


def test_wilson_interval():
    from rapiddiff.eval.knowledge import wilson_interval

    # Reference values (Wilson 1927; e.g. statsmodels proportion_confint(method="wilson")).
    assert wilson_interval(0, 4) == (0.0, 48.99)
    assert wilson_interval(50, 100) == (40.38, 59.62)
    assert wilson_interval(10, 10)[1] == 100.0


class ModeEncoder:
    """Stands in for KnowledgeTextEncoder's mode switch (set for a block, then restored)."""

    def __init__(self):
        self.store, self.knowledge_mode, self.knowledge = object(), "embed", True

    def knowledge_as(self, mode):
        import contextlib

        @contextlib.contextmanager
        def block():
            previous, self.knowledge_mode = self.knowledge_mode, mode
            try:
                yield self
            finally:
                self.knowledge_mode = previous

        return block()


def test_knowledge_modes_validation_split_and_variants_are_tabulated(tmp_path):
    """--modes embed,text switch the encoder's mode for their images; split "val" and the robust
    set's "variant" field get rows of their own."""
    prompts = _prompts(n_seen=1, n_heldout=2)
    prompts[1]["split"] = "val"
    for k, p in enumerate(prompts):
        p["variant"] = "sentence" if k % 2 == 0 else "alias"
    pipe = OraclePipe(prompts)
    pipe.text_encoder = ModeEncoder()
    modes_seen = []

    def call(prompts_, *, seed, knowledge=True, **kwargs):
        mode = pipe.text_encoder.knowledge_mode
        modes_seen.append(mode)
        # Only spelled-out facts reach this "model": embed draws KG-only entities as a wrong shape.
        return OraclePipe.__call__(pipe, prompts_, seed=seed, knowledge=knowledge and mode == "text")

    class Wrapper:
        text_encoder = pipe.text_encoder

        def __call__(self, *a, **kw):
            return call(*a, **kw)

    record = evaluate_knowledge(
        Wrapper(), prompts, tmp_path / "run", SampleSettings(model="m"), modes=("embed", "text")
    )
    assert pipe.text_encoder.knowledge_mode == "embed" and set(modes_seen) == {"embed", "text"}
    rows = {(r["split"], r.get("variant"), r["knowledge"]): r for r in record["table"]}
    assert {s for s, _, _ in rows} == {"seen", "val", "heldout"}
    assert (
        rows[("heldout", None, "text")]["both"] == 100.0 and rows[("heldout", None, "embed")]["shape"] == 0.0
    )
    assert (
        rows[("val", "alias", "embed")]["images"] == 1 and rows[("seen", "sentence", "text")]["both"] == 100.0
    )
    assert (
        record["value"] == rows[("heldout", None, "embed")]["both"]
    )  # the headline: first mode's overall row


class AttributeOracle:
    """Draws attribute captions with the kshapes renderer at the prompt's position: all four right
    with knowledge on; with it off, on the wrong background (so background and "all" must drop
    while colour, shape and position stay)."""

    def __init__(self, prompts):
        from rapiddiff.data.kshapes import LAYOUTS

        self.by_text = {p["text"]: p for p in prompts}
        self.centres = {name: (x, y) for name, x, y in LAYOUTS["row3"]}
        self.text_encoder = SimpleNamespace(store=object())

    def __call__(self, prompts, *, seed, knowledge=True, **kwargs):
        from rapiddiff.data.kshapes.palette import compatible_backgrounds

        images = []
        for text in prompts:
            p = self.by_text[text]
            background = p["background"]
            if not knowledge:
                background = next(b for b in compatible_backgrounds(p["colour"]) if b != background)
            x, y = self.centres[p["position"]]
            images.append(render(ShapeSpec(p["shape"], p["colour"], background, x, y), 64))
        return SimpleNamespace(images=images, seeds=list(seed))


def _kshapes_folder(tmp_path, seed=3):
    from rapiddiff.data.kshapes import KShapesConfig
    from rapiddiff.utils.config import save_config

    folder = tmp_path / "ks"
    folder.mkdir()
    (folder / "prompts.jsonl").write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in _prompts(1, 1)), encoding="utf-8"
    )
    cfg = KShapesConfig(out=folder, seed=seed, prompts_per_entity=1)
    save_config(cfg, folder / "kshapes.yaml")
    return folder, cfg


def test_attribute_split_comes_from_the_file_or_from_an_old_folders_config(tmp_path):
    from rapiddiff.data.kshapes.generate import attribute_prompts

    folder, cfg = _kshapes_folder(tmp_path)
    # A folder written before prompts_attribute.jsonl existed: the prompts are made from kshapes.yaml.
    rows = read_knowledge_prompts(folder, ["seen", "attribute"])
    assert [r["split"] for r in rows[:1]] == ["seen"] and rows[1:] == attribute_prompts(cfg)
    assert len(rows) == 1 + 48
    # The file, when there, is what counts (and is checked like prompts.jsonl).
    (folder / "prompts_attribute.jsonl").write_text(
        json.dumps(rows[1], ensure_ascii=False) + "\n" + json.dumps({**rows[2], "position": None}) + "\n",
        encoding="utf-8",
    )
    with pytest.raises(ValueError, match=r"prompts_attribute\.jsonl: record 2 lacks position"):
        read_knowledge_prompts(folder, ["attribute"])
    (folder / "prompts_attribute.jsonl").write_text(json.dumps(rows[1], ensure_ascii=False) + "\n")
    assert read_knowledge_prompts(folder, ["attribute"]) == [rows[1]]
    (folder / "prompts_attribute.jsonl").unlink()
    (folder / "kshapes.yaml").unlink()
    with pytest.raises(
        FileNotFoundError, match=r"neither prompts_attribute\.jsonl with split 'attribute' nor"
    ):
        read_knowledge_prompts(folder, ["attribute"])


def test_attribute_validation_split_is_its_own_set_and_old_files_get_it_from_the_config(tmp_path):
    from rapiddiff.data.kshapes.generate import attribute_prompts

    folder, cfg = _kshapes_folder(tmp_path)
    test_rows = attribute_prompts(cfg)
    # A file written before the validation split existed holds the test split alone.
    (folder / "prompts_attribute.jsonl").write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in test_rows), encoding="utf-8"
    )
    val = read_knowledge_prompts(folder, ["attribute_val"])
    assert val == attribute_prompts(cfg, "attribute_val") and {r["split"] for r in val} == {"attribute_val"}
    assert read_knowledge_prompts(folder, ["attribute"]) == test_rows
    both = read_knowledge_prompts(folder, ["attribute", "attribute_val"])
    assert both == test_rows + val


def test_the_attribute_split_names_are_the_generators():
    from rapiddiff.data.kshapes.generate import ATTRIBUTE_STREAMS
    from rapiddiff.eval.knowledge import ATTRIBUTE_SPLITS

    assert tuple(ATTRIBUTE_STREAMS) == ATTRIBUTE_SPLITS


def test_attribute_split_scores_all_four_and_render_consistency(tmp_path):
    from rapiddiff.data.kshapes.generate import attribute_prompts

    _, cfg = _kshapes_folder(tmp_path)
    every = attribute_prompts(cfg)
    # every colour, every shape
    prompts = [
        next(p for p in every if (p["colour"], p["shape"]) == (c, SHAPES[k % 6]))
        for k, c in enumerate(COLOURS)
    ]
    record = evaluate_knowledge(
        AttributeOracle(prompts), prompts, tmp_path / "run", SampleSettings(model="oracle"), batch_size=4
    )
    rows = {r["knowledge"]: r for r in record["table"]}
    assert set(rows) == {"on", "off"} and all(r["split"] == "attribute" for r in rows.values())
    on, off = rows["on"], rows["off"]
    assert (on["colour"], on["shape"], on["background"], on["position"], on["all"]) == (100.0,) * 5
    assert (off["colour"], off["shape"], off["position"], off["background"], off["all"]) == (
        100.0, 100.0, 100.0, 0.0, 0.0,
    )  # fmt: skip
    # Renders are as consistent with their re-render as images get; the wrong background does not
    # change that (the re-render draws what the detector read).
    assert on["psnr"] > 30 and on["ssim"] > 0.98 and off["psnr"] > 30
    assert record["details"]["render_grid"] == "render_consistency.png"
    with Image.open(tmp_path / "run" / "render_consistency.png") as grid:
        assert grid.height == 2 * (64 + 6)  # attribute / on and attribute / off, one row each
    md = (tmp_path / "run" / "knowledge.md").read_text(encoding="utf-8")
    assert "| attribute (8) | on | 8 | 100.0 | 100.0 | 100.0 | 100.0 | 100.0 |" in md
    assert "| attribute (8) | off | 8 | 100.0 | 100.0 | 0.0 | 100.0 | 0.0 |" in md
    assert f"| attribute (8) | on | 8 | {on['psnr']:.2f} | {on['ssim']:.4f} |" in md
    detection = json.loads(
        (tmp_path / "run" / "knowledge_off" / "detections.jsonl").read_text().splitlines()[0]
    )
    assert detection["background_ok"] is False and detection["rerender"]["shape"] == detection["shape"]
    assert {p["shape"] for p in prompts} == set(SHAPES)
    assert record["details"]["per_entity"]["attribute/红色的圆形"]["on"]["both"] == 1.0
    # Where the misses are: with knowledge off every background is misread, none is with it on.
    misses = {r["knowledge"]: r for r in record["details"]["attribute_misses"]}
    assert misses["on"]["misreadings"] == [] and all(c["all"] == 100.0 for c in misses["on"]["by_background"])
    assert all(c["all"] == 0.0 for c in misses["off"]["by_background"])
    assert {m["attribute"] for m in misses["off"]["misreadings"]} == {"background"}
    assert "| attribute | on | " in md and "commonest misreadings" in md


def _attribute_record(split, background, shape, read_shape, position_ok=True):
    ok = read_shape == shape
    return {
        "split": split, "entity": None, "colour": "红色", "shape": shape, "background": background,
        "position": "左边", "detected_colour": "红色", "detected_shape": read_shape,
        "detected_background": background, "detected_position": "左边" if position_ok else "中间",
        "colour_ok": True, "shape_ok": ok, "both_ok": ok, "background_ok": True,
        "position_ok": position_ok, "all_ok": ok and position_ok,
    }  # fmt: skip


def test_attribute_misses_are_placed_by_background_and_shape_and_the_splits_kept_apart():
    from rapiddiff.eval.knowledge import attribute_misses, misses_table, per_entity

    test = [_attribute_record("attribute", "深绿色", "椭圆形", "长条形")] * 3
    test += [_attribute_record("attribute", "深绿色", "椭圆形", "椭圆形")]
    test += [_attribute_record("attribute", "灰色", "椭圆形", "椭圆形")] * 4
    test += [_attribute_record("attribute", "灰色", "圆形", "圆形", position_ok=False)]
    val = [_attribute_record("attribute_val", "灰色", "椭圆形", "椭圆形")] * 2
    entity = [{**_attribute_record("heldout", "浅蓝色", "圆形", "圆形"), "entity": "番茄"}]
    rows = attribute_misses({"on": test + val + entity})
    assert [(r["split"], r["images"]) for r in rows] == [("attribute", 9), ("attribute_val", 2)]
    first = rows[0]
    assert first["by_background"] == [
        {"background": "深绿色", "images": 4, "all": 25.0},
        {"background": "灰色", "images": 5, "all": 80.0},
    ]
    assert [c["shape"] for c in first["by_shape"]] == ["圆形", "椭圆形"]  # 0 % before 62.5 %
    assert first["misreadings"] == [
        {"attribute": "shape", "asked": "椭圆形", "read": "长条形", "images": 3},
        {"attribute": "position", "asked": "左边", "read": "中间", "images": 1},
    ]
    assert rows[1]["misreadings"] == []
    md = misses_table(rows)
    assert "| attribute | on | 深绿色 25.0 (4), 灰色 80.0 (5) | 圆形 0.0 (1), 椭圆形 62.5 (8) |" in md
    assert "shape 椭圆形 → 长条形 ×3, position 左边 → 中间 ×1 |" in md
    # The same pair in the two attribute splits stays two entries.
    table = per_entity({"on": test + val})
    assert table["attribute/红色的椭圆形"]["on"]["both"] == 0.625
    assert table["attribute_val/红色的椭圆形"]["on"]["both"] == 1.0


def test_a_mode_that_conditions_like_an_earlier_one_reuses_its_images(tmp_path, knowledge_model):
    """A prompt whose entities have no colour / shape facts reads the same in "both" as in "on"
    (embed) and in "text" as in "off": those images are drawn once and linked in, the one prompt
    that expands is drawn in every mode; and drawing "both" for such a prompt gives "on"'s image."""
    import numpy as np

    from rapiddiff.data.kshapes import ENTITIES
    from rapiddiff.eval.sample import load_pipeline

    pipe = load_pipeline(knowledge_model, device="cpu", dtype="float32")
    facts, bare = ENTITIES[0].name, ENTITIES[1].name  # the fixture's store: facts for the first only
    fields = {"colour": "红色", "shape": "圆形", "split": "seen"}
    prompts = [
        {"text": f"浅蓝色背景上有一个{facts}", "entity": facts, **fields},
        {"text": f"浅蓝色背景上有一个{bare}", "entity": bare, **fields},
        {"text": "浅蓝色背景上有一个红色的圆形", "entity": "红色", **fields},
    ]
    assert pipe.text_encoder.expand([prompts[0]["text"]]) == [prompts[0]["text"]]  # mode embed: as written
    with pipe.text_encoder.knowledge_as("both"):
        expanded = [pipe.text_encoder.expand([p["text"]])[0] != p["text"] for p in prompts]
    assert expanded == [True, False, False]
    settings = SampleSettings(model="m", steps=2, guidance=3.0)
    record = evaluate_knowledge(
        pipe, prompts, tmp_path / "run", settings, modes=("on", "both", "text", "off"), detect=lambda im: {}
    )
    made = {m: (t["generated"], t["reused"]) for m, t in record["details"]["timings"].items()}
    assert made == {"on": (3, 0), "both": (1, 2), "text": (3, 0), "off": (1, 2)}
    run = tmp_path / "run"
    name = sorted(p.name for p in (run / "knowledge_on" / "images").glob("*.png"))[1]  # the bare entity's
    assert (run / "knowledge_both" / "images" / name).samefile(run / "knowledge_on" / "images" / name)
    assert (run / "knowledge_off" / "images" / name).samefile(run / "knowledge_text" / "images" / name)
    # What the reuse assumes, drawn: "both" on a prompt it does not expand is "on"'s image.
    kw = dict(seed=[1], num_inference_steps=2, guidance_scale=3.0, progress=False)
    with pipe.text_encoder.knowledge_as("both"):
        drawn = np.asarray(pipe([prompts[1]["text"]], **kw).images[0], float)
    on = np.asarray(Image.open(run / "knowledge_on" / "images" / name), float)
    np.testing.assert_allclose(drawn, on, atol=1)
    # A rerun resumes: nothing is drawn again, the links stay.
    again = evaluate_knowledge(
        pipe, prompts, tmp_path / "run", settings, modes=("on", "both", "text", "off"), detect=lambda im: {}
    )
    assert {m: t["generated"] for m, t in again["details"]["timings"].items()} == dict.fromkeys(made, 0)
