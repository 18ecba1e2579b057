"""Does a mask ControlNet put the object where its mask says? IoU of the generated object's mask.

For each test item (its caption and its control mask: the data's ``mask`` column, or the mask read
off its image where the folder has none), one image is drawn with the ControlNet and one without
it, from the same seed. The generated image's object is found by the rule of the ``mask`` transform
(:func:`rapiddiff.data.control.object_mask`: what differs from the border's background colour), and
its IoU with the control mask (thresholded at half) is the figure: with control it should approach
the data's own (a real image's mask read by the same rule), without control it is what chance
placement gives.

    python benchmarks/controlnet_mask_iou.py --model builtin --controlnet runs/controlnet/kshapes/model \
        --data data/kshapes/test --limit 200 --out runs/controlnet/kshapes/iou

writes ``OUT/iou.json`` (the means, per item rows) and ``OUT/grid.png`` (rows: control | with | without).
Runs on a CPU for a tiny model (its test) and on a GPU for the real figure.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rapiddiff.data.control import ControlImageTextDataset, object_mask


def generate(
    pipe: Any,
    prompts: list[str],
    control: torch.Tensor | None,
    seeds: list[int],
    *,
    steps: int,
    guidance: float,
    scheduler_name: str,
) -> torch.Tensor:
    """Images [N, 3, H, W] in [0, 1] for ``prompts`` through rapiddiff's one generation path (image
    k with seed ``seeds[k]``, knowledge as the folder has it); steered by the pipeline's loaded
    ControlNet with ``control`` [N, 3, H, W] in [0, 1], else the base model alone. One control image
    per call (the pipeline takes one per net), so a controlled batch is drawn image by image."""
    from PIL import Image

    from rapiddiff.models.controlnet import ControlSpec

    common = {"num_inference_steps": steps, "guidance_scale": guidance, "scheduler": scheduler_name,
              "output_type": "pt", "progress": False, "upscale": False}  # fmt: skip
    if control is None:
        return pipe(prompts, seed=list(seeds), **common).images.float().cpu()
    images = []
    for prompt, image, seed in zip(prompts, control, seeds, strict=True):
        pil = Image.fromarray((image.permute(1, 2, 0).clamp(0, 1) * 255).round().to(torch.uint8).numpy())
        out = pipe([prompt], seed=[seed], control=ControlSpec(pil), **common)
        images.append(out.images.float().cpu())
    return torch.cat(images)


def iou(a: np.ndarray, b: np.ndarray) -> float:
    union = int((a | b).sum())
    return float((a & b).sum() / union) if union else 1.0


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """[N, 3, H, W] in [0, 1] → (N, H, W, 3) uint8."""
    return (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()


def open_data(folder: Path, image_size: int) -> ControlImageTextDataset:
    """The data's ``mask`` column where it has one, else the mask read off each image."""
    try:
        return ControlImageTextDataset(folder, control_column="mask", image_size=image_size)
    except ValueError as err:
        if "no conditioning column" not in str(err):
            raise
        print(f"{folder}: no mask column; the masks are read off the images", file=sys.stderr)
        return ControlImageTextDataset(folder, transform_name="mask", image_size=image_size)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from rapiddiff.infer.pipeline import RapidDiffusionPipeline
    from rapiddiff.models.builtin import resolve_model
    from rapiddiff.models.bundle import load_model_folder
    from rapiddiff.models.sampling import SamplingDefaults, vae_scale_factor

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    base = resolve_model(args.model)  # a folder, builtin or builtin:NAME
    bundle = load_model_folder(base, device=device, dtype=dtype, load_upscaler=False)
    pipe = RapidDiffusionPipeline.from_bundle(bundle)
    pipe.load_controlnet(args.controlnet)  # safetensors only, as everywhere
    defaults = bundle.sampling or SamplingDefaults()
    steps = args.steps or defaults.num_inference_steps
    guidance = defaults.guidance_scale if args.guidance is None else args.guidance
    size = int(bundle.unet.config.sample_size) * vae_scale_factor(bundle.vae)
    data = open_data(Path(args.data), size)
    n = min(args.limit or len(data), len(data))
    rows: list[dict[str, Any]] = []
    grid: list[torch.Tensor] = []
    for start in range(0, n, args.batch_size):
        items = [data[i] for i in range(start, min(n, start + args.batch_size))]
        control = torch.stack([item["control"] for item in items])  # (B, 3, H, W) in [0, 1]
        prompts = [item["text"] for item in items]
        seeds = [args.seed + start + k for k in range(len(items))]
        common = {"steps": steps, "guidance": guidance, "scheduler_name": defaults.scheduler}
        with_control = generate(pipe, prompts, control, seeds, **common)
        without = generate(pipe, prompts, None, seeds, **common)  # a call without control skips the net
        masks = control[:, 0].numpy() >= 0.5
        for k, (w, wo) in enumerate(zip(to_uint8(with_control), to_uint8(without), strict=True)):
            rows.append(
                {
                    "index": int(items[k]["index"]),
                    "text": prompts[k],
                    "seed": seeds[k],
                    "iou_with": iou(object_mask(w), masks[k]),
                    "iou_without": iou(object_mask(wo), masks[k]),
                    "iou_data": iou(
                        object_mask(to_uint8((items[k]["pixel_values"][None] + 1) / 2)[0]), masks[k]
                    ),
                }
            )
        for k in range(len(items)):
            if len(grid) < args.grid_rows:
                grid.append(torch.cat([control[k], with_control[k], without[k]], dim=-1))  # (3, H, 3W)
    summary = {
        "model": str(args.model),
        "controlnet": str(args.controlnet),
        "data": str(args.data),
        "n": len(rows),
        "steps": steps,
        "guidance": guidance,
        "scheduler": defaults.scheduler,
        "seed": args.seed,
        "device": device,
        "dtype": args.dtype,
        **{
            f"mean_{key}": float(np.mean([r[key] for r in rows]))
            for key in ("iou_with", "iou_without", "iou_data")
        },
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "iou.json").write_text(json.dumps(summary, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    if grid:
        from torchvision.utils import make_grid

        from rapiddiff.train.callbacks import save_png

        save_png(make_grid(torch.stack(grid), nrow=1, padding=2), out / "grid.png")
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="the base model folder (builtin: the shipped one)")
    parser.add_argument(
        "--controlnet", required=True, help="a ControlNetModel folder (train controlnet's output)"
    )
    parser.add_argument(
        "--data", required=True, help="a split folder with metadata.jsonl (e.g. data/kshapes/test)"
    )
    parser.add_argument("--out", required=True, help="folder for iou.json and grid.png")
    parser.add_argument("--limit", type=int, default=None, help="the first N items (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="item k is drawn from seed + k (both arms)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    parser.add_argument("--guidance", type=float, default=None, help="CFG scale (default: the model's)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--grid-rows", type=int, default=8)
    parser.add_argument("--device", default=None, help="default: cuda when there is one")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    summary = measure(parse_args(argv))
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}, ensure_ascii=False, indent=1))
    return summary


if __name__ == "__main__":
    main()
