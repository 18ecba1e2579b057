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

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rapiddiff.kg.normalize import normalize
from rapiddiff.utils.logging import get_logger

if TYPE_CHECKING:
    from rapiddiff.kg.store import KnowledgeStore

log = get_logger(__name__)

_END = ""  # trie key marking "a surface form ends here"; no character is the empty string
# jieba.cut splits text into these blocks and segments each on its own; characters outside them
# are single tokens (jieba/__init__.py, re_han_default). Copied so we can find the blocks ourselves.
_JIEBA_BLOCK = re.compile("[\u4e00-\u9fd5a-zA-Z0-9+#&\\._%\\-]+")


def _is_alnum(char: str) -> bool:
    return char.isascii() and char.isalnum()


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
        if clashes:
            log.info("%d surface forms normalise to a form of another entity; the first one is kept", clashes)
        self.word_check = word_check
        self._tokenizer: Any = None

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
        """A private jieba tokenizer with the lexicon added (built on first use, ~1-2 s)."""
        if self._tokenizer is None:
            import logging

            import jieba

            jieba.setLogLevel(logging.WARNING)
            tok = jieba.Tokenizer()
            tok.initialize()
            for surface in self.surfaces:
                # freq=None: jieba's own suggestion, just enough to keep the form in one piece.
                tok.add_word(surface)
            self._tokenizer = tok
        return self._tokenizer

    def candidates(self, norm: str) -> list[tuple[int, int, int]]:
        """Every (start, end, entity_id) occurrence of a surface form in normalised text."""
        trie, end_key = self.trie, _END
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

    def word_boundaries(self, norm: str, positions: Iterable[int]) -> set[int]:
        """Those of ``positions`` where jieba's segmentation of ``norm`` has a word boundary."""
        wanted = sorted(set(positions))
        good: set[int] = set()
        blocks = list(_JIEBA_BLOCK.finditer(norm))
        segmented: set[int] = set()
        cut = self.tokenizer.cut
        b = 0
        for pos in wanted:
            while b < len(blocks) and blocks[b].end() <= pos:
                b += 1
            if 0 < pos < len(norm) and _is_alnum(norm[pos - 1]) and _is_alnum(norm[pos]):
                # Inside a run of Latin letters/digits: never a word boundary, whatever jieba
                # would do with "abc" in its lexicon (it splits "abcd" into "abc" + "d").
                continue
            if b == len(blocks) or pos <= blocks[b].start():
                good.add(pos)  # outside every block, or at a block's edge: always a boundary
            elif b not in segmented:
                # Strictly inside a block: segment the whole block once, keep all its boundaries.
                segmented.add(b)
                offset = blocks[b].start()
                for word in cut(blocks[b].group(), HMM=False):
                    offset += len(word)
                    good.add(offset)
        return good.intersection(wanted)

    def link(self, text: str) -> list[EntitySpan]:
        """Non-overlapping entity spans of ``text``, sorted by start."""
        if not text:
            return []
        norm = normalize(text)
        found = self.candidates(norm)
        if not found:
            return []
        if self.word_check:
            ok = self.word_boundaries(norm, [p for s, e, _ in found for p in (s, e)])
            found = [c for c in found if c[0] in ok and c[1] in ok]
        # Longest first, then leftmost; accept what does not overlap an accepted span.
        found.sort(key=lambda c: (c[0] - c[1], c[0]))
        taken = bytearray(len(text))
        spans = []
        for s, e, entity_id in found:
            if any(taken[s:e]):
                continue
            taken[s:e] = b"\x01" * (e - s)
            spans.append(EntitySpan(s, e, entity_id, text[s:e]))
        spans.sort(key=lambda span: span.start)
        return spans

    def __len__(self) -> int:
        return len(self.surfaces)
