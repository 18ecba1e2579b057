"""Do the colour misses follow the text states? Sharpen a colour word's conditioning against its neighbour.

    python benchmarks/kshapes_conditioning_sharpen.py --kshapes KS [--model rapiddiff/assets/model]
        [--pairs 黄色:橙色,蓝色:紫色] [--alphas 0,1] [--images 8]

For every attribute caption asking for colour A (KS/prompts_attribute.jsonl), the text states of the
caption are replaced by s_A + alpha * (s_A - s_B), where s_B is the same caption with its neighbour B
in A's place (the same tokens elsewhere), and the images are read by the kshapes detector. alpha = 0
is the model as it is; alpha > 0 pushes the conditioning away from B. If the misses into B fall when
only the conditioning is sharpened, the U-Net can draw A and the limit is how far apart the text
side puts A and B; if they do not, the limit is in the U-Net or the latents (issue 18: the misses
are blends of A and B, benchmarks/kshapes_miss_hues.py).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path


def main() -> None:
    import torch

    from rapiddiff.data.kshapes.detect import detect_attributes
    from rapiddiff.data.kshapes.palette import COLOURS
    from rapiddiff.infer.pipeline import RapidDiffusionPipeline

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kshapes", type=Path, required=True, help="a `rapiddiff data kshapes` folder")
    parser.add_argument("--model", default="rapiddiff/assets/model")
    parser.add_argument("--pairs", default="黄色:橙色,蓝色:紫色", help="A:B — colour asked : its neighbour")
    parser.add_argument("--alphas", default="0,1")
    parser.add_argument("--images", type=int, default=8, help="images per caption (seeds 0..N-1)")
    parser.add_argument("--guidance", type=float, default=None, help="default: the model's")
    parser.add_argument(
        "--against",
        choices=("neighbour", "others"),
        default="neighbour",
        help="neighbour: s_B is B's caption; others: s_B is the mean over every other palette colour's "
        "caption (no neighbour named: what a sampler could do from the KG's values of 颜色)",
    )
    args = parser.parse_args()
    pipe = RapidDiffusionPipeline.from_pretrained(args.model, device="cpu")
    encode = pipe.text_encoder.encode
    rows = [json.loads(line) for line in (args.kshapes / "prompts_attribute.jsonl").open(encoding="utf-8")]
    print("| asked (neighbour) | alpha | images | colour right % | read as the neighbour | read as |")
    print("|---|---:|---:|---:|---:|---|")
    for pair in args.pairs.split(","):
        asked, neighbour = pair.split(":")
        captions = [r for r in rows if r["colour"] == asked]
        for alpha in (float(a) for a in args.alphas.split(",")):

            def sharpened(texts, asked=asked, neighbour=neighbour, alpha=alpha):
                states = encode(texts)
                if alpha == 0:
                    return states
                swaps = [neighbour] if args.against == "neighbour" else [c for c in COLOURS if c != asked]
                # Only the object's colour word ("{c}的") is swapped, so a 浅蓝色 background stays. The
                # neighbour runs of 2026-11-24 (BENCHMARKS.md) swapped every occurrence: 蓝色 → 紫色 also
                # turned 浅蓝色 into 浅紫色 in the blue captions on light blue.
                other = torch.stack(
                    [encode([t.replace(f"{asked}的", f"{b}的") for t in texts]) for b in swaps]
                ).mean(0)
                keep = torch.tensor([asked in t for t in texts], device=states.device)[:, None, None]
                return torch.where(keep, states + alpha * (states - other), states)  # negatives stay

            pipe.text_encoder.encode = sharpened
            read = Counter()
            for row in captions:
                out = pipe(
                    row["text"],
                    seed=0,
                    num_images_per_prompt=args.images,
                    guidance_scale=args.guidance,
                    progress=False,
                )
                for image in out.images:
                    read[detect_attributes(image, layout=row["layout"])["colour"]] += 1
            pipe.text_encoder.encode = encode
            n = sum(read.values())
            print(
                f"| {asked} ({neighbour}) | {alpha:g} | {n} | {100 * read[asked] / n:.1f} | {read[neighbour]} | "
                f"{', '.join(f'{k} {v}' for k, v in read.most_common())} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
