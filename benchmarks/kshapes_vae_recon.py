"""How well does a VAE reconstruct kshapes renders? The first limit of the image a U-Net can make.

Draws a fresh kshapes test set (``--seed``, never a training seed: the items of kshapes' test split
for that seed, rendered directly at ``--size``), encodes each image to the posterior's mode and
decodes it, and reports:

- the kshapes detector on the reconstructions: colour / shape / both (and background, position)
  accuracy against what was drawn — and the same detector on the renders themselves (the ceiling);
- PSNR over the whole image and over the object's pixels only (the renderer's own coverage mask,
  edges included): flat backgrounds are easy and flatter the whole-image figure;
- the latents' std (what ``scaling_factor`` should undo: the LDM recipe sets it to 1 / std) and
  the folder's ``scaling_factor``.

    python benchmarks/kshapes_vae_recon.py --vae rapiddiff/assets/kshapes/vae --n 300 --out DIR

Results: DIR/kshapes_vae_recon.{json,md} and DIR/kshapes_vae_recon.png (pairs: render | reconstruction).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rapiddiff.data.kshapes import KShapesConfig, detect_attributes, render, render_mask  # noqa: E402
from rapiddiff.data.kshapes.entities import choose_heldout  # noqa: E402
from rapiddiff.data.kshapes.generate import Item, sample_split  # noqa: E402

KEYS = ("colour", "shape", "background", "position")


def test_items(n: int, seed: int, size: int) -> list[Item]:
    """The items (specs and labels) of kshapes' test split for ``seed``."""
    cfg = KShapesConfig(seed=seed, size=size, train=0, val=0, test=n, hr_scale=0)
    return sample_split(cfg, "test", set(choose_heldout(cfg.heldout, seed)))


def psnr(a: np.ndarray, b: np.ndarray, mask: np.ndarray | None = None) -> float:
    """PSNR in dB of uint8-range arrays (H, W, 3), over the pixels where ``mask`` (H, W) is true."""
    diff = (a.astype(np.float64) - b.astype(np.float64)) ** 2
    mse = diff[mask].mean() if mask is not None else diff.mean()
    return float(10 * np.log10(255.0**2 / max(mse, 1e-10)))


def detector_hits(image: Any, item: Item) -> dict[str, bool]:
    found = detect_attributes(image)
    truth = {"colour": item.spec.colour, "shape": item.spec.shape, "background": item.spec.background,
             "position": item.position}  # fmt: skip
    hits = {k: found.get(k) == truth[k] for k in KEYS}
    hits["both"] = hits["colour"] and hits["shape"]
    return hits


@torch.no_grad()
def measure(vae: Any, items: list[Item], size: int, batch_size: int = 32) -> dict[str, Any]:
    """Reconstruct every item's render; per-image PSNRs, detector hits, and latent statistics."""
    from PIL import Image

    renders = [np.asarray(render(it.spec, size)) for it in items]
    masks = [np.asarray(render_mask(it.spec, size)) > 0 for it in items]
    recons: list[np.ndarray] = []
    latents = []
    device = next(vae.parameters()).device
    for start in range(0, len(items), batch_size):
        x = torch.from_numpy(np.stack(renders[start : start + batch_size])).permute(0, 3, 1, 2)
        x = x.to(device).float().div(127.5).sub(1)  # (B, 3, H, W) in [-1, 1]
        dist = vae.encode(x).latent_dist
        latents.append(dist.sample(generator=torch.Generator(device=device).manual_seed(start)).cpu())
        y = vae.decode(dist.mode()).sample.clamp(-1, 1)
        recons += list(((y + 1) * 127.5).round().byte().permute(0, 2, 3, 1).cpu().numpy())
    z = torch.cat(latents)  # (N, C, h, w), posterior samples: what the U-Net trains on
    rows = []
    for item, original, recon, mask in zip(items, renders, recons, masks, strict=True):
        rows.append(
            {
                "psnr": psnr(recon, original),
                "psnr_object": psnr(recon, original, mask),
                "psnr_background": psnr(recon, original, ~mask),
                "recon": detector_hits(Image.fromarray(recon), item),
                "render": detector_hits(Image.fromarray(original), item),
            }
        )
    return {
        "rows": rows,
        "recons": recons,
        "renders": renders,
        "latent_std": float(z.std()),
        "latent_mean": float(z.mean()),
        "latent_std_per_channel": [round(float(v), 4) for v in z.transpose(0, 1).flatten(1).std(1)],
    }


