"""Text normalisation for entity matching, with a map back to the user's offsets.

Per character: NFKC (full → half width), lower case, traditional → simplified (OpenCC ``t2s``,
asked once per CJK character and folded into a ``str.translate`` table, since converting each
text through OpenCC is slower than the whole linker), the middle-dot family → U+00B7; combining
marks are composed (NFC). One character maps to one, so offsets carry over except where marks
are composed (:func:`normalize_with_offsets` returns the map).
"""

from __future__ import annotations

import functools
import unicodedata

from rapiddiff.kg.cache import cached

# CJK Unified Ideographs (+ Extension A) and the compatibility block: where t2s has entries.
_CJK_RANGES = ((0x3400, 0x4DC0), (0x4E00, 0xA000), (0xF900, 0xFB00))
MIDDLE_DOT = "\u00b7"
# Dots people type between the parts of a transliterated name, all read as U+00B7: Greek ano
# teleia, runic single punctuation, bullet, hyphenation point, bullet operator, dot operator,
# word separator middle dot, katakana middle dot (Japanese and Traditional Chinese text), its
# half-width form, Latin letter sinological dot.
DOT_FAMILY = "\u0387\u16eb\u2022\u2027\u2219\u22c5\u2e31\u30fb\uff65\ua78f"


_TABLE_VERSION = 2  # bump when the rules below change: the cached table is keyed on it


@functools.cache
def normalization_table() -> dict[int, str]:
    """code point → replacement character, for every BMP character that normalisation changes.

    Built once per machine (about a second: NFKC of 64 k characters and OpenCC of 28 k) and
    then read from the on-disk cache (:mod:`rapiddiff.kg.cache`).
    """

    return cached("normalization", table_key(), _build_table)


@functools.cache
def table_key() -> tuple[object, ...]:
    """What the normalisation table depends on (its on-disk cache, and the linker's, are keyed on it)."""
    from importlib.metadata import version

    return (_TABLE_VERSION, unicodedata.unidata_version, version("opencc-python-reimplemented"), DOT_FAMILY)


def _build_table() -> dict[int, str]:
    from opencc import OpenCC

    table: dict[int, str] = {}
    for code in range(0x10000):
        if 0xD800 <= code < 0xE000:  # surrogates cannot be normalised on their own
            continue
        char = chr(code)
        folded = unicodedata.normalize("NFKC", char).lower()
        if len(folded) == 1 and folded != char:
            table[code] = folded
    chars = [chr(c) for start, end in _CJK_RANGES for c in range(start, end)]
    # "\n" separates the characters so OpenCC converts each on its own (it splits on whitespace).
    simplified = OpenCC("t2s").convert("\n".join(chars)).split("\n")
    if len(simplified) != len(chars):  # pragma: no cover - guards against an OpenCC change
        raise RuntimeError("OpenCC t2s changed the number of characters; cannot build the table")
    for char, simple in zip(chars, simplified, strict=True):
        if len(simple) == 1 and simple != char:
            # NFKC/case first (e.g. a compatibility ideograph), then t2s of the result.
            table[ord(char)] = simple
    # Apply t2s after NFKC for characters NFKC maps into the CJK range.
    for code, folded in list(table.items()):
        again = table.get(ord(folded))
        if again is not None and again != folded:
            table[code] = again
    for dot in DOT_FAMILY:
        table[ord(dot)] = MIDDLE_DOT
    return table


@functools.cache
def _simplified_table() -> dict[int, str]:
    # Only the Chinese characters' entries: punctuation (，→ ,), widths and case stay as written.
    return {k: v for k, v in normalization_table().items() if any(a <= k < b for a, b in _CJK_RANGES)}


def to_simplified(text: str) -> str:
    """``text`` with traditional Chinese characters as simplified ones (OpenCC ``t2s`` per character,
    so the length and every offset stay); nothing else changes."""
    return text.translate(_simplified_table())


Offsets = tuple[list[int], list[int]]


def normalize_with_offsets(text: str) -> tuple[str, Offsets | None]:
    """``(normalised text, offsets)``; ``offsets`` is None when offsets carry over unchanged.

    Otherwise ``offsets`` is ``(starts, ends)``: normalised character ``k`` comes from
    ``text[starts[k]:ends[k]]`` (see :func:`original_span`). Only where combining marks follow a
    base character does the text change length: each base character with its marks is composed
    (NFC) on its own, and every character composed from a group stands for the whole group.
    """
    table = normalization_table()
    if unicodedata.is_normalized("NFC", text):
        return text.translate(table), None
    pieces: list[str] = []
    starts: list[int] = []
    ends: list[int] = []
    n = len(text)
    i = 0
    while i < n:
        j = i + 1
        while j < n and unicodedata.combining(text[j]):
            j += 1
        group = text[i:j]
        composed = unicodedata.normalize("NFC", group)
        if composed == group:
            starts.extend(range(i, j))
            ends.extend(range(i + 1, j + 1))
        else:
            starts.extend([i] * len(composed))
            ends.extend([j] * len(composed))
        pieces.append(composed)
        i = j
    return "".join(pieces).translate(table), (starts, ends)


def original_span(offsets: Offsets | None, start: int, end: int) -> tuple[int, int]:
    """The span of the original text that normalised ``[start, end)`` (non-empty) came from."""
    if offsets is None:
        return start, end
    return offsets[0][start], offsets[1][end - 1]


def normalize(text: str) -> str:
    """``text`` normalised for matching (the form names and mentions are compared in)."""
    return normalize_with_offsets(text)[0]
