"""Value contrast: a prompt's attribute words pushed away from the other values the KG knows.

A denoiser trained on squared error draws the mean of what its conditioning leaves open, so when the
text states of two neighbouring values lie close (蓝色 and 紫色, 黄色 and 橙色) a share of images comes
out a blend of the two (BENCHMARKS.md, issue 18: "the colour misses are blends"). The KG knows which
words are values of one relation (the tails of 颜色: 红色, 橙色, ...), so the encoder can sharpen a
mention of one against the rest without being told which neighbour is at fault::

    s  ←  s + strength · Σ_mentions (s − mean_v s[mention → v])

where ``s[mention → v]`` is the prompt's text states with the mention replaced by another value ``v``
of the same relation (the same tokens elsewhere; values whose tokens are not as many as the
mention's are left out, so positions stay aligned). It changes only the conditioning, once per
prompt, at the cost of one text-tower pass over the variants; the U-Net and sampler are untouched.

It is a knowledge use: it needs the store (which values exist) and the linker (which words are
mentions), and does nothing while knowledge is off, so ``knowledge=False`` stays the base encoder
exactly. Mentions the linker reads as negated ("不是蓝色的") are not sharpened. Relations default
to the ones prompt expansion spells (:data:`rapiddiff.models.expansion.DEFAULT_RELATIONS` when the
store has them); a relation with more than :data:`MAX_VALUES` values (a place, a maker) is not an
attribute to contrast and is skipped with a log line.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rapiddiff.utils.logging import get_logger

if TYPE_CHECKING:  # torch is imported where it is used: SamplingDefaults checks strengths without it
    import torch

log = get_logger(__name__)

MAX_VALUES = 32
"""A relation with more distinct tails than this is not contrasted (one tower pass per value)."""


def check_strength(strength: float, name: str = "value_contrast") -> float:
    """``strength`` as a float in [0, 2]; anything else is an error naming the setting."""
    if isinstance(strength, bool) or not isinstance(strength, int | float) or not 0.0 <= strength <= 2.0:
        raise ValueError(f"{name} must be a number in [0, 2] (0 = off), got {strength!r}")
    return float(strength)


class ValueContrast:
    """The value sets of a store's attribute relations, and the sharpening of text states by them.

    Args:
        encoder: a :class:`~rapiddiff.models.text_encoder.KnowledgeTextEncoder` with a store.
        relations: relation names whose values are contrasted; default: the encoder's expansion
            relations (what an image shows of an entity).
    """

    def __init__(self, encoder: Any, relations: Sequence[str] | None = None) -> None:
        store = encoder.store
        if store is None:
            raise ValueError("value_contrast needs a KnowledgeStore: this text encoder has none")
        names = list(store.relation_names)
        if relations is None:
            assert encoder.expander is not None  # set with the store
            relations = encoder.expander.relations
        unknown = [r for r in relations if r not in names]
        if unknown:
            raise ValueError(
                f"contrast relations {unknown} are not relations of the store ({', '.join(names)})"
            )
        import torch

        self.encoder = encoder
        triples = store.triples
        # entity id → the other values of its relation (an entity that is a value of several: the first)
        self.alternatives: dict[int, list[str]] = {}
        for relation in relations:
            tails = torch.unique(triples[triples[:, 1] == names.index(relation), 2]).tolist()
            if len(tails) > MAX_VALUES:
                log.info(
                    "value contrast: %s has %d values (> %d), not contrasted",
                    relation,
                    len(tails),
                    MAX_VALUES,
                )
                continue
            value_names = {t: store.name_of(t) for t in tails}
            for t in tails:
                self.alternatives.setdefault(t, [n for u, n in value_names.items() if u != t])
        self.relations = list(relations)

    def variants(self, text: str) -> list[list[str]]:
        """For each contrasted mention in ``text`` (as the tower reads it), the text with the mention
        replaced by every other value of its relation."""
        found = []
        for span in self.encoder.linker.link_affirmed(text):
            others = self.alternatives.get(span.entity_id)
            if others:
                found.append([text[: span.start] + other + text[span.end :] for other in others])
        return found

    def __call__(self, prompts: Sequence[str], states: torch.Tensor, strength: float) -> torch.Tensor:
        """``states`` [B, L, D] of ``prompts`` (as given to ``encoder.encode``) with every contrasted
        mention sharpened by ``strength``; rows without one are returned as they were."""
        if strength == 0 or not self.encoder.knowledge:
            return states
        texts = self.encoder.readable(prompts)  # expanded and normalised as the tower reads them
        rows, groups, variant_texts = [], [], []
        for b, text in enumerate(texts):
            for group in self.variants(text):
                rows.append(b)
                groups.append((len(variant_texts), len(group)))
                variant_texts += group
        if not variant_texts:
            return states
        tokens = self.encoder.tokenize(variant_texts, expand=False)
        lengths = tokens["attention_mask"].sum(1)
        own = self.encoder.tokenize(texts, expand=False)["attention_mask"].sum(1)
        batch = {k: v.to(self.encoder.device) for k, v in tokens.items()}
        variant_states = self.encoder(**batch).to(states.dtype)  # (V, L, D)
        out = states.clone()
        for b, (first, count) in zip(rows, groups, strict=True):
            same = (lengths[first : first + count] == own[b]).nonzero().flatten() + first
            if len(same):  # no value with as many tokens: nothing aligned to contrast with
                out[b] += strength * (states[b] - variant_states[same].mean(0))
        return out
