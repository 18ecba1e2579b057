"""emoji-zh builder on tiny packages in the real formats: the folder contract, the splits, the KG,
bad input, licences."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

from rapiddiff.data.emoji import EmojiConfig, MissingPackageError, build_emoji, copy_licenses, find_packages
from rapiddiff.data.emoji.catalog import Emoji
from rapiddiff.data.emoji.splits import choose_splits, choose_subset
from rapiddiff.kg.triples import read_aliases, read_triples
from tests.data.emoji_fakes import CORRUPT, MALFORMED, NO_SVG, REDESIGNED, make_packages, make_svg_packages

ENTITY_KEYS = {"id", "char", "zh", "zh_hant", "keywords", "unique_keywords", "category", "subcategory",
               "category_zh", "subcategory_zh", "split", "styles"}  # fmt: skip


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("emoji")
    packages = make_packages(root / "pkgs")
    cfg = EmojiConfig(
        out=root / "out", packages=[str(packages)], heldout=0.15, validation=0.1, train_per_entity=3
    )
    return build_emoji(cfg, progress=False), root / "out", packages


def test_entities_follow_the_contract(built):
    _summary, out, _ = built
    entities = {e["id"]: e for e in _rows(out / "entities.jsonl")}
    assert all(set(e) >= ENTITY_KEYS for e in entities.values())
    tomato = entities["1f345"]
    assert (tomato["char"], tomato["zh"], tomato["zh_hant"]) == ("🍅", "西红柿", "番茄")
    assert tomato["styles"] == ["google", "twitter"] and tomato["category_zh"] == "饮食"
    assert tomato["subcategory_zh"] == "水果" and "番茄" in tomato["unique_keywords"]
    assert entities["1f468-200d-1f373"]["components"] == ["1f468", "1f373"]
    assert entities["1f1e8-1f1f3"]["zh"] == "中国旗帜" and entities["1f1e8-1f1f3"]["region"] == "中国"
    assert not any("1f3fb" in i for i in entities)  # skin tones and components left out
    for e in entities.values():
        for style in e["styles"]:
            with Image.open(out / "glyphs" / style / f"{e['id']}.png") as image:
                assert image.mode == "RGBA" and image.size == (64, 64)


def test_splits_are_disjoint_and_no_kg_only_entity_or_alias_is_in_a_caption(built):
    _summary, out, _ = built
    splits = json.loads((out / "splits.json").read_text(encoding="utf-8"))
    entities = {e["id"]: e for e in _rows(out / "entities.jsonl")}
    groups = [set(splits[s]) for s in ("seen", "heldout", "val")]
    assert sum(map(len, groups)) == len(set().union(*groups)) == len(entities)
    assert groups[1] and groups[2]
    assert all(entities[i]["split"] == s for s in ("seen", "heldout", "val") for i in splits[s])
    kg_only = groups[1] | groups[2]
    alias_names = {a["name"] for a in splits["alias_prompts"]}
    kg_aliases = read_aliases(out / "kg" / "aliases.tsv")
    assert alias_names == {a for i in groups[0] for a in kg_aliases.get(entities[i]["zh"], [])} != set()
    assert all(a["id"] in groups[0] for a in splits["alias_prompts"])
    for split in ("train", "val", "test"):
        rows = _rows(out / split / "metadata.jsonl")
        assert rows and {r["entity"] for r in rows} <= groups[0]
        for row in rows:
            assert (out / split / row["file_name"]).is_file()
            assert row["name"] in row["text"]
            assert row["background"] in row["text"] or row["position"] in row["text"]
            assert not any(entities[i]["zh"] in row["text"] for i in kg_only), row
            assert not any(name in row["text"] for name in alias_names), row
    with Image.open(out / "train" / "000000.png") as image:
        assert image.mode == "RGB" and image.size == (128, 128)


def test_kg_parses_with_the_projects_reader_and_holds_the_relations(built):
    _summary, out, _ = built
    triples = set(read_triples(out / "kg" / "triples.tsv"))
    names = {h for h, _, _ in triples} | {t for _, _, t in triples}
    aliases = read_aliases(out / "kg" / "aliases.tsv", entities=names)
    assert {("西红柿", "类别", "饮食"), ("西红柿", "子类", "水果"), ("西红柿", "关键词", "水果")} <= triples
    assert {("男厨师", "组成", "男人"), ("男厨师", "组成", "煎蛋"), ("中国旗帜", "地区", "中国")} <= triples
    assert ("男厨师", "关键词", "厨师") in triples  # shared by two emoji: a node
    assert not any(t == "番茄" for _, _, t in triples)  # names one emoji only: an alias, not a node
    assert not any(
        t == "上" for _, _, t in triples
    )  # a caption word ("背景上"): the linker would find it everywhere
    assert "番茄" in aliases["西红柿"] and {"猫熊", "胖达", "熊貓"} <= set(aliases["熊猫"])
    assert "笑臉" not in aliases.get("嘿嘿", [])  # the linker reads it as 笑脸, another emoji
    every_alias = [a for al in aliases.values() for a in al]
    assert len(every_alias) == len(set(every_alias)) and not set(every_alias) & names


def test_bad_input_is_skipped_and_named(built):
    summary, out, _ = built
    report = json.loads((out / "build.json").read_text(encoding="utf-8"))
    assert report["counts"] == summary["counts"] and report["hr"]["written"] is False
    style, ident = CORRUPT
    corrupt = [s for s in report["skipped"] if s["key"] == ident]
    assert any(
        s["file"].endswith(f"img/{style}/64/{ident}.png") and "unreadable" in s["reason"] for s in corrupt
    )
    assert ident not in {e["id"] for e in _rows(out / "entities.jsonl")}  # one style left: dropped
    chars = {s["key"] for s in report["skipped"] if s["file"].endswith("zh-Hant/annotations.json")}
    assert "".join(chr(int(p, 16)) for p in MALFORMED.split("-")) in chars
    assert report["counts"]["skipped"] == len(report["skipped"]) >= 2


def test_missing_package_names_the_command(tmp_path):
    packages = make_packages(tmp_path / "pkgs")
    for path in (packages / "cldr-misc-full-1.0.0").rglob("*"):
        path.unlink() if path.is_file() else None
    import shutil

    shutil.rmtree(packages / "cldr-misc-full-1.0.0")
    with pytest.raises(MissingPackageError, match="npm pack cldr-misc-full"):
        build_emoji(EmojiConfig(out=tmp_path / "out", packages=[str(packages)]), progress=False)
    assert not (tmp_path / "out").exists()  # nothing written before the packages are all there


def test_tarballs_are_read_like_folders(tmp_path):
    import tarfile

    packages = make_packages(tmp_path / "pkgs")
    tarballs = tmp_path / "tgz"
    tarballs.mkdir()
    for folder in packages.iterdir():
        with tarfile.open(tarballs / f"{folder.name}.tgz", "w:gz") as archive:
            archive.add(folder / "package", arcname="package")
    found = find_packages([tarballs], tmp_path / "cache")
    assert found["emoji-datasource-google"].version == "1.0.0"
    assert (found["emoji-datasource-google"].root / "emoji.json").is_file()


def test_licences_are_written_and_copied(built, tmp_path):
    _summary, out, _ = built
    licences = {p.name for p in (out / "LICENSES").iterdir()}
    assert {
        "emoji-datasource-google.LICENSE",
        "cldr-annotations-full.LICENSE",
        "emojibase-data.LICENSE",
    } <= licences
    text = (out / "ATTRIBUTION.md").read_text(encoding="utf-8")
    assert "Apache License 2.0" in text and "CC-BY 4.0" in text and "Unicode" in text
    copy_licenses(out, tmp_path / "model")
    assert (tmp_path / "model" / "ATTRIBUTION.md").read_text(encoding="utf-8") == text
    assert {p.name for p in (tmp_path / "model" / "LICENSES").iterdir()} == licences


def test_same_seed_same_files_and_cli_refuses_a_full_folder(built, tmp_path, capsys):
    from rapiddiff.cli import main

    _summary, out, packages = built
    args = ["data", "emoji", "--out", str(tmp_path / "again"), "--package", str(packages)]
    assert main([*args, "--train-per-entity", "3", "--config", str(out / "emoji.yaml")]) == 0

    def digest(folder: Path) -> dict[str, str]:
        names = [
            "splits.json",
            "kg/triples.tsv",
            "kg/aliases.tsv",
            "train/metadata.jsonl",
            "train/000004.png",
        ]
        return {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in names}

    assert digest(tmp_path / "again") == digest(out)
    assert main(args) == 2 and "--overwrite" in capsys.readouterr().err


def _fake(n_sub: int, per: int) -> list[Emoji]:
    return [
        Emoji(f"{s:02x}{i:02x}", "?", f"名{s}_{i}", None, [], "C", f"sub{s}", "类", "子", {"google": Path()})
        for s in range(n_sub)
        for i in range(per)
    ]


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_splits_are_stratified_by_subcategory(seed):
    emojis = _fake(10, 20)
    splits = choose_splits(emojis, seed, heldout=0.10, validation=0.05)
    sub = {e.id: e.subcategory for e in emojis}
    held = Counter(sub[i] for i in splits["heldout"])
    assert len(splits["heldout"]) == 20 and len(splits["val"]) == 10
    assert set(held.values()) == {2}  # every subcategory gives its 10 %
    assert max(Counter(sub[i] for i in splits["val"]).values()) <= 2
    assert splits != choose_splits(emojis, seed + 1, 0.10, 0.05)


def test_subset_is_stratified_deterministic_and_keeps_included_components():
    emojis = _fake(6, 10)
    emojis[3].components = [emojis[15].id]
    subset = choose_subset(emojis, 12, seed=0, include=[emojis[3].id])
    assert len(subset) == 12 and {emojis[3].id, emojis[15].id} <= {e.id for e in subset}
    per_sub = Counter(e.subcategory for e in subset)
    assert len(per_sub) == 6 and max(per_sub.values()) - min(per_sub.values()) <= 2  # includes add one
    assert subset == choose_subset(emojis, 12, seed=0, include=[emojis[3].id])
    with pytest.raises(ValueError, match="--include"):
        choose_subset(emojis, 12, seed=0, include=["zzzz"])


def test_caption_index_sees_names_joined_to_template_words():
    from rapiddiff.data.emoji.compose import CaptionIndex

    index = CaptionIndex(["脑", "西红柿", "存"])
    assert index.contains("的脑")  # "大的脑，深绿色背景": the size word before the name
    assert index.contains("红柿") and index.contains("背景") and index.contains("存在")  # "存在浅蓝色背景的…"
    assert index.contains("个西红")  # "一个西红柿"
    assert not index.contains("番茄") and not index.contains("脑袋")


def test_only_eligible_entities_are_held_out_and_the_shares_stay_shares_of_all():
    emojis = _fake(10, 20)
    eligible = {e.id for i, e in enumerate(emojis) if i % 2}
    splits = choose_splits(emojis, 0, 0.10, 0.05, eligible=lambda e: e.id in eligible)
    assert set(splits["heldout"]) | set(splits["val"]) <= eligible
    assert (len(splits["heldout"]), len(splits["val"])) == (20, 10)
    assert len(Counter(e.subcategory for e in emojis if e.id in splits["heldout"])) == 10


# ----------------------------------------------------------------------------- hr/ copies from SVG
@pytest.fixture(scope="module")
def built_hr(tmp_path_factory, built):
    pytest.importorskip("resvg_py", reason="the hr/ copies need resvg-py (pip install 'rapiddiff[emoji-hr]')")
    root = tmp_path_factory.mktemp("emoji_hr")
    _summary, _out, packages = built
    svgs = make_svg_packages(root / "svg")
    cfg = EmojiConfig(
        out=root / "out",
        packages=[str(packages), str(svgs)],
        heldout=0.15,
        validation=0.1,
        train_per_entity=3,
    )  # fmt: skip (the settings of `built`: the same base images)
    return build_emoji(cfg, progress=False), root / "out"


def test_hr_copies_are_4x_and_aligned_with_the_base_images(built_hr):
    import numpy as np

    from rapiddiff.data.emoji.vector import psnr

    summary, out = built_hr
    hr = summary["hr"]
    assert hr["written"] and hr["size"] == 512 and hr["scale"] == 4
    for split in ("train", "val", "test"):
        rows = _rows(out / "hr" / split / "metadata.jsonl")
        base = {r["file_name"]: r for r in _rows(out / split / "metadata.jsonl")}
        assert rows and all(base[r["file_name"]] == r for r in rows)  # same names, same captions
        assert hr["images"][split] == len(rows) == len(list((out / "hr" / split).glob("*.png")))
        for r in rows:
            high = Image.open(out / "hr" / split / r["file_name"])
            assert high.size == (512, 512)
            low = np.asarray(Image.open(out / split / r["file_name"]), dtype=np.float64)
            # Box-reduced to 128², the SVG drawing lands on the 64 px PNG's composition.
            assert psnr(np.asarray(high.reduce(4), dtype=np.float64), low) > 25, r["file_name"]


def test_hr_leaves_out_glyphs_without_a_matching_svg_and_says_why(built_hr):
    summary, out = built_hr
    why = {(w["style"], w["id"]): w["reason"] for w in summary["hr"]["without"]}
    assert "no SVG" in why[NO_SVG] and "other artwork" in why[REDESIGNED]
    for split in ("train", "val", "test"):
        left_out = [r for r in _rows(out / split / "metadata.jsonl") if (r["style"], r["entity"]) in why]
        assert left_out and not any((out / "hr" / split / r["file_name"]).exists() for r in left_out)
    licences = {p.name for p in (out / "LICENSES").iterdir()}
    assert {"iconify-json-noto.LICENSE", "iconify-json-twemoji.LICENSE"} <= licences
    assert "Twemoji** SVGs" in (out / "ATTRIBUTION.md").read_text(encoding="utf-8")


def test_base_images_do_not_change_with_svgs_and_no_hr_copies_writes_none(built, built_hr, tmp_path):
    from rapiddiff.cli import main

    _s, plain, packages = built
    _s, with_hr = built_hr
    assert not (plain / "hr").exists() and "SVG packages" in built[0]["hr"]["reason"]
    for split in ("train", "val", "test"):
        files = sorted(p.name for p in (plain / split).iterdir())
        assert files == sorted(p.name for p in (with_hr / split).iterdir())
        assert all((plain / split / f).read_bytes() == (with_hr / split / f).read_bytes() for f in files)
    svgs = with_hr.parent / "svg"
    args = ["data", "emoji", "--out", str(tmp_path / "o"), "--package", str(packages), "--package", str(svgs)]
    assert main([*args, "--no-hr-copies", "--train-per-entity", "1"]) == 0
    assert not (tmp_path / "o" / "hr").exists()


def test_svg_tarballs_are_found_by_their_npm_pack_names_and_resvg_is_required(tmp_path, monkeypatch):
    import sys
    import tarfile

    from rapiddiff.data.emoji.packages import OPTIONAL
    from rapiddiff.data.emoji.vector import RasteriserMissingError

    svgs = make_svg_packages(tmp_path / "svg")
    tarballs = tmp_path / "tgz"
    tarballs.mkdir()
    for folder in svgs.iterdir():  # npm pack names @iconify-json/noto's tarball iconify-json-noto-1.0.0.tgz
        with tarfile.open(tarballs / f"{folder.name}.tgz", "w:gz") as archive:
            archive.add(folder / "package", arcname="package")
    found = find_packages([tarballs], tmp_path / "cache", names=(), optional=tuple(OPTIONAL))
    assert set(found) == set(OPTIONAL) and (found["@iconify-json/noto"].root / "icons.json").is_file()
    monkeypatch.setitem(sys.modules, "resvg_py", None)  # as if not installed
    packages = make_packages(tmp_path / "pkgs")
    with pytest.raises(RasteriserMissingError, match=r"rapiddiff\[emoji-hr\]"):
        build_emoji(
            EmojiConfig(out=tmp_path / "out", packages=[str(packages), str(tarballs)]), progress=False
        )
    assert not (tmp_path / "out").exists()  # refused before anything is written
