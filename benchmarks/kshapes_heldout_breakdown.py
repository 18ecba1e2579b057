"""Which held-out entities a kshapes model draws wrong, and whether novelty explains it: each held-out
entity's colour × shape either belongs to some seen entity too (the U-Net was trained on that pair
through a seen entity's knowledge) or to none (it must compose). Reads the per-entity results, with
each entity's expected colour and shape, that ``rapiddiff eval knowledge`` writes.

    python benchmarks/kshapes_heldout_breakdown.py EVAL_DIR/metrics/knowledge.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="metrics/knowledge.json of `rapiddiff eval knowledge`")
    args = parser.parse_args()
    try:
        per_entity = json.loads(args.results.read_text("utf-8"))["details"]["per_entity"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        parser.error(
            f"{args.results}: not the metrics/knowledge.json of `rapiddiff eval knowledge` ({err!r})"
        )

    def pair(v: dict) -> tuple[str, str]:
        return v["expected"]["colour"], v["expected"]["shape"]

    seen_pairs = {pair(v) for v in per_entity.values() if v["split"] == "seen"}
    heldout = {n: v for n, v in per_entity.items() if v["split"] == "heldout"}
    modes = [m for m in ("embed", "both", "off") if all(m in v for v in heldout.values())]
    for mode in modes:
        groups: dict[str, list[float]] = {"pair seen": [], "pair novel": []}
        for v in heldout.values():
            groups["pair seen" if pair(v) in seen_pairs else "pair novel"].append(v[mode]["both"])
        print(
            f"{mode:6s} "
            + "  ".join(f"{g}: {100 * statistics.fmean(x):.1f} % of {len(x)}" for g, x in groups.items() if x)
        )
    first = modes[0]
    for name, v in sorted(heldout.items(), key=lambda kv: kv[1][first]["both"]):
        novel = "seen " if pair(v) in seen_pairs else "novel"
        detected = v[first]["detected"]
        drawn = ", ".join(sorted(set(detected), key=detected.count, reverse=True))
        name = name.partition("/")[2] or name  # "heldout/草莓" (older results: "草莓")
        print(
            f"{name:4s} {novel} want {'/'.join(pair(v)):8s} {first} {100 * v[first]['both']:5.1f} %  drawn: {drawn}"
        )


if __name__ == "__main__":
    main()
