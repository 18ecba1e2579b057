"""How far apart the built-in VAE puts kshapes colours in its latents, and whether the U-Net reads colour words.

1. Renders one object (circle, grey background, centre) in every palette colour, encodes each render
   with a model folder's VAE (latent mean × scaling_factor) and prints the L2 distance between colour
   pairs (closest first, beside their CIELAB ΔE76) and, for scale, from orange to other shapes,
   backgrounds and a 4-pixel shift. The diffusion loss is an MSE in these latents, so a pair that is
   close here is one a U-Net is barely penalised for confusing.
2. The same orange→yellow change against the 4-pixel move, as an MSE in the latents and in the decoded
   pixels: whether a pixel-space loss would weigh the colour more (issue 18 tried one).
3. The U-Net's x₀ prediction from pure noise at t = 900 for "灰色背景的中间有一个{colour}的圆形" (16 noises):
   the mean RGB at the image centre, decoded — whether the colour words reach the U-Net at all.

    python benchmarks/kshapes_latent_colour_distances.py [--model rapiddiff/assets/model]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F


def main() -> None:
    from rapiddiff.data.kshapes.palette import COLOUR_LAB, COLOURS
    from rapiddiff.data.kshapes.render import ShapeSpec, render
    from rapiddiff.infer.pipeline import RapidDiffusionPipeline

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="rapiddiff/assets/model", help="model folder")
    args = parser.parse_args()
    pipe = RapidDiffusionPipeline.from_pretrained(args.model, device="cpu")
    vae, unet = pipe.vae.float().eval(), pipe.unet.float().eval()
    scale = vae.config.scaling_factor

    @torch.no_grad()
    def latent(**change: object) -> torch.Tensor:
        spec = ShapeSpec(
            **{"shape": "圆形", "colour": "橙色", "background": "灰色", "x": 0.5, "y": 0.5, **change}
        )
        pixels = torch.from_numpy(np.asarray(render(spec, 128), dtype=np.float32) / 127.5 - 1)
        return vae.encode(pixels.permute(2, 0, 1)[None]).latent_dist.mean * scale  # (1, C, h, w)

    @torch.no_grad()
    def decoded(z: torch.Tensor) -> torch.Tensor:
        return vae.decode(z / scale).sample

    colours = {name: latent(colour=name) for name in COLOURS}
    pairs = sorted(
        (float((colours[a] - colours[b]).norm()), float(np.linalg.norm(COLOUR_LAB[a] - COLOUR_LAB[b])), a, b)
        for i, a in enumerate(COLOURS)
        for b in list(COLOURS)[i + 1 :]
    )
    print("colour pair | latent L2 | ΔE76")
    for dist, delta_e, a, b in pairs:
        print(f"{a}-{b} | {dist:.1f} | {delta_e:.0f}")
    orange, moved = colours["橙色"], latent(x=0.53)
    print("\nfrom an orange circle | latent L2")
    for shape in ("方形", "三角形", "星形", "椭圆形", "长条形"):
        print(f"shape {shape} | {float((latent(shape=shape) - orange).norm()):.1f}")
    for background in ("浅蓝色", "米色", "深蓝色"):
        print(f"background {background} | {float((latent(background=background) - orange).norm()):.1f}")
    print(f"moved 4 px (x + 0.03) | {float((moved - orange).norm()):.1f}")

    yellow = colours["黄色"]
    in_latents = float(F.mse_loss(orange, yellow) / F.mse_loss(orange, moved))
    in_pixels = float(
        F.mse_loss(decoded(orange), decoded(yellow)) / F.mse_loss(decoded(orange), decoded(moved))
    )
    print(f"\norange→yellow MSE / 4-px move MSE: latents {in_latents:.2f}, decoded pixels {in_pixels:.2f}")

    print("\nx0 prediction at t = 900 from pure noise, mean RGB at the centre")
    alpha = pipe.scheduler.alphas_cumprod[900]
    noise = torch.randn(16, unet.config.in_channels, 16, 16, generator=torch.Generator().manual_seed(0))
    t = torch.full((16,), 900)
    for name in COLOURS:
        with torch.no_grad():
            context = pipe.text_encoder.encode([f"灰色背景的中间有一个{name}的圆形"] * 16).float()
            eps = unet(noise, t, encoder_hidden_states=context).sample
            image = decoded((noise - (1 - alpha).sqrt() * eps) / alpha.sqrt())
        rgb = ((image[:, :, 56:72, 56:72] + 1) * 127.5).clamp(0, 255).mean((0, 2, 3))
        print(f"{name} | {tuple(int(v) for v in rgb)} | palette {COLOURS[name]}")


if __name__ == "__main__":
    main()
