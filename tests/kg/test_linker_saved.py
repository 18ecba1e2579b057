"""A KnowledgeStore saved with its EntityLinker's index (``linker/``): links as a built linker does,
is read without the names, and is never used once it no longer describes the store."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from rapiddiff.kg import linker_index as linker_module
from rapiddiff.kg import store as store_module
from rapiddiff.kg.linker import EntityLinker
from rapiddiff.kg.store import KnowledgeStore

NAMES = ["番茄", "番茄酱", "红色", "茄子", "ABC", "北京", "北京大学", "大学", "熊猫", "乔治·华盛顿"]
ALIASES = {"番茄": ["西红柿", "蕃茄"], "番茄酱": ["蕃茄酱"], "熊猫": ["大熊猫"], "北京大学": ["北大"]}
TEXTS = [
    "一個西紅柿和北京大学的大熊猫",  # traditional characters, an alias, the longest match
    "番茄酱不是番茄，蕃茄醬也不是",  # a name inside a word; a traditional alias
    "ＡＢＣ公司的茄子和ａｂｃ",  # full width, case
    "北大的红色熊猫",
    "乔治•华盛顿来过北京",  # another middle dot
    "没有实体的句子",
]


@pytest.fixture(autouse=True)
def _private_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RAPIDDIFF_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(logging.getLogger("rapiddiff"), "propagate", True)  # for caplog


def _store(names: list[str] = NAMES) -> KnowledgeStore:
    return KnowledgeStore.from_arrays(
        names, ["r"], torch.zeros(len(names), 2), torch.zeros(1, 2), aliases=ALIASES
    )


def _links(linker: EntityLinker) -> list[list[tuple[int, int, int, str]]]:
    return [[(s.start, s.end, s.entity_id, s.surface) for s in linker.link(t)] for t in TEXTS]


def _forbid_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading a store's names (or building an index) from here on fails the test."""

    def fail(*_: object) -> None:
        pytest.fail("read the store's names")

    for attr in ("entity_names", "aliases"):
        monkeypatch.setattr(KnowledgeStore, attr, property(fail))
    monkeypatch.setattr(KnowledgeStore, "forms", fail)
    monkeypatch.setattr(linker_module, "_build_index", lambda *a: pytest.fail("built the index"))


