"""Read the emoji catalogue from the packages: emoji.json entries joined with CLDR's Chinese names.

An entity is an emoji (skin-tone variants and components left out) with a CLDR ``zh`` name and
artwork in every style. Entries that cannot be used are recorded in ``skipped`` (file, key, reason).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rapiddiff.data.emoji.packages import STYLES, Package

SKIN_TONES = {"1f3fb", "1f3fc", "1f3fd", "1f3fe", "1f3ff"}
ZWJ, VS16 = "200d", "fe0f"
FLAG_SUBCATEGORIES = {"country-flag", "subdivision-flag"}
# emoji.json's category names → CLDR characterLabels keys (cldr-misc-full); CLDR has no label for
# the two below, so they take emojibase's zh group message instead.
CLDR_CATEGORY_KEYS = {
    "Animals & Nature": "animals_nature",
    "Food & Drink": "food_drink",
    "Travel & Places": "travel_places",
    "Activities": "activities",
    "Objects": "objects",
    "Symbols": "symbols",
    "Flags": "flags",
}
EMOJIBASE_GROUP_KEYS = {"Smileys & Emotion": "smileys-emotion", "People & Body": "people-body"}


@dataclass
class Emoji:
    """One entity of the set (entities.jsonl holds these fields)."""

    id: str  # lower-case unified code points joined by '-', as emoji-datasource names its images
    char: str
    zh: str
    zh_hant: str | None
    keywords: list[str]
    category: str
    subcategory: str
    category_zh: str
    subcategory_zh: str
    images: dict[str, Path] = field(default_factory=dict)  # style → 64 px PNG in the package
    components: list[str] = field(default_factory=list)  # ids of a ZWJ sequence's parts
    region: str | None = None  # flags: the region CLDR names
    sort_order: int = 0


def skip(skipped: list[dict[str, Any]], file: str | Path, key: str, reason: str) -> None:
    skipped.append({"file": str(file), "key": key, "reason": reason})


def char_of(unified: str) -> str:
    return "".join(chr(int(part, 16)) for part in unified.split("-"))


def _annotation_file(package: Package, folder: str, locale: str) -> Path:
    return package.root / folder / locale / "annotations.json"


def read_annotations(
    packages: dict[str, Package], locale: str, skipped: list[dict[str, Any]]
) -> dict[str, dict[str, list[str]]]:
    """char → {"tts": [...], "default": [...]} for ``locale``: base annotations, then derived ones
    (flags, sequences) for characters the base lacks. Malformed entries are skipped and recorded."""
    merged: dict[str, dict[str, list[str]]] = {}
    sources = [
        (packages["cldr-annotations-full"], "annotations", "annotations"),
        (packages["cldr-annotations-derived-full"], "annotationsDerived", "annotationsDerived"),
    ]
    for package, folder, top in sources:
        path = _annotation_file(package, folder, locale)
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: is {package.name} complete? (`npm pack {package.name}`)"
            )
        entries = json.loads(path.read_text(encoding="utf-8"))[top]["annotations"]
        for char, entry in entries.items():
            ok = isinstance(entry, dict) and all(
                isinstance(entry.get(k, []), list) and all(isinstance(v, str) and v for v in entry.get(k, []))
                for k in ("tts", "default")
            )
            if not ok or not entry.get("tts"):
                skip(
                    skipped,
                    path,
                    char,
                    "malformed annotation entry (needs a non-empty 'tts' list of strings)",
                )
                continue
            merged.setdefault(char, entry)
    return merged


def _lookup(
    annotations: dict[str, dict[str, list[str]]], entry: dict[str, Any]
) -> dict[str, list[str]] | None:
    char = char_of(entry["unified"])
    keys = [char, char.replace("\ufe0f", "")]
    if entry.get("non_qualified"):
        keys.append(char_of(entry["non_qualified"]))
    return next((annotations[k] for k in keys if k in annotations), None)


def _split_label(name: str) -> tuple[str, str] | None:
    """CLDR's derived names read "label: value" (旗: 中国; zh-Hant 旗子：中國)."""
    for colon in (": ", "：", ":"):
        if colon in name:
            label, value = name.split(colon, 1)
            return label.strip(), value.strip()
    return None


