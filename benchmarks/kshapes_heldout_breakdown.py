"""Which held-out entities a kshapes model draws wrong, and whether novelty explains it: each held-out
entity's colour × shape either belongs to some seen entity too (the U-Net was trained on that pair
through a seen entity's knowledge) or to none (it must compose). Reads the per-entity results that
``rapiddiff eval knowledge`` writes (``metrics/knowledge.json``) and the model's own KG.

    python benchmarks/kshapes_heldout_breakdown.py EVAL_DIR/metrics/knowledge.json rapiddiff/assets/model
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from rapiddiff.kg.store import KnowledgeStore


def pair_of(store: KnowledgeStore, name: str) -> tuple[str, str]:
    colour, shape = (store.relation_names.index(r) for r in ("颜色", "形状"))
    facts = store.facts(store.id_of(name))
    return tuple(next(store.entity_names[t] for r, t in facts if r == rel) for rel in (colour, shape))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="metrics/knowledge.json of `rapiddiff eval knowledge`")
    parser.add_argument("model", type=Path, help="the evaluated model folder (its knowledge/store)")
    args = parser.parse_args()
    per_entity = json.loads(args.results.read_text("utf-8"))["details"]["per_entity"]
    store = KnowledgeStore.load(args.model / "knowledge" / "store")
    seen_pairs = {pair_of(store, n) for n, v in per_entity.items() if v["split"] == "seen"}
    heldout = {n: v for n, v in per_entity.items() if v["split"] == "heldout"}
    modes = [m for m in ("embed", "both", "off") if all(m in v for v in heldout.values())]
    for mode in modes:
        groups: dict[str, list[float]] = {"pair seen": [], "pair novel": []}
        for name, v in heldout.items():
            groups["pair seen" if pair_of(store, name) in seen_pairs else "pair novel"].append(
                v[mode]["both"]
            )
        print(
            f"{mode:6s} "
            + "  ".join(f"{g}: {100 * statistics.fmean(x):.1f} % of {len(x)}" for g, x in groups.items() if x)
        )
    for name, v in sorted(heldout.items(), key=lambda kv: kv[1][modes[0]]["both"]):
        want = "/".join(v["expected"].values())
        novel = "novel" if pair_of(store, name) not in seen_pairs else "seen "
        drawn = ", ".join(
            sorted(set(v[modes[0]]["detected"]), key=v[modes[0]]["detected"].count, reverse=True)
        )
        print(
            f"{name:4s} {novel} want {want:8s} {modes[0]} {100 * v[modes[0]]['both']:5.1f} %  drawn: {drawn}"
        )


if __name__ == "__main__":
    main()
