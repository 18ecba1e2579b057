"""EntityLinker on a small Chinese set: overlaps, aliases, traditional / full-width forms, words."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from rapiddiff.kg.linker import EntityLinker, EntitySpan
from rapiddiff.kg.normalize import normalize
from rapiddiff.kg.store import KnowledgeStore

NAMES = ["番茄", "番茄酱", "红色", "茄子", "ABC", "北京", "北京大学", "大学", "熊猫"]
ALIASES = {"番茄": ["西红柿", "蕃茄"], "番茄酱": ["蕃茄酱"], "熊猫": ["大熊猫"]}


@pytest.fixture(scope="module")
def linker() -> EntityLinker:
    store = KnowledgeStore.from_arrays(
        NAMES, ["r"], torch.zeros(len(NAMES), 2), torch.zeros(1, 2), aliases=ALIASES
    )
    return EntityLinker.from_store(store)


def _spans(linker: EntityLinker, text: str) -> list[tuple[str, str]]:
    spans = linker.link(text)
    for span in spans:
        assert text[span.start : span.end] == span.surface  # offsets into the ORIGINAL text
    assert all(a.end <= b.start for a, b in itertools.pairwise(spans))  # sorted, no overlap
    return [(s.surface, NAMES[s.entity_id]) for s in spans]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("蓝色背景上有一个番茄", [("番茄", "番茄")]),
        # the longer entity wins over the one inside it
        ("我爱吃番茄酱", [("番茄酱", "番茄酱")]),
        ("番茄和番茄酱", [("番茄", "番茄"), ("番茄酱", "番茄酱")]),
        # aliases, traditional characters and variant spellings
        ("一个西红柿", [("西红柿", "番茄")]),
        ("一個西紅柿", [("西紅柿", "番茄")]),
        ("蕃茄醬很好吃", [("蕃茄醬", "番茄酱")]),
        ("红色的蕃茄", [("红色", "红色"), ("蕃茄", "番茄")]),
        ("紅色的番茄", [("紅色", "红色"), ("番茄", "番茄")]),
        # full-width and case
        ("ＡＢＣ公司", [("ＡＢＣ", "ABC")]),
        ("abc 和 Abc", [("abc", "ABC"), ("Abc", "ABC")]),
        # not inside a longer Latin word
        ("ABCD", []),
        # overlap: longest, then leftmost
        ("北京大学的熊猫", [("北京大学", "北京大学"), ("熊猫", "熊猫")]),
        ("一只大熊猫", [("大熊猫", "熊猫")]),
        # an entity inside a longer word that jieba keeps whole is not linked
        ("番茄汁", []),
        ("茄子是紫色的", [("茄子", "茄子")]),
        ("", []),
        ("没有实体", []),
    ],
)
def test_link_spans(linker: EntityLinker, text: str, expected: list[tuple[str, str]]) -> None:
    assert _spans(linker, text) == expected


def test_entity_inside_a_word_only_when_word_check_is_on() -> None:
    plain = EntityLinker({"番茄": 0}, word_check=False)
    checked = EntityLinker({"番茄": 0})
    assert [s.surface for s in plain.link("番茄酱")] == ["番茄"]
    assert checked.link("番茄酱") == []
    assert checked.link("番茄，酱") == [EntitySpan(0, 2, 0, "番茄")]


def test_private_jieba_leaves_global_dictionary_alone() -> None:
    import jieba

    linker = EntityLinker({"蓝莓番茄塔": 7})
    assert linker.link("一个蓝莓番茄塔") == [EntitySpan(2, 7, 7, "蓝莓番茄塔")]
    assert "蓝莓番茄塔" not in jieba.lcut("一个蓝莓番茄塔", HMM=False)


def test_normalize_keeps_length_and_folds_forms() -> None:
    text = "ＡＢＣ　蕃茄醬 西紅柿 Ａｂｃ ß"
    out = normalize(text)
    assert len(out) == len(text)
    assert out == "abc 蕃茄酱 西红柿 abc ß"


def test_store_round_trip_then_link(tmp_path: Path) -> None:
    store = KnowledgeStore.from_arrays(
        NAMES, ["r"], torch.zeros(len(NAMES), 2), torch.zeros(1, 2), aliases=ALIASES
    )
    loaded = KnowledgeStore.load(store.save(tmp_path / "kg"))
    spans = EntityLinker.from_store(loaded).link("西紅柿炒蛋")
    assert [(s.start, s.end, loaded.entity_names[s.entity_id]) for s in spans] == [(0, 3, "番茄")]


def test_fused_segmentation_equals_jieba(linker: EntityLinker) -> None:
    # The linker's own pass must put word boundaries exactly where jieba.cut(HMM=False) does.
    import random

    import jieba

    from rapiddiff.kg.linker import _JIEBA_BLOCK
    from rapiddiff.kg.linker_index import jieba_dictionary as _jieba_dictionary

    rng = random.Random(0)
    pieces = [
        "北京大学",
        "的",
        "熊猫",
        "番茄酱",
        "研究生命起源",
        "结婚的和尚未结婚的",
        "我们",
        "中华人民共和国",
        "abc",
        "12",
        "x",
    ]
    texts = ["南京市长江大桥", "他说的确实在理", "工信处女干事每月经过下属科室"]
    texts += ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))) for _ in range(60)]
    freq, total = _jieba_dictionary()
    for text in texts:
        for block in _JIEBA_BLOCK.finditer(text):
            # jieba itself, with the lexicon's forms found in the block added at the linker's
            # frequencies (total kept: the linker adds words per block, not to the whole dictionary)
            tok = jieba.Tokenizer()
            tok.FREQ, tok.total, tok.initialized = dict(freq), total, True
            for word in linker.block_words(block.group()):
                tok.add_word(word, freq=int(linker.word_frequency(word)))
            tok.total = total
            ends, offset = [], 0
            for word in tok.cut(block.group(), HMM=False):
                offset += len(word)
                ends.append(offset)
            if any(c.isascii() for c in block.group()):
                # jieba glues runs of single Latin letters into one token; link() never cuts there anyway.
                continue
            assert linker.segment_ends(block.group()) == ends, block.group()


def test_surface_with_characters_outside_jieba_blocks() -> None:
    linker = EntityLinker({"达·芬奇": 0, "C++": 1, "蒙娜丽莎": 2})
    assert [(s.surface, s.entity_id) for s in linker.link("达·芬奇画了蒙娜丽莎")] == [
        ("达·芬奇", 0),
        ("蒙娜丽莎", 2),
    ]
    assert [s.surface for s in linker.link("学C++很难")] == ["C++"]


@pytest.mark.parametrize(
    "text",
    [
        "达·芬奇画了蒙娜丽莎",  # U+00B7, the form in the lexicon
        "達・芬奇画了蒙娜丽莎",  # U+30FB katakana middle dot, traditional 達
        "达•芬奇画了蒙娜丽莎",  # U+2022 bullet
        "达‧芬奇画了蒙娜丽莎",  # U+2027 hyphenation point
        "达･芬奇画了蒙娜丽莎",  # U+FF65 half-width katakana middle dot
    ],
)
def test_middle_dot_family_matches(text: str) -> None:
    linker = EntityLinker({"达·芬奇": 0, "蒙娜丽莎": 1})
    spans = linker.link(text)
    assert [(s.start, s.end, s.entity_id) for s in spans] == [(0, 4, 0), (6, 10, 1)]
    assert spans[0].surface == text[:4]


def test_decomposed_accents_match_composed_with_offsets_into_the_text() -> None:
    import unicodedata

    linker = EntityLinker({"Pokémon": 0, "Renée": 1, "番茄": 2})
    decomposed = unicodedata.normalize("NFD", "喜欢Pokémon和番茄")
    assert len(decomposed) == 13  # é is e + U+0301
    spans = linker.link(decomposed)
    assert [(s.start, s.end, s.entity_id, s.surface) for s in spans] == [
        (2, 10, 0, decomposed[2:10]),
        (11, 13, 2, "番茄"),
    ]
    # A decomposed name in the lexicon matches composed text the same way.
    nfd = EntityLinker({unicodedata.normalize("NFD", "Renée"): 1})
    assert [(s.start, s.end) for s in nfd.link("我是Renée。")] == [(2, 7)]


def test_normalize_with_offsets_maps_back() -> None:
    import unicodedata

    from rapiddiff.kg.normalize import normalize_with_offsets, original_span

    text = unicodedata.normalize("NFD", "Éa・b")
    norm, offsets = normalize_with_offsets(text)
    assert norm == "éa·b"
    assert original_span(offsets, 0, 1) == (0, 2)
    assert original_span(offsets, 1, 4) == (2, 5)
    assert normalize_with_offsets("达·芬奇")[1] is None  # composed text: offsets carry over


def test_suggested_frequency_is_jiebas() -> None:
    import jieba

    from rapiddiff.kg.linker import suggested_frequency
    from rapiddiff.kg.linker_index import jieba_dictionary as _jieba_dictionary

    freq, total = _jieba_dictionary()
    tok = jieba.Tokenizer()
    tok.FREQ, tok.total, tok.initialized = dict(freq), total, True
    for word in ["番茄酱", "蓝莓番茄塔", "北京大学", "达·芬奇", "x"]:
        assert suggested_frequency(word) == tok.suggest_freq(word, tune=False), word


def test_large_lexicon_from_pairs_and_clashes() -> None:
    # (form, id) pairs instead of a dict (what from_store passes for millions of names); the
    # first of two forms that normalise alike wins.
    pairs = [(f"名字{i}号", i) for i in range(5000)] + [("ＡＢＣ", 7), ("abc", 8)]
    linker = EntityLinker(iter(pairs))
    assert len(linker) == 5001
    assert [(s.surface, s.entity_id) for s in linker.link("见到名字42号和abc")] == [
        ("名字42号", 42),
        ("abc", 7),
    ]


def _reference_checked(linker: EntityLinker, norm: str) -> list[tuple[int, int, int]]:
    """The word check as it was: a second query per position into jieba's own trie (_segment),
    the block's forms added through _extra."""
    from rapiddiff.kg.linker import _JIEBA_BLOCK, _inner_alnum, _segment

    found = linker.candidates(norm)
    n = len(norm)
    block_at = [-1] * n
    blocks = []
    for b, match in enumerate(_JIEBA_BLOCK.finditer(norm)):
        blocks.append(match.span())
        block_at[match.start() : match.end()] = [b] * (match.end() - match.start())

    def inside(p: int) -> bool:
        return 0 < p < n and block_at[p] >= 0 and block_at[p - 1] == block_at[p]

    words: dict[int, list[tuple[int, int]]] = {block_at[p]: [] for c in found for p in c[:2] if inside(p)}
    for s, e, _ in found:
        if block_at[s] in words and block_at[e - 1] == block_at[s]:
            words[block_at[s]].append((s, e))
    boundaries: set[int] = set()
    for b, spans in words.items():
        start, end = blocks[b]
        boundaries.update(start + x for x in _segment(norm[start:end], linker._extra(norm, start, spans)))
    return [
        c
        for c in found
        if (not inside(c[0]) or c[0] in boundaries)
        and (not inside(c[1]) or c[1] in boundaries)
        and not _inner_alnum(norm, c[0], n)
        and not _inner_alnum(norm, c[1], n)
    ]