def _names(entry: dict[str, Any], zh: dict[str, list[str]], hant: dict[str, list[str]] | None):
    """(zh name, zh-Hant name, region): a flag is named "<region>旗帜" (a caption cannot say 旗: 中国)."""
    name, name_hant = zh["tts"][0], hant["tts"][0] if hant else None
    region = None
    if entry["subcategory"] in FLAG_SUBCATEGORIES and (parts := _split_label(name)):
        region = parts[1]
        name = f"{region}旗帜"
        hant_parts = _split_label(name_hant) if name_hant else None
        name_hant = f"{hant_parts[1]}{hant_parts[0]}" if hant_parts else None
    return name, name_hant, region


def category_labels(packages: dict[str, Package]) -> tuple[dict[str, str], dict[str, str]]:
    """emoji.json category → zh label (CLDR characterLabels, else emojibase), subcategory → zh label
    (emojibase's zh messages: CLDR has labels for few subcategories)."""
    misc = packages["cldr-misc-full"].root / "main" / "zh" / "characterLabels.json"
    cldr = json.loads(misc.read_text(encoding="utf-8"))["main"]["zh"]["characterLabels"]
    messages_path = packages["emojibase-data"].root / "zh" / "messages.json"
    messages = json.loads(messages_path.read_text(encoding="utf-8"))
    groups = {g["key"]: g["message"] for g in messages["groups"]}
    categories = {c: cldr[k] for c, k in CLDR_CATEGORY_KEYS.items() if k in cldr}
    categories |= {c: groups[k] for c, k in EMOJIBASE_GROUP_KEYS.items() if k in groups}
    subcategories = {s["key"]: s["message"] for s in messages["subgroups"]}
    return categories, subcategories


def _images(package_of: dict[str, Package], entry: dict[str, Any]) -> dict[str, Path]:
    images = {}
    for style, name in STYLES.items():
        path = package_of[name].root / "img" / style / "64" / entry["image"]
        if entry.get(f"has_img_{style}") and path.is_file():
            images[style] = path
    return images


def read_catalogue(packages: dict[str, Package], skipped: list[dict[str, Any]]) -> list[Emoji]:
    """Every usable emoji, in emoji.json's sort order (skin tones and components left out)."""
    source = packages["emoji-datasource-google"].root / "emoji.json"
    entries = json.loads(source.read_text(encoding="utf-8"))
    zh, hant = read_annotations(packages, "zh", skipped), read_annotations(packages, "zh-Hant", skipped)
    categories, subcategories = category_labels(packages)
    emojis: list[Emoji] = []
    for entry in sorted(entries, key=lambda e: e.get("sort_order", 0)):
        if not isinstance(entry, dict) or not isinstance(entry.get("unified"), str):
            skip(skipped, source, str(entry)[:40], "malformed emoji.json entry")
            continue
        ident = entry["unified"].lower()
        if entry.get("category") == "Component" or SKIN_TONES & set(ident.split("-")):
            continue
        names = _lookup(zh, entry)
        if names is None:
            skip(skipped, source, ident, "no CLDR zh annotation")
            continue
        name, name_hant, region = _names(entry, names, _lookup(hant, entry))
        parts = [p for p in ident.split("-") if p != VS16]
        emojis.append(
            Emoji(
                id=ident,
                char=char_of(entry["unified"]),
                zh=name,
                zh_hant=name_hant if name_hant != name else None,
                keywords=[k for k in names.get("default", []) if k != name],
                category=entry["category"],
                subcategory=entry["subcategory"],
                category_zh=categories.get(entry["category"], entry["category"]),
                subcategory_zh=subcategories.get(entry["subcategory"], entry["subcategory"]),
                images=_images(packages, entry),
                components=_components(ident) if ZWJ in parts else [],
                region=region,
                sort_order=int(entry.get("sort_order", 0)),
            )
        )
    return _resolve_components(emojis)


def _components(ident: str) -> list[str]:
    """The parts of a ZWJ sequence, each without its VS16 (looked up the same way)."""
    return ["-".join(p for p in part.split("-") if p and p != VS16) for part in ident.split(f"-{ZWJ}-")]


def _resolve_components(emojis: list[Emoji]) -> list[Emoji]:
    """Components become entity ids (a part that is no entity of the set is dropped)."""
    by_bare = {"-".join(p for p in e.id.split("-") if p != VS16): e.id for e in emojis}
    for e in emojis:
        e.components = [by_bare[c] for c in e.components if c in by_bare and by_bare[c] != e.id]
    return emojis
