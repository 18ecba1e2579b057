"""KnowledgeFusion's sync-free forward against the formula it replaced (torch.unique + boolean indexing)."""

from __future__ import annotations

import pytest
import torch

from rapiddiff.models.fusion import FusionConfig, KnowledgeFusion, relation_table


def reference_forward(fusion: KnowledgeFusion, token_entity_ids: torch.Tensor) -> list[torch.Tensor]:
    """The previous forward: each distinct linked entity once, scattered back by a boolean mask."""
    linked = token_entity_ids >= 0
    ids, inverse = torch.unique(token_entity_ids[linked], return_inverse=True)
    features = fusion.entity_features(ids)
    deltas = []
    for proj, gate in zip(fusion.out_proj, fusion.gates, strict=True):
        per_entity = gate * proj(features)
        delta = per_entity.new_zeros(*token_entity_ids.shape, per_entity.shape[-1])
        delta[linked] = per_entity[inverse]
        deltas.append(delta)
    return deltas


def make_fusion(seed: int, entities: int = 40, relations: int = 5) -> KnowledgeFusion:
    torch.manual_seed(seed)
    fusion = KnowledgeFusion(
        FusionConfig(kg_dim=8, hidden_size=12, num_layers=2, max_relations=3, mlp_dim=10)
    )
    with torch.no_grad():
        fusion.gates.normal_()  # non-zero gates: the deltas are not all zero
    triples = torch.stack(
        [
            torch.randint(0, entities, (60,)),
            torch.randint(0, relations, (60,)),
            torch.randint(0, entities, (60,)),
        ],
        1,
    )
    fusion.set_knowledge(torch.randn(entities, 8), torch.randn(relations, 8), triples)
    return fusion


@pytest.mark.parametrize("seed", range(4))
def test_forward_matches_the_unique_formula(seed: int) -> None:
    fusion = make_fusion(seed)
    g = torch.Generator().manual_seed(100 + seed)
    ids = torch.randint(0, 40, (5, 11), generator=g)
    ids[torch.rand(ids.shape, generator=g) < 0.6] = -1  # padding / unknown tokens
    ids[0, 3:6] = 7  # one entity spanning several tokens, and again in another row
    ids[2, 0] = 7
    ids[4] = -1  # a row without any entity
    new, old = fusion(ids), reference_forward(fusion, ids)
    assert len(new) == len(old) == 2
    for a, b in zip(new, old, strict=True):
        assert a.shape == (5, 11, 12)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert torch.all(a[ids < 0] == 0)
        assert a[ids >= 0].abs().sum() > 0


