"""U-Net training throughput (images/s): diffusers' train_text_to_image.py loop vs rapiddiff's step.

Both run in one process on the same architecture (random weights from the presets: speed does
not depend on weight values), the same batch, resolution and precision:

- ``reference``: the inner loop of diffusers' ``examples/text_to_image/train_text_to_image.py``
  as run with ``--mixed_precision bf16`` and its defaults (no EMA, no gradient checkpointing,
  SDPA attention, AdamW lr 1e-4, max_grad_norm 1): VAE and text encoder cast to bf16, the U-Net
  in fp32 under bf16 autocast (what accelerate's prepare does), then vae.encode → noise →
  unet → mse → ``loss.item()`` (the script logs it every step) → backward → clip → AdamW step →
  LR-scheduler step → zero_grad. The text tower is the Taiyi-style Chinese BERT of the preset
  (what a Chinese SD 1.x checkpoint uses) — the same module rapiddiff's step runs. VAE and text
  encoder are in eval mode, as ``from_pretrained`` leaves them (a freshly built BertModel would
  otherwise run dropout). Data: a DataLoader over pre-tokenised items, 0 workers (the script's
  default), copied with ``non_blocking=True`` from pageable memory.
- ``eager``, ``channels_last``, ``fuse_qkv``, ``all`` (both), ``compile`` (both + torch.compile),
  ``fused`` (eager + ``optim.fused``: torch's fused AdamW), ``compile_fused`` (``compile`` +
  ``optim.fused``): rapiddiff's ``LatentDiffusion`` LightningModule through a Lightning ``Trainer``
  (``precision="bf16-mixed"``, ``gradient_clip_val=1``), its real data path (resumable sampler,
  0 workers, pinned batches, captions tokenised through its memo), with EMA off and no caption
  dropout/min-SNR, to match the reference's work.

What still differs (by design, both sides' own defaults): Lightning's autocast wraps the whole
training step, so rapiddiff's frozen bf16 text encoder runs under autocast (its LayerNorms and
residual stream in fp32, ~140 extra cast kernels a step at 77 tokens) where the reference runs it
in plain bf16; rapiddiff checks the loss is finite with one sync where the script calls
``loss.item()``; rapiddiff pins each batch in the main thread, the script copies it from pageable
memory.

Timing: ``--repeats`` windows of ``--steps`` optimizer steps after ``--warmup``, one sync at each
window's end (never per step); the median window's images/s is reported, every window is kept.
``--profile N`` profiles N more steps: top kernels, host ops, and the GPU's idle gaps with what the
host was doing in each (``profile_<variant>.txt``; ``--trace`` keeps the Chrome trace). Python GC
pauses (generation 1 and 2) inside the timed windows are counted per variant.

    python benchmarks/train_unet_throughput.py --out $OUT              # SD 1.5 size, 512², batch 8, GPU
    python benchmarks/train_unet_throughput.py --out $OUT --variants reference,eager,fused,compile_fused
    python benchmarks/train_unet_throughput.py --size tiny --device cpu --precision 32 --steps 2 --warmup 1

Writes ``train_unet_throughput.json`` and ``.md`` under ``--out`` (or $OUT).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import itertools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

CAPTIONS = [
    "蓝色背景上有一个红色的圆形",
    "一碗热气腾腾的兰州牛肉面",
    "水墨山水画，远山云雾",
    "白色背景上的一双红色运动鞋",
]
VARIANTS = {
    "eager": {},
    "channels_last": {"channels_last": True},
    "fuse_qkv": {"fuse_qkv": True},
    "all": {"channels_last": True, "fuse_qkv": True},
    "compile": {"channels_last": True, "fuse_qkv": True, "compile": True},
    # optim.fused: torch's fused AdamW (one kernel per parameter group instead of foreach passes)
    "fused": {"fused_adamw": True},
    "compile_fused": {"channels_last": True, "fuse_qkv": True, "compile": True, "fused_adamw": True},
    # the captured step (forward + loss + backward as one CUDA graph) with the non-finite check read
    # every 10 steps: what removes the host time the eager and compiled steps are bound by
    "graph_fused": {
        "channels_last": True,
        "fuse_qkv": True,
        "cuda_graph": True,
        "sync_every": 10,
        "fused_adamw": True,
    },
}


def image_size(size: str) -> int:
    from rapiddiff.models.presets import unet_config, vae_config

    factor = 2 ** (len(vae_config(size)["block_out_channels"]) - 1)
    return int(unet_config(size)["sample_size"]) * factor


def synthetic_items(n: int, side: int) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(0)
    return [
        {
            "pixel_values": torch.rand(3, side, side, generator=generator) * 2 - 1,
            "text": CAPTIONS[i % len(CAPTIONS)],
            "index": i,
        }
        for i in range(n)
    ]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


# ----------------------------------------------------------------------------- the reference
def run_reference(
    args: argparse.Namespace, device: torch.device, items: list[dict[str, Any]]
) -> dict[str, Any]:
    """diffusers' train_text_to_image.py inner loop, line for line (see the module docstring)."""
    import torch.nn.functional as F
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from diffusers.optimization import get_scheduler
    from transformers import BertConfig, BertModel

    from rapiddiff.models.presets import bert_text_config, scheduler_config, unet_config, vae_config
    from rapiddiff.models.text_encoder import chinese_bert_tokenizer

    bf16 = args.precision == "bf16"
    weight_dtype = torch.bfloat16 if bf16 else torch.float32
    noise_scheduler = DDPMScheduler.from_config(scheduler_config())
    tokenizer = chinese_bert_tokenizer()
    text_encoder = BertModel(BertConfig(**bert_text_config(args.size)), add_pooling_layer=False)
    vae = AutoencoderKL(**vae_config(args.size))
    unet = UNet2DConditionModel(**unet_config(args.size))
    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    # from_pretrained returns modules in eval mode and the script never calls .train() on the
    # frozen ones: no dropout in the text encoder (a freshly built BertModel starts in train mode).
    vae.eval()
    text_encoder.eval()
    unet.train()
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4, betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-8)
    lr_scheduler = get_scheduler(
        "constant", optimizer=optimizer, num_warmup_steps=0, num_training_steps=10**6
    )
    unet.to(device)
    text_encoder.to(device, dtype=weight_dtype)
    vae.to(device, dtype=weight_dtype)

    def tokenize(captions: list[str]) -> torch.Tensor:
        return tokenizer(
            captions,
            max_length=tokenizer.model_max_length,
            padding="max_length",
            truncation=True,
            return_tensors="pt",
        ).input_ids

    dataset = [{"pixel_values": it["pixel_values"], "input_ids": tokenize([it["text"]])[0]} for it in items]
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch, shuffle=True, drop_last=True)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    def step(batch: dict[str, torch.Tensor]) -> float:
        pixel_values = batch["pixel_values"].to(device, non_blocking=True)
        input_ids = batch["input_ids"].to(device, non_blocking=True)
        latents = vae.encode(pixel_values.to(weight_dtype)).latent_dist.sample()
        latents = latents * vae.config.scaling_factor
        noise = torch.randn_like(latents)
        bsz = latents.shape[0]
        timesteps = torch.randint(
            0, noise_scheduler.config.num_train_timesteps, (bsz,), device=latents.device
        )
        timesteps = timesteps.long()
        noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
        encoder_hidden_states = text_encoder(input_ids, return_dict=False)[0]
        target = noise
        with autocast:  # accelerate wraps the prepared U-Net's forward in autocast
            model_pred = unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]
        loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
        train_loss = loss.detach().item()  # the script gathers and logs it every step
        loss.backward()
        torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        return train_loss

    batches = iter(_cycle(loader))
    for _ in range(args.warmup):
        step(next(batches))
    sync(device)
    marks = [time.perf_counter()]
    for _ in range(args.repeats):
        for _ in range(args.steps):
            step(next(batches))
        sync(device)
        marks.append(time.perf_counter())
    memory = peak_memory_gib(device)
    if args.profile:
        with profiler(args, "reference"):
            for _ in range(args.profile):
                step(next(batches))
            sync(device)
    return {"window_seconds": _windows(marks), "marks": marks, "peak_memory_gib": memory}


