"""EntityLinker: find the KnowledgeStore's entities in Chinese text, as character spans.

Normalise the text (:mod:`~rapiddiff.kg.normalize`), find every surface form with one MARISA-trie
prefix query a position (independent of word segmentation), reject a candidate whose start or end
falls strictly inside a word of jieba's HMM-free segmentation of its block (番茄 is not linked
inside 番茄酱), and keep the longest, then leftmost, of overlapping candidates. The segmentation
runs compiled (:mod:`~rapiddiff.kg.linker_dp`) with jieba's own float operations.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rapiddiff.kg.linker_index import (
    STORE_INDEX,
    LinkerIndex,
    index_of,
    jieba_table,
    jieba_words,
    read_store_index,
    word_check_module,
)
from rapiddiff.kg.normalize import normalize_with_offsets, original_span
from rapiddiff.utils.logging import get_logger

if TYPE_CHECKING:
    from rapiddiff.kg.store import KnowledgeStore

log = get_logger(__name__)

# jieba.cut splits text into these blocks and segments each on its own; characters outside them
# are single tokens (jieba/__init__.py, re_han_default). Copied so we can find the blocks ourselves.
_JIEBA_BLOCK = re.compile("[\u4e00-\u9fd5a-zA-Z0-9+#&\\._%\\-]+")


def _is_alnum(char: str) -> bool:
    return char.isascii() and char.isalnum()


def _inner_alnum(norm: str, p: int, n: int) -> bool:
    """True where ``p`` falls inside a run of Latin letters/digits: never a word boundary,
    whatever jieba would do with "abc" in its lexicon (it splits "abcd" into "abc" + "d")."""
    return 0 < p < n and _is_alnum(norm[p - 1]) and _is_alnum(norm[p])


def _segment(block: str, extra: dict[int, dict[int, float]] | None = None) -> list[int]:
    """End offsets of the words of jieba's HMM-free segmentation of one jieba block.

    jieba's get_DAG + calc fused into one right-to-left pass (same float operations and
    tie-breaking, so the same path as ``jieba.Tokenizer.cut(block, HMM=False)`` over the same
    dictionary; tests compare the two). ``extra`` adds words to jieba's dictionary for this
    block: start → {last index: weight}; an added word's weight replaces the dictionary's, as
    ``add_word`` does.
    """
    d = jieba_words()
    prefixes, weights, logtotal, longest = d.trie.iter_prefixes_with_ids, d.weights, d.logtotal, d.longest
    n = len(block)
    score = [0.0] * (n + 1)
    nxt = [0] * n
    for k in range(n - 1, -1, -1):
        best_end = -1
        best = 0.0
        added = extra.get(k) if extra else None
        if added is None:
            for word, key_id in prefixes(block[k : k + longest]):  # the DAG edges from k
                i = k + len(word) - 1
                sc = weights[key_id] + score[i + 1]
                if best_end < 0 or sc >= best:  # max over (score, end): ties go to the longer word
                    best, best_end = sc, i
        else:
            edges = dict(added)
            for word, key_id in prefixes(block[k : k + longest]):
                edges.setdefault(k + len(word) - 1, weights[key_id])
            for i in sorted(edges):
                sc = edges[i] + score[i + 1]
                if best_end < 0 or sc >= best:
                    best, best_end = sc, i
        if best_end < 0:  # no word starts here: the single character, log(1) - logtotal
            best, best_end = (0.0 - logtotal) + score[k + 1], k
        score[k] = best
        nxt[k] = best_end + 1
    return _path_ends(nxt)


def _path_ends(nxt: list[int]) -> list[int]:
    """The word ends along the best path of a segmentation DP (``nxt[k]``: where the word starting
    at ``k`` ends)."""
    ends = []
    x = 0
    while x < len(nxt):
        x = nxt[x]
        ends.append(x)
    return ends


def _flat_matches(matches: list[list[tuple[str, int]]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Trie matches per queried position as flat arrays: (matches at each position, each
    match's length, its key id), built by C-level iteration (no Python loop per match)."""
    counts = np.fromiter(map(len, matches), dtype=np.int64, count=len(matches))
    flat = list(itertools.chain.from_iterable(matches))
    if not flat:
        return counts, np.zeros(0, np.int64), np.zeros(0, np.int64)
    keys, key_ids = zip(*flat, strict=True)
    lens = np.fromiter(map(len, keys), dtype=np.int64, count=len(keys))
    return counts, lens, np.fromiter(key_ids, dtype=np.int64, count=len(key_ids))


