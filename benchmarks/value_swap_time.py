"""How long the CLIP stage's hard negatives take to build (rapiddiff.train.negatives.ValueSwap).

    python benchmarks/value_swap_time.py KS [--model rapiddiff/assets/model] [--rows 20000] [--variants 4]

KS is a `rapiddiff data kshapes` folder: its attribute prompts and test captions are tokenized once
(knowledge mode embed, as the CLIP stage tokenizes) and their rows repeated to ``--rows``; the time is
ValueSwap's alone, which is what the GPU-resident CLIP step adds to its start (the tokens it needs anyway).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    from rapiddiff.models.text_encoder import KnowledgeTextEncoder
    from rapiddiff.train.negatives import ValueSwap

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kshapes", type=Path)
    parser.add_argument("--model", default="rapiddiff/assets/model")
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--variants", type=int, default=4)
    args = parser.parse_args()
    encoder = KnowledgeTextEncoder.from_pretrained(args.model)
    encoder.knowledge_mode = "embed"
    files = [args.kshapes / "prompts_attribute.jsonl", args.kshapes / "test" / "metadata.jsonl"]
    captions = [json.loads(line)["text"] for f in files for line in f.open(encoding="utf-8")]
    tokens = encoder.tokenize(captions)
    repeats = -(-args.rows // len(captions))
    rows = {k: v.repeat(repeats, 1)[: args.rows] for k, v in tokens.items()}
    swap = ValueSwap(encoder, ["颜色", "形状"])
    start = time.perf_counter()
    out = swap(rows, args.variants)
    seconds = time.perf_counter() - start
    valid = float(out["neg_valid"][:, 0].float().mean())
    print(
        f"{len(captions)} distinct captions, {args.rows} rows × {args.variants} variants: {seconds:.2f} s "
        f"({valid:.0%} of rows name a value to swap)"
    )


if __name__ == "__main__":
    main()
