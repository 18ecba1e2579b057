"""How much a text tower's states move with each kind of attribute word (issue 18 diagnostic).

For each kind (colour, shape, background, position) the kshapes attribute template is filled with
every word of that kind, the others held fixed; the tower encodes the prompts and the spread is the
distance of each prompt's states from their mean, per token position, averaged over the prompts and
summed over positions. A word the tower cannot read barely moves its states (the U-Net conditioned
on them then draws that attribute at chance): the kshapes CLIP stage with ``entity_token_dropout:
1.0`` hid every KG-entity mention, attribute words included, and its tower's colour spread with
knowledge off was 7.0 against 106.8 for position words (BENCHMARKS.md).

    python benchmarks/kshapes_text_spread.py MODEL [MODEL ...]   # model or CLIP-stage folders

It also prints the centred cosine between colours at the colour word's tokens (neighbouring
colours, the ones the generator confuses), and the distance between neighbours' whole state sequences
relative to the mean distance between any two colours (``colour_distances``: 1.0 = a typical pair).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

KINDS = {
    "colour": (
        "灰色背景的中间有一个{}的圆形",
        ["红色", "橙色", "黄色", "绿色", "蓝色", "紫色", "黑色", "白色"],
    ),
    "shape": ("灰色背景的中间有一个红色的{}", ["圆形", "三角形", "方形", "星形", "椭圆形", "长条形"]),
    "background": (
        "{}背景的中间有一个红色的圆形",
        ["灰色", "粉色", "米色", "浅蓝色", "浅绿色", "深蓝色", "深绿色"],
    ),
    "position": ("灰色背景的{}有一个红色的圆形", ["左边", "中间", "右边"]),
}
# Colour pairs the kshapes generator confuses (orange drawn red, yellow drawn orange), and a far pair.
NEIGHBOURS = [("红色", "橙色"), ("橙色", "黄色"), ("黑色", "白色")]


def spread(encoder: torch.nn.Module, prompts: list[str]) -> float:
    with torch.no_grad():
        states = encoder.encode(prompts).float()  # (N, L, D)
    return float((states - states.mean(0, keepdim=True)).norm(dim=-1).mean(0).sum())


def colour_cosines(encoder: torch.nn.Module) -> dict[str, float]:
    """Cosine between colours' states at the colour word's tokens, centred over the colours: how
    alike the conditioning is for neighbouring colours (the ones the generator confuses)."""
    template, words = KINDS["colour"]
    prompts = [template.format(w) for w in words]
    ids = encoder.tokenize(prompts)["input_ids"]
    where = (ids != ids[:1]).any(0)  # the colour word's token positions
    with torch.no_grad():
        states = encoder.encode(prompts).float()[:, where].flatten(1)
    unit = torch.nn.functional.normalize(states - states.mean(0, keepdim=True), dim=-1)
    cos = unit @ unit.T
    pairs = {f"{a}-{b}": float(cos[words.index(a), words.index(b)]) for a, b in NEIGHBOURS}
    others = cos[~torch.eye(len(words), dtype=torch.bool)]
    return {**pairs, "min": float(others.min()), "max": float(others.max())}


def colour_distances(encoder: torch.nn.Module) -> dict[str, float]:
    """Distance between neighbouring colours' states (all token positions), over the mean distance of
    the 8 colours' 28 pairs: under 1, the pair is closer than a typical one."""
    template, words = KINDS["colour"]
    with torch.no_grad():
        states = encoder.encode([template.format(w) for w in words]).float().flatten(1)
    dist = torch.cdist(states, states)
    typical = dist[~torch.eye(len(words), dtype=torch.bool)].mean()
    pairs = {f"{a}-{b}": float(dist[words.index(a), words.index(b)] / typical) for a, b in NEIGHBOURS}
    pairs["蓝色-紫色"] = float(dist[words.index("蓝色"), words.index("紫色")] / typical)
    return pairs


def measure(folder: Path) -> dict[str, dict[str, Any]]:
    from rapiddiff.models.text_encoder import KnowledgeTextEncoder

    encoder = KnowledgeTextEncoder.from_pretrained(folder).float().eval()
    modes: dict[str, bool | str] = {"off": False}
    if encoder.fusion is not None:
        modes["embed"] = "embed"
    results = {}
    for mode, value in modes.items():
        encoder.set_knowledge(value)
        results[mode] = {
            kind: spread(encoder, [template.format(w) for w in words])
            for kind, (template, words) in KINDS.items()
        }
        results[mode]["colour_cosines"] = colour_cosines(encoder)
        results[mode]["colour_distances"] = colour_distances(encoder)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+", type=Path, help="folders with text_encoder/ + tokenizer/")
    args = p.parse_args()
    for folder in args.models:
        if not (folder / "text_encoder").is_dir():
            p.error(f"{folder}: no text_encoder/ folder (a model folder or a CLIP stage's output)")
    results = {str(m): measure(m) for m in args.models}
    print(json.dumps(results, indent=1, ensure_ascii=False))
    print("\n| model | knowledge | " + " | ".join(KINDS) + " |\n|---|---|" + "---:|" * len(KINDS))
    for model, modes in results.items():
        for mode, row in modes.items():
            print(f"| {model} | {mode} | " + " | ".join(f"{row[k]:.1f}" for k in KINDS) + " |")
            print("  colour cosines:", {k: round(v, 2) for k, v in row["colour_cosines"].items()})
            print(
                "  colour distances / typical:", {k: round(v, 2) for k, v in row["colour_distances"].items()}
            )


if __name__ == "__main__":
    main()
