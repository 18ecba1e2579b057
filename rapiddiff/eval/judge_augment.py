"""The judge's training renders: real glyphs composed onto augmented canvases, a batch at a time.

Everything is a tensor op on the glyphs' device (the GPU when training there), drawn from one
``torch.Generator``, so a render is a function of the generator's seed: backgrounds (the data
folder's shades, random solids, gradients, noise), placement (scale, centre, a small rotation;
never a mirror: ⬅ and ➡ are different emoji), colour jitter without hue shifts (🧡 and 💛 differ
only in hue), blur, pixel noise and JPEG.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Augment:
    """How far the renders vary (the defaults are the judge's training renders)."""

    scale: tuple[float, float] = (0.3, 1.0)
    """The glyph's side as a fraction of the canvas side (log-uniform in this range)."""
    rotation: float = 10.0
    """Largest rotation, degrees either way."""
    shade_p: float = 0.5
    """Share of canvases on one of the data folder's background shades (the rest: random solid,
    gradient or noise, a third each)."""
    jitter: float = 0.15
    """Brightness, contrast and saturation factors in 1 ± this."""
    blur_p: float = 0.4
    blur_sigma: tuple[float, float] = (0.3, 1.5)
    noise_p: float = 0.3
    noise_std: float = 0.04
    jpeg_p: float = 0.3
    jpeg_quality: tuple[int, int] = (30, 95)

    @classmethod
    def clean(cls, scale: tuple[float, float] = (0.3, 1.0)) -> Augment:
        """Renders of the real artwork on the data folder's shades, nothing degraded: the
        "real images" a Fréchet distance compares generated ones with."""
        return cls(scale=scale, rotation=0.0, shade_p=1.0, jitter=0.0, blur_p=0.0, noise_p=0.0, jpeg_p=0.0)


def _uniform(n: int, low: float, high: float, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    return low + (high - low) * torch.rand(n, generator=gen, device=device)


def backgrounds(n: int, size: int, shades: torch.Tensor, aug: Augment, gen: torch.Generator) -> torch.Tensor:
    """Canvases [n, 3, size, size] in [0, 1]: shades (±3 % jitter), random solids, gradients, noise."""
    device = shades.device
    shade = shades[torch.randint(len(shades), (n,), generator=gen, device=device)]
    shade = (shade + 0.03 * (2 * torch.rand(n, 3, generator=gen, device=device) - 1)).clamp(0, 1)
    solid = torch.rand(n, 3, generator=gen, device=device)
    # A gradient between two random colours along a random direction.
    angle = _uniform(n, 0, 2 * math.pi, gen, device)
    axis = torch.linspace(-0.5, 0.5, size, device=device)
    t = (
        axis.view(1, 1, size) * angle.cos().view(n, 1, 1) + axis.view(1, size, 1) * angle.sin().view(n, 1, 1)
    ) + 0.5
    other = torch.rand(n, 3, generator=gen, device=device)
    gradient = solid[:, :, None, None] + (other - solid)[:, :, None, None] * t[:, None].clamp(0, 1)
    # Smooth low-frequency blotches plus fine grain over a random colour.
    blotches = F.interpolate(torch.randn(n, 3, 4, 4, generator=gen, device=device), size=size, mode="bicubic")
    grain = torch.randn(n, 3, size, size, generator=gen, device=device)
    noise = other[:, :, None, None] + 0.15 * blotches + 0.05 * grain
    kind = torch.rand(n, generator=gen, device=device)
    rest = (1 - aug.shade_p) / 3
    out = torch.where(
        kind.view(n, 1, 1, 1) < aug.shade_p, shade[:, :, None, None].expand(n, 3, size, size), noise
    )
    out = torch.where(((kind >= aug.shade_p) & (kind < aug.shade_p + rest)).view(n, 1, 1, 1),
                      solid[:, :, None, None].expand(n, 3, size, size), out)  # fmt: skip
    out = torch.where(
        ((kind >= aug.shade_p + rest) & (kind < aug.shade_p + 2 * rest)).view(n, 1, 1, 1), gradient, out
    )
    return out.clamp(0, 1)


def place(glyphs: torch.Tensor, size: int, aug: Augment, gen: torch.Generator) -> torch.Tensor:
    """RGBA glyphs [n, 4, h, w] in [0, 1], premultiplied, scaled, rotated and moved onto a
    transparent size² canvas (the glyph stays inside it)."""
    n, device = glyphs.shape[0], glyphs.device
    low, high = math.log(aug.scale[0]), math.log(aug.scale[1])
    scale = _uniform(n, low, high, gen, device).exp()
    # Centres where the whole glyph box fits (in [-1, 1] canvas coordinates).
    room = (1 - scale).clamp(min=0)
    centre = (2 * torch.rand(n, 2, generator=gen, device=device) - 1) * room[:, None]
    angle = _uniform(n, -aug.rotation, aug.rotation, gen, device) * math.pi / 180
    cos, sin = angle.cos() / scale, angle.sin() / scale
    # Canvas point p → glyph point R(-angle)(p - centre) / scale.
    matrix = torch.stack([torch.stack([cos, sin], 1), torch.stack([-sin, cos], 1)], 1)  # (n, 2, 2)
    offset = -(matrix @ centre[:, :, None])  # (n, 2, 1)
    grid = F.affine_grid(torch.cat([matrix, offset], 2), [n, 4, size, size], align_corners=False)
    premultiplied = torch.cat([glyphs[:, :3] * glyphs[:, 3:], glyphs[:, 3:]], 1)
    return F.grid_sample(premultiplied, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def colour_jitter(images: torch.Tensor, amount: float, gen: torch.Generator) -> torch.Tensor:
    """Brightness, contrast and saturation factors in 1 ± ``amount``, each image its own."""
    if amount <= 0:
        return images
    n, device = images.shape[0], images.device
    brightness, contrast, saturation = (
        _uniform(n, 1 - amount, 1 + amount, gen, device).view(n, 1, 1, 1) for _ in range(3)
    )
    luma = torch.tensor([0.299, 0.587, 0.114], device=device).view(1, 3, 1, 1)
    images = images * brightness
    mean = (images * luma).sum(1, keepdim=True).mean((2, 3), keepdim=True)
    images = mean + (images - mean) * contrast
    grey = (images * luma).sum(1, keepdim=True)
    return (grey + (images - grey) * saturation).clamp(0, 1)


def gaussian_blur(images: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Each image blurred with its own σ (pixels; 0: unchanged), separable, reflect-padded."""
    n, c, h, w = images.shape
    radius = max(1, math.ceil(3 * float(sigma.max())))
    x = torch.arange(-radius, radius + 1, device=images.device, dtype=images.dtype)
    kernel = torch.exp(-(x[None] ** 2) / (2 * sigma.clamp(min=1e-3)[:, None] ** 2))
    kernel = kernel / kernel.sum(1, keepdim=True)  # (n, k)
    kernel = kernel.repeat_interleave(c, 0)  # one kernel per (image, channel): a grouped conv
    flat = F.pad(images.reshape(1, n * c, h, w), (radius, radius, radius, radius), mode="reflect")
    flat = F.conv2d(flat, kernel[:, None, None, :], groups=n * c)
    flat = F.conv2d(flat, kernel[:, None, :, None], groups=n * c)
    return flat.reshape(n, c, h, w)


# The JPEG standard's (Annex K) luminance and chrominance quantisation tables.
_LUMA = [16, 11, 10, 16, 24, 40, 51, 61, 12, 12, 14, 19, 26, 58, 60, 55, 14, 13, 16, 24, 40, 57, 69, 56,
         14, 17, 22, 29, 51, 87, 80, 62, 18, 22, 37, 56, 68, 109, 103, 77, 24, 35, 55, 64, 81, 104, 113, 92,
         49, 64, 78, 87, 103, 121, 120, 101, 72, 92, 95, 98, 112, 100, 103, 99]  # fmt: skip
_CHROMA = (
    [17, 18, 24, 47] + [99] * 4 + [18, 21, 26, 66] + [99] * 4 + [24, 26, 56] + [99] * 5 + [47, 66] + [99] * 38
)


def jpeg(images: torch.Tensor, quality: torch.Tensor) -> torch.Tensor:
    """Baseline JPEG's loss, batched on the images' device, each image at its own quality (1–100):
    YCbCr, 4:2:0 chroma, 8×8 DCT, the standard tables scaled as libjpeg scales them, rounding.
    torchvision's codec works one image at a time on the CPU; this keeps a GPU batch on the GPU."""
    n, _, h, w = images.shape
    device = images.device
    x = images.float() * 255
    r, g, b = x.unbind(1)
    y = 0.299 * r + 0.587 * g + 0.114 * b
    cb = 128 - 0.168736 * r - 0.331264 * g + 0.5 * b
    cr = 128 + 0.5 * r - 0.418688 * g - 0.081312 * b
    q = quality.float().clamp(1, 100)
    factor = torch.where(q < 50, 5000 / q, 200 - 2 * q)  # libjpeg's quality scaling
    tables = [torch.tensor(t, device=device, dtype=torch.float32).view(8, 8) for t in (_LUMA, _CHROMA)]

    def quantise(channel: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        ch, cw = channel.shape[1:]
        pad = (0, (-cw) % 8, 0, (-ch) % 8)
        blocks = F.pad(channel[:, None] - 128, pad, mode="replicate")[:, 0]
        bh, bw = blocks.shape[1] // 8, blocks.shape[2] // 8
        blocks = blocks.view(n, bh, 8, bw, 8).transpose(2, 3)  # (n, bh, bw, 8, 8)
        step = ((table[None] * factor.view(n, 1, 1) + 50) / 100).floor().clamp(min=1).view(n, 1, 1, 8, 8)
        coeff = _dct(device) @ blocks @ _dct(device).T
        blocks = _dct(device).T @ ((coeff / step).round() * step) @ _dct(device)
        return (blocks.transpose(2, 3).reshape(n, bh * 8, bw * 8) + 128)[:, :ch, :cw]

    y = quantise(y, tables[0])
    chroma = [F.avg_pool2d(c[:, None], 2, ceil_mode=True)[:, 0] for c in (cb, cr)]
    cb, cr = (
        F.interpolate(quantise(c, tables[1])[:, None], size=(h, w), mode="bilinear", align_corners=False)[
            :, 0
        ]
        for c in chroma
    )
    rgb = torch.stack(
        [y + 1.402 * (cr - 128), y - 0.344136 * (cb - 128) - 0.714136 * (cr - 128), y + 1.772 * (cb - 128)], 1
    )
    return (rgb / 255).clamp(0, 1).to(images.dtype)


def _dct(device: torch.device) -> torch.Tensor:
    """The orthonormal 8-point DCT-II matrix."""
    k = torch.arange(8, dtype=torch.float32, device=device)
    matrix = torch.cos(math.pi * (2 * k[None] + 1) * k[:, None] / 16) * math.sqrt(2 / 8)
    matrix[0] /= math.sqrt(2)
    return matrix


def render(
    glyphs: torch.Tensor, size: int, shades: torch.Tensor, aug: Augment, gen: torch.Generator
) -> torch.Tensor:
    """Training renders [n, 3, size, size] in [0, 1] of RGBA glyphs [n, 4, h, w] in [0, 1]."""
    n, device = glyphs.shape[0], glyphs.device
    canvas = backgrounds(n, size, shades, aug, gen)
    layer = place(glyphs, size, aug, gen)
    images = layer[:, :3] + (1 - layer[:, 3:]) * canvas
    images = colour_jitter(images, aug.jitter, gen)
    if aug.blur_p > 0:
        sigma = _uniform(n, *aug.blur_sigma, gen, device)
        sigma = torch.where(
            torch.rand(n, generator=gen, device=device) < aug.blur_p, sigma, torch.zeros_like(sigma)
        )
        images = gaussian_blur(images, sigma)
    if aug.noise_p > 0:
        std = (
            aug.noise_std
            * torch.rand(n, generator=gen, device=device)
            * (torch.rand(n, generator=gen, device=device) < aug.noise_p)
        )
        images = images + std.view(n, 1, 1, 1) * torch.randn(images.shape, generator=gen, device=device)
    images = images.clamp(0, 1)
    if aug.jpeg_p > 0:
        chosen = torch.rand(n, generator=gen, device=device) < aug.jpeg_p
        quality = torch.randint(
            aug.jpeg_quality[0], aug.jpeg_quality[1] + 1, (n,), generator=gen, device=device
        )
        if bool(chosen.any()):
            images = images.clone()
            images[chosen] = jpeg(images[chosen], quality[chosen])
    return images