def suggested_frequency(word: str) -> int:
    """The frequency ``jieba.Tokenizer.add_word(word)`` gives a word (``suggest_freq(word, False)``)
    against jieba's main dictionary: just enough to keep the word in one piece."""
    d = jieba_words()
    total = round(math.exp(d.logtotal))
    product = 1.0
    start = 0
    for end in _segment(word) if word else []:
        product *= (d.frequency(word[start:end]) or 1) / total
        start = end
    return max(int(product * total) + 1, d.frequency(word) or 1)


@dataclass(frozen=True)
class EntitySpan:
    """A linked mention: ``text[start:end] == surface`` in the ORIGINAL text."""

    start: int
    end: int
    entity_id: int
    surface: str


# Words saying that the mention after them is NOT in the picture: 画一个番茄，不是苹果 / 而不是 / 并非 /
# 没有 / 不要. Knowledge readers link with EntityLinker.link_affirmed, which skips such mentions:
# injecting 苹果's facts would draw them.
NEGATION_CUES: tuple[str, ...] = ("不是", "并非", "而非", "没有", "不要", "不含")
_NEGATED = re.compile("(?:" + "|".join(NEGATION_CUES) + r")[^，,。.；;：:！!？?、\s]{0,2}$")


def is_negated(text: str, span: EntitySpan) -> bool:
    """Whether a negation cue (:data:`NEGATION_CUES`) stands at most two characters before the mention,
    inside its clause ("不是Y", "而不是一个Y", "没有Y"; not "不是Y的Z"'s Z, nor across a comma)."""
    return _NEGATED.search(text, 0, span.start) is not None


