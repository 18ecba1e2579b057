"""Do an entity's TransE translations land on its facts? For each entity split a kshapes model folder
records (knowledge/kg_only_entities.json: held-out, validation; seen = the other objects with a 颜色
fact), the share of entities whose ``e + r(颜色)`` / ``e + r(形状)`` is nearest (L1, TransE's scoring
norm here) to their true tail among all that relation's tails. 100 % means the facts are in the
vectors, so a held-out entity the U-Net draws wrong loses them downstream (the fusion), not in TransE.

    python benchmarks/kshapes_transe_probe.py rapiddiff/assets/model
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from rapiddiff.kg.store import KnowledgeStore


def nearest_tail_accuracy(store: KnowledgeStore, names: list[str], relation: str) -> tuple[int, int]:
    """(right, scored): entities whose e + r is nearest their true tail among the relation's tails."""
    entities = torch.as_tensor(store.entity_vectors).float()
    rel = store.relation_names.index(relation)
    facts = store.triples[store.triples[:, 1] == rel]  # (head, rel, tail) rows of this relation
    tails = torch.unique(facts[:, 2])
    right = scored = 0
    for name in names:
        head = store.id_of(name)
        truth = facts[facts[:, 0] == head, 2]
        if len(truth) == 0:
            continue
        query = entities[head] + torch.as_tensor(store.relation_vectors[rel]).float()
        nearest = tails[(entities[tails] - query).abs().sum(-1).argmin()]
        right += bool((truth == nearest).any())
        scored += 1
    return right, scored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "model", type=Path, help="a model folder with knowledge/store and kg_only_entities.json"
    )
    args = parser.parse_args()
    knowledge = args.model / "knowledge"
    if not (knowledge / "kg_only_entities.json").is_file():
        parser.error(f"{knowledge}/kg_only_entities.json not found: a kshapes chain's model folder is needed")
    store = KnowledgeStore.load(knowledge / "store")
    record = json.loads((knowledge / "kg_only_entities.json").read_text("utf-8"))
    never = set(record["never_named_in_training"])
    colour = store.relation_names.index("颜色")
    objects = torch.unique(store.triples[store.triples[:, 1] == colour, 0]).tolist()
    splits = {"held-out": record["heldout"], "validation": record["validation"]}
    splits["seen"] = [store.entity_names[i] for i in objects if store.entity_names[i] not in never]
    for relation in ("颜色", "形状"):
        for split, names in splits.items():
            right, scored = nearest_tail_accuracy(store, names, relation)
            print(
                f"{relation} {split:10s} e + r nearest the true tail: {right}/{scored} ({100 * right / max(scored, 1):.0f} %)"
            )


if __name__ == "__main__":
    main()
