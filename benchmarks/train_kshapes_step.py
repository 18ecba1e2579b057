"""The kshapes U-Net training step (7 M parameters, 16² latents, batch 64): plain vs each speed switch.

Three scenes, each its own plain step as the baseline, all in one process on the same data:

- ``finetune``: ``rapiddiff train finetune`` (mode full, U-Net only, EMA) from the built-in model,
  images decoded and VAE-encoded every step (configs/finetune/full.yaml's way, batch 64).
- ``chain_on``: the chain's U-Net stage, knowledge on (configs/unet/kshapes.yaml: a fresh kshapes
  U-Net + the fusion train, latents cached, EMA 0.999, min-SNR 5).
- ``chain_off``: the same with the text side frozen (the chain's knowledge-off U-Net).

Variants add one switch at a time, then all; each records its first losses, which are compared
with its scene's plain step (the same seed, data order and random draws: they should agree to
bf16 rounding). Every run goes through a Lightning Trainer and the real data path.

    python benchmarks/train_kshapes_step.py --out $OUT                 # GPU
    python benchmarks/train_kshapes_step.py --device cpu --precision 32 --batch 4 --steps 2 --warmup 4 \\
        --images 16 --scenes chain_off --variants plain,all            # smoke test

Writes ``train_kshapes_step.{json,md}`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
BUILTIN = REPO / "rapiddiff" / "assets" / "kshapes"
FAST_DATA = {"cache_latents": True, "speed": {"gpu_data": True}}
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "cache_latents": {"cache_latents": True},
    "gpu_data": FAST_DATA,
    "gpu_data+cache_text": {"cache_latents": True, "speed": {"gpu_data": True, "cache_text": True}},
    "fused_adamw+foreach_ema": {"optim": {"fused": True}, "speed": {"foreach_ema": True}},
    "cuda_graph": {"speed": {"cuda_graph": True}},
    "no_graph": {  # `all` without the captured step
        "cache_latents": True,
        "optim": {"fused": True},
        "speed": {"gpu_data": True, "cache_text": True, "foreach_ema": True},
    },
    "all": {
        "cache_latents": True,
        "optim": {"fused": True},
        "speed": {"gpu_data": True, "cache_text": True, "foreach_ema": True, "cuda_graph": True},
    },
    "all+sync10": {  # `all` with the non-finite flag (and DDP's Ctrl-C agreement) read every 10 steps
        "cache_latents": True,
        "optim": {"fused": True},
        "speed": {
            "gpu_data": True,
            "cache_text": True,
            "foreach_ema": True,
            "cuda_graph": True,
            "sync_every": 10,
        },
    },
}


def make_data(folder: Path, images: int) -> Path:
    if not (folder / "train" / "metadata.jsonl").is_file():
        subprocess.run(
            [sys.executable, "-m", "rapiddiff", "data", "kshapes", "--out", str(folder), "--train", str(images),
             "--val", "16", "--test", "16", "--hr-scale", "0"],
            check=True,
        )  # fmt: skip
    return folder / "train"


def build_module(scene: str, variant: dict[str, Any], text_frozen: bool) -> Any:
    from rapiddiff.train.finetune import FineTune
    from rapiddiff.train.optim import OptimConfig
    from rapiddiff.train.speed import SpeedConfig
    from rapiddiff.train.unet import DiffusionLoss, EMAConfig, LatentDiffusion

    speed = dict(variant.get("speed", {}))
    if not text_frozen:
        speed.pop("cache_text", None)
    speed_cfg = SpeedConfig(**speed)
    loss = DiffusionLoss(caption_dropout=0.1, snr_gamma=5.0)
    cache = bool(variant.get("cache_latents", scene != "finetune"))
    if scene == "finetune":
        optim = OptimConfig(lr=1e-5, warmup_steps=500, **variant.get("optim", {}))
        return FineTune(
            pretrained=str(BUILTIN),
            mode="full",
            trainable=("unet",),
            loss=loss,
            optim=optim,
            ema=EMAConfig(decay=0.9999),
            speed=speed_cfg,
            cache_latents=cache,
        )
    optim = OptimConfig(lr=2e-4, schedule="cosine", warmup_steps=500, **variant.get("optim", {}))
    return LatentDiffusion(
        unet="kshapes",
        vae=str(BUILTIN),
        text_encoder=str(BUILTIN),
        trainable=("unet",) if text_frozen else ("unet", "fusion"),
        loss=loss,
        optim=optim,
        ema=EMAConfig(decay=0.999),
        speed=speed_cfg,
        cache_latents=cache,
    )


def run(args: argparse.Namespace, device: torch.device, train: Path, scene: str, name: str) -> dict[str, Any]:
    import pytorch_lightning as pl

    from rapiddiff.train.data import ImageTextData

    variant = VARIANTS[name]
    text_frozen = scene != "chain_on"
    if name == "gpu_data+cache_text" and not text_frozen:
        return {"skipped": "the text side trains in this scene"}
    steps = args.warmup + args.steps
    profile_path = Path(args.out) / f"profile_{scene}_{name}.txt" if args.profile else None
    probe = step_probe(device, args.warmup, steps, args.profile, profile_path)

    pl.seed_everything(0, verbose=False)
    module = build_module(scene, variant, text_frozen)
    data = ImageTextData(
        str(train), image_size=args.image_size, batch_size=args.batch, num_workers=args.workers
    )
    row, trainer = timed_fit(module, data, probe, device, args, devices=args.devices)
    del trainer, module
    release(device)
    return row


def timed_fit(
    module: Any, data: Any, probe: Any, device: torch.device, args: argparse.Namespace, devices: int = 1
) -> tuple[dict[str, Any], Any]:
    """Fit ``module`` on ``data`` with the benchmarks' bare trainer (no logger, checkpoints or
    validation; the configs' gradient clip) for ``probe``'s steps; the timing row every benchmark
    reports (images/s over all ranks) and the trainer, for what a caller adds to the row."""
    import pytorch_lightning as pl

    trainer = pl.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        precision="bf16-mixed" if args.precision == "bf16" else "32-true",
        max_steps=args.warmup + args.steps + args.profile,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[probe],
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    trainer.fit(module, datamodule=data)
    seconds = probe.times["end"] - probe.times["start"]
    row = {
        "it_s": args.steps / seconds,
        "images_s": args.steps * args.batch * devices / seconds,  # all ranks
        "ms_per_step": 1000 * seconds / args.steps,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "losses": [float(x) for x in probe.losses],
    }
    return row, trainer


def step_probe(
    device: torch.device,
    warmup: int,
    steps: int,
    profile: int = 0,
    profile_path: Path | None = None,
    read_loss: bool = False,
) -> Any:
    """A callback that times steps ``warmup``..``steps`` (``.times["start"/"end"]``), keeps every
    step's loss on the device (``.losses``, read after the run: no sync per step), and, with
    ``profile_path``, profiles ``profile`` steps after the timed ones. ``read_loss`` reads each loss
    on the host at the batch's end (the per-step sync a baseline may need)."""
    import pytorch_lightning as pl

    class StepProbe(pl.Callback):
        def __init__(self) -> None:
            self.losses: list[torch.Tensor] = []
            self.times: dict[str, float] = {}
            self.prof: Any = None

        def on_train_batch_start(self, trainer: Any, *_: Any) -> None:
            if trainer.global_step == warmup:
                sync(device)
                self.times["start"] = time.perf_counter()
            if profile and profile_path is not None and trainer.global_step == steps:
                from torch.profiler import ProfilerActivity
                from torch.profiler import profile as torch_profile

                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
                self.prof = torch_profile(activities=acts)
                self.prof.__enter__()
                self.times["prof_start"] = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *_: Any) -> None:
            self.losses.append(outputs["loss"].detach())
            if read_loss:
                float(outputs["loss"])
            if trainer.global_step == steps:
                sync(device)
                self.times["end"] = time.perf_counter()
            if self.prof is not None and trainer.global_step == steps + profile:
                sync(device)
                wall = (time.perf_counter() - self.times["prof_start"]) / profile
                self.prof.__exit__(None, None, None)
                write_profile(self.prof, profile_path, profile, wall)
                self.prof = None

    return StepProbe()