def _rebuilt(folder: Path, caplog: pytest.LogCaptureFixture, reason: str) -> EntityLinker:
    """from_store on the store in ``folder``, expected to fall back to the names, saying ``reason``."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rapiddiff"):
        linker = EntityLinker.from_store(KnowledgeStore.load(folder))
    lines = [r.getMessage() for r in caplog.records if r.name == "rapiddiff.kg.linker"]
    assert any(reason in line for line in lines), lines
    return linker


def test_saved_index_links_as_a_built_linker_without_reading_names(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    store = _store()
    built = EntityLinker(list(store.forms()))
    expected = _links(built)
    assert sum(map(len, expected)) >= 10
    store.save(tmp_path / "store", linker=True)
    assert sorted(os.listdir(tmp_path / "store" / "linker")) == [
        "entity_ids.npy", "head_table.npy", "heads.npy", "index.json", "keys.marisa", "weights.npy",
    ]  # fmt: skip
    _forbid_names(monkeypatch)
    for source in (KnowledgeStore.load(tmp_path / "store"), store):  # the saved store knows its folder
        linker = EntityLinker.from_store(source)
        assert _links(linker) == expected
        assert list(linker.trie.iteritems()) == list(built.trie.iteritems())
        assert np.array_equal(linker.entity_ids, built.entity_ids)
        assert (linker._heads, linker.longest, linker._head_set[1], len(linker)) == (
            built._heads, built.longest, built._head_set[1], len(built),
        )  # fmt: skip
        assert np.array_equal(linker._head_set[0], built._head_set[0])
        assert [s.entity_id for s in linker.link("番茄", word_check=False)] == [0]
    # Each linker fills in its forms' weights as it meets them: never into the saved file.
    assert np.isnan(np.load(tmp_path / "store" / "linker" / "weights.npy")[built.entity_ids >= 0]).all()


def test_no_pickle_in_the_linker_folder(tmp_path: Path) -> None:
    folder = _store().save(tmp_path / "store", linker=True) / "linker"
    for file in folder.glob("*.npy"):
        array = np.load(file, allow_pickle=False)
        assert array.dtype != object
    meta = json.loads((folder / "index.json").read_text(encoding="utf-8"))
    assert meta["about"]["entities"]["bytes"] == (tmp_path / "store" / "entities.tsv").stat().st_size
    assert not any(f.suffix in {".pkl", ".pickle", ".npz"} for f in folder.iterdir())


def test_edited_entities_rebuild_with_the_reason_and_new_links(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _store().save(tmp_path / "store", linker=True)
    entities = tmp_path / "store" / "entities.tsv"
    # The same size (茄子 → 老虎: as many bytes), then another size (→ 东北虎).
    for new_name, new_text in (("老虎", "北京的老虎"), ("东北虎", "北京的东北虎")):
        names = [new_name if n == "茄子" else n for n in NAMES]
        other = _store(names).save(tmp_path / f"other-{new_name}", linker=False)
        shutil.copyfile(other / "entities.tsv", entities)
        linker = _rebuilt(tmp_path / "store", caplog, "entities.tsv changed since the index was written")
        assert [(s.surface, s.entity_id) for s in linker.link(new_text)] == [("北京", 5), (new_name, 3)]
        assert _links(linker) == _links(EntityLinker(list(_store(names).forms())))


def test_copied_store_keeps_its_index(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    expected = _links(EntityLinker(list(_store().forms())))
    _store().save(tmp_path / "store", linker=True)
    shutil.copytree(tmp_path / "store", tmp_path / "copy", copy_function=shutil.copyfile)  # new mtimes
    saved = json.loads((tmp_path / "copy" / "linker" / "index.json").read_text(encoding="utf-8"))
    assert (tmp_path / "copy" / "entities.tsv").stat().st_mtime_ns != saved["about"]["entities"]["mtime_ns"]
    _forbid_names(monkeypatch)
    assert _links(EntityLinker.from_store(KnowledgeStore.load(tmp_path / "copy"))) == expected


def test_index_follows_jieba_by_content_not_by_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Another machine's jieba (same dictionary, other path and mtime) reads the saved index."""
    expected = _links(EntityLinker(list(_store().forms())))
    _store().save(tmp_path / "store", linker=True)
    version, _, size, mtime = linker_module._jieba_source()
    monkeypatch.setattr(
        linker_module, "_jieba_source", lambda: (version, "/elsewhere/dict.txt", size, mtime + 1)
    )
    _forbid_names(monkeypatch)
    assert _links(EntityLinker.from_store(KnowledgeStore.load(tmp_path / "store"))) == expected


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("truncate keys.marisa", "damaged: keys.marisa has"),
        ("empty keys.marisa", "damaged: keys.marisa has"),
        ("remove weights.npy", "damaged: FileNotFoundError"),
        ("truncate entity_ids.npy", "damaged: entity_ids.npy has"),
        ("remove index.json", "no index.json"),
        ("garble index.json", "damaged: index.json"),
        ("version", "written by another linker version"),
        ("code", "written by another linker version"),
        ("jieba", "written for another jieba dictionary"),
        ("keys", "damaged: 1 keys in index.json"),
        ("bytes", "damaged: TypeError"),
        ("about", "damaged: index.json does not identify the store's names"),
    ],
)
def test_damaged_or_foreign_index_rebuilds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str, reason: str
) -> None:
    """Never raises, never loads a wrong index: the names are read and the spans are right."""
    expected = _links(EntityLinker(list(_store().forms())))
    folder = _store().save(tmp_path / "store", linker=True) / "linker"
    meta_file = folder / "index.json"
    meta = json.loads(meta_file.read_text(encoding="utf-8"))
    action, _, name = damage.partition(" ")
    if action == "truncate":
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[: len(data) // 2])
    elif action == "empty":
        (folder / name).write_bytes(b"")
    elif action == "remove":
        (folder / name).unlink()
    elif action == "garble":
        meta_file.write_text(meta_file.read_text(encoding="utf-8")[:-20], encoding="utf-8")
    else:  # one field of index.json changed
        changed = {"version": meta["version"] + 1, "code": "0" * 64, "keys": 1, "bytes": 5, "about": 5}
        meta[damage] = changed.get(damage, ["jieba", 0])
        meta_file.write_text(json.dumps(meta), encoding="utf-8")
    assert _links(_rebuilt(tmp_path / "store", caplog, reason)) == expected


def test_a_newer_linker_version_does_not_read_the_index(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _store().save(tmp_path / "store", linker=True)
    monkeypatch.setattr(linker_module, "_INDEX_VERSION", linker_module._INDEX_VERSION + 1)
    linker = _rebuilt(tmp_path / "store", caplog, "written by another linker version")
    assert _links(linker) == _links(EntityLinker(list(_store().forms())))


def test_auto_mode_writes_the_index_only_for_large_stores(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert store_module.LINKER_MIN_ENTITIES == 100_000
    small = _store().save(tmp_path / "small")
    assert not (small / "linker").exists()
    monkeypatch.setattr(store_module, "LINKER_MIN_ENTITIES", len(NAMES))
    large = _store().save(tmp_path / "large")
    assert (large / "linker" / "index.json").is_file()
    _store().save(large, linker=False)  # forced off: an earlier index in the folder goes
    assert not (large / "linker").exists()
    monkeypatch.setattr(store_module, "LINKER_MIN_ENTITIES", len(NAMES) + 1)
    assert not (_store().save(tmp_path / "below") / "linker").exists()
    assert (_store().save(tmp_path / "forced", linker=True) / "linker").is_dir()


def test_save_takes_the_index_from_the_per_user_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A store whose linker was already built (and cached) is saved without building it again."""
    store = _store()
    expected = _links(EntityLinker.from_store(store))
    monkeypatch.setattr(linker_module, "_build_index", lambda *a: pytest.fail("built the index"))
    store.save(tmp_path / "store", linker=True)
    assert _links(EntityLinker.from_store(KnowledgeStore.load(tmp_path / "store"))) == expected


def test_kg_info_says_whether_the_store_carries_its_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rapiddiff.cli import main

    def linker_line(folder: Path) -> str:
        assert main(["kg", "info", str(folder)]) == 0
        return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("linker:"))

    assert "no saved index" in linker_line(_store().save(tmp_path / "small"))
    folder = _store().save(tmp_path / "large", linker=True)
    assert "index saved in linker/" in linker_line(folder)
    os.utime(folder / "entities.tsv", ns=(1, 1))  # touched, not changed: the sha256 still matches
    assert "index saved in linker/" in linker_line(folder)
    (folder / "linker" / "keys.marisa").write_bytes(b"")
    assert "linker/ not used (damaged: keys.marisa has 0 bytes" in linker_line(folder)


@pytest.mark.parametrize("where", ["its own folder", "another folder"])
def test_a_loaded_store_saved_again_takes_its_index_along(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, where: str
) -> None:
    """The index comes from the linker/ of the folder the store was loaded from (the per-user cache
    holds none, nothing is built) and describes the entities.tsv written now."""
    expected = _links(EntityLinker(list(_store().forms())))
    folder = _store().save(tmp_path / "store", linker=True)
    shutil.rmtree(tmp_path / "cache")
    monkeypatch.setattr(linker_module, "_build_index", lambda *a: pytest.fail("built the index"))
    target = folder if where == "its own folder" else tmp_path / "elsewhere"
    KnowledgeStore.load(folder).save(target, linker=True)
    _forbid_names(monkeypatch)
    assert _links(EntityLinker.from_store(KnowledgeStore.load(target))) == expected