def _windows(marks: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(marks)]


@contextlib.contextmanager
def profiler(args: argparse.Namespace, name: str) -> Any:
    """torch.profiler over the steps inside: top kernels, host ops and the GPU's idle gaps (what the
    host was doing in each) to OUT/profile_<name>.txt; with --trace the Chrome trace, gzipped."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        yield
    wall = (time.perf_counter() - start) / args.profile
    events = prof.key_averages()
    lines = [
        f"{name}: {args.profile} profiled steps, wall {wall * 1000:.1f} ms/step (under the profiler)",
        events.table(
            sort_by="self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total",
            row_limit=25,
        ),
        events.table(sort_by="self_cpu_time_total", row_limit=30),  # syncs and copies show here
    ]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    trace = Path(args.out) / f"trace_{name}.json"
    prof.export_chrome_trace(str(trace))
    lines.insert(1, gpu_gaps(json.loads(trace.read_text()), args.profile))
    if args.trace:
        import gzip

        with gzip.open(f"{trace}.gz", "wb") as handle:
            handle.write(trace.read_bytes())
    trace.unlink()
    (Path(args.out) / f"profile_{name}.txt").write_text("\n".join(lines) + "\n")
    print(lines[0], lines[1], sep="\n", file=sys.stderr, flush=True)


def gpu_gaps(trace: dict[str, Any], steps: int, top: int = 12) -> str:
    """The GPU's busy and idle time over the profiled steps (first kernel to last), and the largest
    idle gaps with the host's CUDA runtime calls and outermost op running when each began."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    gpu = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"])
        for e in events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    if not gpu:
        return "no GPU activity recorded"
    busy, gaps, end = 0.0, [], gpu[0][0]
    previous = ""
    for a, b, kernel in gpu:
        if a > end:
            gaps.append((a - end, end, previous, kernel))
        busy += max(0.0, b - max(a, end))
        if b > end:
            end, previous = b, kernel
    span = end - gpu[0][0]
    host = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver", "cpu_op", "user_annotation")]
    lines = [
        f"GPU over {steps} steps: span {span / 1e3 / steps:.1f} ms/step, kernels busy "
        f"{busy / 1e3 / steps:.1f} ms/step, idle {(span - busy) / 1e3 / steps:.1f} ms/step "
        f"({len(gaps)} gaps; {sum(g for g, *_ in gaps if g > 100) / 1e3 / steps:.1f} ms/step in gaps > 0.1 ms)",
        "largest idle gaps (ms, after kernel → before kernel: host calls overlapping the gap):",
    ]
    for gap, at, before, after in sorted(gaps, reverse=True)[:top]:
        overlapping = sorted(
            (e for e in host if float(e["ts"]) < at + gap and float(e["ts"]) + float(e["dur"]) > at),
            key=lambda e: -float(e["dur"]),
        )
        runtime = [
            f"{e['name']} {float(e['dur']) / 1e3:.1f}" for e in overlapping if e.get("cat") != "cpu_op"
        ]
        ops = [f"{e['name']} {float(e['dur']) / 1e3:.1f}" for e in overlapping if e.get("cat") == "cpu_op"]
        lines.append(
            f"  {gap / 1e3:7.2f}  {before[:40]} → {after[:40]}:  {'; '.join(runtime[:4])} | ops {'; '.join(ops[:5])}"
        )
    return "\n".join(lines)