def release(device: torch.device) -> None:
    """Free what a finished variant left, so the next one starts from an empty cache."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def write_profile(prof: Any, path: Path, steps: int, wall: float) -> None:
    from torch.autograd import DeviceType

    events = prof.key_averages()
    # The rule of torch's own table total (profiler_util._build_table): device-side events only, and
    # not the record_function ranges mirrored on the GPU timeline (Optimizer.step, Lightning's hooks),
    # whose time is their kernels' again.
    kernels = [e for e in events if e.device_type != DeviceType.CPU and not e.is_user_annotation]
    gpu_ms = sum(e.self_device_time_total for e in kernels) / steps / 1000
    head = f"{steps} profiled steps: wall {wall * 1000:.1f} ms/step, GPU kernel time {gpu_ms:.1f} ms/step"
    tables = [
        events.table(sort_by="self_cpu_time_total", row_limit=30),
        events.table(sort_by="cpu_time_total", row_limit=30),
        events.table(sort_by="self_device_time_total", row_limit=15),
    ]
    path.write_text(head + "\n" + "\n".join(tables) + "\n", encoding="utf-8")
    print(f"[profile] {path.name}: {head}", file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--data", default=None, help="a kshapes folder (default: generated under --out)")
    parser.add_argument("--images", type=int, default=2048, help="training images to generate")
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=60, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=8, help="untimed steps first (capture happens here)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "32"])
    parser.add_argument("--scenes", default="finetune,chain_on,chain_off")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--profile", type=int, default=0, help="profile this many steps after the timed ones")
    parser.add_argument("--devices", type=int, default=1, help="GPUs (DDP; launch with torchrun)")
    parser.add_argument("--parity-steps", type=int, default=20, help="first losses compared with plain")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else args.device)
    if device.type == "auto":
        device = torch.device("cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train = Path(args.data) / "train" if args.data else make_data(out / "kshapes_data", args.images)
    results: list[dict[str, Any]] = []
    for scene in [s for s in args.scenes.split(",") if s]:
        plain: list[float] | None = None
        for name in [v for v in args.variants.split(",") if v]:
            print(f"[{scene} / {name}] ...", file=sys.stderr, flush=True)
            try:
                row = run(args, device, train, scene, name)
            except Exception as err:  # one failing variant must not lose the others
                row = {"error": repr(err)[:600]}
            row = {"scene": scene, "variant": name, **row}
            if name == "plain" and "losses" in row:
                plain = row["losses"]
            if plain is not None and "losses" in row:
                n = min(args.parity_steps, len(plain), len(row["losses"]))
                a, b = torch.tensor(row["losses"][:n]), torch.tensor(plain[:n])
                row["max_rel_loss_diff"] = float(((a - b).abs() / b.abs().clamp_min(1e-8)).max())
                row["mean_loss"], row["plain_mean_loss"] = float(a.mean()), float(b.mean())
            print(
                f"[{scene} / {name}] {json.dumps({k: v for k, v in row.items() if k != 'losses'})}",
                file=sys.stderr,
            )
            results.append(row)
    for row in results:
        base = next((r for r in results if r["scene"] == row["scene"] and r["variant"] == "plain"), None)
        if base and "it_s" in base and "it_s" in row:
            row["x_plain"] = row["it_s"] / base["it_s"]
    report = {
        "benchmark": "train_kshapes_step",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "batch": args.batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "precision": args.precision,
        "results": results,
    }
    report["devices"] = args.devices
    if int(os.environ.get("RANK", "0")) != 0:
        return report
    (out / "train_kshapes_step.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    lines = [
        f"kshapes U-Net step, batch {args.batch}, {args.precision}, {report['device']}, {report['date']}, "
        f"{args.steps} timed steps after {args.warmup}",
        "",
        "| scene | variant | it/s | images/s | ms/step | × plain | peak GiB | max rel. loss diff (first "
        f"{args.parity_steps}) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if "it_s" not in r:
            lines.append(
                f"| {r['scene']} | {r['variant']} | {r.get('skipped') or 'failed: ' + r.get('error', '')[:80]} |||||"
            )
            continue
        mem = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "–"
        lines.append(
            f"| {r['scene']} | {r['variant']} | {r['it_s']:.1f} | {r['images_s']:.0f} | {r['ms_per_step']:.2f} | "
            f"{r.get('x_plain', 0):.2f} | {mem} | {r.get('max_rel_loss_diff', float('nan')):.1e} |"
        )
    (out / "train_kshapes_step.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return report


if __name__ == "__main__":
    main()
