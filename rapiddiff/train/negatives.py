"""Hard negative captions from the knowledge graph: one attribute value swapped (the CLIP stage).

NegCLIP (Yuksekgonul et al., ICLR 2023) adds, for each image, its caption with words swapped as an
extra negative, so the text tower must tell "a red square" from "an orange square" instead of
matching a bag of words. Here the KG says which words may be swapped and for what: a linked mention
of a *value* — the tail of a fact of one of the chosen relations (红色 for 颜色) — becomes another
value of that relation (黄色). In-batch negatives rarely do this: in a batch of kshapes captions,
a caption's nearest other caption differs in several words, so neighbouring colours never have to
be told apart in the same context (and the generator confuses exactly those).

The swap edits token rows instead of re-tokenizing text: linking and tokenizing cost ~5 ms a
caption on a CPU, too slow for a few variants of every training caption at each run's start, while
a splice of token ids costs microseconds. The edited row equals what ``tokenize`` gives for the
swapped text whenever the new name tokenizes on its own as it does in context (tested), except
that a caption ``tokenize`` had to cut stays without its cut words when a shorter name frees room.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rapiddiff.models.text_encoder import KnowledgeTextEncoder, relation_ids

__all__ = ["ValueSwap"]


class ValueSwap:
    """Builds hard negative token rows by swapping one KG value mention per caption.

    Args:
        encoder: the text encoder whose ``tokenize`` made the rows (its tokenizer spells the values).
        relations: relations whose tails may be swapped for one another, e.g. ``["颜色", "形状"]``.
    """

    def __init__(self, encoder: KnowledgeTextEncoder, relations: Sequence[str]) -> None:
        store = encoder.store
        if store is None:
            raise ValueError("hard_negative_relations needs a knowledge store: the KG names the values")
        tokenizer = encoder.tokenizer
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        triples = store.triples
        self.group = torch.full((len(store),), -1, dtype=torch.long)  # entity → its value group, or -1
        self.values: list[list[int]] = []  # group → value entity ids
        self.spelling: dict[int, list[int]] = {}  # value entity → its name's token ids
        for relation in relation_ids(store, relations, "hard_negative_relations"):
            tails = torch.unique(triples[triples[:, 1] == relation, 2]).tolist()
            tails = [t for t in tails if self.group[t] < 0]  # a value of two relations: its first
            if len(tails) < 2:
                continue  # nothing to swap for
            for t in tails:
                self.group[t] = len(self.values)
                self.spelling[t] = tokenizer(store.name_of(t), add_special_tokens=False)["input_ids"]
            self.values.append(tails)

    def __call__(self, tokens: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
        """``tokenize`` rows [N, L] → ``k`` negatives each: ``neg_input_ids``, ``neg_attention_mask``,
        ``neg_token_entity_ids`` [N, k, L] and ``neg_valid`` [N, k] (False where a caption names no
        value: its row is then a copy of the caption, left out of the loss).

        A row's variants depend on its tokens alone (the draws are seeded by them), so a caption has
        the same ``k`` variants whether its batch or the whole training set is swapped at once: the
        plain and the GPU-resident step see the same negatives."""
        ids, mask, entities = (tokens[n].cpu() for n in ("input_ids", "attention_mask", "token_entity_ids"))
        n, length = ids.shape
        out_ids = ids.unsqueeze(1).repeat(1, k, 1)
        out_mask = mask.unsqueeze(1).repeat(1, k, 1)
        out_entities = entities.unsqueeze(1).repeat(1, k, 1)
        valid = torch.zeros(n, k, dtype=torch.bool)
        groups = self.group[entities.clamp(min=0)].masked_fill(entities < 0, -1)
        for row in (groups >= 0).any(1).nonzero().flatten().tolist():
            runs = _runs(entities[row], groups[row])
            used = int(mask[row].sum())
            row_ids, row_entities = ids[row, :used].tolist(), entities[row, :used].tolist()
            # hash() of a tuple of ints is the same in every process (no PYTHONHASHSEED salt)
            generator = torch.Generator().manual_seed(hash(tuple(row_ids)) & 0x7FFF_FFFF)
            for j in range(k):
                start, end, entity = runs[int(torch.randint(len(runs), (1,), generator=generator))]
                choices = [v for v in self.values[int(self.group[entity])] if v != entity]
                new = choices[int(torch.randint(len(choices), (1,), generator=generator))]
                spliced = _splice(row_ids, start, end, self.spelling[new], length)
                kept = len(spliced)
                out_ids[row, j] = torch.tensor(spliced + [self.pad_id] * (length - kept))
                out_mask[row, j] = (torch.arange(length) < kept).to(mask.dtype)
                spliced_entities = _splice(row_entities, start, end, [new] * len(self.spelling[new]), length)
                out_entities[row, j] = torch.tensor(spliced_entities + [-1] * (length - kept))
                valid[row, j] = True
        return {
            "neg_input_ids": out_ids,
            "neg_attention_mask": out_mask,
            "neg_token_entity_ids": out_entities,
            "neg_valid": valid,
        }


def _runs(entities: torch.Tensor, groups: torch.Tensor) -> list[tuple[int, int, int]]:
    """(start, end, entity) of each mention of a swappable value in one row."""
    runs: list[tuple[int, int, int]] = []
    row = entities.tolist()
    for i, (entity, group) in enumerate(zip(row, groups.tolist(), strict=True)):
        if group < 0:
            continue
        if runs and runs[-1][1] == i and runs[-1][2] == entity:
            runs[-1] = (runs[-1][0], i + 1, entity)
        else:
            runs.append((i, i + 1, entity))
    return runs


def _splice(row: list[Any], start: int, end: int, new: list[Any], length: int) -> list[Any]:
    """``row`` (opening special, content, closing special) with ``row[start:end]`` replaced by
    ``new``, cut to ``length`` as the tokenizer truncates: content first, the closing token kept."""
    spliced = row[:start] + new + row[end:]
    if len(spliced) > length:
        spliced = spliced[: length - 1] + spliced[-1:]
    return spliced
