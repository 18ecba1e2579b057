"""ControlNet conditioning images: the on-the-fly transforms, the builders' mask column, the dataset."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from rapiddiff.data.control import (
    ControlImageTextDataset,
    canny,
    canny_control,
    control_transform,
    mask_control,
    object_mask,
)
from rapiddiff.data.kshapes import KShapesConfig, ShapeSpec, generate_kshapes, render, render_mask


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    return float((a & b).sum() / max(1, (a | b).sum()))


@pytest.mark.parametrize("shape", ["圆形", "三角形", "星形", "长条形"])
def test_mask_transform_finds_the_drawn_object(shape: str) -> None:
    spec = ShapeSpec(shape, "红色", "浅蓝色", 0.3, 0.6, background_shift=(3, -4, 2))
    image = np.asarray(render(spec, 64))
    coverage = np.asarray(render_mask(spec, 64))
    found = object_mask(image)
    # Pixels mostly covered are the object, pixels mostly not are not (half-covered ones: either).
    assert found[coverage > 160].all() and not found[coverage < 96].any()
    control = mask_control(torch.from_numpy(image.copy()).permute(2, 0, 1).float() / 127.5 - 1)
    assert control.shape == (3, 64, 64) and set(control.unique().tolist()) <= {0.0, 1.0}
    assert torch.equal(control[0].bool(), torch.from_numpy(found))


def test_mask_of_a_flat_image_is_empty_and_holes_are_filled() -> None:
    flat = np.full((32, 32, 3), (170, 200, 235), dtype=np.uint8)
    assert not object_mask(flat).any()
    ring = flat.copy()
    ring[8:24, 8:24] = (215, 35, 35)
    ring[12:20, 12:20] = (170, 200, 235)  # a detail in the background's colour
    assert object_mask(ring)[8:24, 8:24].all()


def test_canny_marks_the_outline_of_a_square_and_nothing_inside_or_out() -> None:
    image = np.zeros((32, 32), dtype=np.float32)
    image[8:24, 8:24] = 255.0
    edges = canny(image)
    outline = np.zeros_like(edges)
    outline[7:25, 7:25] = True
    outline[10:22, 10:22] = False  # a 2-3 pixel band around the square's border
    assert edges.any() and not (edges & ~outline).any()
    assert all(edges[r, 8:24].any() for r in (7, 8, 23, 24)) or edges[:, 8:24].any(axis=0).all()
    assert edges[8:24].any(axis=1).all()  # every row crosses the left or right side
    assert not canny(np.full((16, 16), 90.0)).any()
    control = canny_control(np.stack([image.astype(np.uint8)] * 3, -1))
    assert control.shape == (3, 32, 32) and torch.equal(control[1].bool(), torch.from_numpy(edges))


def test_unknown_transform_names_the_choices_and_the_column_route() -> None:
    with pytest.raises(ValueError, match=r"there are: mask, canny.*data\.control\.column"):
        control_transform("depth")


@pytest.fixture(scope="module")
def kshapes_with_masks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ks") / "k"
    generate_kshapes(KShapesConfig(out=out, size=64, train=8, val=2, test=2, masks=True), progress=False)
    return out


def test_kshapes_masks_column_matches_the_object(kshapes_with_masks: Path) -> None:
    rows = [json.loads(line) for line in (kshapes_with_masks / "train" / "metadata.jsonl").open()]
    assert all(r["mask"] == f"masks/{r['file_name']}" for r in rows)
    for r in rows:
        image = np.asarray(Image.open(kshapes_with_masks / "train" / r["file_name"]).convert("RGB"))
        mask = np.asarray(Image.open(kshapes_with_masks / "train" / r["mask"]))
        assert mask.ndim == 2 and mask.max() == 255 and mask.min() == 0
        assert _iou(mask >= 128, object_mask(image)) > 0.9
    hr_rows = (kshapes_with_masks / "hr" / "train" / "metadata.jsonl").read_text(encoding="utf-8")
    assert '"mask"' not in hr_rows  # no masks at 4×


def test_kshapes_without_masks_writes_the_same_images_and_no_column(
    kshapes_with_masks: Path, tmp_path: Path
) -> None:
    out = tmp_path / "plain"
    generate_kshapes(KShapesConfig(out=out, size=64, train=8, val=2, test=2), progress=False)
    assert not (out / "train" / "masks").exists()
    plain = [json.loads(line) for line in (out / "train" / "metadata.jsonl").open()]
    masked = [json.loads(line) for line in (kshapes_with_masks / "train" / "metadata.jsonl").open()]
    assert plain == [{k: v for k, v in r.items() if k != "mask"} for r in masked]
    for r in plain:
        a = (out / "train" / r["file_name"]).read_bytes()
        assert a == (kshapes_with_masks / "train" / r["file_name"]).read_bytes()


def test_emoji_masks_are_the_pasted_glyph(tmp_path: Path) -> None:
    from rapiddiff.data.emoji import EmojiConfig, build_emoji
    from tests.data.emoji_fakes import make_packages

    out = tmp_path / "emoji"
    cfg = EmojiConfig(
        out=out, packages=[str(make_packages(tmp_path / "pkgs"))], train_per_entity=1, masks=True, size=64
    )
    build_emoji(cfg, progress=False)
    rows = [json.loads(line) for line in (out / "train" / "metadata.jsonl").open()]
    assert rows and all(r["mask"] == f"masks/{r['file_name']}" for r in rows)
    for r in rows:
        image = np.asarray(Image.open(out / "train" / r["file_name"]).convert("RGB")).astype(int)
        inside = np.asarray(Image.open(out / "train" / r["mask"])) >= 128
        background = np.median(image[0], axis=0)
        outside_diff = np.abs(image[~inside] - background).max()
        assert inside.any() and outside_diff <= 8  # outside the mask: the background shade
        assert _iou(inside, object_mask(image.astype(np.uint8))) > 0.8


def test_dataset_reads_a_mask_column_and_skips_a_missing_file(kshapes_with_masks: Path, logs) -> None:
    folder = kshapes_with_masks / "train"
    rows = [json.loads(line) for line in (folder / "metadata.jsonl").open()]
    rows[1]["mask"] = "masks/missing.png"
    table = folder / "broken.jsonl"
    table.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    ds = ControlImageTextDataset(table, control_column="mask", image_size=32)
    assert len(ds) == len(rows) - 1
    [(info, reason)] = ds.skipped
    assert info["line"] == 2 and reason.startswith("conditioning image:") and "missing.png" in reason
    item = ds[0]
    assert item["control"].shape == (3, 32, 32) and 0 <= item["control"].min() < item["control"].max() <= 1
    with pytest.raises(ValueError, match=r"no conditioning column 'edges'.*--masks"):
        ControlImageTextDataset(folder, control_column="edges", image_size=32)


def test_dataset_makes_the_control_from_the_transformed_image_even_without_decoding(
    kshapes_with_masks: Path,
) -> None:
    ds = ControlImageTextDataset(kshapes_with_masks / "train", transform_name="mask", image_size=64)
    item = ds[0]
    assert torch.equal(item["control"], mask_control(item["pixel_values"]))
    ds.decode_images = False  # a cached-latents run
    again = ds[0]
    assert "pixel_values" not in again and torch.equal(again["control"], item["control"])
    with pytest.raises(ValueError, match="centre-cropped and never flipped"):
        ControlImageTextDataset(kshapes_with_masks / "train", control_column="mask", hflip=True)
