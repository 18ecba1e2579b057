"""The emoji knowledge graph: triples (类别, 子类, 关键词, 组成, 地区) and aliases.

Emoji nodes are named by their ``zh`` name (what captions and the linker use). A keyword that
names one emoji only becomes an alias of it, not a node: as a node it would have one edge and
teach TransE nothing, and as both it would make the linker's match ambiguous.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from rapiddiff.data.emoji.catalog import Emoji
from rapiddiff.kg.normalize import normalize

Triple = tuple[str, str, str]
CATEGORY, SUBCATEGORY, KEYWORD, COMPONENT, REGION, PARENT = "类别", "子类", "关键词", "组成", "地区", "属于"


def keyword_counts(emojis: Iterable[Emoji]) -> Counter[str]:
    return Counter(k for e in emojis for k in set(e.keywords))


def _label_names(emojis: list[Emoji]) -> tuple[dict[str, str], dict[str, str]]:
    """Category / subcategory → node name; a label equal to an emoji's name or to another label
    gets a suffix, so two things never share a node by accident."""
    taken = {e.zh for e in emojis}
    categories: dict[str, str] = {}
    for e in emojis:
        if e.category not in categories:
            label = e.category_zh
            categories[e.category] = f"{label}（类别）" if label in taken else label
            taken.add(categories[e.category])
    subcategories: dict[str, str] = {}
    for e in emojis:
        if e.subcategory not in subcategories:
            label = e.subcategory_zh
            subcategories[e.subcategory] = f"{label}（子类）" if label in taken else label
            taken.add(subcategories[e.subcategory])
    return categories, subcategories


def kg_triples(emojis: list[Emoji], counts: Counter[str], in_template: Callable[[str], bool]) -> list[Triple]:
    """All triples, emoji by emoji in sort order (``counts``: keyword → emoji it names, over the
    whole catalogue, so a slice has the same shared keywords as the full set). A keyword that
    the caption words around a name contain (上, 蓝色 in 浅蓝色背景上) is no node: the linker would
    find it in every caption and add its knowledge there."""
    categories, subcategories = _label_names(emojis)
    name_of = {e.id: e.zh for e in emojis}
    triples: list[Triple] = []
    seen_sub: set[str] = set()
    for e in emojis:
        triples += [
            (e.zh, CATEGORY, categories[e.category]),
            (e.zh, SUBCATEGORY, subcategories[e.subcategory]),
        ]
        if e.subcategory not in seen_sub:
            seen_sub.add(e.subcategory)
            triples.append((subcategories[e.subcategory], PARENT, categories[e.category]))
        triples += [(e.zh, KEYWORD, k) for k in e.keywords if counts[k] > 1 and not in_template(k)]
        triples += [(e.zh, COMPONENT, name_of[c]) for c in e.components if c in name_of]
        if e.region:
            triples.append((e.zh, REGION, e.region))
    return list(dict.fromkeys(triples))


def choose_aliases(
    emojis: list[Emoji], counts: Counter[str], in_captions: Callable[[str], bool]
) -> dict[str, list[tuple[str, str]]]:
    """Emoji id → [(alias, kind)], kind "zh_hant" or "keyword". An alias is kept only when it is
    no node of the KG (nor normalises to another node's name), no other emoji's alias, at least
    two characters, and such that no caption can contain it (``in_captions``: compose.CaptionIndex.contains)."""
    names = [e.zh for e in emojis]
    nodes = set(names) | {k for e in emojis for k in e.keywords if counts[k] > 1}
    nodes |= {e.category_zh for e in emojis} | {e.subcategory_zh for e in emojis}
    nodes |= {e.region for e in emojis if e.region}
    # The linker compares names in normalised form (笑臉 → 笑脸): an alias whose form is another
    # node's would link to that node, not to its emoji.
    forms = {normalize(n) for n in nodes}
    proposed: dict[str, list[tuple[str, str]]] = {}
    owners: Counter[str] = Counter()
    for e in emojis:
        items = [(e.zh_hant, "zh_hant")] if e.zh_hant else []
        items += [(k, "keyword") for k in e.keywords if counts[k] == 1]
        first = dict(reversed(items))  # alias → its first kind (a zh-Hant name may be a keyword too)
        kept = [(a, first[a]) for a in dict.fromkeys(a for a, _ in items)]
        own = normalize(e.zh)
        kept = [
            (a, k)
            for a, k in kept
            if a not in nodes
            and (normalize(a) == own or normalize(a) not in forms)
            and len(a) >= 2
            and not in_captions(a)
        ]
        proposed[e.id] = kept
        owners.update({normalize(a) for a, _ in kept})
    return {ident: [a for a in items if owners[normalize(a[0])] == 1] for ident, items in proposed.items()}


def aliases_tsv(emojis: list[Emoji], aliases: dict[str, list[tuple[str, str]]]) -> str:
    return "".join(f"{e.zh}\t{'|'.join(a for a, _ in aliases[e.id])}\n" for e in emojis if aliases.get(e.id))