def _dense_texts(rng: Any, words: list[str], lexicon: dict[str, int], count: int) -> list[str]:
    pool = [*rng.sample(words, 400), *rng.sample(sorted(lexicon), min(len(lexicon), 2000))]
    pool += ["，", "。", "的", "了", "x", "12", "abc", "C++", "·", "ＡＢ", "番茄酱"]
    return ["".join(rng.choice(pool) for _ in range(rng.randint(3, 30))) for _ in range(count)]


@pytest.mark.parametrize("loops", ["compiled", "plain"])
@pytest.mark.parametrize("dense", [False, True])
def test_compiled_word_check_keeps_what_the_python_reference_keeps(
    monkeypatch: pytest.MonkeyPatch, dense: bool, loops: str
) -> None:
    """The compiled check (forms and jieba's words from one trie query where a form may start,
    jieba's words from the hash table elsewhere, the DP in numba) keeps exactly the candidates the
    pure-Python reference keeps (jieba's own trie, _segment's DP), on dense random text. Sparse: a
    3,000-word lexicon, so most positions take jieba's words from the hash table; dense: every
    dictionary word of 2+ characters and every character of the texts is a form, as at 16 M names,
    so nearly every position is queried and nearly every block segmented. "plain": the same loops
    as linker_dp's plain-Python twin (what a process uses for its first few thousand characters)."""
    import random

    from rapiddiff.kg import linker_dp
    from rapiddiff.kg import linker_index as linker_module
    from rapiddiff.kg.linker_index import jieba_dictionary as _jieba_dictionary
    from rapiddiff.kg.normalize import normalize

    monkeypatch.setattr(linker_module, "_PLAIN_CHARS", 10**12 if loops == "plain" else 0)
    monkeypatch.setattr(linker_module, "_plain_chars_used", 0)
    expected = linker_module.plain_dp() if loops == "plain" else linker_dp
    assert linker_module.word_check_module(1) is expected
    assert hasattr(expected.check, "py_func") == (loops == "compiled")

    rng = random.Random(3 if not dense else 4)
    freq, _ = _jieba_dictionary()
    words = sorted(w for w, f in freq.items() if f and len(w) >= 2)
    lexicon = {w: i for i, w in enumerate(rng.sample(words, 3000) if not dense else words)}
    lexicon.update({"番茄": -1, "番茄酱": -1, "红色": -1, "abc": -1, "C++": -1, "达·芬奇": -1})
    texts = _dense_texts(rng, words, lexicon, 200)
    if dense:
        lexicon.update((c, -1) for c in sorted(set("".join(texts))) if c.strip())
    lexicon = {w: i for i, w in enumerate(lexicon)}
    linker = EntityLinker(lexicon)
    assert linker_module.word_check_module(1) is expected
    kept = found = 0
    for text in texts:
        norm = normalize(text)
        ours = linker._checked_candidates(norm)
        assert ours == _reference_checked(linker, norm), text
        assert linker._checked_candidates(norm) == ours  # again, every form weighed now
        kept, found = kept + len(ours), found + len(linker.candidates(norm))
    assert 500 < kept < found  # dense in forms, and the check rejected some


