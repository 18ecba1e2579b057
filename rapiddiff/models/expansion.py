"""Prompt expansion: a knowledge mode that spells each linked entity's KG facts out as text.

Knowledge can reach the U-Net two ways: as TransE vectors fused into the text tower
(:mod:`rapiddiff.models.fusion`, mode "embed"), or as words — the entity's facts written into the
prompt before it is tokenized (mode "text"); "both" does the two. Expansion is the honest ceiling
for the vector path: a model that learned what "红色的三角形" looks like needs no transfer through
TransE to draw 草莓 once it is told 草莓 is a red triangle.

The text is generic for any KG: for every linked mention, the tails of the chosen relations are
joined with "的", in the order the relations are listed (several tails of one relation with "、"),
and written before the mention with "，" between::

    草莓 (颜色 红色, 形状 三角形)  →  "红色的三角形，草莓"
    "浅蓝色背景上有一个草莓"       →  "浅蓝色背景上有一个红色的三角形，草莓"

That reads naturally when the tails are attribute words (colour, shape, material, ...), as in the
kshapes KG; :data:`DEFAULT_RELATIONS` picks those when the store has them, otherwise every relation
of the entity is spelled (choose ``relations`` for another KG: e.g. ("颜色", "材质")). A mention with
none of the chosen facts is left as it is. Linking is the encoder's own (longest match, word check),
so the same mentions that get vectors in "embed" get words in "text".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

KNOWLEDGE_MODES: tuple[str, ...] = ("embed", "text", "both")
"""embed: TransE vectors fused into the text tower; text: facts spelled into the prompt; both."""

DEFAULT_RELATIONS: tuple[str, ...] = ("颜色", "形状")
"""Spelled when the store has any of them (what an image shows of an entity); else every relation."""


def check_mode(mode: str) -> str:
    if mode not in KNOWLEDGE_MODES:
        raise ValueError(f"knowledge mode {mode!r}: choose one of {', '.join(KNOWLEDGE_MODES)} (or 'off')")
    return mode


class PromptExpander:
    """Writes the facts of each entity a prompt mentions into the prompt.

    Args:
        store: a ``KnowledgeStore`` (names, relation names, triples).
        linker: an ``EntityLinker`` over the store (the text encoder's own).
        relations: relation names whose tails are spelled, in this order; default
            :data:`DEFAULT_RELATIONS` where the store has them, else all of the store's relations.
    """

    def __init__(self, store: Any, linker: Any, relations: Sequence[str] | None = None) -> None:
        names = list(store.relation_names)
        if relations is None:
            relations = [r for r in DEFAULT_RELATIONS if r in names] or names
        unknown = [r for r in relations if r not in names]
        if unknown:
            raise ValueError(
                f"expansion relations {unknown} are not relations of the KnowledgeStore "
                f"(it has: {', '.join(names)})"
            )
        self.store, self.linker = store, linker
        self.relations = list(relations)
        self._relation_ids = [names.index(r) for r in self.relations]
        self._descriptions: dict[int, str] = {}

    def description(self, entity_id: int) -> str:
        """The entity's chosen facts as words ("红色的三角形"); "" when it has none."""
        if entity_id not in self._descriptions:
            facts = self.store.facts(entity_id)  # [(relation_id, tail_id)]
            parts = []
            for rel in self._relation_ids:
                # name_of: a few names, not all of them (16 M entities: ~58 s and ~10 GB to read)
                tails = [self.store.name_of(t) for r, t in facts if r == rel]
                if tails:
                    parts.append("、".join(tails))
            self._descriptions[entity_id] = "的".join(parts)
        return self._descriptions[entity_id]

    def expand(self, text: str) -> str:
        """``text`` with "<facts>，" written before every linked mention that has facts."""
        pieces, last = [], 0
        for span in self.linker.link_affirmed(text):  # sorted by start
            words = self.description(span.entity_id)
            if not words:
                continue
            pieces += [text[last : span.start], words, "，"]
            last = span.start
        pieces.append(text[last:])
        return "".join(pieces)

    def __call__(self, prompts: Sequence[str]) -> list[str]:
        return [self.expand(p) for p in prompts]
