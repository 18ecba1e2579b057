"""ImageTextDataset on every supported form, with corrupt files, odd modes, EXIF and bad captions."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from rapiddiff.data.images import BadImageError, load_rgb
from rapiddiff.data.loader import (
    ImageTextDataConfig,
    ImageTextDataset,
    StreamingImageTextDataset,
    collate_image_text,
    load_image_text_dataset,
)
from rapiddiff.data.text import clean_caption

SIZE = 16
RED = (200, 40, 40)


def _png(image: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kw)
    return buffer.getvalue()


def _value(rgb) -> torch.Tensor:
    return torch.tensor(rgb, dtype=torch.float32) / 127.5 - 1.0


def _odd_images() -> dict[str, tuple[bytes, tuple[int, int, int]]]:
    """name → (encoded file, the RGB the loader must produce)."""
    rgba = Image.new("RGBA", (24, 24), (0, 0, 255, 0))  # fully transparent → white
    grey = Image.new("L", (24, 24), 90)
    palette = Image.new("RGB", (24, 24), RED).convert("P", palette=Image.Palette.ADAPTIVE)
    cmyk = Image.new("CMYK", (24, 24), (0, 255, 255, 0))  # pure red in naive CMYK
    deep = Image.fromarray(np.full((24, 24), 32896, dtype=np.uint16))  # 16-bit grey → 128
    assert deep.mode.startswith("I;16")
    return {
        "rgb.png": (_png(Image.new("RGB", (24, 24), RED)), RED),
        "rgba.png": (_png(rgba), (255, 255, 255)),
        "grey.png": (_png(grey), (90, 90, 90)),
        "palette.png": (_png(palette), RED),
        "cmyk.tif": (_png(cmyk, "TIFF"), (255, 0, 0)),
        "deep.png": (_png(deep), (128, 128, 128)),
    }


def _truncated() -> bytes:
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    data = _png(noise)
    return data[: len(data) // 2]


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """An imagefolder: six odd modes + EXIF-rotated JPEG, and one item of each kind of bad data."""
    root = tmp_path / "folder"
    (root / "img").mkdir(parents=True)
    rows = []
    for name, (data, _) in _odd_images().items():
        (root / "img" / name).write_bytes(data)
        rows.append({"file_name": f"img/{name}", "text": f"一张  {name}"})
    (root / "img" / "truncated.png").write_bytes(_truncated())
    (root / "img" / "garbage.png").write_bytes(b"this is not an image at all")
    (root / "img" / "tiny.png").write_bytes(_png(Image.new("RGB", (8, 8), RED)))
    rows += [
        {"file_name": "img/truncated.png", "text": "截断的文件"},
        {"file_name": "img/garbage.png", "text": "坏文件"},
        {"file_name": "img/missing.png", "text": "不存在的文件"},
        {"file_name": "img/rgb.png", "text": "   "},
        {"file_name": "img/rgb.png", "text": None},
        {"file_name": "img/rgb.png"},
        {"file_name": "img/tiny.png", "text": "小图"},
        {"file_name": "img/rotated.jpg", "text": "旋转的图"},
    ]
    (root / "img" / "rotated.jpg").write_bytes(_rotated_jpeg())
    with (root / "metadata.jsonl").open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    return root


def test_clean_caption():
    assert clean_caption("  一个  番茄 \n在 桌上 ") == "一个番茄在桌上"
    assert clean_caption("ＡＢＣ１２３，好吃！") == "ABC123，好吃！"
    assert clean_caption("a  photo\u200b of 猫") == "a photo of 猫"
    assert clean_caption("這是一個蘋果", t2s=True) == "这是一个苹果"
    assert clean_caption("這是一個蘋果") == "這是一個蘋果"
    assert clean_caption(None) == clean_caption(" \t ") == ""


@pytest.mark.parametrize("name", list(_odd_images()))
def test_odd_modes_become_rgb(tmp_path, name):
    data, expected = _odd_images()[name]
    (tmp_path / name).write_bytes(data)
    image = load_rgb(name, tmp_path)
    assert image.mode == "RGB"
    np.testing.assert_allclose(np.asarray(image)[12, 12], expected, atol=2)


def _rotated_jpeg() -> bytes:
    """40×20 stored, left half red, right half blue; EXIF orientation 6 = "rotate 90° clockwise
    to view", so the viewed image is 20×40 with red on top."""
    image = Image.new("RGB", (40, 20), (255, 0, 0))
    image.paste((0, 0, 255), (20, 0, 40, 20))
    exif = Image.Exif()
    exif[0x0112] = 6
    return _png(image, "JPEG", exif=exif.tobytes(), quality=95)


