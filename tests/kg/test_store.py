"""KnowledgeStore: exact round trip through the folder format, lazy + memory-mapped, no pickle."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import pytest
import torch

from rapiddiff.kg.store import KnowledgeStore


def _store() -> KnowledgeStore:
    gen = torch.Generator().manual_seed(1)
    names = ["番茄", "红色", "圆形", "香蕉", "ＡＢＣ"]
    return KnowledgeStore.from_arrays(
        names,
        ["颜色", "形状"],
        torch.randn(5, 8, generator=gen),
        torch.randn(2, 8, generator=gen),
        triples=[(0, 0, 1), (0, 1, 2), (3, 1, 2)],
        aliases={"番茄": ["西红柿", "蕃茄"], "ＡＢＣ": ["abc公司"]},
        config={"model": "TransE", "metrics": {"hits_at_10": 0.5}},
    )


def test_round_trip_is_exact(tmp_path: Path) -> None:
    store = _store()
    store.save(tmp_path / "kg")
    loaded = KnowledgeStore.load(tmp_path / "kg")
    assert loaded.entity_names == store.entity_names
    assert loaded.relation_names == store.relation_names
    assert loaded.aliases == [["西红柿", "蕃茄"], [], [], [], ["abc公司"]]
    assert torch.equal(loaded.entity_vectors, store.entity_vectors)
    assert torch.equal(loaded.relation_vectors, store.relation_vectors)
    assert loaded.entity_vectors.dtype == torch.float32
    assert torch.equal(loaded.triples, store.triples)
    assert loaded.dim == 8 and len(loaded) == 5
    assert loaded.config["metrics"] == {"hits_at_10": 0.5}
    assert loaded.config["n_triples"] == 3
    # and the files are the documented, human-readable ones
    assert (tmp_path / "kg" / "entities.tsv").read_text(encoding="utf-8").splitlines()[
        1
    ] == "0\t番茄\t西红柿|蕃茄"
    assert "番茄\t形状\t圆形" in (tmp_path / "kg" / "triples.tsv").read_text(encoding="utf-8")
    assert json.loads((tmp_path / "kg" / "config.json").read_text())["dim"] == 8


def test_lookup_and_facts(tmp_path: Path) -> None:
    loaded = KnowledgeStore.load(_store().save(tmp_path / "kg"))
    assert loaded.id_of("番茄") == 0
    assert loaded.id_of("西红柿") == 0
    assert loaded.id_of("西紅柿") == 0  # traditional form, via normalisation
    assert loaded.id_of("abc") == 4  # full-width name, half-width lower-case query
    assert loaded.id_of("苹果") is None
    assert loaded.facts(0) == [(0, 1), (1, 2)]
    assert loaded.facts(3) == [(1, 2)]
    assert loaded.facts(2) == []
    assert torch.equal(loaded.vector("蕃茄"), loaded.entity_vectors[0])
    with pytest.raises(KeyError, match="苹果"):
        loaded.vector("苹果")


def test_load_never_unpickles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _store().save(tmp_path / "kg")

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("KnowledgeStore.load unpickled something")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    loaded = KnowledgeStore.load(tmp_path / "kg")
    _ = (
        loaded.entity_names,
        loaded.triples,
        loaded.facts(0),
        loaded.id_of("番茄"),
        loaded.entity_vectors.sum(),
    )
    assert not list((tmp_path / "kg").glob("*.pkl"))


def test_vectors_are_memory_mapped_and_names_lazy(tmp_path: Path) -> None:
    _store().save(tmp_path / "kg")
    loaded = KnowledgeStore.load(tmp_path / "kg")
    assert loaded._entity_names is None and loaded._triples is None  # nothing read yet
    # the tensor's memory lies inside a mapping of the safetensors file (Linux /proc/self/maps)
    ptr = loaded.entity_vectors.data_ptr()
    file = str((tmp_path / "kg" / "entity_embeddings.safetensors").resolve())
    maps = [line.split() for line in Path("/proc/self/maps").read_text().splitlines()]
    ranges = [tuple(int(x, 16) for x in m[0].split("-")) for m in maps if len(m) >= 6 and m[5] == file]
    assert any(lo <= ptr < hi for lo, hi in ranges), "entity vectors are not memory-mapped"
    # copy-on-write: writing to the tensor must not change the file
    loaded.entity_vectors[0, 0] = 123.0
    again = KnowledgeStore.load(tmp_path / "kg")
    assert again.entity_vectors[0, 0] != 123.0


def test_bad_inputs_raise_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="entity names must be unique; 'b' appears twice"):
        KnowledgeStore.from_arrays(["a", "b", "c", "b"], ["r"], torch.zeros(4, 4), torch.zeros(1, 4))
    for bad in ("", " a", "a\u3000", "a\tb", "a\nb", "a\r"):  # each names the bad value
        with pytest.raises(ValueError, match=r"entity name: name .* cannot be written to TSV"):
            KnowledgeStore.from_arrays(["ok", bad], ["r"], torch.zeros(2, 4), torch.zeros(1, 4))
        with pytest.raises(ValueError, match=rf"alias: name {re.escape(repr(bad))} cannot be written"):
            KnowledgeStore.from_arrays(
                ["ok"], ["r"], torch.zeros(1, 4), torch.zeros(1, 4), aliases=[["x", bad]]
            )
    with pytest.raises(ValueError, match=r"entity_vectors must be \[3, dim\]"):
        KnowledgeStore.from_arrays(["a", "b", "c"], ["r"], torch.zeros(2, 4), torch.zeros(1, 4))
    with pytest.raises(ValueError, match="ids outside"):
        KnowledgeStore.from_arrays(["a"], ["r"], torch.zeros(1, 4), torch.zeros(1, 4), triples=[(0, 0, 5)])
    with pytest.raises(ValueError, match="separator"):
        KnowledgeStore.from_arrays(["a"], ["r"], torch.zeros(1, 4), torch.zeros(1, 4), aliases=[["x|y"]])
    with pytest.raises(FileNotFoundError, match="not a KnowledgeStore folder"):
        (tmp_path / "empty").mkdir()
        KnowledgeStore.load(tmp_path / "empty")
    store_dir = _store().save(tmp_path / "kg")
    (store_dir / "entity_embeddings.safetensors").write_bytes(b"\x00" * 4)
    with pytest.raises(ValueError, match="not a safetensors file"):
        KnowledgeStore.load(store_dir)


def test_damaged_name_table_is_reported_on_first_use(tmp_path: Path) -> None:
    store_dir = _store().save(tmp_path / "kg")
    lines = (store_dir / "entities.tsv").read_text(encoding="utf-8").splitlines()
    (store_dir / "entities.tsv").write_text("\n".join(lines[:-1]) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="4 rows but the embeddings hold 5"):
        _ = KnowledgeStore.load(store_dir).entity_names
    (store_dir / "entities.tsv").write_text("\n".join([*lines[:2], "1\tx"]) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"entities.tsv:3: expected 3 tab-separated columns"):
        _ = KnowledgeStore.load(store_dir).aliases


def test_name_of_reads_one_line_not_every_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store()
    expected = list(store.entity_names)
    assert [store.name_of(i) for i in range(len(store))] == expected  # in memory
    store_dir = store.save(tmp_path / "kg")
    loaded = KnowledgeStore.load(store_dir)
    monkeypatch.setattr(KnowledgeStore, "_read_entities", lambda self: pytest.fail("read every name"))
    assert [loaded.name_of(i) for i in (4, 0, 3, 1, 2)] == [expected[i] for i in (4, 0, 3, 1, 2)]
    with pytest.raises(IndexError, match=r"not in 0\.\.4"):
        loaded.name_of(5)
    monkeypatch.undo()
    # Windows line ends read the same; a file without one line per entity is read whole (its error).
    text = (store_dir / "entities.tsv").read_text(encoding="utf-8")
    (store_dir / "entities.tsv").write_bytes(text.replace("\n", "\r\n").encode("utf-8"))
    assert [KnowledgeStore.load(store_dir).name_of(i) for i in range(5)] == expected
    (store_dir / "entities.tsv").write_text("\n".join(text.splitlines()[:-1]) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="4 rows but the embeddings hold 5"):
        KnowledgeStore.load(store_dir).name_of(0)
    (store_dir / "entities.tsv").write_text(text.replace("1\t红色", "7\t红色"), encoding="utf-8")
    with pytest.raises(ValueError, match=r"entities.tsv:3: expected 'id<TAB>name<TAB>aliases' for entity 1"):
        KnowledgeStore.load(store_dir).name_of(1)


def test_name_index_is_saved_memory_mapped_and_rebuilt_when_missing(tmp_path: Path) -> None:
    from rapiddiff.kg.store import NAME_INDEX, NAME_INDEX_IDS

    folder = _store().save(tmp_path / "kg")
    assert (folder / NAME_INDEX).is_file() and (folder / NAME_INDEX_IDS).is_file()
    saved = KnowledgeStore.load(folder)
    assert [saved.id_of(n) for n in ("番茄", "西红柿", "蕃茄", "香蕉", "abc公司")] == [0, 0, 0, 3, 4]
    assert saved._entity_names is None  # an exact hit needs only the index, not entities.tsv
    assert [saved.id_of(n) for n in ("ａｂｃ", "西紅柿", "没有")] == [4, 0, None]  # normalised, or unknown
    (folder / NAME_INDEX).unlink()
    (folder / NAME_INDEX_IDS).unlink()
    rebuilt = KnowledgeStore.load(folder)
    assert [rebuilt.id_of(n) for n in ("番茄", "西红柿", "香蕉", "abc公司", "ａｂｃ")] == [0, 0, 3, 4, 4]


def _shuffled_kg(seed: int = 0) -> tuple[list[str], list[str], torch.Tensor]:
    """Names in no sorted order and triples in random order, with repeats: a store as a user builds it."""
    gen = torch.Generator().manual_seed(seed)
    names = [f"实体{i}" for i in torch.randperm(60, generator=gen).tolist()]
    relations = [f"关系{i}" for i in (3, 0, 6, 1, 5, 2, 4)]
    triples = torch.stack(
        [torch.randint(0, 60, (700,), generator=gen), torch.randint(0, 7, (700,), generator=gen),
         torch.randint(0, 60, (700,), generator=gen)],
        dim=1,
    )  # fmt: skip
    return names, relations, triples


def test_save_writes_triples_grouped_by_head_and_relation(tmp_path: Path) -> None:
    """A store saved from shuffled triples has them distinct and in (head, relation, tail) order
    on disk; it reads back the same, and fusion's relation table equals the shuffled input's."""
    from rapiddiff.models.fusion import relation_table

    names, relations, triples = _shuffled_kg()
    assert not bool((triples[1:, 0] >= triples[:-1, 0]).all())  # the input is not grouped
    store = KnowledgeStore.from_arrays(
        names, relations, torch.randn(60, 4), torch.randn(7, 4), triples=triples
    )
    folder = store.save(tmp_path / "kg")
    lines = (folder / "triples.tsv").read_text(encoding="utf-8").splitlines()
    ent, rel = {n: i for i, n in enumerate(names)}, {n: i for i, n in enumerate(relations)}
    on_disk = [(ent[h], rel[r], ent[t]) for h, r, t in (line.split("\t") for line in lines[1:])]
    assert on_disk == sorted(set(map(tuple, triples.tolist())))  # grouped, distinct, nothing lost
    loaded = KnowledgeStore.load(folder)
    assert loaded.triples.tolist() == [list(t) for t in on_disk]
    assert torch.equal(store.triples, loaded.triples)  # the saved store took the written order
    assert loaded.config["n_triples"] == len(on_disk)
    expected = relation_table(triples, 60, 3)
    assert torch.equal(relation_table(loaded.triples, 60, 3), expected)
    assert (expected >= 0).sum() > 60  # heads with several relations, some capped at 3
    for head in (0, 17, 59):
        assert sorted(loaded.facts(head)) == sorted({(r, t) for h, r, t in triples.tolist() if h == head})


def test_store_written_before_with_unsorted_triples_reads_the_same(tmp_path: Path) -> None:
    """Stores saved before the grouping (triples in any order, repeats) still load correctly."""
    from rapiddiff.kg.triples import write_triples_array
    from rapiddiff.models.fusion import relation_table

    names, relations, triples = _shuffled_kg(1)
    store = KnowledgeStore.from_arrays(
        names, relations, torch.randn(60, 4), torch.randn(7, 4), triples=triples
    )
    folder = store.save(tmp_path / "kg")
    # as the earlier save wrote it: the ids in the given order, repeats included, no id copy
    write_triples_array(
        folder / "triples.tsv", triples.numpy(), names, relations, header="head\trelation\ttail"
    )
    (folder / "triples.ids.npy").unlink()
    loaded = KnowledgeStore.load(folder)
    first = list(dict.fromkeys(map(tuple, triples.tolist())))  # file order, first occurrences
    assert loaded.triples.tolist() == [list(t) for t in first]
    assert torch.equal(relation_table(loaded.triples, 60, 8), relation_table(triples, 60, 8))
    assert sorted(loaded.facts(5)) == sorted({(r, t) for h, r, t in first if h == 5})
    # saving it again writes it grouped
    again = KnowledgeStore.load(loaded.save(tmp_path / "kg2"))
    assert again.triples.tolist() == sorted(list(t) for t in first)


def test_triples_are_memory_mapped_from_their_id_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """save() writes triples.ids.npy beside triples.tsv; load() maps it instead of parsing the TSV
    (minutes and tens of GB at 140 M triples); a store without it (written before) reads the TSV
    and gives the same triples, facts and relation table."""
    import rapiddiff.kg.triples as triples_module
    from rapiddiff.kg.store import TRIPLE_IDS
    from rapiddiff.models.fusion import relation_table

    names, relations, triples = _shuffled_kg(2)
    store = KnowledgeStore.from_arrays(
        names, relations, torch.randn(60, 4), torch.randn(7, 4), triples=triples
    )
    folder = store.save(tmp_path / "kg")
    assert (folder / TRIPLE_IDS).is_file()

    def no_parse(*args: object, **kwargs: object) -> None:
        raise AssertionError("triples.tsv was parsed although the store has its id copy")

    with monkeypatch.context() as patch:
        patch.setattr(triples_module, "read_triples_array", no_parse)
        mapped = KnowledgeStore.load(folder)
        rows = mapped.triples
        file = str((folder / TRIPLE_IDS).resolve())  # the rows lie in a mapping of that file
        maps = [line.split() for line in Path("/proc/self/maps").read_text().splitlines()]
        spans = [tuple(int(x, 16) for x in m[0].split("-")) for m in maps if len(m) >= 6 and m[5] == file]
        assert any(lo <= rows.data_ptr() < hi for lo, hi in spans), "triples are not memory-mapped"
        assert rows.dtype == torch.long and torch.equal(rows, store.triples)
        facts = {h: mapped.facts(h) for h in range(61)}  # 60: out of range, no facts
        table = relation_table(rows, 60, 3)
    (folder / TRIPLE_IDS).unlink()  # now as a store saved before 2026-11-23
    parsed = KnowledgeStore.load(folder)
    assert torch.equal(parsed.triples, rows)
    assert {h: parsed.facts(h) for h in range(61)} == facts and facts[60] == []
    assert torch.equal(relation_table(parsed.triples, 60, 3), table)
    assert sum(map(len, facts.values())) == len(rows)


@pytest.mark.parametrize("damage", ["tsv edited", "wrong shape", "not npy"])
def test_stale_or_damaged_triple_ids_fall_back_to_the_tsv(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    import numpy as np

    from rapiddiff.kg.store import TRIPLE_IDS

    folder = _store().save(tmp_path / "kg")
    tsv = folder / "triples.tsv"
    if damage == "tsv edited":  # a fact added by hand: the id copy no longer says the same
        tsv.write_text(tsv.read_text(encoding="utf-8") + "香蕉\t颜色\t红色\n", encoding="utf-8")
    elif damage == "wrong shape":
        np.save(folder / TRIPLE_IDS, np.zeros((3, 2), dtype=np.int64))
    else:
        (folder / TRIPLE_IDS).write_bytes(b"not a numpy file")
    with caplog.at_level("WARNING"):
        loaded = KnowledgeStore.load(folder)
        rows = loaded.triples.tolist()
    assert TRIPLE_IDS in caplog.text and "reading triples.tsv instead" in caplog.text
    expected = [[0, 0, 1], [0, 1, 2], [3, 1, 2]] + ([[3, 0, 1]] if damage == "tsv edited" else [])
    assert rows == expected


def test_vector_files_are_safetensors_written_without_a_copy_in_memory(tmp_path: Path) -> None:
    """save() streams the vector files; safetensors' own reader reads them back exactly, with the
    metadata, and safetensors' own writer gives the same tensors through load()."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    store = _store()
    folder = store.save(tmp_path / "kg")
    for name, expected in (
        ("entity_embeddings.safetensors", store.entity_vectors),
        ("relation_embeddings.safetensors", store.relation_vectors),
    ):
        assert torch.equal(load_file(str(folder / name))["embeddings"], expected)
        with safe_open(str(folder / name), "pt") as f:
            assert f.metadata() == {"format": "rapiddiff.KnowledgeStore"}
        save_file({"embeddings": expected}, str(folder / name))  # as a store written before
    again = KnowledgeStore.load(folder)
    assert torch.equal(again.entity_vectors, store.entity_vectors)
    assert torch.equal(again.relation_vectors, store.relation_vectors)
