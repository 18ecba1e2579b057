"""The EntityLinker's word check compiled with numba: jieba's DAG and DP over the blocks that need
segmenting, and the boundary filter, with no Python loop per position or edge.

The float operations are :func:`rapiddiff.kg.linker._segment`'s, in the same order, so the result
is bit-identical (tests compare it with a pure-Python reference). The trie query stays in Python;
its matches arrive as flat arrays (``qpos``, ``counts``, ``lens``, ``kids``), and jieba's words
elsewhere come from an open-addressing hash table over code points (:func:`build_words`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

# The same file imported under this name runs as plain Python, numba not even imported:
# rapiddiff.kg.linker.plain_dp() loads it so, for a process that links only a few short texts
# (a cold `rapiddiff generate`), where numba's start costs more than the whole check.
PLAIN_TWIN = "rapiddiff.kg._linker_dp_plain"


def _plain(function: Any) -> Any:
    @functools.wraps(function)
    def plain(*args: Any) -> Any:
        with np.errstate(over="ignore"):  # the hashes wrap on purpose, as compiled uint64 does
            return function(*args)

    return plain


_njit: Callable[[Any], Any] = _plain
if __name__ != PLAIN_TWIN:
    try:
        import numba

        _njit = numba.njit(cache=True, nogil=True)
    except ImportError:  # e.g. a machine without llvmlite's 60 MB wheel: the same code, plain Python
        pass


_MULT = np.uint64(1_000_003)
_MIX = np.uint64(0x9E3779B97F4A7C15)


@_njit
def _in_jieba_block(c: int) -> bool:
    # linker._JIEBA_BLOCK's class [\u4e00-\u9fd5a-zA-Z0-9+#&._%-], on code points
    return (
        (0x4E00 <= c <= 0x9FD5)
        or (97 <= c <= 122)
        or (65 <= c <= 90)
        or (48 <= c <= 57)
        or c == 43  # +
        or c == 35  # #
        or c == 38  # &
        or c == 46  # .
        or c == 95  # _
        or c == 37  # %
        or c == 45  # -
    )


@_njit
def _is_alnum(c: int) -> bool:
    return (97 <= c <= 122) or (65 <= c <= 90) or (48 <= c <= 57)


@_njit
def _inside(block_at: np.ndarray, p: int, n: int) -> bool:
    return 0 < p < n and block_at[p] >= 0 and block_at[p - 1] == block_at[p]


@_njit
def _slot(h: np.uint64, mask: int) -> int:
    return np.int64(((h * _MIX) >> np.uint64(20)) & np.uint64(mask))


@_njit
def build_words(pool: np.ndarray, offsets: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """jieba's words (code points ``pool[offsets[w]:offsets[w + 1]]``, weight ``weights[w]``) and
    every prefix of them as an open-addressing hash table: (slot → ``offset << 8 | length`` of the
    string in ``pool``, -1 empty; slot → weight, NaN for a prefix that is not itself a word). One
    slot holds what a probe reads, so a lookup touches the table, the pool, and the weight."""
    n_words = offsets.size - 1
    size = 1
    while size < 2 * int(offsets[-1]):  # at most one entry per character of the words
        size *= 2
    table = np.full(size, -1, np.int64)
    slot_weight = np.full(size, np.nan)
    for w in range(n_words):
        start = offsets[w]
        length = offsets[w + 1] - start
        h = np.uint64(0)
        for ln in range(1, length + 1):
            h = h * _MULT + np.uint64(pool[start + ln - 1])
            s = _find(table, pool, pool, start, ln, h)
            if table[s] < 0:
                table[s] = (start << 8) | ln
            if ln == length:
                slot_weight[s] = weights[w]
    return table, slot_weight


@_njit
def _find(table: np.ndarray, pool: np.ndarray, text: np.ndarray, k: int, ln: int, h: np.uint64) -> int:
    """The slot of ``text[k:k + ln]`` (hash ``h``) in a :func:`build_words` table, or the empty
    slot where it would go."""
    mask = table.size - 1
    s = _slot(h, mask)
    while True:
        entry = table[s]
        if entry < 0:
            return s
        if entry & 255 == ln:
            off = entry >> 8
            same = True
            for x in range(ln):
                if pool[off + x] != text[k + x]:
                    same = False
                    break
            if same:
                return s
        s = (s + 1) & mask


@_njit
def _jieba_words(
    cp: np.ndarray,
    k: int,
    end: int,
    table: np.ndarray,
    slot_weight: np.ndarray,
    pool: np.ndarray,
    out_end: np.ndarray,
    out_weight: np.ndarray,
) -> int:
    """jieba's words starting at ``k`` and ending before ``end``, shortest first, walked as jieba's
    get_DAG walks its dictionary (stop at the first string that is no word's prefix): their last
    index and weight into ``out_end``/``out_weight``; returns how many."""
    count = 0
    h = np.uint64(0)
    for ln in range(1, end - k + 1):
        h = h * _MULT + np.uint64(cp[k + ln - 1])
        s = _find(table, pool, cp, k, ln, h)
        if table[s] < 0:
            break
        w = slot_weight[s]
        if w == w:  # a word, not only a prefix
            out_end[count] = k + ln - 1
            out_weight[count] = w
            count += 1
    return count


@_njit
def build_set(keys: np.ndarray) -> np.ndarray:
    """Non-negative int64 ``keys`` as an open-addressing hash set (-1: empty)."""
    size = 2
    while size < 2 * keys.size:
        size *= 2
    table = np.full(size, -1, np.int64)
    for key in keys:
        s = _slot(np.uint64(key), size - 1)
        while table[s] >= 0 and table[s] != key:
            s = (s + 1) & (size - 1)
        table[s] = key
    return table


@_njit
def _contains(table: np.ndarray, key: int) -> bool:
    mask = table.size - 1
    s = _slot(np.uint64(key), mask)
    while table[s] >= 0:
        if table[s] == key:
            return True
        s = (s + 1) & mask
    return False


@_njit
def jieba_dag(
    cp: np.ndarray, table: np.ndarray, slot_weight: np.ndarray, pool: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (start, last index, weight) of jieba's words in ``cp`` (what :func:`check` reads
    where no form starts; the tests compare it with jieba's own dictionary)."""
    n = cp.size
    word_end = np.empty(n, np.int64)
    word_weight = np.empty(n, np.float64)
    starts = [0]
    ends = [0]
    weights = [0.0]
    for k in range(n):
        for x in range(_jieba_words(cp, k, n, table, slot_weight, pool, word_end, word_weight)):
            starts.append(k)
            ends.append(word_end[x])
            weights.append(word_weight[x])
    return np.array(starts[1:], np.int64), np.array(ends[1:], np.int64), np.array(weights[1:], np.float64)


SINGLE = (1 << 21) - 1  # above every code point: c << 21 | SINGLE is a one-character form's key


@_njit
def form_starts(cp: np.ndarray, heads: np.ndarray, singles: bool) -> np.ndarray:
    """Positions where a form may start: the two characters there are a form's first two (``heads``,
    a :func:`build_set` of ``c0 << 21 | c1``), or the character is a one-character form (``c << 21 |
    SINGLE`` in ``heads``; ``singles``: the lexicon has any)."""
    n = cp.size
    out = np.empty(n, np.int64)
    k = 0
    for i in range(n):
        c = np.int64(cp[i]) << 21
        if (i + 1 < n and _contains(heads, c | np.int64(cp[i + 1]))) or (
            singles and _contains(heads, c | SINGLE)
        ):
            out[k] = i
            k += 1
    return out[:k]


@_njit
def check(
    cp: np.ndarray,
    qpos: np.ndarray,
    counts: np.ndarray,
    lens: np.ndarray,
    kids: np.ndarray,
    entity_ids: np.ndarray,
    weights: np.ndarray,
    logtotal: float,
    table: np.ndarray,
    slot_weight: np.ndarray,
    pool: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(candidate starts, ends, entity ids — by start, then length; True for each candidate kept;
    the trie keys of forms whose segmentation weight is still NaN).

    Candidates are the trie matches that are forms. A jieba block is segmented when a candidate
    boundary falls strictly inside it, with jieba's DP (linker._segment's loop: edges in order of
    length, ``sc = weight + score[end + 1]``, ``sc >= best``, the single character at
    ``0.0 - logtotal`` where no word starts). A position's edges are its trie matches where it
    was queried (forms at their add_word weight ``weights[key]``, jieba's words at jieba's), else
    jieba's words from the hash table. When a form in a segmented block has no weight yet, nothing
    is kept and those keys are returned: the caller weighs them and calls again.
    """
    n = cp.size
    block_at, blocks = _block_ids(cp)
    cs, ce, ci, first, number = _form_candidates(n, qpos, counts, lens, kids, entity_ids)
    segment = _blocks_to_segment(block_at, blocks, cs, ce, n)
    unweighed = np.empty(kids.size, np.int64)
    u = 0
    boundary = np.zeros(n + 1, np.bool_)
    score = np.zeros(n + 1)
    nxt = np.zeros(n, np.int64)
    word_end = np.empty(n, np.int64)
    word_weight = np.empty(n, np.float64)
    end = n
    while end > 0:
        while end > 0 and block_at[end - 1] < 0:  # the block ending at `end` (exclusive)
            end -= 1
        if end == 0:
            break
        b = block_at[end - 1]
        start = end - 1
        while start > 0 and block_at[start - 1] == b:
            start -= 1
        if segment[b]:
            score[end] = 0.0
            for k in range(end - 1, start - 1, -1):
                if first[k] >= 0:  # the trie's matches: forms and jieba's words
                    best, best_end, u = _trie_edge(
                        k, end, first[k], number[k], lens, kids, weights, entity_ids, score, unweighed, u
                    )
                else:  # no form starts here: jieba's words
                    found = _jieba_words(cp, k, end, table, slot_weight, pool, word_end, word_weight)
                    best, best_end = _word_edge(found, word_end, word_weight, score)
                if best_end < 0:
                    best = (0.0 - logtotal) + score[k + 1]
                    best_end = k
                score[k] = best
                nxt[k] = best_end + 1
            x = start
            while x < end:
                x = nxt[x]
                boundary[x] = True
        end = start
    if u:
        return cs, ce, ci, np.zeros(cs.size, np.bool_), unweighed[:u]
    return cs, ce, ci, _kept(cp, block_at, boundary, cs, ce), unweighed[:0]


@_njit
def _block_ids(cp: np.ndarray) -> tuple[np.ndarray, int]:
    """The jieba block of each position (-1 outside every block), and how many blocks there are."""
    n = cp.size
    block_at = np.full(n, -1, np.int64)
    b = -1
    for p in range(n):
        if _in_jieba_block(cp[p]):
            if p == 0 or block_at[p - 1] < 0:
                b += 1
            block_at[p] = b
    return block_at, b + 1


@_njit
def _form_candidates(
    n: int, qpos: np.ndarray, counts: np.ndarray, lens: np.ndarray, kids: np.ndarray, entity_ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(starts, ends, entity ids of the matches that are forms; each position's first match and
    number of matches, -1 and 0 where it was not queried)."""
    m = kids.size
    cs = np.empty(m, np.int64)
    ce = np.empty(m, np.int64)
    ci = np.empty(m, np.int64)
    first = np.full(n, -1, np.int64)
    number = np.zeros(n, np.int64)
    c = 0
    j = 0
    for q in range(qpos.size):
        i = qpos[q]
        first[i] = j
        number[i] = counts[q]
        for _ in range(counts[q]):
            entity = entity_ids[kids[j]]
            if entity >= 0:
                cs[c] = i
                ce[c] = i + lens[j]
                ci[c] = entity
                c += 1
            j += 1
    return cs[:c], ce[:c], ci[:c], first, number


@_njit
def _blocks_to_segment(
    block_at: np.ndarray, blocks: int, cs: np.ndarray, ce: np.ndarray, n: int
) -> np.ndarray:
    """Whether each block holds a candidate boundary strictly inside it (only those are segmented)."""
    segment = np.zeros(blocks, np.bool_)
    for x in range(cs.size):
        if _inside(block_at, cs[x], n):
            segment[block_at[cs[x]]] = True
        if _inside(block_at, ce[x], n):
            segment[block_at[ce[x]]] = True
    return segment


@_njit
def _trie_edge(
    k: int,
    end: int,
    first: int,
    number: int,
    lens: np.ndarray,
    kids: np.ndarray,
    weights: np.ndarray,
    entity_ids: np.ndarray,
    score: np.ndarray,
    unweighed: np.ndarray,
    u: int,
) -> tuple[float, int, int]:
    """The best DP edge from ``k`` over its trie matches (best score, its last index or -1, and
    ``u`` after the forms found without a weight were appended to ``unweighed``)."""
    best_end = -1
    best = 0.0
    for e in range(first, first + number):
        i = k + lens[e] - 1
        if i >= end:
            break
        w = weights[kids[e]]
        if w != w:  # NaN: a form not weighed yet, or neither form nor word
            if entity_ids[kids[e]] >= 0:
                unweighed[u] = kids[e]
                u += 1
            continue
        sc = w + score[i + 1]
        if best_end < 0 or sc >= best:
            best = sc
            best_end = i
    return best, best_end, u


@_njit
def _word_edge(
    found: int, word_end: np.ndarray, word_weight: np.ndarray, score: np.ndarray
) -> tuple[float, int]:
    """The best DP edge over the ``found`` jieba words of a position (its last index or -1)."""
    best_end = -1
    best = 0.0
    for x in range(found):
        i = word_end[x]
        sc = word_weight[x] + score[i + 1]
        if best_end < 0 or sc >= best:
            best = sc
            best_end = i
    return best, best_end


@_njit
def _kept(
    cp: np.ndarray, block_at: np.ndarray, boundary: np.ndarray, cs: np.ndarray, ce: np.ndarray
) -> np.ndarray:
    """True for each candidate whose both ends are word boundaries and cut no Latin/digit run."""
    n = cp.size
    keep = np.zeros(cs.size, np.bool_)
    for x in range(cs.size):
        s = cs[x]
        e = ce[x]
        keep[x] = (
            (not _inside(block_at, s, n) or boundary[s])
            and (not _inside(block_at, e, n) or boundary[e])
            and not (0 < s < n and _is_alnum(cp[s - 1]) and _is_alnum(cp[s]))
            and not (0 < e < n and _is_alnum(cp[e - 1]) and _is_alnum(cp[e]))
        )
    return keep
