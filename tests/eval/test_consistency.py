"""Render consistency: kshapes renders score high against their re-render; degraded copies lower."""

from __future__ import annotations

import json

import numpy as np
from PIL import Image, ImageFilter

from rapiddiff.data.kshapes import BACKGROUNDS, ShapeSpec, detect_attributes, render
from rapiddiff.eval.consistency import psnr, render_consistency, rerender, rerender_spec, ssim, write_grid

SPECS = [
    ShapeSpec("三角形", "红色", "浅蓝色", 0.23, 0.52, scale=0.95, colour_shift=(4, -3, 2)),
    ShapeSpec("星形", "黄色", "深蓝色", 0.5, 0.47, scale=1.08),
    ShapeSpec("长条形", "绿色", "米色", 0.77, 0.55, scale=1.0, background_shift=(2, -1, 3)),
    ShapeSpec("圆形", "白色", "灰色", 0.49, 0.5, scale=0.9),
]


def test_a_render_scores_high_and_a_blurred_or_off_colour_copy_lower():
    for spec in SPECS:
        image = render(spec, 128)
        clean = render_consistency(image, detect_attributes(image))
        assert clean["rerender"]["shape"] == spec.shape and clean["rerender"]["colour"] == spec.colour
        assert abs(clean["rerender"]["scale"] - spec.scale) < 0.05
        assert clean["psnr"] > 30 and clean["ssim"] > 0.98, (spec, clean)
        blurred = image.filter(ImageFilter.GaussianBlur(2.5))
        soft = render_consistency(blurred, detect_attributes(blurred))
        assert soft["psnr"] < clean["psnr"] - 3 and soft["ssim"] < clean["ssim"], (spec, soft)
        # Specks and a mottled background (what the shipped model draws) cost too.
        rng = np.random.default_rng(0)
        noisy = np.asarray(image, np.float32) + rng.normal(0, 12, (128, 128, 3))
        mottled = Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))
        assert render_consistency(mottled, detect_attributes(mottled))["ssim"] < clean["ssim"] - 0.05


def test_psnr_and_ssim_of_identical_and_different_images():
    a = render(SPECS[0], 64)
    assert psnr(a, a) == 100.0 and abs(ssim(a, a) - 1.0) < 1e-6
    b = Image.new("RGB", (64, 64), BACKGROUNDS["浅蓝色"][0])
    x = np.asarray(a, np.float64) / 255
    y = np.asarray(b, np.float64) / 255
    assert abs(psnr(a, b) - 10 * np.log10(1 / np.mean((x - y) ** 2))) < 1e-9
    assert ssim(a, b) < 0.95


def test_no_object_re_renders_the_background_and_the_grid_pairs_images(tmp_path):
    plain = Image.new("RGB", (64, 64), BACKGROUNDS["粉色"][0])
    found = detect_attributes(plain)
    spec = rerender_spec(found)
    assert spec == {"background": "粉色", "shape": None}
    assert np.array_equal(np.asarray(rerender(spec, (64, 64))), np.asarray(plain))
    assert render_consistency(plain, found)["psnr"] == 100.0
    assert render_consistency(plain, {"colour": "红色"}) == {"psnr": None, "ssim": None, "rerender": None}

    run = tmp_path / "run"
    (run / "images").mkdir(parents=True)
    records = []
    for k, s in enumerate(SPECS):
        render(s, 64).save(run / "images" / f"{k}.png")
        found = detect_attributes(render(s, 64))
        records.append({"file": f"images/{k}.png", "split": "seen" if k < 3 else "attribute",
                        **render_consistency(render(s, 64), found)})  # fmt: skip
    json.dumps(records)  # what detections.jsonl holds must be JSON
    grid = write_grid({"on": run}, {"on": records}, tmp_path / "grid.png", per_group=2)
    with Image.open(grid) as im:
        # Two rows (seen, attribute), each up to 2 pairs of 64-px tiles beside a label strip.
        assert im.size == (110 + 2 * (2 * 64 + 6), 2 * (64 + 6))
        row = np.asarray(im.convert("RGB"))[:64, 110 : 110 + 128]
    assert np.abs(row[:, :64].astype(int) - np.asarray(render(SPECS[0], 64), int)).max() == 0
    assert write_grid({"on": run}, {"on": [{**records[0], "rerender": None}]}, tmp_path / "g2.png") is None


def test_ssim_agrees_with_torchmetrics():
    import torch
    from torchmetrics.functional.image import structural_similarity_index_measure

    def tensor(image):
        return torch.from_numpy(np.asarray(image, np.float32) / 255).permute(2, 0, 1)[None]

    a = render(SPECS[1], 96)
    rng = np.random.default_rng(1)
    noisy = Image.fromarray(
        np.clip(np.asarray(a, float) + rng.normal(0, 20, (96, 96, 3)), 0, 255).astype(np.uint8)
    )
    for b in (a.filter(ImageFilter.GaussianBlur(2)), noisy, render(SPECS[0], 96)):
        want = float(structural_similarity_index_measure(tensor(b), tensor(a), data_range=1.0))
        assert abs(ssim(b, a) - want) < 1e-3, (ssim(b, a), want)
