"""eval report: one self-contained page with the metrics and the samples, rendered by chromium."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from rapiddiff.cli import main
from rapiddiff.data.kshapes import ENTITIES, ShapeSpec, render
from rapiddiff.eval.common import metric_record, write_json, write_jsonl


def _run(root, name, n_prompts=3, per_prompt=2, size=48):
    run = root / name
    (run / "images").mkdir(parents=True)
    rows = []
    for i, e in enumerate(ENTITIES[:n_prompts]):
        for j in range(per_prompt):
            file = f"images/{i:06d}_s{i * per_prompt + j}.png"
            render(ShapeSpec(e.shape, e.colour, "米色", 0.5, 0.5), size).save(run / file)
            rows.append(
                {
                    "file": file,
                    "prompt": f"米色背景上有一个{e.name}",
                    "seed": i * per_prompt + j,
                    "index": i,
                    "entity": e.name,
                    "split": "seen",
                }
            )
    write_jsonl(run / "index.jsonl", rows)
    write_json(
        run / "sample.json", {"settings": {"steps": 20}, "model_config": {"unet": {"sample_size": 16}}}
    )
    return run


KNOWLEDGE_ROWS = [  # the shape `eval knowledge` writes (accuracy_table)
    {
        "split": "seen",
        "knowledge": "on",
        "images": 40,
        "entities": 10,
        "colour": 90.0,
        "shape": 80.0,
        "both": 75.0,
    },
    {
        "split": "seen",
        "knowledge": "off",
        "images": 40,
        "entities": 10,
        "colour": 85.0,
        "shape": 80.0,
        "both": 70.0,
    },
    {
        "split": "heldout",
        "knowledge": "on",
        "images": 24,
        "entities": 6,
        "colour": 50.0,
        "shape": 45.8,
        "both": 25.0,
    },
    {
        "split": "heldout",
        "knowledge": "off",
        "images": 24,
        "entities": 6,
        "colour": 12.5,
        "shape": 20.8,
        "both": 4.2,
    },
]


@pytest.fixture
def report_run(tmp_path):
    from rapiddiff.eval.knowledge import wilson_interval

    root = tmp_path / "eval"
    _run(root, "knowledge_on")
    _run(root, "knowledge_off")
    write_json(
        root / "metrics" / "fid.json",
        metric_record(
            "fid_clip",
            "FID-CLIP(rapiddiff image tower)",
            12.5,
            warnings=["only 6 images"],
            details={"library": "torch-fidelity", "resize": "bilinear", "n_real": 6, "n_fake": 6},
        ),
    )
    rows = [
        {**r, "both_ci95": list(wilson_interval(round(r["both"] * r["images"] / 100), r["images"]))}
        for r in KNOWLEDGE_ROWS
    ]
    write_json(
        root / "metrics" / "knowledge.json",
        metric_record(
            "knowledge",
            "kshapes attribute accuracy (both, held-out, knowledge on) %",
            25.0,
            table=rows,
            warnings=[],
            details={"chance": {"colour": 12.5, "shape": 100 / 6, "both": 100 / 48}},
        ),
    )
    recall = tmp_path / "recall.json"  # the format `eval recall --out` writes
    recall.write_text(
        json.dumps(
            {
                "text_to_image": {"R@1": 40.0, "R@5": 80.0, "R@10": 95.0, "mean": 71.67},
                "image_to_text": {"R@1": 35.0, "R@5": 75.0, "R@10": 90.0, "mean": 66.67},
                "mean_recall": 69.17,
                "num_text_queries": 20,
                "num_image_queries": 20,
                "knowledge": True,
                "entities": [],
                "model": "m",
            }
        )
    )
    return root, recall


def test_report_puts_results_with_intervals_first_then_plots_and_large_samples(report_run):
    root, recall = report_run
    assert main(["eval", "report", str(root), "--metrics", str(recall), "--thumb", "32"]) == 0
    page = (root / "report.html").read_text(encoding="utf-8")
    assert len(re.findall(r"<img src='data:image/(png|jpeg);base64,", page)) == 6 + 6
    assert not re.search(r"(src|href)=['\"]?(https?:|//|file:)", page)  # nothing fetched from anywhere
    # Order: results, plots, samples, settings.
    positions = [page.index(m) for m in ("id='metrics'", "id='plots'", "class='samples'", "id='settings'")]
    assert positions == sorted(positions)
    assert page.index("<table") < page.index("<img")
    metrics = page[positions[0] : positions[1]]
    # Knowledge on/off × seen/held-out, each accuracy with its 95 % Wilson interval, and the lift.
    assert "held-out (6)" in metrics and "seen (10)" in metrics
    assert "25.0 %<span class='ci'>12.0–44.9</span>" in metrics  # held-out, on, both: 6/24
    assert "50.0 %<span class='ci'>31.4–68.6</span>" in metrics  # held-out, on, colour: 12/24
    assert "+20.8 pt" in metrics  # held-out lift in both
    assert "Chance (uniform guess)" in metrics
    # Recall with intervals over its 20 queries; FID with how it was measured.
    assert "40.0 %<span class='ci'>21.9–61.3</span>" in metrics
    for needle in ("FID-CLIP(rapiddiff image tower)", "12.5", "only 6 images", "torch-fidelity"):
        assert needle in metrics, needle
    # Plots: inline SVG bar charts with interval whiskers and the chance line.
    plots = page[positions[1] : positions[2]]
    assert plots.count("<svg") == 4 and plots.count("class='bar'") == 3 * 4 + 3
    assert "chance 2 %" in plots
    # Samples: knowledge_on beside knowledge_off, drawn at 256 px, enlarged pixel for pixel.
    samples = page[positions[2] : positions[3]]
    assert samples.index("<h4>knowledge_on</h4>") < samples.index("<h4>knowledge_off</h4>")
    assert samples.count("width='256' height='256'") == 12 and "class='pixel'" in samples
    assert "米色背景上有一个" + ENTITIES[0].name in samples
    # Fonts that render Chinese on common systems.
    assert (
        '"Noto Sans CJK SC", "Source Han Sans SC", "PingFang SC", "Microsoft YaHei", "WenQuanYi Micro Hei", sans-serif'
        in page
    )
    assert "sample_size" in page[positions[3] :]
    grid = Image.open(root / "report.png")
    assert grid.size == (4 + 2 * (2 * 36) + 8, 4 + 3 * 36)
    pixels = np.asarray(grid)
    assert pixels[4:36, 4:36].std() > 10  # an image, not the white background


def test_report_without_runs_says_what_to_do(tmp_path, capsys):
    assert main(["eval", "report", str(tmp_path)]) == 2
    assert "eval sample" in capsys.readouterr().err


def _chromium() -> str | None:
    return next(
        (p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None
    )


def _browse(tmp_path, *args: str) -> subprocess.CompletedProcess:
    cmd = [
        _chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        *args,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result


@pytest.mark.skipif(
    _chromium() is None, reason="chromium is not installed: `apt-get install -y chromium` (CI installs it)"
)
def test_report_renders_in_chromium_results_first_and_images_large(report_run, tmp_path):
    root, recall = report_run
    assert main(["eval", "report", str(root), "--metrics", str(recall)]) == 0
    url = (root / "report.html").resolve().as_uri()
    dom = _browse(tmp_path, "--virtual-time-budget=5000", "--dump-dom", url).stdout
    # The page's own script counts images the browser decoded (naturalWidth > 0) after load and
    # the smallest width one is drawn at.
    found = re.search(r'data-images-loaded="(\d+)/(\d+)"', dom)
    assert found, dom[:500]
    assert found.group(1) == found.group(2) == "12"
    assert int(re.search(r'data-min-image-width="(\d+)"', dom).group(1)) >= 256
    # In the rendered DOM the first section after the title is the results table.
    sections = re.findall(r"<section (?:id|class)=\"(\w+)\"", dom)
    assert sections[:3] == ["metrics", "plots", "samples"], sections
    first_table = re.search(r"<table class=\"(\w+)\"", dom).group(1)
    assert first_table == "knowledge"
    # A screenshot as the test's artefact (look at it: tables, bars, Chinese prompts, large images).
    shot = tmp_path / "report-screenshot.png"
    _browse(tmp_path, "--window-size=1400,2200", f"--screenshot={shot}", "--virtual-time-budget=5000", url)
    image = np.asarray(Image.open(shot).convert("RGB"))
    assert image.shape[:2] == (2200, 1400) and image.std() > 20
    artefacts = os.environ.get("RAPIDDIFF_TEST_ARTEFACTS")
    if artefacts:
        Path(artefacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(artefacts) / shot.name)
