"""How far apart the built-in VAE puts kshapes colours in its latents, against other changes.

Renders one object (circle, grey background, centre) in every palette colour, encodes each render
with a model folder's VAE (latent mean × scaling_factor) and prints the L2 distance between colour
pairs (closest first, beside their CIELAB ΔE76) and, for scale, from orange to other shapes,
backgrounds and a 4-pixel shift. The diffusion loss is an MSE in these latents, so a pair that is
close here is one a U-Net is barely penalised for confusing (issue 18, BENCHMARKS.md).

    python benchmarks/kshapes_latent_colour_distances.py [--model rapiddiff/assets/model]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch


def main() -> None:
    from diffusers import AutoencoderKL

    from rapiddiff.data.kshapes.palette import COLOUR_LAB, COLOURS
    from rapiddiff.data.kshapes.render import ShapeSpec, render

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="rapiddiff/assets/model", help="model folder (its vae/)")
    args = parser.parse_args()
    vae = AutoencoderKL.from_pretrained(f"{args.model}/vae").float().eval()

    def latent(**change: object) -> torch.Tensor:
        spec = ShapeSpec(
            **{"shape": "圆形", "colour": "橙色", "background": "灰色", "x": 0.5, "y": 0.5, **change}
        )
        pixels = torch.from_numpy(np.asarray(render(spec, 128), dtype=np.float32) / 127.5 - 1)
        with torch.no_grad():
            return vae.encode(pixels.permute(2, 0, 1)[None]).latent_dist.mean[0] * vae.config.scaling_factor

    colours = {name: latent(colour=name) for name in COLOURS}
    pairs = sorted(
        (float((colours[a] - colours[b]).norm()), float(np.linalg.norm(COLOUR_LAB[a] - COLOUR_LAB[b])), a, b)
        for i, a in enumerate(COLOURS)
        for b in list(COLOURS)[i + 1 :]
    )
    print("colour pair | latent L2 | ΔE76")
    for dist, delta_e, a, b in pairs:
        print(f"{a}-{b} | {dist:.1f} | {delta_e:.0f}")
    orange = colours["橙色"]
    print("\nfrom an orange circle | latent L2")
    for shape in ("方形", "三角形", "星形", "椭圆形", "长条形"):
        print(f"shape {shape} | {float((latent(shape=shape) - orange).norm()):.1f}")
    for background in ("浅蓝色", "米色", "深蓝色"):
        print(f"background {background} | {float((latent(background=background) - orange).norm()):.1f}")
    print(f"moved 4 px (x + 0.03) | {float((latent(x=0.53) - orange).norm()):.1f}")


if __name__ == "__main__":
    main()
