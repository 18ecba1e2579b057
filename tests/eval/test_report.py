"""eval report: one self-contained page with the metrics and the samples, rendered by chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

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


@pytest.fixture
def report_run(tmp_path):
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
    write_json(
        root / "metrics" / "knowledge.json",
        metric_record(
            "knowledge",
            "kshapes accuracy",
            50.0,
            table=[{"split": "heldout", "knowledge": "on", "both": 50.0}],
            warnings=[],
        ),
    )
    recall = tmp_path / "recall.json"  # the format `eval recall --out` writes
    recall.write_text(json.dumps({"text_to_image": {"R@1": 40.0}, "mean_recall": 55.5, "model": "m"}))
    return root, recall


def test_report_is_self_contained_and_complete(report_run, tmp_path):
    root, recall = report_run
    assert main(["eval", "report", str(root), "--metrics", str(recall), "--thumb", "32"]) == 0
    page = (root / "report.html").read_text(encoding="utf-8")
    assert len(re.findall(r"<img src='data:image/png;base64,", page)) == 6 + 6
    assert not re.search(r"(src|href)=['\"]?(https?:|//|file:)", page)  # nothing fetched from anywhere
    for needle in (
        "FID-CLIP(rapiddiff image tower)",
        "12.5",
        "only 6 images",
        "torch-fidelity",
        "text_to_image.R@1",
        "mean_recall",
        "55.5",
        "heldout",
        "knowledge_off",
        "sample_size",
        "米色背景上有一个" + ENTITIES[0].name,
    ):
        assert needle in page, needle
    # Sub-runs with one prompt list are shown side by side: 3 prompts × (2 + 2) images, 32 px, gaps.
    assert "<th colspan='3'>knowledge_off</th><th colspan='3'>knowledge_on</th>" in page
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


@pytest.mark.skipif(
    _chromium() is None, reason="chromium is not installed: `apt-get install -y chromium` (CI installs it)"
)
def test_report_renders_its_images_in_chromium(report_run, tmp_path):
    root, _ = report_run
    assert main(["eval", "report", str(root), "--thumb", "32"]) == 0
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
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        "--virtual-time-budget=5000",
        "--dump-dom",
        (root / "report.html").resolve().as_uri(),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    # The page's own script counts images the browser decoded (naturalWidth > 0) after load.
    found = re.search(r'data-images-loaded="(\d+)/(\d+)"', result.stdout)
    assert found, result.stdout[:500]
    assert found.group(1) == found.group(2) == "12"
