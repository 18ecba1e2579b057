"""Which emoji a build uses (``--limit``) and which are seen, held out or for validation.

Both are stratified by subcategory: a slice takes the subcategories in turn; the splits take
every k-th entity of the list grouped by subcategory, so each subcategory gives its share.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

from rapiddiff.data.emoji.catalog import Emoji


def _key(seed: int, tag: str, ident: str) -> str:
    # A hash, not a shared RNG stream: an entity's key does not move when another entity is added.
    return hashlib.sha256(f"{seed}:{tag}:{ident}".encode()).hexdigest()


def _stratified(emojis: Sequence[Emoji], seed: int, tag: str) -> list[Emoji]:
    """Entities ordered so every prefix, and every k-th element, spreads over the subcategories."""
    groups: dict[str, list[Emoji]] = {}
    for e in sorted(emojis, key=lambda e: _key(seed, tag, e.id)):
        groups.setdefault(e.subcategory, []).append(e)
    order = sorted(groups)
    out: list[Emoji] = []
    for round_ in range(max((len(g) for g in groups.values()), default=0)):
        out += [groups[s][round_] for s in order if round_ < len(groups[s])]
    return out


def choose_subset(
    emojis: list[Emoji], limit: int | None, seed: int, include: Sequence[str] = ()
) -> list[Emoji]:
    """``limit`` entities (all when None): the ``include`` ones (ids or characters), the components
    of those, then round-robin over subcategories; in catalogue order."""
    if limit is None or limit >= len(emojis):
        return list(emojis)
    by_id = {e.id: e for e in emojis}
    by_char = {e.char: e for e in emojis}
    chosen: dict[str, Emoji] = {}
    for wanted in include:
        e = by_id.get(wanted) or by_char.get(wanted)
        if e is None:
            raise ValueError(f"--include {wanted!r}: no such emoji among the usable ones")
        for ident in [e.id, *e.components]:
            chosen[ident] = by_id[ident]
    for e in _stratified(emojis, seed, "subset"):
        if len(chosen) >= limit:
            break
        chosen.setdefault(e.id, e)
    return [e for e in emojis if e.id in chosen]


def choose_splits(
    emojis: list[Emoji],
    seed: int,
    heldout: float,
    validation: float,
    eligible: Callable[[Emoji], bool] | None = None,
) -> dict[str, list[str]]:
    """{"seen", "heldout", "val"} → ids: every k-th entity of the list grouped by subcategory is
    held out, then every k-th of the rest is for validation (at least one each when there are ≥ 3).
    Only ``eligible`` entities may be held out or validation (the shares stay shares of all)."""
    pool = [e for e in emojis if eligible is None or eligible(e)]
    grouped = sorted(pool, key=lambda e: (e.subcategory, _key(seed, "split", e.id)))
    scale = len(emojis) / max(1, len(grouped))
    picked_h = _every(grouped, min(1.0, heldout * scale), seed)
    rest = [e for e in grouped if e.id not in picked_h]
    picked_v = _every(rest, min(1.0, validation * len(emojis) / max(1, len(rest))), seed + 1)
    ids = [e.id for e in emojis]
    return {
        "seen": [i for i in ids if i not in picked_h and i not in picked_v],
        "heldout": [i for i in ids if i in picked_h],
        "val": [i for i in ids if i in picked_v],
    }


def _every(grouped: list[Emoji], fraction: float, seed: int) -> set[str]:
    """Systematic sampling: n evenly spaced entities from a seeded offset, so a subcategory of m
    entities gives m·fraction of them, rounded up or down."""
    n = max(1, round(len(grouped) * fraction)) if fraction > 0 and len(grouped) >= 3 else 0
    if not n:
        return set()
    step = len(grouped) / n
    offset = int(_key(seed, "offset", str(len(grouped))), 16) % 1000 / 1000 * step
    return {grouped[int(offset + i * step)].id for i in range(n)}