class EntityLinker:
    """Longest-match entity linking over a surface-form lexicon, with a jieba word-cut check."""

    def __init__(
        self, lexicon: Mapping[str, int] | Iterable[tuple[str, int]], *, word_check: bool = True
    ) -> None:
        """``lexicon``: surface form → entity id (a mapping, or (form, id) pairs). Forms are
        normalised; on a clash the first wins.

        ``word_check=False`` skips the jieba check (pure longest match), for ablations.
        """
        pairs = lexicon.items() if isinstance(lexicon, Mapping) else lexicon
        self._set_index(index_of(pairs), word_check)

    def _set_index(self, index: LinkerIndex, word_check: bool) -> None:
        self.trie, self.entity_ids, self._heads = index.trie, index.entity_ids, index.heads
        self.longest, clashes = index.longest, index.clashes
        self._forms = int((self.entity_ids >= 0).sum())
        self._ids = memoryview(self.entity_ids)  # indexing gives a Python int: 3x a numpy scalar
        # The segmentation weight of each trie key (see LinkerIndex.weights); this linker fills
        # in its forms' add_word weights as it meets them, so it keeps its own copy (a read index's
        # is mapped copy-on-write: the filled-in pages are this process's).
        self._weights = index.weights
        self._scan_longest = max(self.longest, jieba_words().longest)
        self._singles = {h for h in self._heads if len(h) == 1}  # one-character forms
        self._head_set = index.head_set
        if clashes:
            log.info("%d surface forms normalise to a form of another entity; the first one is kept", clashes)
        self.word_check = word_check
        self._frequencies: dict[str, float] = {}

    @classmethod
    def from_store(cls, store: KnowledgeStore, *, word_check: bool = True) -> EntityLinker:
        """A linker of the store's names and aliases (names first, so a name always beats another
        entity's alias).

        A store saved with its linker's index (``store_folder/linker``, what ``save`` writes for a
        large store) gives it without a name read: the index is memory-mapped, in milliseconds.
        Where the store has none, or it no longer describes the store (entities.tsv edited, another
        linker version, a damaged file: logged at INFO), the index is built from the names as
        ``EntityLinker(store.forms())`` builds it, through the per-user cache.
        """
        index, why = read_store_index(store)
        if index is None:
            if store.path is not None and (store.path / STORE_INDEX).exists():
                log.info(
                    "%s: not used (%s); building the linker's index from the names",
                    store.path / STORE_INDEX,
                    why,
                )
            else:
                log.debug("%s: %s; the linker's index comes from the names", store.path, why)
            return cls(store.forms(), word_check=word_check)
        linker = cls.__new__(cls)
        linker._set_index(index, word_check)
        return linker

    def candidates(self, norm: str) -> list[tuple[int, int, int]]:
        """Every (start, end, entity_id) occurrence of a surface form in normalised text."""
        found = []
        prefixes = self.trie.iter_prefixes_with_ids
        ids = self._ids
        longest = self.longest  # the forms' longest: jieba's longer words are not needed here
        heads, singles = self._heads, self._singles
        for i in range(len(norm)):
            if norm[i : i + 2] in heads or (singles and norm[i] in singles):
                for key, key_id in prefixes(norm[i : i + longest]):
                    entity_id = ids[key_id]
                    if entity_id >= 0:
                        found.append((i, i + len(key), entity_id))
        return found

    def segment_ends(self, block: str) -> list[int]:
        """End offsets of the words of jieba's HMM-free segmentation of one jieba block, with
        jieba's dictionary plus the lexicon's forms found in the block (see :meth:`block_words`)."""
        spans = [(s, e) for s, e, _ in self.candidates(block)]
        return _segment(block, self._extra(block, 0, spans))

    def block_words(self, block: str) -> list[str]:
        """The lexicon's (normalised) forms that occur inside ``block``."""
        return sorted({block[s:e] for s, e, _ in self.candidates(block)})

    def word_frequency(self, form: str) -> float:
        """The frequency a lexicon form has in the segmentation: jieba's ``add_word`` suggestion."""
        freq = self._frequencies.get(form)
        if freq is None:
            if len(self._frequencies) > 1_000_000:  # a bound for long-running processes
                self._frequencies.clear()
            freq = self._frequencies[form] = float(suggested_frequency(form))
        return freq

    def _extra(self, norm: str, offset: int, spans: Iterable[tuple[int, int]]) -> dict[int, dict[int, float]]:
        """The lexicon words of one block (spans in ``norm``, block starting at ``offset``) as
        :func:`_segment`'s ``extra``: local start → {local last index: weight}."""
        extra: dict[int, dict[int, float]] = {}
        logtotal = jieba_words().logtotal
        for s, e in spans:
            weight = math.log(self.word_frequency(norm[s:e])) - logtotal
            extra.setdefault(s - offset, {})[e - 1 - offset] = weight
        return extra

    def _checked_candidates(self, norm: str) -> list[tuple[int, int, int]]:
        """Candidates whose both ends are word boundaries: not strictly inside a jieba block,
        or an end of a word of that block's segmentation.

        Python queries the trie where a form may start (forms and jieba's words in one query);
        the rest — jieba's words elsewhere, the blocks, the DP, the filter — runs compiled
        (:mod:`rapiddiff.kg.linker_dp`) on the matches as flat arrays."""
        dp = word_check_module(len(norm))
        cp = np.frombuffer(norm.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        qpos = dp.form_starts(cp, *self._head_set)
        if not qpos.size:
            return []
        prefixes, longest = self.trie.iter_prefixes_with_ids, self._scan_longest
        counts, lens, kids = _flat_matches([list(prefixes(norm[i : i + longest])) for i in qpos.tolist()])
        d = jieba_words()
        words = jieba_table()
        args = (cp, qpos, counts, lens, kids, self.entity_ids, self._weights, d.logtotal, *words)
        cs, ce, ci, keep, unweighed = dp.check(*args)
        if unweighed.size:  # forms met for the first time in a segmented block: weigh them, then redo
            restore = self.trie.restore_key
            for key_id in set(unweighed.tolist()):
                self._weights[key_id] = math.log(float(suggested_frequency(restore(key_id)))) - d.logtotal
            cs, ce, ci, keep, unweighed = dp.check(*args)
        return list(zip(cs[keep].tolist(), ce[keep].tolist(), ci[keep].tolist(), strict=True))

    def link(self, text: str, *, word_check: bool | None = None) -> list[EntitySpan]:
        """Non-overlapping entity spans of ``text``, sorted by start (``word_check`` overrides
        the linker's setting for this call)."""
        if not text:
            return []
        norm, offsets = normalize_with_offsets(text)
        check = self.word_check if word_check is None else word_check
        found = self._checked_candidates(norm) if check else self.candidates(norm)
        if not found:
            return []
        # Longest first, then leftmost; accept what does not overlap an accepted span.
        found.sort(key=lambda c: (c[0] - c[1], c[0]))
        taken = bytearray(len(norm))
        spans = []
        for s, e, entity_id in found:
            if any(taken[s:e]):
                continue
            taken[s:e] = b"\x01" * (e - s)
            start, end = original_span(offsets, s, e)
            spans.append(EntitySpan(start, end, entity_id, text[start:end]))
        spans.sort(key=lambda span: span.start)
        return spans

    def link_affirmed(self, text: str) -> list[EntitySpan]:
        """:meth:`link` without the mentions ``text`` negates (:func:`is_negated`): the spans that get
        knowledge, in training data and at inference alike."""
        return [span for span in self.link(text) if not is_negated(text, span)]

    def __len__(self) -> int:
        return self._forms