def summarise(result: dict[str, Any], vae: Any, args: argparse.Namespace, seconds: float) -> dict[str, Any]:
    rows = result["rows"]

    def pct(source: str, key: str) -> float:
        return round(100.0 * sum(r[source][key] for r in rows) / len(rows), 2)

    factor = float(vae.config.scaling_factor)
    return {
        "vae": str(args.vae),
        "images": len(rows),
        "seed": args.seed,
        "size": args.size,
        "accuracy_recon": {k: pct("recon", k) for k in ("colour", "shape", "both", "background", "position")},
        "accuracy_render": {
            k: pct("render", k) for k in ("colour", "shape", "both", "background", "position")
        },
        "psnr_image_db": round(float(np.mean([r["psnr"] for r in rows])), 2),
        "psnr_object_db": round(float(np.mean([r["psnr_object"] for r in rows])), 2),
        "psnr_background_db": round(float(np.mean([r["psnr_background"] for r in rows])), 2),
        "latent_std": round(result["latent_std"], 4),
        "latent_mean": round(result["latent_mean"], 4),
        "latent_std_per_channel": result["latent_std_per_channel"],
        "scaling_factor": factor,
        "scaled_latent_std": round(result["latent_std"] * factor, 4),
        "ldm_scaling_factor": round(1.0 / result["latent_std"], 5),
        "parameters": sum(p.numel() for p in vae.parameters()),
        "seconds": round(seconds, 1),
        "host": platform.node(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def markdown(s: dict[str, Any]) -> str:
    r, g = s["accuracy_recon"], s["accuracy_render"]
    return "\n".join(
        [
            f"VAE `{s['vae']}` ({s['parameters'] / 1e6:.2f} M parameters), {s['images']} kshapes test renders "
            f"(seed {s['seed']}, {s['size']}²), {s['date']}:",
            "",
            "| | colour % | shape % | both % | background % | position % | PSNR image dB | PSNR object dB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
            f"| renders (ceiling) | {g['colour']} | {g['shape']} | {g['both']} | {g['background']} | "
            f"{g['position']} | — | — |",
            f"| reconstructions | {r['colour']} | {r['shape']} | {r['both']} | {r['background']} | "
            f"{r['position']} | {s['psnr_image_db']} | {s['psnr_object_db']} |",
            "",
            f"Latents (posterior samples): std {s['latent_std']}, mean {s['latent_mean']}, per channel "
            f"{s['latent_std_per_channel']}; scaling_factor {s['scaling_factor']} → scaled std "
            f"{s['scaled_latent_std']} (LDM recipe: factor {s['ldm_scaling_factor']}).",
        ]
    )


def save_grid(result: dict[str, Any], path: Path, count: int = 16) -> None:
    from PIL import Image

    pairs = [
        np.concatenate([a, b], axis=1)
        for a, b in zip(result["renders"][:count], result["recons"][:count], strict=True)
    ]
    rows = [np.concatenate(pairs[i : i + 4], axis=1) for i in range(0, len(pairs) - len(pairs) % 4, 4)]
    if rows:
        Image.fromarray(np.concatenate(rows, axis=0)).save(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vae", type=Path, required=True, help="AutoencoderKL folder or model folder")
    parser.add_argument("--n", type=int, default=300, help="test renders")
    parser.add_argument(
        "--seed", type=int, default=1234, help="kshapes seed of the renders (not a training seed)"
    )
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    from rapiddiff.train.vae import load_vae

    vae = load_vae(str(args.vae)).eval().to(args.device)  # fp32 either way
    start = time.time()
    result = measure(vae, test_items(args.n, args.seed, args.size), args.size)
    summary = summarise(result, vae, args, time.time() - start)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kshapes_vae_recon.json").write_text(
        json.dumps(summary, ensure_ascii=False, indent=1), "utf-8"
    )
    (args.out / "kshapes_vae_recon.md").write_text(markdown(summary) + "\n", "utf-8")
    save_grid(result, args.out / "kshapes_vae_recon.png")
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
