"""Tiny npm package folders in the real formats of emoji-datasource, CLDR and emojibase."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

# (unified, category, subcategory, zh tts, zh keywords, zh-Hant tts or None)
EMOJI = [
    ("1F345", "Food & Drink", "food-fruit", "西红柿", ["水果", "番茄", "蔬菜", "西红柿"], "番茄"),
    ("1F34E", "Food & Drink", "food-fruit", "红苹果", ["水果", "苹果"], "紅蘋果"),
    ("1F34C", "Food & Drink", "food-fruit", "香蕉", ["水果", "芭蕉", "上"], None),
    ("1F347", "Food & Drink", "food-fruit", "葡萄", ["水果", "提子", "上"], None),
    ("1F349", "Food & Drink", "food-fruit", "西瓜", ["水果", "瓜"], None),
    ("1F34B", "Food & Drink", "food-fruit", "柠檬", ["水果", "酸"], "檸檬"),
    ("1F373", "Food & Drink", "food-prepared", "煎蛋", ["煎", "早餐"], None),
    ("1F35E", "Food & Drink", "food-prepared", "面包", ["早餐", "吐司"], "麵包"),
    ("1F950", "Food & Drink", "food-prepared", "羊角面包", ["早餐", "可颂"], "可頌"),
    ("1F43C", "Animals & Nature", "animal-mammal", "熊猫", ["猫熊", "胖达", "熊猫"], "熊貓"),
    ("1F436", "Animals & Nature", "animal-mammal", "狗脸", ["宠物", "汪星人"], "狗臉"),
    ("1F431", "Animals & Nature", "animal-mammal", "猫脸", ["宠物", "喵星人"], "貓臉"),
    ("1F42D", "Animals & Nature", "animal-mammal", "老鼠头", ["宠物", "耗子"], None),
    ("1F430", "Animals & Nature", "animal-mammal", "兔子脸", ["宠物", "小白兔"], None),
    ("1F468", "People & Body", "person", "男人", ["男", "成人"], None),
    ("1F469", "People & Body", "person", "女人", ["女", "成人"], None),
    ("1F468-200D-1F373", "People & Body", "person-role", "男厨师", ["男", "大厨", "厨师"], "男廚師"),
    ("1F469-200D-1F373", "People & Body", "person-role", "女厨师", ["女", "大厨", "厨师"], "女廚師"),
    ("1F642", "Smileys & Emotion", "face-smiling", "笑脸", ["微笑", "开心"], None),
    ("1F600", "Smileys & Emotion", "face-smiling", "嘿嘿", ["开心", "大笑"], "笑臉"),  # → 笑脸 normalised
    ("1F1E8-1F1F3", "Flags", "country-flag", None, None, None),  # derived: 旗: 中国
    ("1F1EF-1F1F5", "Flags", "country-flag", None, None, None),  # derived: 旗: 日本
    ("1F1EB-1F1F7", "Flags", "country-flag", None, None, None),  # derived: 旗: 法国
]
FLAGS = {"1F1E8-1F1F3": ("中国", "中國"), "1F1EF-1F1F5": ("日本", "日本"), "1F1EB-1F1F7": ("法国", "法國")}
CORRUPT = ("twitter", "1f34b")  # 🍋's Twemoji image is not a PNG: skipped, and 🍋 dropped (one style)
MALFORMED = "1F34C"  # 🍌's zh-Hant entry has a tts that is no list


def char(unified: str) -> str:
    return "".join(chr(int(p, 16)) for p in unified.split("-"))


def _write(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def _package(root: Path, name: str) -> Path:
    folder = root / f"{name}-1.0.0" / "package"
    _write(folder / "package.json", {"name": name, "version": "1.0.0"})
    (folder / "LICENSE").write_text(f"licence of {name}\n", encoding="utf-8")
    return folder


def _entries() -> list[dict]:
    entries = []
    for order, (unified, category, subcategory, *_rest) in enumerate(EMOJI):
        entry = {"name": unified, "unified": unified, "non_qualified": None, "image": f"{unified.lower()}.png",
                 "category": category, "subcategory": subcategory, "sort_order": order,
                 "has_img_google": True, "has_img_twitter": True}  # fmt: skip
        if unified == "1F468":
            entry["skin_variations"] = {"1F3FB": {"unified": "1F468-1F3FB", "image": "1f468-1f3fb.png"}}
        entries.append(entry)
    entries.append({"name": "SKIN", "unified": "1F3FB", "image": "1f3fb.png", "category": "Component",
                    "subcategory": "skin-tone", "sort_order": 99, "has_img_google": True, "has_img_twitter": True})  # fmt: skip
    return entries


def _images(folder: Path, style: str) -> None:
    for i, (unified, *_rest) in enumerate([*EMOJI, ("1F3FB",)]):
        path = folder / "img" / style / "64" / f"{unified.lower()}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        if (style, unified.lower()) == CORRUPT:
            path.write_bytes(b"not a png at all")
            continue
        colour = (40 + 9 * i, 200 - 7 * i, 90 if style == "google" else 180, 255)
        Image.new("RGBA", (64, 64), colour).save(path)


def _annotations(locale: str) -> tuple[dict, dict]:
    base, derived = {}, {}
    for unified, _c, _s, zh, keywords, hant in EMOJI:
        if unified in FLAGS:
            region = FLAGS[unified][0 if locale == "zh" else 1]
            derived[char(unified)] = {
                "default": ["旗"],
                "tts": [f"旗: {region}" if locale == "zh" else f"旗子：{region}"],
            }
            continue
        if locale == "zh":
            base[char(unified)] = {"default": keywords, "tts": [zh]}
        elif hant:
            base[char(unified)] = {"default": [hant], "tts": [hant]}
    if locale == "zh-Hant":
        base[char(MALFORMED)] = {"default": ["芭蕉"], "tts": "香蕉"}
    return base, derived


def make_packages(root: Path) -> Path:
    """Write the six packages under ``root`` (as ``NAME-1.0.0/package/`` folders); returns ``root``."""
    for style in ("google", "twitter"):
        folder = _package(root, f"emoji-datasource-{style}")
        _write(folder / "emoji.json", _entries())
        _images(folder, style)
    full, derived = _package(root, "cldr-annotations-full"), _package(root, "cldr-annotations-derived-full")
    for locale in ("zh", "zh-Hant"):
        base, more = _annotations(locale)
        _write(
            full / "annotations" / locale / "annotations.json",
            {"annotations": {"identity": {}, "annotations": base}},
        )
        _write(derived / "annotationsDerived" / locale / "annotations.json",
               {"annotationsDerived": {"identity": {}, "annotations": more}})  # fmt: skip
    labels = {"animals_nature": "动物与自然", "food_drink": "饮食", "flags": "旗帜"}
    _write(_package(root, "cldr-misc-full") / "main" / "zh" / "characterLabels.json",
           {"main": {"zh": {"characterLabels": labels}}})  # fmt: skip
    subgroups = [{"key": k, "message": v, "order": i} for i, (k, v) in enumerate(
        {"food-fruit": "水果", "food-prepared": "熟食", "animal-mammal": "哺乳动物", "person": "人",
         "person-role": "职业", "country-flag": "国旗"}.items())]  # fmt: skip
    groups = [{"key": "people-body", "message": "人体", "order": 1}]
    _write(
        _package(root, "emojibase-data") / "zh" / "messages.json", {"groups": groups, "subgroups": subgroups}
    )
    return root


# The SVG packages (Iconify JSON) of the hr/ copies: every glyph a 16-unit square of its PNG's colour,
# except NO_SVG (absent, as Noto's flags are) and REDESIGNED (another colour: not the PNG's artwork).
NO_SVG = ("google", "1f1e8-1f1f3")
REDESIGNED = ("google", "1f436")
ICONIFY = {"google": "@iconify-json/noto", "twitter": "@iconify-json/twemoji"}


def make_svg_packages(root: Path) -> Path:
    """Write @iconify-json/noto and @iconify-json/twemoji folders under ``root``; returns ``root``."""
    for style, name in ICONIFY.items():
        folder = root / f"{name.lstrip('@').replace('/', '-')}-1.0.0" / "package"
        _write(folder / "package.json", {"name": name, "version": "1.0.0"})
        _write(folder / "info.json", {"name": name, "author": {"name": "someone", "url": "https://example.org"},
               "license": {"title": "CC BY 4.0", "spdx": "CC-BY-4.0", "url": "https://example.org/l"}})  # fmt: skip
        icons, chars = {}, {}
        for i, (unified, *_rest) in enumerate(EMOJI):
            ident = unified.lower()
            if (style, ident) == NO_SVG:
                continue
            r, g, b = 40 + 9 * i, 200 - 7 * i, 90 if style == "google" else 180
            if (style, ident) == REDESIGNED:
                r, g, b = 255 - r, 255 - g, 255 - b
            icons[f"icon-{ident}"] = {"body": f'<rect width="16" height="16" fill="#{r:02x}{g:02x}{b:02x}"/>'}
            chars[ident] = f"icon-{ident}"
        _write(folder / "icons.json", {"prefix": style, "icons": icons, "width": 16, "height": 16})
        _write(folder / "chars.json", chars)
    return root
