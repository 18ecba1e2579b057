"""eval emoji: prompts from the data folder, the judge-feature Fréchet distance, and the command end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rapiddiff.cli import main
from rapiddiff.eval.emoji import FRECHET_LABEL, SPLITS, TEMPLATES, emoji_prompts, frechet_rows


def test_templates_are_kshapes_evaluation_templates():
    from rapiddiff.data.kshapes.captions import PROMPT_TEMPLATES

    assert TEMPLATES == PROMPT_TEMPLATES


def test_prompts_cover_every_split_with_the_folders_vocabulary(emoji_folder):
    from rapiddiff.eval.emoji_layout import calibrate

    vocab = calibrate(emoji_folder)
    rows = emoji_prompts(emoji_folder, SPLITS, vocab)
    by_split = {s: [r for r in rows if r["split"] == s] for s in SPLITS}
    assert [len(by_split[s]) for s in SPLITS] == [4, 2, 1, 1]
    assert by_split["seen"][0]["text"].endswith("有一个物0") and by_split["seen"][0]["kind"] == "zh"
    assert [r["kind"] for r in by_split["alias"]] == ["zh_hant", "keyword"] and "物0甲" in by_split["alias"][
        0
    ]["text"]
    assert all(r["background"] in vocab.backgrounds and r["background"] in r["text"] for r in rows)
    assert all(r["position"] is None or r["position"] in r["text"] for r in rows)
    assert any(r["position"] for r in rows)
    assert emoji_prompts(emoji_folder, SPLITS, vocab) == rows  # deterministic
    assert len(emoji_prompts(emoji_folder, ["seen"], vocab, limit=2)) == 2


def test_frechet_distance_of_a_set_to_itself_is_zero_and_grows_with_a_shift():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(400, 8)), rng.normal(size=(400, 8))
    real = {"seen": {"a": a, "b": b}}
    pooled = np.concatenate([a, b])
    distances = [
        frechet_rows({("seen", "on"): pooled + shift}, real)[0]["generated_vs_real"] for shift in (0, 0.5, 1)
    ]
    assert abs(distances[0]) < 1e-6 and distances[0] < distances[1] < distances[2]
    assert distances[2] == pytest.approx(8.0, rel=0.05)  # ‖Δμ‖² = 8 × 1², covariances equal
    row = frechet_rows({("seen", "on"): pooled + 1}, real)[0]
    assert row["real_styles"] == ["a", "b"] and row["style_vs_style"] < 0.5 and row["ratio"] > 10


@pytest.mark.slow  # the tiny_judge fixture trains 200 steps (~2 min on a busy 2-core CPU)
def test_eval_emoji_end_to_end_on_a_tiny_model(tmp_path, emoji_folder, tiny_judge, tiny_model, capsys):
    judge_dir, _ = tiny_judge
    out = tmp_path / "run"
    args = ["eval", "emoji", "--model", str(tiny_model), "--data", str(emoji_folder), "--judge", str(judge_dir),
            "--out", str(out), "--splits", "seen,alias,heldout,val", "--knowledge", "on,off", "--steps", "2",
            "--images-per-prompt", "2", "--batch-size", "8", "--device", "cpu"]  # fmt: skip
    assert main(args) == 0
    record = json.loads((out / "metrics" / "emoji.json").read_text())
    assert {"metric", "label", "value", "table", "warnings", "details"} <= set(record)
    assert {"judge", "frechet", "frechet_label", "vocabulary", "settings", "grids", "timings"} <= set(
        record["details"]
    )
    rows = {(r["split"], r.get("kind"), r["knowledge"]): r for r in record["table"]}
    for split in SPLITS:
        for mode in ("on", "off"):
            row = rows[(split, None, mode)]
            assert {
                "images",
                "entities",
                "top1",
                "top1_ci95",
                "top5",
                "subcategory",
                "background",
                "position",
            } <= set(row)
            assert row["images"] == {"seen": 8, "alias": 4, "heldout": 2, "val": 2}[split]
    assert ("alias", "zh_hant", "on") in rows and ("alias", "keyword", "off") in rows
    # This model has no KnowledgeStore: on and off draw the same images, so they must read the same.
    for split in SPLITS:
        assert rows[(split, None, "on")]["top1"] == rows[(split, None, "off")]["top1"]
    assert record["details"]["frechet_label"] == FRECHET_LABEL
    f = record["details"]["frechet"][0]
    assert {"generated_vs_real", "style_vs_style", "real_styles", "ratio", "images"} <= set(f)
    assert (
        record["details"]["grids"] == [f"grid_{s}.png" for s in SPLITS] and (out / "grid_seen.png").is_file()
    )
    judged = (out / "knowledge_on" / "judgements.jsonl").read_text().splitlines()
    assert len(judged) == 16 and {"judged", "judged_top5", "top1_ok", "background_ok"} <= set(
        json.loads(judged[0])
    )
    md = (out / "emoji.md").read_text()
    assert md.startswith("| prompts | knowledge |") and FRECHET_LABEL in md
    assert md.strip() in capsys.readouterr().out


@pytest.mark.slow  # the tiny_judge fixture trains 200 steps (~2 min on a busy 2-core CPU)
def test_bad_flags_are_named(tmp_path, emoji_folder, tiny_judge, capsys):
    judge_dir, _ = tiny_judge
    base = [
        "eval",
        "emoji",
        "--data",
        str(emoji_folder),
        "--judge",
        str(judge_dir),
        "--out",
        str(tmp_path / "r"),
    ]
    assert main([*base, "--splits", "seen,sene"]) == 2
    assert "unknown split 'sene'" in capsys.readouterr().err
    assert main([*base, "--modes", "on,of"]) == 2
    assert "unknown mode 'of'" in capsys.readouterr().err