def _cycle(loader: Any) -> Any:
    while True:
        yield from loader


# ----------------------------------------------------------------------------- rapiddiff
def run_rapiddiff(
    args: argparse.Namespace,
    device: torch.device,
    items: list[dict[str, Any]],
    speed: dict[str, Any],
    name: str,
) -> dict[str, Any]:
    import pytorch_lightning as pl

    from rapiddiff.train.data_order import resumable_loader
    from rapiddiff.train.optim import OptimConfig
    from rapiddiff.train.speed import SpeedConfig
    from rapiddiff.train.unet import DiffusionLoss, LatentDiffusion

    speed = dict(speed)
    fused = bool(speed.pop("fused_adamw", False))

    class Items(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(items)

        def __getitem__(self, i: int) -> dict[str, Any]:
            return items[i]

    class Data(pl.LightningDataModule):
        def train_dataloader(self) -> Any:
            return resumable_loader(Items(), self.trainer, batch_size=args.batch)

    timed = args.steps * args.repeats
    # Sync'd marks at the warm-up's end and after every window of --steps steps (a sync every
    # window, not every step: the host may run ahead within a window, as it does in training).
    window_ends = {args.warmup + k * args.steps for k in range(args.repeats + 1)}

    class Timer(pl.Callback):
        def __init__(self) -> None:
            self.marks: list[float] = []
            self.profile: Any = None

        def on_train_batch_start(self, trainer: Any, *_: Any) -> None:
            if trainer.global_step == args.warmup:
                sync(device)
                self.marks.append(time.perf_counter())
            if args.profile and trainer.global_step == args.warmup + timed:
                self.profile = profiler(args, name)
                self.profile.__enter__()

        def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
            if trainer.global_step in window_ends and trainer.global_step > args.warmup:
                sync(device)
                self.marks.append(time.perf_counter())
            if self.profile is not None and trainer.global_step == args.warmup + timed + args.profile:
                sync(device)
                self.profile.__exit__(None, None, None)
                self.profile = None

    module = LatentDiffusion(
        unet=args.size,
        vae=args.size,
        text_encoder=args.size,
        trainable=("unet",),
        loss=DiffusionLoss(caption_dropout=0.0),
        optim=OptimConfig(lr=1e-4, schedule="constant", warmup_steps=0, fused=fused),
        ema=None,
        speed=SpeedConfig(**speed),
    )
    timer = Timer()
    trainer = pl.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        precision="bf16-mixed" if args.precision == "bf16" else "32-true",
        max_steps=args.warmup + timed + args.profile,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        callbacks=[timer],
    )
    trainer.fit(module, datamodule=Data())
    memory = peak_memory_gib(device)
    return {"window_seconds": _windows(timer.marks), "marks": timer.marks, "peak_memory_gib": memory}


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the JSON and markdown")
    parser.add_argument("--size", default="sd15", choices=["sd15", "kshapes", "tiny"], help="model preset")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps per window")
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed windows per variant (the median is reported)"
    )
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compile happens here)")
    parser.add_argument("--device", default="auto", help="auto, cuda or cpu")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "32"])
    parser.add_argument(
        "--devices", type=int, default=1, help="GPUs for rapiddiff's variants (DDP; launch with torchrun)"
    )
    parser.add_argument("--profile", type=int, default=0, help="profile this many steps after the timed ones")
    parser.add_argument(
        "--trace", action="store_true", help="with --profile: also write trace_<variant>.json.gz"
    )
    parser.add_argument("--tag", default="", help="a label for this run's rows (e.g. which tree ran them)")
    parser.add_argument(
        "--variants",
        default="reference,eager,channels_last,fuse_qkv,all,compile",
        help=f"comma-separated: reference and any of {', '.join(VARIANTS)}",
    )
    args = parser.parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else args.device)
    if device.type == "auto":
        device = torch.device("cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the script's default (--allow_tf32 off)
    side = image_size(args.size)
    pauses: list[tuple[float, float]] = []  # (start, seconds) of gen-1/2 collections
    gc_start = [0.0]

    def gc_timer(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter()
        elif info.get("generation", 0) >= 1:
            pauses.append((gc_start[0], time.perf_counter() - gc_start[0]))

    gc.callbacks.append(gc_timer)
    items = synthetic_items(max(4 * args.batch, 32), side)
    results = []
    for name in [v.strip() for v in args.variants.split(",") if v.strip()]:
        if name != "reference" and name not in VARIANTS:
            parser.error(f"unknown variant {name!r}")
        free(device)
        torch.manual_seed(0)
        print(f"[{name}] ...", file=sys.stderr, flush=True)
        pauses.clear()
        try:
            if name == "reference":
                measured = run_reference(args, device, items)
            else:
                measured = run_rapiddiff(args, device, items, VARIANTS[name], name)
        except Exception as err:  # one failing variant (e.g. compile) must not lose the others
            print(f"[{name}] failed: {err!r}", file=sys.stderr, flush=True)
            results.append(
                {"variant": name, "images_per_s": None, "error": repr(err)[:500], "peak_memory_gib": None}
            )
            continue
        per_window = [
            args.steps * args.batch * args.devices / t for t in measured["window_seconds"]
        ]  # all ranks
        images_per_s = statistics.median(per_window)
        # Python's cyclic GC: a pause right after a sync leaves the GPU idle for as long.
        marks = measured.pop("marks")
        timed = [d for t, d in pauses if marks[0] <= t <= marks[-1]]
        measured["gc_collections"], measured["gc_seconds"] = len(timed), sum(timed)
        row = {"variant": name, "images_per_s": images_per_s, "images_per_s_windows": per_window, **measured}
        print(
            f"[{name}] {images_per_s:.2f} images/s (windows {[round(x, 2) for x in per_window]})",
            file=sys.stderr,
            flush=True,
        )
        results.append(row)
    reference = next((r["images_per_s"] for r in results if r["variant"] == "reference"), None)
    for row in results:
        row["vs_reference"] = row["images_per_s"] / reference if reference and row["images_per_s"] else None
    report = {
        "benchmark": "train_unet_throughput",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "diffusers": __import__("diffusers").__version__,
        "size": args.size,
        "resolution": side,
        "batch": args.batch,
        "precision": args.precision,
        "steps": args.steps,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "tag": args.tag,
        "results": results,
    }
    report["devices"] = args.devices
    if int(os.environ.get("RANK", "0")) != 0:
        return report
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_unet_throughput.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    lines = [
        f"U-Net training throughput, {args.size} at {side}², batch {args.batch}, {args.precision}, "
        f"{report['device']}, {report['date']}",
        "",
        "| variant | images/s | × reference | peak GiB |",
        "|---|---|---|---|",
    ]
    for row in results:
        ratio = f"{row['vs_reference']:.2f}" if row["vs_reference"] else "–"
        memory = f"{row['peak_memory_gib']:.1f}" if row["peak_memory_gib"] is not None else "–"
        speed = (
            f"{row['images_per_s']:.2f}" if row["images_per_s"] else f"failed: {row.get('error', '')[:60]}"
        )
        lines.append(f"| {row['variant']} | {speed} | {ratio} | {memory} |")
    (out / "train_unet_throughput.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return report


if __name__ == "__main__":
    main()
