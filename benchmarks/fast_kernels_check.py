"""rapiddiff's Triton kernels (fast_norm, fast_geglu) against Inductor's, shape by shape, on a GPU.

For every GroupNorm and GEGLU input shape of the SD 1.5 U-Net at batch 2 (one guided step, 512²)
and of the VAE decoder at batch 1, this checks the kernels against a float64 reference (relative
L2 error, fresh random inputs with a non-zero mean) and times them against what the fast path runs
today: ``torch.compile`` (Inductor, default mode) of the same computation. Times are medians of
CUDA-graph replays (``triton.testing.do_bench_cudagraph``), so launch gaps count as they do inside
the captured loop. Also times the U-Net's 22 time-embedding projections (M = 2) one by one against
one concatenated product. Writes OUT/kernels.json and prints a table.

    python benchmarks/fast_kernels_check.py --out $OUT

A CPU smoke run of the same code (Triton's interpreter, no timings, the small kshapes preset):
``TRITON_INTERPRET=1 python benchmarks/fast_kernels_check.py --device cpu --preset kshapes``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from rapiddiff.infer.bench import rel_err


def shapes_of(model: torch.nn.Module, run: Any) -> dict[str, list[tuple]]:
    """Input shapes of every GroupNorm and GEGLU projection during ``run()`` (with repeats)."""
    from diffusers.models.activations import GEGLU

    seen: dict[str, list[tuple]] = {"gn": [], "geglu": []}
    hooks = []
    for module in model.modules():
        if isinstance(module, torch.nn.GroupNorm):
            hooks.append(
                module.register_forward_pre_hook(
                    lambda m, a: (
                        seen["gn"].append((tuple(a[0].shape), m.num_groups)) if a[0].dim() == 4 else None
                    )
                )
            )
        elif isinstance(module, GEGLU):
            hooks.append(
                module.register_forward_pre_hook(
                    lambda m, a: seen["geglu"].append(
                        (math.prod(a[0].shape[:-1]), m.proj.out_features // 2, m.proj.in_features)
                    )
                )
            )
    with torch.no_grad():
        run()
    for h in hooks:
        h.remove()
    return seen


def bench_ms(fn: Any) -> float:
    """Median ms of CUDA-graph replays of ``fn`` (NaN off CUDA: the smoke run only checks the code)."""
    import triton.testing

    fn()
    if not torch.cuda.is_available():
        return math.nan
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median"))


def gn_bytes(shape: tuple[int, ...], itemsize: int = 2) -> int:
    """Fewest bytes a GroupNorm of ``shape`` moves: read x twice (statistics, apply), write y once."""
    return 3 * math.prod(shape) * itemsize


def check_gn(shape: tuple, groups: int, count: int, device: torch.device) -> dict[str, Any]:
    from rapiddiff.infer import fast_norm

    n, c = shape[:2]
    gen = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(shape, generator=gen, device=device) * 2 + 0.5).half()
    x = x.contiguous(memory_format=torch.channels_last)
    dtype = x.dtype if device.type == "cuda" else torch.float32
    x, wt = x.to(dtype), torch.randn(c, generator=gen, device=device).to(dtype)
    b = torch.randn(c, generator=gen, device=device).to(dtype)
    add = torch.randn(n, c, generator=gen, device=device).to(dtype)
    row: dict[str, Any] = {"shape": list(shape), "groups": groups, "per_eval": count}
    ref = fast_norm.reference(x.double(), wt.double(), b.double(), add.double(), groups, 1e-5, True)
    ours = fast_norm.launch(x, wt, b, add, groups, 1e-5, True)
    row["rel_err"] = rel_err(ours, ref)
    row["rel_err_stock_fp16"] = rel_err(fast_norm.reference(x, wt, b, add, groups, 1e-5, True), ref)

    def inductor_fn(x: torch.Tensor, add: torch.Tensor) -> torch.Tensor:
        return F.silu(F.group_norm(x + add[:, :, None, None], groups, wt, b, 1e-5))

    compiled = torch.compile(inductor_fn, dynamic=False) if device.type == "cuda" else inductor_fn
    with torch.no_grad():
        row["inductor_us"] = 1e3 * bench_ms(lambda: compiled(x, add))
        for block in (32, 64, 128):
            row[f"ours_{block}_us"] = 1e3 * bench_ms(
                lambda block=block: fast_norm.launch(x, wt, b, add, groups, 1e-5, True, block_hw=block)
            )
    row["floor_us"] = gn_bytes(shape) / 3.0e12 * 1e6  # ~3.0 TB/s measured copy rate (H100)
    row["best_ours_us"] = min(row["ours_64_us"], row["ours_128_us"], row["ours_32_us"])
    return row


def check_geglu(m: int, n: int, k: int, count: int, device: torch.device) -> dict[str, Any]:
    from rapiddiff.infer import fast_geglu

    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    x = torch.randn(m, k, generator=gen, device=device).to(dtype)
    wt = (torch.randn(2 * n, k, generator=gen, device=device) / math.sqrt(k)).to(dtype)
    b = torch.randn(2 * n, generator=gen, device=device).to(dtype)
    row: dict[str, Any] = {"m": m, "n": n, "k": k, "per_eval": count}
    ref = fast_geglu.reference(x.double(), wt.double(), b.double())
    cpu_config = None if device.type == "cuda" else (32, 32, 32, 4, 2)  # the interpreter times nothing
    ours = fast_geglu.launch(x, wt, b, config=cpu_config)
    row["rel_err"] = rel_err(ours, ref)
    row["rel_err_stock_fp16"] = rel_err(fast_geglu.reference(x, wt, b), ref)
    best = getattr(fast_geglu._geglu_tuned, "best_config", None)
    row["config"] = str(best)
    compiled = (
        torch.compile(fast_geglu.reference, dynamic=False) if device.type == "cuda" else fast_geglu.reference
    )
    with torch.no_grad():
        row["inductor_us"] = 1e3 * bench_ms(lambda: compiled(x, wt, b))
        row["ours_us"] = 1e3 * bench_ms(lambda: fast_geglu.launch(x, wt, b, config=cpu_config))
    flops = 2 * m * (2 * n) * k
    row["ours_tflops"] = flops / (row["ours_us"] * 1e-6) / 1e12
    return row


def check_temb(unet: torch.nn.Module, device: torch.device) -> dict[str, Any]:
    projs = [m.time_emb_proj for m in unet.modules() if getattr(m, "time_emb_proj", None) is not None]
    emb = torch.randn(2, projs[0].in_features, device=device, dtype=projs[0].weight.dtype)
    weight = torch.cat([p.weight for p in projs])
    bias = torch.cat([p.bias for p in projs])

    def separate() -> list[torch.Tensor]:
        return [p(F.silu(emb)) for p in projs]

    def together() -> torch.Tensor:
        return F.linear(F.silu(emb), weight, bias)

    with torch.no_grad():
        return {
            "projections": len(projs),
            "rows": int(weight.shape[0]),
            "separate_us": 1e3 * bench_ms(separate),
            "one_product_us": 1e3 * bench_ms(together),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "kernels-out"))
    parser.add_argument("--preset", default="sd15", help="architecture (rapiddiff.models.presets)")
    parser.add_argument(
        "--device", default="cuda", help="cuda; cpu only for a smoke run (TRITON_INTERPRET=1)"
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from diffusers import AutoencoderKL, UNet2DConditionModel

    from rapiddiff.models import presets

    device = torch.device(args.device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    began = time.time()
    unet_cfg = presets.unet_config(args.preset)
    with torch.device(device):
        unet = UNet2DConditionModel(**unet_cfg).to(dtype).eval()
        vae = AutoencoderKL(**presets.vae_config(args.preset)).to(dtype).eval()
    unet.to(memory_format=torch.channels_last)
    vae.to(memory_format=torch.channels_last)
    side, width = unet_cfg["sample_size"], unet_cfg["cross_attention_dim"]
    x = torch.randn(2, 4, side, side, device=device, dtype=dtype).contiguous(
        memory_format=torch.channels_last
    )
    ctx = torch.randn(2, 77, width, device=device, dtype=dtype)
    t = torch.tensor(500, device=device)
    unet_shapes = shapes_of(unet, lambda: unet(x, t, encoder_hidden_states=ctx))
    latents = torch.randn(1, 4, side, side, device=device, dtype=dtype)
    vae_shapes = shapes_of(vae, lambda: vae.decode(latents))
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke run)",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "gn": [],
        "geglu": [],
    }
    print(f"shapes recorded in {time.time() - began:.1f} s", flush=True)

    def counted(items: list[tuple]) -> list[tuple[tuple, int]]:  # distinct shapes, largest first
        return sorted(
            Counter(items).items(), key=lambda kv: -math.prod(kv[0][0]) if isinstance(kv[0][0], tuple) else 0
        )

    def save(key: str, row: Any) -> None:  # after every row: a call cut short keeps what it measured
        if isinstance(result.get(key), list):
            result[key].append(row)
        else:
            result[key] = row
        print(json.dumps(row), flush=True)
        (out / "kernels.json").write_text(json.dumps(result, indent=1))

    from rapiddiff.infer import fast_norm

    for (m, n, k), count in counted(unet_shapes["geglu"]):
        save("geglu", check_geglu(m, n, k, count, device))
    save("temb", check_temb(unet, device))
    for where, seen in (("unet", unet_shapes), ("vae", vae_shapes)):
        for (shape, groups), count in counted(seen["gn"]):
            if fast_norm.supported(torch.empty(shape, device="meta"), groups):
                save("gn", {"model": where, **check_gn(shape, groups, count, device)})

    lines = [
        "| model | GroupNorm input | ×/eval | Inductor µs | ours µs (32/64/128 rows) | floor µs | rel err (ours / stock fp16) |"
    ]
    lines.append("|---|---|---:|---:|---|---:|---|")
    for r in result["gn"]:
        lines.append(
            f"| {r['model']} | {tuple(r['shape'])} g{r['groups']} | {r['per_eval']} | {r['inductor_us']:.1f} | "
            f"{r['ours_32_us']:.1f} / {r['ours_64_us']:.1f} / {r['ours_128_us']:.1f} | {r['floor_us']:.1f} | "
            f"{r['rel_err']:.1e} / {r['rel_err_stock_fp16']:.1e} |"
        )
    lines.append("")
    lines.append(
        "| GEGLU M×N×K | ×/eval | Inductor µs | ours µs | ours TFLOP/s | rel err (ours / stock fp16) | config |"
    )
    lines.append("|---|---:|---:|---:|---:|---|---|")
    for r in result["geglu"]:
        lines.append(
            f"| {r['m']}×{r['n']}×{r['k']} | {r['per_eval']} | {r['inductor_us']:.1f} | {r['ours_us']:.1f} | "
            f"{r['ours_tflops']:.0f} | {r['rel_err']:.1e} / {r['rel_err_stock_fp16']:.1e} | {r['config']} |"
        )
    te = result["temb"]
    lines.append("")
    lines.append(
        f"time embedding: {te['projections']} projections ({te['rows']} rows) one by one {te['separate_us']:.1f} µs, "
        f"as one product {te['one_product_us']:.1f} µs"
    )

    def saved(rows: list[dict], ours: str) -> float:
        return sum((r["inductor_us"] - r[ours]) * r["per_eval"] for r in rows)

    unet_gn = [r for r in result["gn"] if r["model"] == "unet"]
    lines.append(
        f"per U-Net evaluation, ours minus Inductor: GroupNorm (64 rows) {-saved(unet_gn, 'ours_64_us'):.0f} µs, "
        f"GEGLU {-saved(result['geglu'], 'ours_us'):.0f} µs"
    )
    table = "\n".join(lines)
    (out / "kernels.md").write_text(table + "\n")
    print(table, flush=True)


if __name__ == "__main__":
    main()
