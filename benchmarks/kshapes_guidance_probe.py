"""Why guidance 5.0 drew orange circles yellow (issue 18 diagnostic): the built-in model's images for
one prompt at several CFG scales, with the colour the kshapes detector reads and the median RGB of
the object's pixels. Add ``--knowledge-guidance GK ...`` to try a third branch that pushes from the
knowledge-off prediction toward the knowledge-on one on a prompt split instead:
ε = ε_u + g (ε_k − ε_u) + g_k (ε_k − ε_off) (BENCHMARKS.md: not adopted).

    python benchmarks/kshapes_guidance_probe.py --prompt 灰色背景的中间有一个橙色的圆形 --guidance 1 3 5
    python benchmarks/kshapes_guidance_probe.py --kshapes ks0 --split heldout --guidance 4 --knowledge-guidance 0 3
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rapiddiff.data.kshapes import detect_attributes  # noqa: E402
from rapiddiff.infer.pipeline import RapidDiffusionPipeline  # noqa: E402
from rapiddiff.models import sampling  # noqa: E402


def object_rgb(image) -> list[float] | None:
    """Median RGB of the pixels far (> 60) from the border's median colour: the object."""
    a = np.asarray(image.convert("RGB"), dtype=np.float64)
    background = np.median(np.concatenate([a[:2].reshape(-1, 3), a[-2:].reshape(-1, 3)]), 0)
    mask = np.linalg.norm(a - background, axis=-1) > 60
    return np.median(a[mask], 0).round().tolist() if mask.sum() > 20 else None


def with_knowledge_guidance(pipe: RapidDiffusionPipeline, state: dict) -> None:
    """Wrap the eager loop's model so the text half gets + (g_k / g)(ε_k − ε_off) (state: gk, g, off)."""
    original = sampling.unet_model

    def wrapped(unet):
        base = original(unet)

        def model(x, t, context):
            out = base(x, t, context)
            n = state["off"].shape[0]
            if state["gk"] == 0 or context.shape[0] != 2 * n:
                return out
            uncond, text = out.chunk(2)
            off = base(x[n:], t, state["off"].to(context.dtype))
            return torch.cat([uncond, text + state["gk"] / state["g"] * (text - off)])

        return model

    sampling.unet_model = wrapped


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(ROOT / "rapiddiff/assets/model"))
    p.add_argument("--prompt", help="one prompt, seeds 0-7 at each scale")
    p.add_argument("--kshapes", type=Path, help="a `rapiddiff data kshapes` folder (with --split)")
    p.add_argument("--split", default="heldout")
    p.add_argument("--knowledge", default="embed")
    p.add_argument("--guidance", type=float, nargs="+", default=[1.0, 3.0, 5.0])
    p.add_argument("--knowledge-guidance", type=float, nargs="+", default=[0.0])
    args = p.parse_args()
    if (args.prompt is None) == (args.kshapes is None):
        p.error("give --prompt or --kshapes")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    pipe = RapidDiffusionPipeline.from_pretrained(args.model)
    state = {"gk": 0.0, "g": 1.0, "off": torch.zeros(0)}
    with_knowledge_guidance(pipe, state)
    if args.prompt:
        prompts, seeds, first = [{"text": args.prompt}], 8, 0
    else:
        lines = (args.kshapes / "prompts.jsonl").read_text("utf-8").splitlines()
        prompts = [r for r in map(json.loads, lines) if r["split"] == args.split]
        seeds, first = 4, 1000  # prompt i: seeds 1000 + 4i ... + 3
    for g in args.guidance:
        for gk in args.knowledge_guidance:
            state.update(gk=gk, g=g)
            right, colours, rgbs = {"colour": 0, "shape": 0, "both": 0}, [], []
            for i, prompt in enumerate(prompts):
                texts = [prompt["text"]] * seeds
                with torch.inference_mode(), pipe.text_encoder.knowledge_as("off"):
                    state["off"] = pipe.text_encoder.encode(texts)
                out = pipe(
                    texts, guidance_scale=g, seed=first + seeds * i, progress=False, knowledge=args.knowledge
                )
                for image in out.images:
                    read = detect_attributes(image)
                    colours.append(read["colour"])
                    rgbs += [object_rgb(image)] if object_rgb(image) else []
                    if "colour" in prompt:
                        c, s = read["colour"] == prompt["colour"], read["shape"] == prompt["shape"]
                        right["colour"] += c
                        right["shape"] += s
                        right["both"] += c and s
            n = len(prompts) * seeds
            row = {"guidance": g, "knowledge_guidance": gk, "images": n}
            if args.prompt:
                row.update(colours=colours, median_rgb=np.median(rgbs, 0).round().tolist() if rgbs else None)
            else:
                row.update({k: round(100 * v / n, 1) for k, v in right.items()})
            print(json.dumps(row, ensure_ascii=False), flush=True)


if __name__ == "__main__":
    main()
