"""eval report: one self-contained page with the metrics and the samples, rendered by chromium."""

from __future__ import annotations

import base64
import io
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
    assert main(["eval", "report", str(tmp_path / "nope")]) == 2
    assert f"eval run folder not found: {tmp_path / 'nope'}" in capsys.readouterr().err


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


class _Oracle:
    """Draws every prompt with the kshapes renderer, as `eval knowledge` would get it from a model:
    entity prompts right with knowledge on (modes on and both), held-out ones the wrong shape with
    it off; attribute captions at their position, on the wrong background with knowledge off."""

    def __init__(self, prompts):
        from rapiddiff.data.kshapes import LAYOUTS
        from rapiddiff.data.kshapes.palette import compatible_backgrounds

        self.by_text = {p["text"]: p for p in prompts}
        self.centres = {name: (x, y) for name, x, y in LAYOUTS["row3"]}
        self.other_background = lambda p: next(
            b for b in compatible_backgrounds(p["colour"]) if b != p["background"]
        )
        self.text_encoder = self  # the mode switch `--modes both` needs

    def knowledge_as(self, mode):
        import contextlib

        return contextlib.nullcontext(self)

    store = object()

    def __call__(self, prompts, *, seed, knowledge=True, **kwargs):
        from types import SimpleNamespace

        from rapiddiff.data.kshapes import SHAPES

        images = []
        for text in prompts:
            p = self.by_text[text]
            if p["split"] == "attribute":
                background = p["background"] if knowledge else self.other_background(p)
                spec = ShapeSpec(p["shape"], p["colour"], background, *self.centres[p["position"]])
            else:
                shape = p["shape"]
                if not knowledge and p["split"] == "heldout":
                    shape = SHAPES[(SHAPES.index(shape) + 1) % len(SHAPES)]
                spec = ShapeSpec(shape, p["colour"], "浅蓝色", 0.5, 0.5)
            images.append(render(spec, 64))
        return SimpleNamespace(images=images, seeds=list(seed))


@pytest.fixture
def attribute_run(tmp_path):
    """A real `eval knowledge` run (the kshapes detector, render consistency, the grid) with splits
    seen, held-out and attribute and modes on, both and off: the JSON and files as it writes them."""
    from rapiddiff.data.kshapes import KShapesConfig
    from rapiddiff.data.kshapes.generate import attribute_prompts
    from rapiddiff.eval.knowledge import evaluate_knowledge
    from rapiddiff.eval.sample import SampleSettings

    entity = [
        {
            "text": f"浅蓝色背景上有一个{e.name}",
            "entity": e.name,
            "colour": e.colour,
            "shape": e.shape,
            "split": s,
        }
        for e, s in zip(ENTITIES[:2], ("seen", "heldout"), strict=True)
    ]
    prompts = entity + attribute_prompts(KShapesConfig(out=tmp_path / "ks", seed=3))[:3]
    root = tmp_path / "k"
    record = evaluate_knowledge(
        _Oracle(prompts),
        prompts,
        root,
        SampleSettings(model="oracle"),
        modes=("on", "both", "off"),
        workers=0,
    )
    return root, record


def test_report_shows_attribute_split_named_attributes_render_consistency_and_mode_both(attribute_run):
    root, record = attribute_run
    rows = {(r["split"], r["knowledge"]): r for r in record["table"]}
    assert main(["eval", "report", str(root), "--thumb", "32"]) == 0
    page = (root / "report.html").read_text(encoding="utf-8")
    start, end = page.index("<table class='knowledge'>"), page.index("</table>")
    table = page[start:end]
    # The new columns, under their group names, beside colour / shape / both.
    for needle in ("background right", "position right", "all named right", "render PSNR", "render SSIM"):
        assert f"<th>{needle}</th>" in table, needle
    assert "<th colspan='2'>render consistency</th>" in table
    body = {}
    for tr in re.findall(r"<tr>(<td>.*?)</tr>", table):
        cells = re.findall(r"<td[^>]*>(.*?)</td>", tr)
        body[(cells[0], cells[1])] = cells[2:]
    # Attribute captions (3 colour × shape pairs), knowledge off: the wrong background, so
    # background and all named at 0 % (with all named's interval), colour / shape / position right.
    off = body[("attribute captions (3)", "off")]
    assert off[0] == "3"
    assert off[1].startswith("100.0 %<span class='ci'>")
    assert off[4:7] == ["0.0 %", "100.0 %", "0.0 %<span class='ci'>0.0–56.1</span>"]
    on = body[("attribute captions (3)", "on")]
    assert on[4:6] == ["100.0 %", "100.0 %"] and on[6].startswith("100.0 %<span class='ci'>43.9–100.0")
    # Render consistency: the mean PSNR / SSIM as the JSON holds them.
    a_on = rows[("attribute", "on")]
    assert on[7:9] == [f"{a_on['psnr']:.2f} dB", f"{a_on['ssim']:.4f}"] and a_on["psnr"] > 30
    # Mode "both" spelled out so it is not read as the "both right" column; these entity prompts
    # name neither background nor position: "—".
    held_both = body[("held-out (1)", "both (KG facts + vectors)")]
    assert held_both[3].startswith("100.0 %") and held_both[4] == held_both[5] == "—"
    # Lift rows for every knowledge mode over off, the percent columns in points, PSNR in dB.
    assert "<td>both − off</td>" in table and "<td>on − off</td>" in table
    lift = re.search(r"<tr class='lift'><td>attribute captions</td><td>on − off</td>(.*?)</tr>", table).group(
        1
    )
    assert "+100.0 pt" in lift and " dB</td>" in lift
    assert "Render PSNR / SSIM" in page and "scored over the prompts that name them" in page
    # The 'all named' chart beside both / colour / shape.
    plots = page[page.index("id='plots'") : page.index("id='consistency'")]
    assert plots.count("<svg") == 4 and "all named attributes right, %" in plots
    # The consistency grid, embedded and drawn enlarged, between the plots and the samples.
    section = page[page.index("id='consistency'") : page.index("class='samples'")]
    found = re.search(
        r"<img src='data:image/png;base64,([^']+)'( class='pixel')? width='(\d+)' height='(\d+)'", section
    )
    assert found, section[:300]
    with Image.open(root / "render_consistency.png") as grid:
        embedded = Image.open(io.BytesIO(base64.b64decode(found.group(1))))
        assert embedded.size == grid.size  # the grid itself, not a thumbnail
        assert np.array_equal(np.asarray(embedded.convert("RGB")), np.asarray(grid.convert("RGB")))
        shown = int(found.group(3)), int(found.group(4))
        assert grid.width <= shown[0] <= 1256 and shown[0] * grid.height == shown[1] * grid.width
    assert "render_consistency.png" in section
    # Three sample sets side by side; knowledge_off last.
    samples = page[page.index("class='samples'") :]
    assert samples.index("<h4>knowledge_both</h4>") < samples.index("<h4>knowledge_off</h4>")


