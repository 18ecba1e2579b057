"""Triples/alias TSV readers: good files parse, every bad line is named by file and line."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from rapiddiff.kg.triples import KGFormatError, read_aliases, read_triples, write_triples


def _write(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    return path


def test_reads_comments_blank_lines_bom_and_drops_duplicates(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _write(
        tmp_path / "t.tsv",
        "\ufeff# head\trelation\ttail\n番茄\t颜色\t红色\n\n番茄\t颜色\t红色\r\n  # note\n香蕉\t颜色\t 黄色 \n番茄\t颜色\t红色\n",
    )
    with caplog.at_level(logging.INFO, logger="rapiddiff"):
        triples = read_triples(path)
    assert triples == [("番茄", "颜色", "红色"), ("香蕉", "颜色", "黄色")]
    assert "2 triples read, 2 duplicates dropped" in caplog.text


@pytest.mark.parametrize(
    ("body", "line", "needle"),
    [
        ("a\tr\tb\na\tr\n", 2, "expected 3 tab-separated columns"),
        ("a\tr\tb\tc\n", 1, "got 4"),
        ("# c\na\t\tb\n", 2, "column 2 is empty"),
        (b"a\tr\tb\nx\tr\t\xb7\xac\n", 2, "not valid UTF-8"),
        ("\n\n# only comments\n", None, "no triples found"),
    ],
)
def test_triples_errors_name_file_and_line(
    tmp_path: Path, body: str | bytes, line: int | None, needle: str
) -> None:
    path = _write(tmp_path / "bad.tsv", body)
    with pytest.raises(KGFormatError) as err:
        read_triples(path)
    where = f"{path}:{line}:" if line else f"{path}:"
    assert where in str(err.value) and needle in str(err.value)


def test_missing_file_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="triples file not found"):
        read_triples(tmp_path / "nope.tsv")


def test_aliases_merge_and_check_entities(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.tsv", "# aliases\n番茄\t西红柿|蕃茄\n番茄\t蕃茄|番茄\nＡＢＣ\tabc\n")
    assert read_aliases(path) == {"番茄": ["西红柿", "蕃茄"], "ＡＢＣ": ["abc"]}
    with pytest.raises(KGFormatError, match=rf"{path}:4: alias line for unknown entity 'ＡＢＣ'"):
        read_aliases(path, entities={"番茄", "红色"})


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("番茄\t西红柿||x\n", "empty alias"),
        ("番茄\n", "expected 2 tab-separated columns"),
        ("番茄\ta\tb\n", "got 3"),
    ],
)
def test_alias_errors(tmp_path: Path, body: str, needle: str) -> None:
    path = _write(tmp_path / "a.tsv", body)
    with pytest.raises(KGFormatError, match=needle) as err:
        read_aliases(path)
    assert f"{path}:1:" in str(err.value)


def test_write_then_read_round_trips(tmp_path: Path) -> None:
    triples = [("番茄", "颜色", "红色"), ("New York", "in", "USA")]
    write_triples(tmp_path / "t.tsv", triples, header="head\trelation\ttail")
    assert read_triples(tmp_path / "t.tsv") == triples
    with pytest.raises(ValueError, match="cannot be written"):
        write_triples(tmp_path / "u.tsv", [("a\tb", "r", "c")])


def test_read_triples_array_fast_and_small_paths_agree(tmp_path, monkeypatch) -> None:
    """The pyarrow reader (large files) and the plain one (small files) give the same ids and
    names as pykeen's labelling of read_triples, and the writer writes what read_triples reads."""
    import numpy as np
    from pykeen.triples import TriplesFactory

    from rapiddiff.kg import triples as T

    path = tmp_path / "t.tsv"
    path.write_text(
        "\ufeff番茄\t颜色\t红色\n# comment\n# a\tb\tc\n\n  香蕉 \t颜色\t黄色\r\n番茄\t颜色\t红色\n香蕉\t形状\t长条\n   \n",
        encoding="utf-8",
    )
    exact = T.read_triples(path)
    small = T.read_triples_array(path)
    monkeypatch.setattr(T, "_SMALL_FILE", 0)
    large = T.read_triples_array(path)
    factory = TriplesFactory.from_labeled_triples(np.asarray(exact, dtype=str))
    for ids, entities, relations in (small, large):
        assert ids.tolist() == [
            [e.index(h), r.index(rel), e.index(t)] for e, r in [(entities, relations)] for h, rel, t in exact
        ]
        assert sorted(ids.tolist()) == factory.mapped_triples.tolist()  # pykeen sorts them
        assert entities == list(factory.entity_to_id) and relations == list(factory.relation_to_id)
    for reader_small in (True, False):  # sort=True: the same triples, sorted (pykeen's order)
        monkeypatch.setattr(T, "_SMALL_FILE", 16 << 20 if reader_small else 0)
        ids, entities, relations = T.read_triples_array(path, sort=True)
        assert ids.tolist() == factory.mapped_triples.tolist() and entities == large[1]
    out = tmp_path / "out.tsv"
    T.write_triples_array(out, large[0], large[1], large[2], header="x", chunk=2)
    assert T.read_triples(out) == exact
    for bad, message in (
        (b"a\tb\tc\nd\te\n", ":2: expected 3"),
        (b"a\tb\tc\nd\xff\te\tf\n", ":2: not valid UTF-8"),
    ):
        path.write_bytes(bad)
        with pytest.raises(T.KGFormatError, match=message):
            T.read_triples_array(path)


