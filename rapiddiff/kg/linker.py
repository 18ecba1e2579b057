"""EntityLinker: find the KnowledgeStore's entities in Chinese text, as character spans.

1. Normalise the text character by character (full/half width, case, traditional → simplified;
   :mod:`rapiddiff.kg.normalize`), so offsets stay those of the original text.
2. Find every occurrence of every surface form (names and aliases) with a character trie —
   independent of word segmentation, so an entity is found wherever it is written.
3. Reject a candidate whose start or end falls inside a word of jieba's segmentation (HMM off,
   the entity lexicon added to a private ``jieba.Tokenizer``): 番茄 is not linked inside
   番茄酱 unless 番茄酱 is itself an entity. jieba is the expensive step, so it runs only on the
   jieba blocks (runs of Han/alphanumeric characters, which jieba segments independently) where
   a candidate boundary falls strictly inside the block.
4. Keep the longest, then leftmost, of overlapping candidates.

Why a pure-Python trie and not pyahocorasick: the trie walk costs well under jieba's check on
the benchmark (BENCHMARKS.md, ``benchmarks/kg_link_speed.py``), so a C automaton would not
change the total, and it would be one more compiled dependency.
"""

from __future__ import annotations

import bisect
import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rapiddiff.kg.normalize import normalize, normalize_with_offsets, original_span
from rapiddiff.utils.logging import get_logger

if TYPE_CHECKING:
    from rapiddiff.kg.store import KnowledgeStore

log = get_logger(__name__)

_PREFIX = object()  # marks a dictionary prefix that is not itself a word
_END = ""  # trie key marking "a surface form ends here"; no character is the empty string
# jieba.cut splits text into these blocks and segments each on its own; characters outside them
# are single tokens (jieba/__init__.py, re_han_default). Copied so we can find the blocks ourselves.
_JIEBA_BLOCK = re.compile("[\u4e00-\u9fd5a-zA-Z0-9+#&\\._%\\-]+")


@functools.cache
def _jieba_dictionary() -> tuple[dict[str, int], int]:
    """jieba's main dictionary (word/prefix → frequency, total), loaded once per process."""
    import logging

    import jieba

    jieba.setLogLevel(logging.WARNING)
    tok = jieba.Tokenizer()
    tok.initialize()
    return tok.FREQ, tok.total


def _is_alnum(char: str) -> bool:
    return char.isascii() and char.isalnum()


def _inner_alnum(norm: str, p: int, n: int) -> bool:
    """True where ``p`` falls inside a run of Latin letters/digits: never a word boundary,
    whatever jieba would do with "abc" in its lexicon (it splits "abcd" into "abc" + "d")."""
    return 0 < p < n and _is_alnum(norm[p - 1]) and _is_alnum(norm[p])


def _trie_matches(trie: dict[str, Any], norm: str) -> list[tuple[int, int, int]]:
    end_key = _END
    found = []
    n = len(norm)
    for i in range(n):
        node = trie.get(norm[i])
        j = i + 1
        while node is not None:
            hit = node.get(end_key)
            if hit is not None:
                found.append((i, j, hit))
            if j == n:
                break
            node = node.get(norm[j])
            j += 1
    return found


@dataclass(frozen=True)
class EntitySpan:
    """A linked mention: ``text[start:end] == surface`` in the ORIGINAL text."""

    start: int
    end: int
    entity_id: int
    surface: str