def test_report_of_an_old_knowledge_json_has_no_new_columns(report_run):
    root, _ = report_run
    assert main(["eval", "report", str(root), "--thumb", "32"]) == 0
    page = (root / "report.html").read_text(encoding="utf-8")
    table = page[page.index("<table class='knowledge'>") : page.index("</table>")]
    assert table.startswith("<table class='knowledge'><tr><th>entities</th>")
    assert table.count("<th>") == 6 and "render" not in table and "class='groups'" not in table
    assert "id='consistency'" not in page and "Render PSNR" not in page


@pytest.mark.skipif(
    _chromium() is None, reason="chromium is not installed: `apt-get install -y chromium` (CI installs it)"
)
def test_report_with_render_consistency_renders_in_chromium(attribute_run, tmp_path):
    root, _ = attribute_run
    assert main(["eval", "report", str(root)]) == 0
    url = (root / "report.html").resolve().as_uri()
    dom = _browse(tmp_path, "--virtual-time-budget=5000", "--dump-dom", url).stdout
    # 5 prompts × 3 sets of samples and the consistency grid, all decoded by the browser.
    found = re.search(r'data-images-loaded="(\d+)/(\d+)"', dom)
    assert found and found.group(1) == found.group(2) == "16", dom[:500]
    assert int(re.search(r'data-min-image-width="(\d+)"', dom).group(1)) >= 256
    sections = re.findall(r"<section (?:id|class)=\"(\w+)\"", dom)
    assert sections[:4] == ["metrics", "plots", "consistency", "samples"], sections
    assert "render consistency" in dom and "attribute captions (3)" in dom


def test_prompt_variants_get_a_row_each_and_plots_keep_the_overall_rows():
    """prompts_robust.jsonl runs tabulate each variant beside the split's overall row; the report
    shows every one (they used to overwrite each other) and plots only the overall rows."""
    from rapiddiff.eval.report import knowledge_html, plots_html

    def row(variant, mode, both):
        r = {"split": "heldout", "knowledge": mode, "images": 10, "entities": 2}
        return {**r, **({"variant": variant} if variant else {}), "colour": 80.0, "shape": 70.0, "both": both}

    rows = [
        row(v, m, b)
        for v, b0 in ((None, 50.0), ("alias", 40.0), ("sentence", 60.0))
        for m, b in (("on", b0), ("off", 10.0))
    ]
    record = {"metric": "knowledge", "table": rows, "_file": "k.json"}
    page = knowledge_html(record)
    for name, both in (
        ("held-out (2)", 50.0),
        ("held-out, alias (2)", 40.0),
        ("held-out, sentence (2)", 60.0),
    ):
        assert re.search(
            rf"<tr><td>{re.escape(name)}</td><td>on</td><td class='num'>10</td>.*?{both:.1f} %", page
        )
    assert page.count("<td>on − off</td>") == 3 and "+30.0 pt" in page and "+50.0 pt" in page
    plots = plots_html([record])
    assert plots.count("class='bar'") == 3 * 2  # one group (held-out), on / off, in 3 charts
    assert "50.0 %" in plots and "40.0 %" not in plots and "60.0 %" not in plots
