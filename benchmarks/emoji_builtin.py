"""A trained emoji-zh model folder → the shippable fp16 built-in folder (benchmarks/emoji_chain.py's
last step; also runnable alone):

    python benchmarks/emoji_builtin.py --model RUN/seed-0/unet_s16 --data RUN/data --out rapiddiff/assets/emoji

The text tower keeps only the vocabulary emoji-zh's captions, prompts and KG names use (the other rows
of the 21,128-token table were never trained), traditional characters are read as simplified ones
first (the tower only ever read simplified text), the folder records the sampling defaults the chain
evaluated with, and it carries the data folder's licences and attribution.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def assemble_emoji_model(model: Path, data: Path, out: Path, *, steps: int, guidance: float | None) -> None:
    import torch

    from rapiddiff.data.licenses import copy_licenses_of_sources
    from rapiddiff.models.bundle import load_model_folder, save_model_folder
    from rapiddiff.models.sampling import SamplingDefaults, default_sampler
    from rapiddiff.models.vocab import prune_vocabulary

    bundle = load_model_folder(model, device="cpu", dtype=torch.float16)
    files = [data / split / "metadata.jsonl" for split in ("train", "val", "test")]
    texts = [json.loads(line)["text"] for file in files for line in file.open(encoding="utf-8")]
    texts += [json.loads(line)["text"] for line in (data / "prompts.jsonl").open(encoding="utf-8")]
    print(f"[emoji-builtin] vocabulary: {prune_vocabulary(bundle.text_encoder, texts)}", flush=True)
    bundle.text_encoder.simplified_text = True
    if guidance is None:
        guidance = bundle.sampling.guidance_scale if bundle.sampling is not None else None
    bundle.sampling = SamplingDefaults(
        num_inference_steps=steps,
        **({"guidance_scale": guidance} if guidance is not None else {}),
        scheduler=default_sampler(bundle.scheduler.config, "pndm"),
    )
    save_model_folder(bundle, out)
    copy_licenses_of_sources([data], out)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"[emoji-builtin] {out}: {size / 1e6:.1f} MB", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", type=Path, required=True, help="a trained model folder (the U-Net stage's output)"
    )
    p.add_argument("--data", type=Path, required=True, help="the emoji-zh data folder it trained on")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--guidance", type=float)
    args = p.parse_args()
    assemble_emoji_model(args.model, args.data, args.out, steps=args.steps, guidance=args.guidance)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