def test_jieba_hash_table_is_jiebas_dictionary() -> None:
    """The compiled check's table of jieba's words gives, at every position, the words jieba's
    get_DAG finds there (walking its dictionary of words and prefixes), at jieba's weights."""
    import random

    import numpy as np

    from rapiddiff.kg import linker_dp
    from rapiddiff.kg.linker_index import jieba_dictionary as _jieba_dictionary
    from rapiddiff.kg.linker_index import jieba_table as _jieba_table
    from rapiddiff.kg.linker_index import jieba_words as _jieba

    freq, _ = _jieba_dictionary()
    d = _jieba()
    rng = random.Random(5)
    words = sorted(w for w, f in freq.items() if f)
    text = "".join(rng.choice(words) for _ in range(3000)) + "abc12ＸＹ，的了x"
    cp = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    starts, ends, weights = linker_dp.jieba_dag(cp, *_jieba_table())
    got = list(zip(starts.tolist(), ends.tolist(), weights.tolist(), strict=True))
    expected = []
    for k in range(len(text)):  # jieba.Tokenizer.get_DAG, then calc's weight of each word
        i = k
        frag = text[k]
        while i < len(text) and frag in freq:
            if freq[frag]:
                expected.append((k, i, d.weights[d.trie[frag]]))
            i += 1
            frag = text[k : i + 1]
    assert got == expected
    assert len({s for s, _, _ in got}) > 0.9 * len(text)


