"""Caption clean-up: whitespace, full-width letters and digits, optional traditional → simplified."""

from __future__ import annotations

import functools
import re
import unicodedata

# Full-width ASCII letters and digits and the ideographic space become their ASCII forms; full-width
# punctuation (，！？：；（）) stays, because it is how Chinese is written and tokenizers know it.
_FULLWIDTH = {code: chr(code - 0xFEE0) for code in range(0xFF10, 0xFF1A)}
_FULLWIDTH |= {code: chr(code - 0xFEE0) for code in range(0xFF21, 0xFF3B)}
_FULLWIDTH |= {code: chr(code - 0xFEE0) for code in range(0xFF41, 0xFF5B)}
_FULLWIDTH[0x3000] = " "
_CJK = r"\u3000-\u303f\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef"
_SPACE_BETWEEN_CJK = re.compile(rf"(?<=[{_CJK}])\s+(?=[{_CJK}])")


@functools.cache
def _t2s():
    from opencc import OpenCC

    return OpenCC("t2s")


def clean_caption(text: str | None, *, t2s: bool = False) -> str:
    """A caption ready for the tokenizer; ``""`` means there is no caption.

    - drops control characters and zero-width spaces, NFC-normalises;
    - maps full-width letters/digits/space to ASCII;
    - collapses runs of whitespace, removes spaces between two CJK characters (an artefact of
      word-segmented corpora: "一个 番茄" → "一个番茄"), strips the ends;
    - with ``t2s``, converts traditional to simplified Chinese with OpenCC ``t2s`` (phrase-aware).
    """
    if text is None:
        return ""
    text = unicodedata.normalize("NFC", str(text)).translate(_FULLWIDTH)
    text = "".join(c for c in text if c in "\t\n " or unicodedata.category(c) not in ("Cc", "Cf"))
    text = re.sub(r"\s+", " ", text).strip()
    text = _SPACE_BETWEEN_CJK.sub("", text)
    if t2s and text:
        text = _t2s().convert(text)
    return text
