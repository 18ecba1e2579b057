"""Knowledge fusion: what an entity's KG knowledge adds to the hidden states of its tokens.

An entity's knowledge is a small set of vectors from the TransE store: its own vector ``e`` and
one relational translation ``e + r`` for each relation it has (TransE puts ``e + r`` near the
tail, so for 番茄 ``e + r(颜色)`` lands near 红色). Each vector goes through the same small MLP
(a shared per-item encoder, as in Deep Sets), and the results are mean-pooled over the valid
items. Sharing the MLP is what lets knowledge transfer: the MLP learns what 红色's own vector
means from every caption that links 红色, and a held-out entity's ``e + r(颜色)`` arrives as a
vector close to it.

How far is "close"? On kshapes a held-out entity's ``e + r(颜色)`` is nearest its true colour, but at an
L1 distance (6.8) not far below the spacing of the colours themselves (8.4): the MLP sees a noisy
version of 红色. ``relation_items="tail"`` uses the KG's own answer instead: for each of the entity's
facts ``(e, r, t)`` the tail's vector ``t``, exactly the vector the MLP learns from captions that link
红色 — the vector form of spelling the facts into the prompt. ``"translation"`` (``e + r``) remains
for entities whose facts the KG lacks but TransE predicts. Each fused layer then has its own output projection and a scalar gate that
starts at zero, so at initialisation nothing changes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

RELATION_ITEMS = ("translation", "tail")
LOGIT_SCALE = 10.0  # relation_weights: the logits' parametrisation (KnowledgeFusion.__init__ says why)


@dataclass
class FusionConfig:
    """Shape of a :class:`KnowledgeFusion` module (saved as ``knowledge/fusion_config.json``)."""

    kg_dim: int
    """Width of the TransE vectors in the KnowledgeStore."""
    hidden_size: int
    """Width of the text tower's hidden states the knowledge is added to."""
    num_layers: int = 1
    """How many encoder layers receive knowledge (one projection and one gate each)."""
    max_relations: int = 8
    """At most this many relations per entity become ``e + r`` items (the rest are dropped)."""
    mlp_dim: int = 0
    """Width of the shared per-item MLP; 0 means ``hidden_size``."""
    entity_item: bool = True
    """Whether the entity's own vector ``e`` is one of its items. False keeps only the ``e + r``
    translations (``e`` alone for an entity without relations): ``e`` is where training can memorise
    a seen entity, while ``e + r`` lands near tails that every caption shares, which is what a
    held-out entity can use."""

    relation_items: str = "translation"
    """What an entity's relation ``r`` contributes: ``"translation"``, TransE's ``e + r`` (lands near
    the tail, a prediction); ``"tail"``, the vector of the tail ``t`` of the entity's fact ``(e, r, t)``.
    A relation with several tails contributes one of them (the smallest id): fine for one-valued
    relations like 颜色/形状; for a KG of many-valued ones "translation" loses nothing there."""

    relation_weights: int = 0
    """0: an entity's items are mean-pooled. N > 0 (the store's relation count): one learned weight per
    relation and one for ``e``, and the items are pooled by the softmax of their weights, so training can
    favour 颜色 and 形状 over 产地 or 季节. The weights start at zero: the mean, at first."""

    def __post_init__(self) -> None:
        for name in ("kg_dim", "hidden_size", "num_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"FusionConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_relations < 0:
            raise ValueError(f"FusionConfig.max_relations must be >= 0, got {self.max_relations}")
        if not isinstance(self.entity_item, bool):  # a hand-edited fusion_config.json
            raise ValueError(f"FusionConfig.entity_item must be true or false, got {self.entity_item!r}")
        if self.relation_items not in RELATION_ITEMS:
            raise ValueError(
                f"FusionConfig.relation_items must be one of {', '.join(RELATION_ITEMS)}, got {self.relation_items!r}"
            )
        if not isinstance(self.relation_weights, int) or self.relation_weights < 0:
            raise ValueError(
                f"FusionConfig.relation_weights must be an int >= 0, got {self.relation_weights!r}"
            )

    def to_dict(self) -> dict[str, int | bool | str]:
        return dataclasses.asdict(self)


def relation_table(triples: torch.Tensor, num_entities: int, max_relations: int) -> torch.Tensor:
    """For each head entity, the ids of up to ``max_relations`` distinct relations it has.

    ``triples`` is [T, 3] (head, relation, tail). Returns a long tensor [num_entities,
    max_relations] padded with -1; relations are kept in ascending id order. One sort of 32-bit
    (head, relation) keys (numpy's SIMD sort; skipped when the store's triples are already in
    that order), then linear passes: 140 M triples take seconds, not a Python loop's hours.
    """
    import numpy as np

    if triples.numel() == 0 or max_relations == 0:
        return torch.full((num_entities, max_relations), -1, dtype=torch.long)
    pairs = triples[:, :2].cpu().numpy()
    num_rel = int(pairs[:, 1].max()) + 1
    # Keys head·R + rel sort by head, then relation; 32 bits where they fit (half the memory
    # traffic of 64, and numpy's vectorised sort of uint32). Computed in one pass each.
    key_type = np.uint32 if num_entities * num_rel < 2**32 else np.uint64
    keys = np.empty(len(pairs), dtype=key_type)
    np.multiply(pairs[:, 0], num_rel, out=keys, casting="unsafe")
    np.add(keys, pairs[:, 1], out=keys, casting="unsafe")
    if len(keys) > 1 and bool((keys[1:] < keys[:-1]).any()):
        keys.sort()
    distinct = np.empty(len(keys), dtype=bool)  # duplicates of a (head, relation) dropped
    distinct[0] = True
    np.not_equal(keys[1:], keys[:-1], out=distinct[1:])
    keys = keys[distinct]
    del distinct
    heads = keys // key_type(num_rel)
    first = np.empty(len(keys), dtype=bool)  # where a head's run of relations starts
    first[0] = True
    np.not_equal(heads[1:], heads[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    del first
    ends = np.append(starts[1:], len(keys))
    run_heads = heads[starts].astype(np.int64)
    del heads
    table = np.full((num_entities, max_relations), -1, dtype=np.int64)
    # Column j holds each head's (j+1)-th relation: max_relations passes over the heads, not the pairs.
    for j in range(max_relations):
        has = starts + j < ends
        if not has.any():
            break
        at = starts[has] + j
        table[run_heads[has], j] = keys[at] - run_heads[has] * num_rel
    return torch.from_numpy(table)


def relation_tails(triples: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The tail of each (head, relation) in a :func:`relation_table`: [N, K] entity ids, -1 where the
    table has none; the smallest tail id where the KG gives a relation several tails. One argsort of
    the (head, relation) keys (skipped when the store's triples are in that order), a minimum per run,
    then a binary search per table cell: 3.3 s on 10 M random triples on this 2-core machine
    (relation_table: 1.0 s), paid at load in "tail" mode only."""
    import numpy as np

    table = table.cpu()
    tails = torch.full_like(table, -1)
    valid = (table >= 0).numpy()
    if triples.numel() == 0 or not valid.any():
        return tails
    triples = triples.cpu().numpy()
    num_rel = int(max(triples[:, 1].max(), table.max())) + 1
    keys = triples[:, 0].astype(np.int64) * num_rel + triples[:, 1]
    ends = triples[:, 2].astype(np.int64)
    if len(keys) > 1 and bool((keys[1:] < keys[:-1]).any()):
        order = np.argsort(keys, kind="stable")
        keys, ends = keys[order], ends[order]
        del order
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    keys, ends = keys[starts], np.minimum.reduceat(ends, starts)
    rows = np.nonzero(valid)[0]
    wanted = rows * num_rel + table.numpy()[valid]
    out = tails.numpy()
    out[valid] = ends[np.searchsorted(keys, wanted)]  # every table cell is some triple's (head, relation)
    return tails


class KnowledgeFusion(nn.Module):
    """Entity ids per token → one additive delta per fused layer, zero outside entity spans."""

    def __init__(self, config: FusionConfig) -> None:
        super().__init__()
        self.config = config
        width = config.mlp_dim or config.hidden_size
        # LayerNorm first: TransE vectors are unit-norm (tiny entries); the norm also keeps
        # e + r comparable to the tail's own vector after scaling.
        self.item_mlp = nn.Sequential(
            nn.LayerNorm(config.kg_dim),
            nn.Linear(config.kg_dim, width),
            nn.GELU(),
            nn.Linear(width, width),
        )
        self.out_proj = nn.ModuleList(nn.Linear(width, config.hidden_size) for _ in range(config.num_layers))
        self.gates = nn.Parameter(torch.zeros(config.num_layers))
        # relation_weights: logits of each relation's items, then of the entity's own vector (last),
        # stored divided by LOGIT_SCALE: Adam moves a parameter ~lr a step whatever its gradient, and a
        # softmax needs logits a few units apart, not the thousandths 300 steps at lr 1e-3 would give.
        self.item_logits = (
            nn.Parameter(torch.zeros(config.relation_weights + 1)) if config.relation_weights else None
        )
        # Training-only regulariser (like nn.Dropout's p, not part of the saved architecture): each
        # knowledge item is dropped with this probability, so no single item (e.g. the entity's
        # own vector, which a held-out entity's training never shaped) carries the signal alone.
        self.item_dropout = 0.0
        # The store's tables: not learned and saved with the store, so not persistent here.
        self.register_buffer("entity_vectors", torch.zeros(0, config.kg_dim), persistent=False)
        self.register_buffer("relation_vectors", torch.zeros(0, config.kg_dim), persistent=False)
        self.register_buffer(
            "entity_relations", torch.zeros(0, config.max_relations, dtype=torch.long), persistent=False
        )
        # relation_items="tail" only: the tail entity of each entity_relations cell.
        self.register_buffer(
            "entity_tails", torch.zeros(0, config.max_relations, dtype=torch.long), persistent=False
        )

    @property
    def num_entities(self) -> int:
        return self.entity_vectors.shape[0]

    def set_knowledge(
        self, entity_vectors: torch.Tensor, relation_vectors: torch.Tensor, triples: torch.Tensor
    ) -> None:
        """Load a store's vectors and facts (kept on the module's device)."""
        if entity_vectors.shape[-1] != self.config.kg_dim or relation_vectors.shape[-1] != self.config.kg_dim:
            raise ValueError(
                f"knowledge store vectors have width {entity_vectors.shape[-1]} (relations "
                f"{relation_vectors.shape[-1]}), but the fusion weights expect kg_dim={self.config.kg_dim}; "
                "use the store these fusion weights were trained with"
            )
        if self.config.relation_weights and relation_vectors.shape[0] != self.config.relation_weights:
            raise ValueError(
                f"the knowledge store has {relation_vectors.shape[0]} relations, but the fusion weighs "
                f"{self.config.relation_weights}; use the store these fusion weights were trained with"
            )
        device = self.gates.device
        table = relation_table(triples.cpu(), entity_vectors.shape[0], self.config.max_relations)
        self.entity_vectors = entity_vectors.detach().float().to(device)
        self.relation_vectors = relation_vectors.detach().float().to(device)
        self.entity_relations = table.to(device)
        if self.config.relation_items == "tail":
            self.entity_tails = relation_tails(triples.cpu(), table).to(device)

    def entity_items(self, entity_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Knowledge items of entities [E] → vectors [E, 1 + K, kg_dim] and a validity mask [E, 1 + K].

        Item 0 is ``e``; items 1..K are ``e + r`` (or, with ``config.relation_items`` "tail", the
        fact's tail ``t``) for the entity's relations, masked where absent. With ``config.entity_item``
        False, item 0 is masked unless the entity has no relation.
        """
        items, mask, _ = self._items(entity_ids)
        return items, mask

    def _items(self, entity_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`entity_items` and the relation id of each item 1..K [E, K] (-1 where absent)."""
        e = self.entity_vectors[entity_ids]  # (E, d)
        rel_ids = self.entity_relations[entity_ids]  # (E, K)
        has_rel = rel_ids >= 0
        if self.config.relation_items == "tail":
            relational = self.entity_vectors[self.entity_tails[entity_ids].clamp(min=0)]  # (E, K, d)
        else:
            relational = e.unsqueeze(1) + self.relation_vectors[rel_ids.clamp(min=0)]  # (E, K, d)
        items = torch.cat([e.unsqueeze(1), relational], dim=1)  # (E, 1 + K, d)
        own = torch.ones_like(has_rel[:, :1])
        if not self.config.entity_item:
            own = ~has_rel.any(1, keepdim=True)
        mask = torch.cat([own, has_rel], dim=1)
        return items, mask, rel_ids

    def entity_features(self, entity_ids: torch.Tensor) -> torch.Tensor:
        """Pooled knowledge of entities [E] → [E, mlp_dim] (masked mean of the shared MLP)."""
        items, mask, rel_ids = self._items(entity_ids)
        if self.training and self.item_dropout > 0:
            kept = mask & (torch.rand(mask.shape, device=mask.device) >= self.item_dropout)
            mask = torch.where(kept.any(1, keepdim=True), kept, mask)  # never drop every item
        h = self.item_mlp(items)  # (E, 1 + K, W)
        if self.item_logits is None:
            m = mask.unsqueeze(-1).to(h.dtype)
            return (h * m).sum(1) / m.sum(1)
        scaled = self.item_logits * LOGIT_SCALE
        own = scaled[-1].expand(rel_ids.shape[0], 1)
        logits = torch.cat([own, scaled[rel_ids.clamp(min=0)]], dim=1).masked_fill(~mask, float("-inf"))
        return (h * torch.softmax(logits, dim=1).unsqueeze(-1).to(h.dtype)).sum(1)

    def forward(self, token_entity_ids: torch.Tensor, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """[B, L] entity ids (-1 = none) → one delta [B, L, hidden_size] per fused layer.

        No host sync and fixed shapes (so a CUDA graph can capture it): the distinct entities are
        found with a sort into a table of B·L slots (what ``torch.unique`` returns, in its order,
        then padding), each slot's features are computed, and every token gathers its entity's.
        """
        if self.num_entities == 0:
            raise RuntimeError("KnowledgeFusion has no knowledge loaded; call set_knowledge(...) first")
        self._check_ids(token_entity_ids)
        dtype = dtype or self.gates.dtype
        flat = token_entity_ids.reshape(-1)
        linked = flat >= 0
        # Unlinked tokens sort after every entity (one extra group, never read).
        keys = torch.where(linked, flat, self.num_entities)
        ordered, order = torch.sort(keys, stable=True)
        new_group = torch.ones_like(ordered, dtype=torch.bool)
        new_group[1:] = ordered[1:] != ordered[:-1]
        group = torch.cumsum(new_group, 0) - 1  # slot of each sorted token's entity
        slots = torch.zeros_like(flat).scatter_(0, group, ordered)  # slot → entity (0 past the last)
        inverse = torch.empty_like(group).scatter_(0, order, group)  # token → slot
        features = self.entity_features(slots.clamp(max=self.num_entities - 1))  # (B·L, W)
        keep = linked.unsqueeze(-1)
        deltas = []
        for proj, gate in zip(self.out_proj, self.gates, strict=True):
            per_entity = gate * proj(features)  # (B·L slots, H)
            # index_select, not per_entity[inverse]: the same rows, but its backward is one index_add_
            # where advanced indexing's sorts the B·L indices first (a fifth of the CLIP step's GPU time).
            gathered = per_entity.index_select(0, inverse)
            per_token = torch.where(keep, gathered, per_entity.new_zeros(()))
            deltas.append(per_token.reshape(*token_entity_ids.shape, -1).to(dtype))
        return deltas

    def _check_ids(self, token_entity_ids: torch.Tensor) -> None:
        """Ids must index this store: checked on the host where they live there (no sync), on the
        device without a sync (an out-of-range id stops the next synchronising call)."""
        if not token_entity_ids.numel():
            return
        if token_entity_ids.device.type == "cpu":
            largest = int(token_entity_ids.max())
            if largest >= self.num_entities:
                raise ValueError(
                    f"token_entity_ids refer to entity {largest}, but the store has "
                    f"{self.num_entities} entities; were the ids made with a different store?"
                )
            return
        torch._assert_async(
            token_entity_ids.max() < self.num_entities,
            f"token_entity_ids refer to an entity past the store's {self.num_entities}; "
            "were the ids made with a different store?",
        )