def test_exif_orientation_is_applied(tmp_path):
    (tmp_path / "r.jpg").write_bytes(_rotated_jpeg())
    loaded = np.asarray(load_rgb("r.jpg", tmp_path)).astype(int)
    assert loaded.shape == (40, 20, 3)  # portrait now
    assert loaded[5, 10, 0] > 200 and loaded[5, 10, 2] < 60  # red on top
    assert loaded[35, 10, 2] > 200 and loaded[35, 10, 0] < 60  # blue below


def test_imagefolder_skips_and_counts_bad_items(folder, tmp_path):
    log = tmp_path / "skipped.jsonl"
    ds = ImageTextDataset(folder, image_size=SIZE, skip_log=log)
    # truncated.png has a valid header: with verify="header" it is found only when decoded.
    assert len(ds) == 6 + 1 + 1 + 1  # odd modes, truncated (not yet known), tiny (upscaled), rotated
    reasons = [reason for _, reason in ds.skipped]
    assert len(reasons) == 5
    assert sum(r == "empty caption" for r in reasons) == 3
    assert any(r.startswith("missing file") for r in reasons)
    assert any(r.startswith("not an image") for r in reasons)
    expected = {f"一张 {n}": rgb for n, (_, rgb) in _odd_images().items()}
    texts, checked = [], 0
    for i in range(len(ds)):
        item = ds[i]
        assert item["pixel_values"].shape == (3, SIZE, SIZE)
        assert item["pixel_values"].dtype == torch.float32
        assert item["pixel_values"].min() >= -1.0 and item["pixel_values"].max() <= 1.0
        texts.append(item["text"])
        if item["text"] in expected:
            centre = item["pixel_values"][:, SIZE // 2, SIZE // 2]
            torch.testing.assert_close(centre, _value(expected[item["text"]]), atol=0.02, rtol=0)
            checked += 1
    assert checked == len(expected)
    rotated = next(ds[i] for i in range(len(ds)) if ds[i]["text"] == "旋转的图")["pixel_values"]
    # Portrait after EXIF: resized to 16×32 and centre-cropped, red above blue.
    torch.testing.assert_close(rotated[:, 2, 8], _value((255, 0, 0)), atol=0.1, rtol=0)
    torch.testing.assert_close(rotated[:, 13, 8], _value((0, 0, 255)), atol=0.1, rtol=0)
    # The truncated file was replaced by the next good item and recorded as skipped.
    assert "截断的文件" not in texts
    assert any("truncated" in r or "corrupt" in r for _, r in ds.skipped)
    logged = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
    assert len(logged) == len(ds.skipped) == 6
    assert {row["row"] for row in logged} == {6, 7, 8, 9, 10, 11}
    assert all("reason" in row for row in logged)


def test_full_verification_and_skipping_small_images(folder):
    ds = ImageTextDataset(folder, image_size=SIZE, verify="full", small_images="skip")
    reasons = [reason for _, reason in ds.skipped]
    assert len(ds) == 7
    assert any(r.startswith("corrupt or truncated") for r in reasons)
    assert any(r.startswith("image too small (8x8") for r in reasons)
    assert sorted(ds[i]["index"] for i in range(len(ds))) == [*range(6), 13]


def _write_table_images(root: Path) -> list[tuple[str, bytes]]:
    (root / "imgs").mkdir(parents=True)
    out = []
    for i, colour in enumerate([(255, 0, 0), (0, 255, 0), (0, 0, 255)]):
        data = _png(Image.new("RGB", (20, 30), colour))
        (root / "imgs" / f"{i}.png").write_bytes(data)
        out.append((f"imgs/{i}.png", data))
    return out


def _check_three(ds, colours=((255, 0, 0), (0, 255, 0), (0, 0, 255))):
    assert len(ds) == len(colours)
    for i, colour in enumerate(colours):
        item = ds[i]
        assert item["pixel_values"].shape == (3, SIZE, SIZE)
        torch.testing.assert_close(item["pixel_values"][:, 4, 4], _value(colour), atol=0.01, rtol=0)


def test_csv_and_tsv_with_relative_paths_and_custom_columns(tmp_path):
    images = _write_table_images(tmp_path)
    lines = ["caption,path"] + [f"图片 {i}号,{p}" for i, (p, _) in enumerate(images)] + [",imgs/0.png"]
    (tmp_path / "data.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    ds = ImageTextDataset(tmp_path / "data.csv", image_size=SIZE, image_column="path", text_column="caption")
    _check_three(ds)
    assert ds[0]["text"] == "图片 0号" and ds.skipped[0][1] == "empty caption"
    # TSV: quote marks in captions must survive (no CSV quoting in TSV).
    lines = ["image\ttext"] + [f'{p}\t"引号"里的图{i}' for i, (p, _) in enumerate(images)]
    (tmp_path / "data.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    ds = ImageTextDataset(tmp_path / "data.tsv", image_size=SIZE)
    _check_three(ds)
    assert ds[2]["text"] == '"引号"里的图2'


def test_headerless_tsv_with_urlsafe_base64_like_chinese_clip(tmp_path):
    images = _write_table_images(tmp_path)
    lines = [f"{i}\t{base64.urlsafe_b64encode(data).decode()}\t图{i}" for i, (_, data) in enumerate(images)]
    lines.append(f"9\t{base64.b64encode(b'garbage' * 100).decode()}\t坏的")
    (tmp_path / "imgs.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    ds = ImageTextDataset(tmp_path / "imgs.tsv", image_size=SIZE, column_names=["image_id", "image", "text"])
    _check_three(ds)
    assert [r for _, r in ds.skipped] == ["not an image file (unidentified format)"]
    assert ds.skipped[0][0]["image"].startswith("<base64")


def test_jsonl_with_base64_and_parquet_with_bytes_and_image_structs(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    images = _write_table_images(tmp_path)
    rows = [{"image": base64.b64encode(d).decode(), "text": f"图{i}"} for i, (_, d) in enumerate(images)]
    rows.append({"image": None, "text": "没有图"})
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    ds = ImageTextDataset(tmp_path / "d.jsonl", image_size=SIZE)
    _check_three(ds)
    assert ds.skipped[0][1] == "no image (empty cell)"

    table = pa.table({"img": [d for _, d in images], "text": ["a", "b", "c"]})
    pq.write_table(table, tmp_path / "bytes.parquet")
    _check_three(ImageTextDataset(tmp_path / "bytes.parquet", image_size=SIZE, image_column="img"))

    structs = [{"bytes": d, "path": None} for _, d in images[:2]] + [{"bytes": None, "path": images[2][0]}]
    pq.write_table(pa.table({"image": structs, "text": ["a", "b", "c"]}), tmp_path / "structs.parquet")
    _check_three(ImageTextDataset(tmp_path / "structs.parquet", image_size=SIZE))


def test_streaming_shards_with_workers_yield_every_good_row_once(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "shards").mkdir()
    n_good = 0
    for shard in range(2):
        data, texts = [], []
        for i in range(5):
            bad = i == 4
            value = (shard * 10 + i) * 5
            data.append(b"broken" if bad else _png(Image.new("RGB", (20, 20), (value, value, value))))
            texts.append(f"第{shard}片第{i}张")
            n_good += not bad
        pq.write_table(pa.table({"image": data, "text": texts}), tmp_path / "shards" / f"{shard:03d}.parquet")
    stream = load_image_text_dataset(str(tmp_path / "shards" / "*.parquet"), streaming=True, image_size=SIZE)
    assert isinstance(stream, StreamingImageTextDataset)
    items = list(stream)
    assert len(items) == n_good and len(stream.skipped) == 2
    loader = torch.utils.data.DataLoader(stream, batch_size=3, num_workers=2, collate_fn=collate_image_text)
    texts = [t for batch in loader for t in batch["text"]]
    assert sorted(texts) == sorted(item["text"] for item in items)


def test_entity_annotation_and_tokens_are_computed_once(folder):
    import cn_clip
    from transformers import BertTokenizerFast

    try:
        from rapiddiff.kg.linker import EntityLinker

        linker = EntityLinker({"番茄": 0, "红色": 1}, word_check=False)
    except ImportError:  # pragma: no cover - contract stand-in
        linker = None
    calls = []

    class CountingLinker:
        def link_affirmed(self, text):  # what the dataset links with (negated mentions dropped)
            calls.append(text)
            return linker.link_affirmed(text)

    root = folder.parent / "annot"
    root.mkdir()
    Image.new("RGB", (20, 20), RED).save(root / "a.png")
    captions = ["一个红色的番茄", "什么都没有", "番茄和番茄"]
    (root / "metadata.jsonl").write_text(
        "".join(json.dumps({"file_name": "a.png", "text": t}, ensure_ascii=False) + "\n" for t in captions),
        encoding="utf-8",
    )
    vocab = Path(cn_clip.__file__).parent / "clip" / "vocab.txt"
    tokenizer = BertTokenizerFast(vocab_file=str(vocab))
    ds = ImageTextDataset(root, image_size=SIZE, linker=CountingLinker(), tokenizer=tokenizer, max_length=12)
    for _epoch in range(2):
        items = [ds[i] for i in range(len(ds))]
    assert len(calls) == 3  # linked once, when the dataset was built
    assert items[0]["entities"] == [(2, 4, 1), (5, 7, 0)]
    assert items[1]["entities"] == []
    ids = items[0]["token_entity_ids"]
    assert ids.shape == (12,) and items[0]["input_ids"].shape == (12,)
    # [CLS] 一 个 红 色 的 番 茄 [SEP]: tokens 3-4 are 红色, 6-7 番茄.
    assert ids[:9].tolist() == [-1, -1, -1, 1, 1, -1, 0, 0, -1]
    assert (items[1]["token_entity_ids"] == -1).all()
    batch = collate_image_text(items)
    assert batch["pixel_values"].shape == (3, 3, SIZE, SIZE) and batch["token_entity_ids"].shape == (3, 12)
    assert batch["entities"][2] == [(0, 2, 0), (3, 5, 0)]


def test_config_builds_the_dataset_and_errors_name_the_problem(folder, tmp_path):
    cfg = ImageTextDataConfig(source=str(folder), image_size=SIZE, small_images="skip")
    ds = load_image_text_dataset(cfg)
    assert isinstance(ds, ImageTextDataset) and len(ds) == 8
    with pytest.raises(FileNotFoundError, match=r"metadata\.jsonl"):
        ImageTextDataset(tmp_path, image_size=SIZE)
    with pytest.raises(ValueError, match="no text column 'caption'"):
        ImageTextDataset(folder, image_size=SIZE, text_column="caption")
    (tmp_path / "x.xlsx").write_text("")
    with pytest.raises(ValueError, match="unsupported table format"):
        ImageTextDataset(tmp_path / "x.xlsx")
    with pytest.raises(BadImageError, match="missing file"):
        load_rgb("nope.png", tmp_path)


@pytest.mark.parametrize(
    ("shape", "crop"), [((40, 24), "center"), ((24, 40), "center"), ((16, 16), "center")]
)
def test_transform_matches_torchvision(shape, crop):
    from torchvision import transforms

    from rapiddiff.data.transforms import build_image_transform

    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (*shape[::-1], 3), dtype=np.uint8))
    reference = transforms.Compose(
        [
            transforms.Resize(SIZE, interpolation=transforms.InterpolationMode.BICUBIC, antialias=True),
            transforms.CenterCrop(SIZE),
            transforms.ToTensor(),
            transforms.Normalize([0.5], [0.5]),
        ]
    )
    ours = build_image_transform(SIZE, crop=crop)(image)
    assert ours.shape == (3, SIZE, SIZE) and ours.is_contiguous()
    torch.testing.assert_close(ours, reference(image), atol=1e-5, rtol=0)


def test_random_crop_and_flip_follow_torch_seed():
    from rapiddiff.data.transforms import build_image_transform

    image = Image.fromarray(np.random.default_rng(1).integers(0, 255, (24, 48, 3), dtype=np.uint8))
    transform = build_image_transform(SIZE, crop="random", hflip=True)
    torch.manual_seed(3)
    first = [transform(image) for _ in range(6)]
    torch.manual_seed(3)
    second = [transform(image) for _ in range(6)]
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert len({tuple(t[0, 0, :4].tolist()) for t in first}) > 1  # crops/flips differ between draws


def test_streaming_webdataset_tar_shards_survive_a_corrupt_image(tmp_path):
    import tarfile

    for shard in range(2):
        with tarfile.open(tmp_path / f"{shard:03d}.tar", "w") as tar:
            for i in range(3):
                data = b"broken" if (shard, i) == (1, 1) else _png(Image.new("RGB", (20, 20), RED), "JPEG")
                for name, payload in (
                    (f"{shard}_{i}.jpg", data),
                    (f"{shard}_{i}.txt", f"图{shard}{i}".encode()),
                ):
                    info = tarfile.TarInfo(name)
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
    stream = load_image_text_dataset(tmp_path, streaming=True, image_size=SIZE)
    items = list(stream)
    assert [it["text"] for it in items] == ["图00", "图01", "图02", "图10", "图12"]
    assert [r for _, r in stream.skipped] == ["not an image file (unidentified format)"]
    torch.testing.assert_close(items[0]["pixel_values"][:, 8, 8], _value(RED), atol=0.05, rtol=0)


def test_large_jpegs_decode_at_reduced_scale_with_the_same_result(tmp_path):
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:600, 0:800]
    smooth = np.stack([127 + 100 * np.sin(xx / (60 + 20 * k)) * np.cos(yy / 70) for k in range(3)], -1)
    Image.fromarray(np.clip(smooth + rng.normal(0, 3, smooth.shape), 0, 255).astype(np.uint8)).save(
        tmp_path / "big.jpg", quality=92
    )
    (tmp_path / "metadata.jsonl").write_text('{"file_name": "big.jpg", "text": "大图"}\n', encoding="utf-8")
    fast = ImageTextDataset(tmp_path, image_size=SIZE * 4)
    full = ImageTextDataset(tmp_path, image_size=SIZE * 4, jpeg_draft=False)
    assert fast.load_image(0).size == (100, 75)  # 800×600 decoded at 1/8: still ≥ 64 on both sides
    assert full.load_image(0).size == (800, 600)
    difference = (fast[0]["pixel_values"] - full[0]["pixel_values"]).abs().mean() * 127.5
    assert difference < 3.0  # grey levels
