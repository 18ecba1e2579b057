"""The eval tests use the shared tiny-model fixtures of tests/conftest.py (tiny_model, tiny_pipe, knowledge_model)."""

import json

import pytest

EMOJI_SHADES = {"浅蓝色": (170, 200, 235), "深绿色": (22, 72, 44), "米色": (232, 220, 188)}
EMOJI_POSITIONS = {"左边": (0.25, 0.5), "中间": (0.5, 0.5), "右边": (0.75, 0.5)}
EMOJI_SHAPES = ("circle", "square", "triangle")
EMOJI_COLOURS = {"red": (220, 40, 40), "blue": (40, 80, 220)}


def draw_glyph(shape: str, colour: tuple[int, int, int], style: str, size: int = 32):
    """A synthetic "emoji": a coloured shape on transparency; style b outlines it and tints it."""
    from PIL import Image, ImageDraw

    image = Image.new("RGBA", (size, size), (0, 0, 0, 0))
    draw = ImageDraw.Draw(image)
    fill = colour if style == "a" else tuple(min(255, c + 30) for c in colour)
    outline, width = ((0, 0, 0), 2) if style == "b" else (None, 0)
    box = (3, 3, size - 4, size - 4)
    if shape == "circle":
        draw.ellipse(box, fill=fill, outline=outline, width=width)
    elif shape == "square":
        draw.rectangle(box, fill=fill, outline=outline, width=width)
    else:
        draw.polygon(
            [(size / 2, 3), (size - 4, size - 4), (3, size - 4)], fill=fill, outline=outline, width=width
        )
    return image


def compose(
    glyph, shade: tuple[int, int, int], centre: tuple[float, float], size: int = 64, side: float = 0.4
):
    """The glyph pasted at ``centre`` (fractions) on a solid ``shade``: a builder-like training image."""
    from PIL import Image

    canvas = Image.new("RGB", (size, size), shade)
    px = round(side * size)
    small = glyph.resize((px, px))
    canvas.paste(small, (round(centre[0] * size - px / 2), round(centre[1] * size - px / 2)), small)
    return canvas


@pytest.fixture(scope="session")
def emoji_folder(tmp_path_factory):
    """A tiny data folder in `rapiddiff data emoji`'s layout: 6 synthetic entities (shape × colour, the
    shape their subcategory) in two styles, splits, alias prompts, and builder-like training images."""
    root = tmp_path_factory.mktemp("emoji")
    entities = []
    for k, (shape, (_name, rgb)) in enumerate((s, c) for s in EMOJI_SHAPES for c in EMOJI_COLOURS.items()):
        entity = f"e{k}"
        split = "seen" if k < 4 else ("heldout" if k == 4 else "val")
        entities.append({"id": entity, "char": "?", "zh": f"物{k}", "zh_hant": f"物{k}甲", "keywords": [],
                         "unique_keywords": [], "category": "形", "subcategory": shape, "category_zh": "形",
                         "subcategory_zh": shape, "split": split, "styles": ["a", "b"]})  # fmt: skip
        for style in ("a", "b"):
            (root / "glyphs" / style).mkdir(parents=True, exist_ok=True)
            draw_glyph(shape, rgb, style).save(root / "glyphs" / style / f"{entity}.png")
    (root / "entities.jsonl").write_text("".join(json.dumps(e, ensure_ascii=False) + "\n" for e in entities))
    splits = {
        "seen": ["e0", "e1", "e2", "e3"], "heldout": ["e4"], "val": ["e5"],
        "alias_prompts": [{"id": "e0", "name": "物0甲", "kind": "zh_hant"}, {"id": "e1", "name": "关键一", "kind": "keyword"}],
    }  # fmt: skip
    (root / "splits.json").write_text(json.dumps(splits, ensure_ascii=False))
    (root / "images").mkdir()
    rows = []
    for k, entity in enumerate(splits["seen"]):
        e = entities[int(entity[1:])]
        for j, (bg, shade) in enumerate(EMOJI_SHADES.items()):
            pos = list(EMOJI_POSITIONS)[(k + j) % 3]
            name = f"images/{entity}_{j}.png"
            glyph = draw_glyph(e["subcategory"], EMOJI_COLOURS[("red", "blue")[int(entity[1:]) % 2]], "a")
            compose(glyph, shade, EMOJI_POSITIONS[pos]).save(root / name)
            rows.append({"file_name": name, "text": f"{bg}背景的{pos}有一个{e['zh']}", "entity": entity,
                         "style": "a", "background": bg, "position": pos})  # fmt: skip
    (root / "metadata.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return root


@pytest.fixture(scope="session")
def tiny_judge(emoji_folder, tmp_path_factory):
    """A judge trained for a few seconds on the fixture folder (arch tiny, 32²)."""
    from rapiddiff.eval.judge import TrainSettings, train_judge

    out = tmp_path_factory.mktemp("judge") / "judge"
    settings = TrainSettings(epochs=800, batch_size=48, lr=3e-3, test_renders=8)
    figures = train_judge(emoji_folder, out, settings, arch="tiny", input_size=32, device="cpu")
    return out, figures
