"""Character-level text normalisation for entity matching: one character in, one character out.

Full-width → half-width and compatibility forms (Unicode NFKC), upper → lower case, traditional
→ simplified Chinese (OpenCC ``t2s``). Because every character maps to exactly one character,
offsets in the normalised text ARE offsets in the original text, so linker spans point into
what the user wrote.

Why a table rather than ``OpenCC('t2s').convert(text)`` on every call: opencc-python converts
about 0.4 M chars/s, slower than the whole linker's budget, and its phrase rules may change
lengths. We ask OpenCC once for each CJK character (the phrase rules do not apply to a lone
character) and fold the answers into a ``str.translate`` table, which runs at tens of M chars/s.
Names and text go through the same table, so a character OpenCC maps differently inside a
phrase (乾隆 vs 乾燥) still matches consistently.
"""

from __future__ import annotations

import functools
import unicodedata

# CJK Unified Ideographs (+ Extension A) and the compatibility block: where t2s has entries.
_CJK_RANGES = ((0x3400, 0x4DC0), (0x4E00, 0xA000), (0xF900, 0xFB00))


@functools.cache
def normalization_table() -> dict[int, str]:
    """code point → replacement character, for every BMP character that normalisation changes."""
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
    return table


def normalize(text: str) -> str:
    """``text`` with each character normalised; ``len(normalize(t)) == len(t)`` always."""
    return text.translate(normalization_table())
