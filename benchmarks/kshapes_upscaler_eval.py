"""×4 upscalers against bicubic and nearest on kshapes validation pairs: PSNR (whole image and near
edges, where an upscaler can win) and a grid of edge crops (nearest | bicubic | each upscaler | truth).

    python benchmarks/kshapes_upscaler_eval.py --data DIR --upscalers old=rapiddiff/assets/kshapes new=runs/up \\
        --out OUT [--n 100] [--device cuda]

DIR is a `rapiddiff data kshapes` folder (val/ and hr/val/ hold the same file names at 1× and 4×).
Writes OUT/kshapes_upscaler_eval.json and OUT/kshapes_upscaler_grid.png.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from kshapes_vae_recon import psnr  # benchmarks/: the masked PSNR the VAE benchmark reports
from PIL import Image


def _pixels(image: torch.Tensor) -> np.ndarray:
    """(3, H, W) in [0, 1] → (H, W, 3) in the uint8 range, what kshapes_vae_recon.psnr reads."""
    return image.clamp(0, 1).permute(1, 2, 0).double().cpu().numpy() * 255


def _edges(hr: torch.Tensor) -> torch.Tensor:
    """Pixels within 4 HR pixels of a colour change (the only place an upscaler can beat bicubic)."""
    grey = hr.mean(0, keepdim=True)[None]
    dx = (grey[..., :, 1:] - grey[..., :, :-1]).abs()
    dy = (grey[..., 1:, :] - grey[..., :-1, :]).abs()
    edge = torch.zeros_like(grey)
    edge[..., :, 1:] += dx
    edge[..., 1:, :] += dy
    return (F.max_pool2d((edge > 0.02).float(), 9, 1, 4) > 0)[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--upscalers", nargs="+", required=True, help="NAME=PATH (a model folder or a file)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--n", type=int, default=100, help="validation pairs")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    from rapiddiff.models.upscaler import load_upscaler

    names = sorted(p.name for p in (args.data / "val").glob("*.png"))[: args.n]
    if not names:
        parser.error(f"{args.data / 'val'}: no PNG images")
    to_t = lambda p: torch.from_numpy(np.array(Image.open(p).convert("RGB"))).permute(2, 0, 1).float() / 255  # noqa: E731
    nets = {}
    for spec in args.upscalers:
        name, _, path = spec.partition("=")
        try:
            nets[name] = load_upscaler(path, device=args.device).float()
        except (FileNotFoundError, ValueError) as err:  # a wrong path or an unknown file: say which
            parser.error(f"--upscalers {spec}: {err}")
    scores: dict[str, dict[str, list[float]]] = {
        k: {"psnr": [], "psnr_edges": []} for k in ["nearest", "bicubic", *nets]
    }
    crops: list[list[torch.Tensor]] = []
    start = time.time()
    with torch.no_grad():
        for i, name in enumerate(names):
            low = to_t(args.data / "val" / name)[None].to(args.device)
            high = to_t(args.data / "hr" / "val" / name).to(args.device)
            edges = _edges(high)
            outs = {
                "nearest": F.interpolate(low, scale_factor=4, mode="nearest")[0],
                "bicubic": F.interpolate(low, scale_factor=4, mode="bicubic", align_corners=False)[0],
            }
            outs |= {k: net(low)[0] for k, net in nets.items()}
            truth, near = _pixels(high), edges[0].cpu().numpy()
            for k, img in outs.items():
                scores[k]["psnr"].append(psnr(_pixels(img), truth))
                scores[k]["psnr_edges"].append(psnr(_pixels(img), truth, near))
            if i < 6:  # a 96² crop around the object's edge
                ys, xs = torch.nonzero(edges[0], as_tuple=True)
                cy, cx = (int(ys.float().mean()), int(xs.float().min()) + 8) if len(ys) else (64, 64)
                y0 = min(max(cy - 48, 0), high.shape[1] - 96)
                x0 = min(max(cx - 48, 0), high.shape[2] - 96)
                crops.append(
                    [t.clamp(0, 1)[:, y0 : y0 + 96, x0 : x0 + 96].cpu() for t in [*outs.values(), high]]
                )
    result = {
        "pairs": len(names),
        "device": args.device,
        "seconds": round(time.time() - start, 1),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "psnr_db": {k: round(float(np.mean(v["psnr"])), 3) for k, v in scores.items()},
        "psnr_edges_db": {k: round(float(np.mean(v["psnr_edges"])), 3) for k, v in scores.items()},
        "columns": ["nearest", "bicubic", *nets, "truth"],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kshapes_upscaler_eval.json").write_text(json.dumps(result, indent=1), "utf-8")
    rows = [torch.cat(row, dim=2) for row in crops]
    grid = (torch.cat(rows, dim=1).permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    Image.fromarray(grid).resize((grid.shape[1] * 2, grid.shape[0] * 2), Image.NEAREST).save(
        args.out / "kshapes_upscaler_grid.png"
    )
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