def test_word_check_without_numba_keeps_the_same_spans(
    monkeypatch: pytest.MonkeyPatch, linker: EntityLinker
) -> None:
    """Where numba cannot be installed, linker_dp runs the same code as plain Python: same spans."""
    import importlib
    import sys

    from rapiddiff.kg import linker_dp

    texts = ["一碗番茄炒蛋和一个苹果", "番茄酱不是番茄", "北京烤鸭在北京", "这张图里只有一个苹果，位于左边"]
    compiled = [linker.link(text) for text in texts]
    monkeypatch.setitem(sys.modules, "numba", None)  # `import numba` now raises ImportError
    try:
        plain_module = importlib.reload(linker_dp)
        assert not hasattr(plain_module.check, "py_func"), "check is still a numba dispatcher"
        assert [linker.link(text) for text in texts] == compiled
    finally:
        monkeypatch.undo()
        importlib.reload(linker_dp)
    assert hasattr(linker_dp.check, "py_func")


def _index_folders(folder: Path) -> list[Path]:
    return sorted(folder.glob("linker-*"))


def test_cached_index_is_the_built_one(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A linker read from the on-disk cache is the one a build makes: the same trie keys and ids,
    entity ids, weights, heads and lengths, and the same spans; nothing is built the second time."""
    import numpy as np

    from rapiddiff.kg import linker_index as linker_module

    monkeypatch.setenv("RAPIDDIFF_CACHE_DIR", str(tmp_path))
    lexicon = {name: i for i, name in enumerate(NAMES)} | {"西红柿": 0, "大熊猫": 8, "蕃茄": 0}
    built = EntityLinker(lexicon)
    assert len(_index_folders(tmp_path)) == 1  # the trie and the arrays, in one folder
    builds = []
    monkeypatch.setattr(linker_module, "_build_index", lambda *a: builds.append(a) or pytest.fail("rebuilt"))
    cached = EntityLinker(lexicon)
    assert not builds
    assert list(cached.trie.iteritems()) == list(built.trie.iteritems())
    assert np.array_equal(cached.entity_ids, built.entity_ids) and cached.entity_ids.dtype == np.int32
    assert np.array_equal(cached._weights, built._weights, equal_nan=True)
    assert (cached._heads, cached.longest, cached._scan_longest, len(cached)) == (
        built._heads, built.longest, built._scan_longest, len(built),
    )  # fmt: skip
    texts = ["一个西紅柿和北京大学的大熊猫", "番茄酱不是番茄", "ＡＢＣ公司的茄子", "番茄汁"]
    assert [cached.link(t) for t in texts] == [built.link(t) for t in texts]
    # The linker fills in its forms' weights as it meets them: the cache keeps the unfilled ones.
    assert np.isnan(EntityLinker(lexicon)._weights[cached.entity_ids >= 0]).all()


def test_changed_lexicon_never_reuses_an_old_index(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A changed store (a form added, an id changed, the same forms in another order — which decides
    clashes) gets its own index; the old one is never read for it."""
    monkeypatch.setenv("RAPIDDIFF_CACHE_DIR", str(tmp_path))
    names = ["番茄", "红色", "熊猫"]
    store = KnowledgeStore.from_arrays(names, ["r"], torch.zeros(3, 2), torch.zeros(1, 2))
    assert [s.entity_id for s in EntityLinker.from_store(store).link("红色的番茄")] == [1, 0]
    renamed = KnowledgeStore.from_arrays(
        ["熊猫", "红色", "番茄"], ["r"], torch.zeros(3, 2), torch.zeros(1, 2)
    )
    assert [s.entity_id for s in EntityLinker.from_store(renamed).link("红色的番茄")] == [1, 2]
    aliased = KnowledgeStore.from_arrays(
        names, ["r"], torch.zeros(3, 2), torch.zeros(1, 2), aliases={"番茄": ["西红柿"]}
    )
    assert [s.surface for s in EntityLinker.from_store(aliased).link("红色的西红柿")] == ["红色", "西红柿"]
    assert EntityLinker.from_store(store).link("红色的西红柿") == [EntitySpan(0, 2, 1, "红色")]
    # Order decides a clash (two forms that normalise alike): first pair wins, cache or not.
    assert EntityLinker([("番茄", 0), ("番茄", 5)]).link("番茄")[0].entity_id == 0
    assert EntityLinker([("番茄", 5), ("番茄", 0)]).link("番茄")[0].entity_id == 5
    assert len(_index_folders(tmp_path)) == 5


def test_index_cache_is_keyed_on_the_code_and_jieba(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Another linker version (or jieba dictionary) does not read this one's index."""
    from rapiddiff.kg import linker_index as linker_module

    monkeypatch.setenv("RAPIDDIFF_CACHE_DIR", str(tmp_path))
    EntityLinker({"番茄": 0})
    monkeypatch.setattr(linker_module, "_INDEX_VERSION", linker_module._INDEX_VERSION + 1)
    EntityLinker({"番茄": 0})
    assert len(_index_folders(tmp_path)) == 2
    jieba_version, size, _ = linker_module._jieba_identity()
    monkeypatch.setattr(
        linker_module, "_jieba_identity", lambda: (jieba_version, size, "0" * 64)
    )  # other words
    EntityLinker({"番茄": 0})
    assert len(_index_folders(tmp_path)) == 3
    # The code digest covers linker_index.py and linker_dp.py (the head set's hash layout is cached).
    code = tmp_path / "code"
    code.mkdir()
    for name in ("linker_index.py", "linker_dp.py"):
        (code / name).write_bytes(Path(linker_module.__file__).with_name(name).read_bytes())
    monkeypatch.setattr(linker_module, "__file__", str(code / "linker_index.py"))
    digests = [linker_module._code_digest.__wrapped__()]
    for name in ("linker_dp.py", "linker_index.py"):
        with (code / name).open("a") as f:
            f.write("# edited\n")
        digests.append(linker_module._code_digest.__wrapped__())
    assert len(set(digests)) == 3


def test_damaged_or_unwritable_index_cache_builds_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A truncated or emptied cache file is built again (and rewritten); a cache folder that cannot
    be written only costs the build."""
    monkeypatch.setenv("RAPIDDIFF_CACHE_DIR", str(tmp_path / "cache"))
    expected = EntityLinker({"番茄": 0, "红色": 1}).link("红色的番茄")
    (folder,) = _index_folders(tmp_path / "cache")
    for damaged in sorted(folder.iterdir()):
        good = damaged.read_bytes()
        for bad in (good[: len(good) // 2], b""):
            damaged.write_bytes(bad)
            assert EntityLinker({"番茄": 0, "红色": 1}).link("红色的番茄") == expected
            assert damaged.read_bytes() == good  # rewritten
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("RAPIDDIFF_CACHE_DIR", str(blocker / "cache"))
    assert EntityLinker({"番茄": 0, "红色": 1}).link("红色的番茄") == expected


def test_index_cache_keeps_the_most_recently_used(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from rapiddiff.kg import linker_index as linker_module

    monkeypatch.setenv("RAPIDDIFF_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(linker_module, "_KEEP_INDEXES", 2)
    EntityLinker({"番茄": 0})
    first = _index_folders(tmp_path)
    EntityLinker({"红色": 0})
    EntityLinker({"番茄": 0})  # read: now the most recently used
    EntityLinker({"熊猫": 0})
    folders = _index_folders(tmp_path)
    assert len(folders) == 2 and set(first) <= set(folders)


def test_a_short_text_links_without_starting_numba(tmp_path: Path) -> None:
    """A fresh process that links a prompt (a cold `rapiddiff generate`) runs the word check as
    linker_dp's plain twin: numba is never imported; the spans are the compiled check's."""
    import json
    import os
    import subprocess
    import sys

    from rapiddiff.kg import linker_dp
    from rapiddiff.kg import linker_index as linker_module

    assert linker_module.plain_dp().__name__ == linker_dp.PLAIN_TWIN
    lexicon = {name: i for i, name in enumerate(NAMES)} | {"西红柿": 0}
    text = "一個西紅柿和北京大学的大熊猫，番茄酱不是番茄"
    code = (
        "import json, sys\n"
        "from rapiddiff.kg.linker import EntityLinker\n"
        f"spans = EntityLinker({lexicon!r}).link({text!r})\n"
        "print(json.dumps([[s.start, s.end, s.entity_id] for s in spans] + ['numba' in sys.modules]))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for _ in range(2):  # the first run may build the caches (jieba's table is built compiled)
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path
        )
        assert done.returncode == 0, done.stderr
    *spans, numba_loaded = json.loads(done.stdout)
    assert numba_loaded is False
    assert spans == [[s.start, s.end, s.entity_id] for s in EntityLinker(lexicon).link(text)]
    assert len(spans) == 4


@pytest.mark.parametrize(
    ("text", "mention", "negated"),
    [
        ("画一个番茄，不是牛仔裤，背景是浅蓝色", "牛仔裤", True),
        ("画一个番茄，不是牛仔裤，背景是浅蓝色", "番茄", False),
        ("中间放着的是苹果而不是金字塔", "金字塔", True),
        ("中间放着的是苹果而不是金字塔", "苹果", False),
        ("桌上没有一个苹果", "苹果", True),  # up to two characters between cue and mention
        ("不是苹果的番茄", "番茄", False),  # too far from the cue
        ("不是，苹果", "苹果", False),  # another clause
        ("并非苹果", "苹果", True),
    ],
)
def test_is_negated(text: str, mention: str, negated: bool) -> None:
    from rapiddiff.kg.linker import EntitySpan, is_negated

    start = text.index(mention)
    assert is_negated(text, EntitySpan(start, start + len(mention), 0, mention)) is negated


def test_link_affirmed_drops_only_the_negated_mentions(linker: EntityLinker) -> None:
    text = "画一个番茄，不是熊猫"
    assert [s.surface for s in linker.link(text)] == ["番茄", "熊猫"]  # linking itself keeps both
    assert [s.surface for s in linker.link_affirmed(text)] == ["番茄"]
