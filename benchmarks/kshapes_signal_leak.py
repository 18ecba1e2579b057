"""Signal-leak check (issue 18, BENCHMARKS.md "Backgrounds and the noise schedule"): does a model's
background follow the text, or the image signal a non-zero-terminal-SNR schedule leaves in x_T?

Attribute prompts asking for a light (and a dark) background are sampled from pure noise, and from
x_T = √(1-ᾱ)·ε + √ᾱ·z with z the VAE latent of a training render of the asked / the opposite
background, ᾱ that of the first sampling step. Prints the backgrounds read back, the border pixel
mean, and the same for the model's x0 estimate at the first step. PNDM, 25 steps, guidance 7.5.

    python benchmarks/kshapes_signal_leak.py DATA N [MODEL]   # DATA: `rapiddiff data kshapes --seed 1`
"""

import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from rapiddiff.data.kshapes.detect import detect_attributes
from rapiddiff.models import sampling
from rapiddiff.models.bundle import builtin_model_dir, load_model_folder

torch.set_grad_enabled(False)
data = Path(sys.argv[1])
n = int(sys.argv[2])
model = sys.argv[3] if len(sys.argv) > 3 else str(builtin_model_dir())
b = load_model_folder(model, load_upscaler=False)
b.unet.float().eval()
b.vae.float().eval()
b.text_encoder.float().eval()
LIGHT = {"粉色", "浅绿色", "浅蓝色", "米色"}
prompts = [json.loads(x) for x in (data / "prompts_attribute.jsonl").read_text().splitlines()]
light = [p for p in prompts if p["background"] in LIGHT][:n]
dark = [p for p in prompts if p["background"] in {"深蓝色", "深绿色"}][: n // 2]
rows = [json.loads(x) for x in (data / "train" / "metadata.jsonl").read_text().splitlines()]


def latent_of(bg: str) -> torch.Tensor:
    r = next(r for r in rows if r["background"] == bg)
    img = np.asarray(Image.open(data / "train" / r["file_name"]).convert("RGB"), dtype=np.float32) / 127.5 - 1
    x = torch.from_numpy(img).permute(2, 0, 1)[None]
    return b.vae.encode(x).latent_dist.mode() * b.vae.config.scaling_factor


cfg = dict(b.scheduler.config)
steps, gs = 25, 7.5


def run(ps, src_bg=None, label=""):
    sched = sampling.make_scheduler("pndm", cfg)
    sched.set_timesteps(steps)
    t0 = int(sched.timesteps[0])
    abar = float(sched.alphas_cumprod[t0])
    cond = b.text_encoder.encode([p["text"] for p in ps])
    uncond = b.text_encoder.encode([""] * len(ps))
    noise = sampling.draw_noise(sampling.generators(range(len(ps))), (4, 16, 16), torch.float32)
    x = noise
    if src_bg is not None:
        z = torch.cat([latent_of(src_bg if isinstance(src_bg, str) else src_bg(p)) for p in ps])
        x = (1 - abar) ** 0.5 * noise + abar**0.5 * z
    # x0 the model predicts at the first step (guided)
    out = b.unet(torch.cat([x, x]), torch.tensor(t0), encoder_hidden_states=torch.cat([uncond, cond])).sample
    u, c = out.chunk(2)
    eps = u + gs * (c - u)
    x0 = (x - (1 - abar) ** 0.5 * eps) / abar**0.5
    x0img = sampling.decode(b.vae, x0)
    lat = sampling.denoise(sampling.unet_model(b.unet), x, cond, uncond, sched, sched.timesteps, gs)
    imgs = sampling.decode(b.vae, lat)

    def score(images):
        ok, got, means = 0, Counter(), []
        for p, im in zip(ps, images, strict=True):
            arr = (im.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
            d = detect_attributes(Image.fromarray(arr))
            ok += d["background"] == p["background"]
            got[d["background"]] += 1
            border = np.concatenate([arr[:4].reshape(-1, 3), arr[-4:].reshape(-1, 3)])
            means.append(border.mean())
        return ok, got, float(np.mean(means))

    f, fg, fm = score(imgs)
    x0s, _, x0m = score(x0img)
    print(
        f"{label:34s} t0={t0} sqrt(abar)={abar**0.5:.4f} final bg right {f}/{len(ps)} border mean {fm:5.1f}"
        f" {dict(fg.most_common(3))} | first-step x0 bg right {x0s}/{len(ps)} mean {x0m:5.1f}",
        flush=True,
    )


print("latent mean per channel (scaled), pink vs dark blue vs grey:")
for bg in ("粉色", "浅蓝色", "灰色", "深蓝色"):
    print(bg, latent_of(bg).mean(dim=(2, 3)).squeeze().numpy().round(3))
run(light, None, "light bg asked, pure noise")
run(dark, None, "dark bg asked, pure noise")
run(light, lambda p: p["background"], "light asked, leak of the SAME bg")
run(light, "深蓝色", "light asked, leak of dark blue")
run(dark, "粉色", "dark asked, leak of pink")
