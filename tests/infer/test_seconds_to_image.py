"""benchmarks/seconds_to_image.py on the tiny model: two settings (a PNDM reference, 4 steps here, and
one other), the JSON and the markdown table, a pluggable scorer, and a budget that stops early."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCORES: list[dict] = []


def _script():
    spec = importlib.util.spec_from_file_location(
        "seconds_to_image", REPO / "benchmarks" / "seconds_to_image.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_score(model: Path, settings: dict) -> float:
    """A scorer as --scorer MODULE:FUNCTION takes it: (model folder, settings) → score."""
    SCORES.append({"model": model, **settings})
    return float(settings["num_inference_steps"])


def test_two_settings_give_a_table_against_the_reference(tiny_model, tmp_path):
    script = _script()
    SCORES.clear()
    argv = ["--model", str(tiny_model), "--device", "cpu", "--reference-steps", "4", "--samplers", "dpm++", "--steps", "3",
            "--deep-cache", "1", "--seeds", "1", "--prompts", "一只熊猫", "--out", str(tmp_path),
            "--knowledge-eval", "--scorer", f"{__name__}:fake_score"]  # fmt: skip
    assert script.main(argv) == 0
    result = json.loads((tmp_path / "seconds_to_image.json").read_text())
    rows = {(r["sampler"], r["steps"], r["deep_cache"]): r for r in result["rows"]}
    assert list(rows) == [("pndm", 4, 1), ("dpm++", 3, 1)]
    ref, fast = rows["pndm", 4, 1], rows["dpm++", 3, 1]
    assert ref["psnr_db"] == 100.0 and ref["ssim"] > 0.999  # the reference against itself
    assert fast["psnr_db"] < 100.0 and fast["seconds"] > 0
    assert [s["num_inference_steps"] for s in SCORES] == [4, 3] and SCORES[0]["model"] == Path(tiny_model)
    table = (tmp_path / "seconds_to_image.md").read_text()
    assert "| dpm++ | 3 | off |" in table and "| -1.0 |" in table and result["meta"]["path"] == "eager"


def test_a_budget_stops_after_the_reference_and_names_what_it_skipped(tiny_model, tmp_path):
    argv = ["--model", str(tiny_model), "--device", "cpu", "--reference-steps", "4", "--samplers", "ddim", "--steps", "2", "4",
            "--deep-cache", "1", "--seeds", "1", "--prompts", "x", "--budget-s", "0.001", "--out", str(tmp_path)]  # fmt: skip
    assert _script().main(argv) == 0
    result = json.loads((tmp_path / "seconds_to_image.json").read_text())
    assert [r["steps"] for r in result["rows"]] == [4] and result["skipped"] == ["ddim-2-dc1", "ddim-4-dc1"]
    assert "Not run (budget): ddim-2-dc1, ddim-4-dc1" in (tmp_path / "seconds_to_image.md").read_text()