def test_group_triples_sorts_drops_duplicates_and_keeps_sorted_input() -> None:
    import numpy as np

    from rapiddiff.kg.triples import group_triples

    rng = np.random.default_rng(0)
    ids = np.stack([rng.integers(0, 30, 500), rng.integers(0, 4, 500), rng.integers(0, 30, 500)], axis=1)
    grouped = group_triples(ids, 30, 4)
    assert grouped.tolist() == np.unique(ids, axis=0).tolist()  # lexicographic, distinct
    assert group_triples(grouped, 30, 4) is grouped  # already in order: one check, no copy
    # ids too large for one int64 key: the lexicographic row sort gives the same order
    big = ids * np.array([10**9, 1, 10**9])
    assert group_triples(big, 3 * 10**10, 4).tolist() == np.unique(big, axis=0).tolist()
    assert group_triples(ids[:1], 30, 4).tolist() == ids[:1].tolist()
    with pytest.raises(ValueError, match=r"\[T, 3\]"):
        group_triples(ids[:, :2], 30, 4)


@pytest.mark.parametrize("fast", [False, True])
def test_lenient_reads_skip_and_name_each_bad_line(tmp_path: Path, monkeypatch, fast: bool) -> None:
    """With a ``skipped`` list, every reader keeps the good lines and records each bad one as
    (file:line, reason), where a strict read stops at the first."""
    from rapiddiff.kg import triples as T

    monkeypatch.setattr(T, "_SMALL_FILE", 0 if fast else 16 << 20)  # the pyarrow reader, or the plain one
    path = _write(tmp_path / "t.tsv", b"a\tr\tb\nbroken\n# c\nc\t\td\n\xff\tr\tb\nb\tr\tc\n")
    skipped: list[tuple[str, str]] = []
    ids, entities, relations = T.read_triples_array(path, skipped=skipped)
    assert [(entities[h], relations[r], entities[t]) for h, r, t in ids.tolist()] == [
        ("a", "r", "b"),
        ("b", "r", "c"),
    ]
    assert [where for where, _ in skipped] == [f"{path}:2", f"{path}:4", f"{path}:5"]
    assert "got 1" in skipped[0][1] and "column 2 is empty" in skipped[1][1] and "UTF-8" in skipped[2][1]
    aliases = _write(tmp_path / "a.tsv", "a\tA\nzz\tZ\nb\t|B\nb\tB\n")
    assert read_aliases(aliases, entities=entities, skipped=skipped) == {"a": ["A"], "b": ["B"]}
    assert [where for where, _ in skipped[3:]] == [f"{aliases}:2", f"{aliases}:3"]
    with pytest.raises(KGFormatError, match=":2: expected 3"):
        T.read_triples_array(path)