def test_gradients_match_the_unique_formula() -> None:
    fusion = make_fusion(5)
    ids = torch.tensor([[3, 3, -1, 9, -1], [-1, 9, 0, -1, -1]])
    grads = []
    for fn in (lambda: fusion(ids), lambda: reference_forward(fusion, ids)):
        fusion.zero_grad()
        sum((d * torch.arange(d.numel()).reshape(d.shape)).sum() for d in fn()).backward()
        grads.append({n: p.grad.clone() for n, p in fusion.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-5, atol=1e-6)


def test_item_dropout_draws_as_before_on_cpu() -> None:
    """Dropout is per distinct entity, in torch.unique's order: the same draws as the old formula."""
    fusion = make_fusion(6).train()
    fusion.item_dropout = 0.5
    ids = torch.tensor([[12, 12, 4, -1, 30], [4, -1, -1, 30, 2]])
    torch.manual_seed(1)
    new = fusion(ids)
    torch.manual_seed(1)
    old = reference_forward(fusion, ids)
    for a, b in zip(new, old, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_all_unlinked_and_out_of_range_ids() -> None:
    fusion = make_fusion(7)
    ids = torch.full((2, 4), -1)
    assert all(torch.all(d == 0) for d in fusion(ids))
    with pytest.raises(ValueError, match="refer to entity 40, but the store has 40"):
        fusion(torch.tensor([[1, 40]]))


def test_relation_table_is_distinct_sorted_and_capped() -> None:
    triples = torch.tensor([[0, 2, 1], [0, 1, 3], [0, 2, 4], [0, 0, 1], [2, 3, 0], [0, 4, 0]])
    table = relation_table(triples, 4, 3)
    assert table.tolist() == [[0, 1, 2], [-1, -1, -1], [3, -1, -1], [-1, -1, -1]]


def test_without_the_entity_item_only_translations_are_pooled() -> None:
    """entity_item=False: an entity with relations pools only its e + r items (so changing e's own
    contribution is the only difference), one without relations keeps e; the config round-trips."""
    fusion = make_fusion(8)
    table = fusion.entity_relations
    with_rel = int(torch.nonzero((table >= 0).any(1))[0])
    without_rel = int(torch.nonzero(~(table >= 0).any(1))[0])
    ids = torch.tensor([with_rel, without_rel])
    items, mask = fusion.entity_items(ids)
    assert mask[0, 0] and mask[1, 0]  # the default keeps e for both
    fusion.config.entity_item = False
    items_off, mask_off = fusion.entity_items(ids)
    torch.testing.assert_close(items_off, items)
    assert not mask_off[0, 0] and mask_off[1, 0]  # e dropped only where a translation exists
    assert torch.equal(mask_off[:, 1:], mask[:, 1:])
    h = fusion.item_mlp(items_off[0, 1:][mask_off[0, 1:]])
    torch.testing.assert_close(fusion.entity_features(ids)[0], h.mean(0))
    assert (
        fusion.entity_features(ids)[0]
        .sub(KnowledgeFusion.entity_features(make_fusion(8), ids)[0])
        .abs()
        .max()
        > 0
    )
    assert FusionConfig(**fusion.config.to_dict()).entity_item is False
    assert FusionConfig(
        **{k: v for k, v in fusion.config.to_dict().items() if k != "entity_item"}
    ).entity_item
    with pytest.raises(ValueError, match="entity_item must be true or false, got 'no'"):
        FusionConfig(kg_dim=8, hidden_size=12, entity_item="no")


def test_relation_tails_pick_each_facts_smallest_tail() -> None:
    """relation_items="tail": each (head, relation) of the table gets its fact's tail — the smallest
    tail id where the KG gives several — and -1 where the table has no relation."""
    from rapiddiff.models.fusion import relation_tails

    triples = torch.tensor([[0, 2, 4], [0, 1, 3], [0, 2, 1], [0, 0, 2], [2, 3, 0], [0, 4, 0]])
    table = relation_table(triples, 4, 3)
    assert relation_tails(triples, table).tolist() == [[2, 3, 1], [-1, -1, -1], [0, -1, -1], [-1, -1, -1]]
    assert relation_tails(triples[:0], relation_table(triples[:0], 4, 3)).tolist() == [[-1] * 3] * 4


def test_tail_items_are_the_facts_tail_vectors() -> None:
    """A held-out entity whose fact says 红色 gets 红色's own vector as that item (not the noisy
    e + r), so it reaches the MLP exactly as the colour word does; the config round-trips and
    rejects an unknown kind."""
    fusion = make_fusion(3)
    triples = torch.tensor([[0, 1, 5], [0, 3, 7], [2, 1, 5], [9, 0, 4]])
    tail = KnowledgeFusion(FusionConfig(**{**fusion.config.to_dict(), "relation_items": "tail"}))
    tail.load_state_dict(fusion.state_dict())
    tail.set_knowledge(fusion.entity_vectors, fusion.relation_vectors, triples)
    items, mask = tail.entity_items(torch.tensor([0, 2, 9, 5]))
    vectors = fusion.entity_vectors
    torch.testing.assert_close(items[0, :3], vectors[[0, 5, 7]])
    torch.testing.assert_close(items[1, 1], items[0, 1])  # two entities with the same fact share it
    torch.testing.assert_close(items[2, 1], vectors[4])
    t, f = True, False
    assert mask.tolist() == [[t, t, t, f], [t, t, f, f], [t, t, f, f], [t, f, f, f]]
    # the translation kind on the same facts: e + r, different from the tail
    fusion.set_knowledge(fusion.entity_vectors, fusion.relation_vectors, triples)
    translated, _ = fusion.entity_items(torch.tensor([0]))
    torch.testing.assert_close(translated[0, 1], vectors[0] + fusion.relation_vectors[1])
    assert not torch.allclose(translated[0, 1], items[0, 1])
    assert FusionConfig(**tail.config.to_dict()).relation_items == "tail"
    saved_before = {k: v for k, v in tail.config.to_dict().items() if k != "relation_items"}
    assert FusionConfig(**saved_before).relation_items == "translation"  # a fusion_config.json from before
    with pytest.raises(ValueError, match="relation_items must be one of translation, tail, got 'tails'"):
        FusionConfig(kg_dim=8, hidden_size=12, relation_items="tails")


def test_relation_weights_start_as_the_mean_and_then_favour_a_relation() -> None:
    """relation_weights: zero logits pool exactly the mean; raising one relation's logit pulls the
    pooled features toward that relation's item; the store must have as many relations."""
    triples = torch.tensor([[0, 1, 5], [0, 3, 7], [2, 1, 5], [9, 0, 4]])
    plain = KnowledgeFusion(FusionConfig(kg_dim=8, hidden_size=12, max_relations=3))
    weighted = KnowledgeFusion(FusionConfig(**{**plain.config.to_dict(), "relation_weights": 4}))
    weighted.load_state_dict({**plain.state_dict(), "item_logits": torch.zeros(5)})
    vectors, relations = torch.randn(10, 8), torch.randn(4, 8)
    for fusion in (plain, weighted):
        fusion.set_knowledge(vectors, relations, triples)
    ids = torch.tensor([0, 2, 9, 5])
    torch.testing.assert_close(weighted.entity_features(ids), plain.entity_features(ids))
    with torch.no_grad():
        weighted.item_logits[3] = 2.0  # relation 3: only entity 0 has it (its item 2)
    items, _ = plain.entity_items(ids[:1])
    only_r3 = plain.item_mlp(items[0, 2])
    moved = (weighted.entity_features(ids[:1])[0] - only_r3).norm()
    assert moved < 0.01 * (plain.entity_features(ids[:1])[0] - only_r3).norm()
    torch.testing.assert_close(weighted.entity_features(ids[1:]), plain.entity_features(ids[1:]))
    with pytest.raises(ValueError, match="store has 5 relations, but the fusion weighs 4"):
        weighted.set_knowledge(vectors, torch.randn(5, 8), triples)
    with pytest.raises(ValueError, match="relation_weights must be an int >= 0, got -1"):
        FusionConfig(kg_dim=8, hidden_size=12, relation_weights=-1)