class EntityLinker:
    """Longest-match entity linking over a surface-form lexicon, with a jieba word-cut check."""

    def __init__(self, lexicon: Mapping[str, int], *, word_check: bool = True) -> None:
        """``lexicon``: surface form → entity id. Forms are normalised; on a clash the first wins.

        ``word_check=False`` skips the jieba check (pure longest match), for ablations.
        """
        self.trie: dict[str, Any] = {}
        self.surfaces: dict[str, int] = {}
        clashes = 0
        for surface, entity_id in lexicon.items():
            key = normalize(surface.strip())
            if not key:
                continue
            if key in self.surfaces:
                clashes += self.surfaces[key] != entity_id
                continue
            self.surfaces[key] = int(entity_id)
            node = self.trie
            for char in key:
                node = node.setdefault(char, {})
            node[_END] = int(entity_id)
        # Surface forms with a character outside jieba's blocks cannot be met by the block scan.
        self._cross_trie: dict[str, Any] = {}
        for key, entity_id in self.surfaces.items():
            if _JIEBA_BLOCK.fullmatch(key) is None:
                node = self._cross_trie
                for char in key:
                    node = node.setdefault(char, {})
                node[_END] = entity_id
        if clashes:
            log.info("%d surface forms normalise to a form of another entity; the first one is kept", clashes)
        self.word_check = word_check
        self._tokenizer: Any = None
        self._weights: dict[str, Any] | None = None
        self._weights_total = 0
        self._logtotal = 0.0

    @classmethod
    def from_store(cls, store: KnowledgeStore, **kwargs: Any) -> EntityLinker:
        """Names first, then aliases, so a name always beats another entity's alias."""
        lexicon: dict[str, int] = {}
        for i, name in enumerate(store.entity_names):
            lexicon.setdefault(name, i)
        for i, aliases in enumerate(store.aliases):
            for alias in aliases:
                lexicon.setdefault(alias, i)
        return cls(lexicon, **kwargs)

    @property
    def tokenizer(self) -> Any:
        """A private ``jieba.Tokenizer`` with the lexicon added (built on first use).

        It starts from a copy of jieba's main dictionary, loaded once per process: loading it
        takes about a second, copying it a few tens of milliseconds.
        """
        if self._tokenizer is None:
            import jieba

            freq, total = _jieba_dictionary()
            tok = jieba.Tokenizer()
            tok.FREQ, tok.total, tok.initialized = dict(freq), total, True
            for surface in self.surfaces:
                # freq=None: jieba's own suggestion, just enough to keep the form in one piece.
                tok.add_word(surface)
            self._tokenizer = tok
        return self._tokenizer

    def candidates(self, norm: str) -> list[tuple[int, int, int]]:
        """Every (start, end, entity_id) occurrence of a surface form in normalised text."""
        return _trie_matches(self.trie, norm)

    def segment_ends(self, block: str) -> list[int]:
        """End offsets of the words of jieba's HMM-free segmentation of one jieba block.

        The same maximum-probability path over the same dictionary DAG as
        ``jieba.Tokenizer.cut(block, HMM=False)`` (tests compare the two); see :meth:`_scan`.
        """
        return self._scan(block, 0, None)

    def _scan(self, block: str, offset: int, found: list[tuple[int, int, int]] | None) -> list[int]:
        """Segment one jieba block; append the entity occurrences met on the way to ``found``.

        jieba's get_DAG + calc, fused into one right-to-left pass (same float operations and
        tie-breaking, so the same path): no word list is built, one dict lookup per DAG step. The DAG walk meets every dictionary word of the block, and every surface
        form is in the dictionary (the tokenizer has the lexicon added), so the same pass finds
        the candidates: with a large lexicon nearly every block holds one, and a separate trie
        pass plus a segmentation would do the work twice. jieba's merging of single Latin
        letters into one token is not replicated: link() never cuts inside a Latin run anyway.
        """
        weights = self._word_weights()
        logtotal = self._logtotal
        surfaces = self.surfaces if found is not None else {}
        n = len(block)
        score = [0.0] * (n + 1)
        nxt = [0] * n
        for k in range(n - 1, -1, -1):
            best_end = -1
            best = 0.0
            i = k
            # jieba.get_DAG: extend while the fragment is a dictionary prefix; words have a weight.
            frag = block[k]
            w = weights.get(frag)
            while w is not None:
                if w is not _PREFIX:
                    sc = w + score[i + 1]
                    if best_end < 0 or sc >= best:  # max over (score, end): ties go to the longer word
                        best, best_end = sc, i
                    entity = surfaces.get(frag)
                    if entity is not None:
                        found.append((offset + k, offset + i + 1, entity))  # type: ignore[union-attr]
                i += 1
                if i == n:
                    break
                frag = block[k : i + 1]
                w = weights.get(frag)
            if best_end < 0:  # no word starts here: the single character, log(1) - logtotal
                best, best_end = (0.0 - logtotal) + score[k + 1], k
            score[k] = best
            nxt[k] = best_end + 1
        ends = []
        x = 0
        while x < n:
            x = nxt[x]
            ends.append(offset + x)
        return ends

    def _word_weights(self) -> dict[str, Any]:
        """jieba's dictionary as word → log(freq) - log(total) (jieba's calc() term), prefixes → _PREFIX.

        One dict lookup per DAG step instead of jieba's three (``in``, ``[]``, ``.get`` in calc).
        """
        tok = self.tokenizer
        if self._weights is None or self._weights_total != tok.total:
            logtotal = math.log(tok.total)
            log = math.log
            self._weights = {w: (log(f) - logtotal) if f else _PREFIX for w, f in tok.FREQ.items()}
            self._weights_total, self._logtotal = tok.total, logtotal
        return self._weights

    def _checked_candidates(self, norm: str) -> list[tuple[int, int, int]]:
        """Candidates whose both ends are word boundaries of jieba's segmentation of ``norm``."""
        found: list[tuple[int, int, int]] = []
        boundaries: set[int] = set()
        blocks: list[tuple[int, int]] = []
        for block in _JIEBA_BLOCK.finditer(norm):
            start = block.start()
            boundaries.add(start)
            boundaries.update(self._scan(block.group(), start, found))
            blocks.append((start, block.end()))
        found = [c for c in found if c[0] in boundaries and c[1] in boundaries]
        if self._cross_trie:
            # Surface forms holding characters jieba never puts in a block (e.g. 达·芬奇): found by
            # the trie; their ends are boundaries unless they fall strictly inside a block.
            starts = [a for a, _ in blocks]

            def ok(p: int) -> bool:
                j = bisect.bisect_right(starts, p) - 1
                return j < 0 or p >= blocks[j][1] or p in boundaries

            found += [c for c in _trie_matches(self._cross_trie, norm) if ok(c[0]) and ok(c[1])]
        n = len(norm)
        return [c for c in found if not _inner_alnum(norm, c[0], n) and not _inner_alnum(norm, c[1], n)]

    def link(self, text: str) -> list[EntitySpan]:
        """Non-overlapping entity spans of ``text``, sorted by start."""
        if not text:
            return []
        norm, offsets = normalize_with_offsets(text)
        found = self._checked_candidates(norm) if self.word_check else self.candidates(norm)
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

    def __len__(self) -> int:
        return len(self.surfaces)
