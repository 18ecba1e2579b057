"""``rapiddiff eval clipscore``: image–text agreement with the project's Chinese CLIP.

CLIPScore convention (Hessel et al. 2021, as torchmetrics computes it): per image–prompt pair
``100 × max(cos(image, text), 0)``, averaged over pairs. The model is rapiddiff's KnowledgeCLIP
(OpenAI's English CLIP, torchmetrics' default, cannot read Chinese prompts), so the number is
labelled with the model it came from: scores of different CLIP models are not comparable.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rapiddiff.eval.common import (
    add_device_arguments,
    default_metric_path,
    metric_record,
    read_index,
    uint8_batches,
    write_json,
)
from rapiddiff.utils.device import resolve_device

# Modules that load torch, numpy or PIL are imported inside the functions that use them:
# `rapiddiff eval --help` imports every eval module.


def clip_scores(clip: Any, images: Any, texts: Sequence[str]) -> Any:
    """Per-pair scores [N]: 100 × max(cos, 0); ``images`` float [N, 3, H, W] in [-1, 1]."""
    import torch

    img = torch.nn.functional.normalize(clip.encode_image(images).float(), dim=-1)
    txt = torch.nn.functional.normalize(clip.encode_text(list(texts)).float(), dim=-1)
    return 100.0 * (img * txt.to(img.device)).sum(-1).clamp(min=0)


def clipscore_run(
    clip: Any, run_dir: str | Path, *, batch_size: int = 64, device: Any = "cpu"
) -> dict[str, Any]:
    """Mean CLIPScore over an eval run's (image, prompt) pairs → a metric record."""
    import torch
    from tqdm.auto import tqdm

    run_dir = Path(run_dir)
    index = read_index(run_dir)
    if not index:
        raise ValueError(f"{run_dir}/index.jsonl lists no images")
    prompt_of = {run_dir / row["file"]: row["prompt"] for row in index}
    scores = []
    with torch.inference_mode(), tqdm(total=len(index), desc="clipscore", unit="img") as bar:
        for files, batch in uint8_batches(list(prompt_of), batch_size):
            pixels = batch.to(device, torch.float32) / 127.5 - 1.0
            scores.append(clip_scores(clip, pixels, [prompt_of[f] for f in files]).cpu())
            bar.update(len(files))
    s = torch.cat(scores).double()
    name = getattr(clip, "name_or_path", None) or "rapiddiff KnowledgeCLIP"
    return metric_record(
        "clipscore",
        f"CLIPScore({name})",
        float(s.mean()),
        details={
            "convention": "100 * max(cos(image, text), 0), mean over pairs",
            "std": float(s.std()) if len(s) > 1 else 0.0,
            "pairs": len(s),
            "run": str(run_dir),
        },
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "CLIPScore of an eval run with rapiddiff's Chinese KnowledgeCLIP: 100 × max(cos, 0) per (image, "
        "prompt) pair of RUN/index.jsonl, averaged. Writes RUN/metrics/clipscore.json."
    )
    parser.add_argument("run", type=Path, help="eval run folder (from `rapiddiff eval sample`)")
    parser.add_argument(
        "--clip-model", required=True, type=Path, help="KnowledgeCLIP folder (rapiddiff train clip)"
    )
    parser.add_argument(
        "--knowledge", choices=("on", "off"), default="on", help="the CLIP text tower's knowledge"
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--out", type=Path, help="JSON result (default: RUN/metrics/clipscore.json)")
    add_device_arguments(parser, dtype=False)  # features in float32, statistics in float64


def run(args: argparse.Namespace) -> int:

    read_index(args.run)  # a wrong folder fails before the model loads
    device = resolve_device(args.device)
    from rapiddiff.models.clip import KnowledgeCLIP

    clip = KnowledgeCLIP.from_pretrained(args.clip_model).to(device).eval()
    if hasattr(clip, "text_encoder"):
        clip.text_encoder.knowledge = args.knowledge == "on"
    record = clipscore_run(clip, args.run, batch_size=args.batch_size, device=device)
    record["label"] = f"CLIPScore(KnowledgeCLIP {args.clip_model.name})"
    record["details"].update(clip_model=str(args.clip_model), knowledge=args.knowledge)
    out = args.out or default_metric_path(args.run, "clipscore")
    write_json(out, record)
    print(f"{record['label']}: {record['value']:.2f} over {record['details']['pairs']} pairs → {out}")
    return 0
