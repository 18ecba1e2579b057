"""The kshapes CLIP step (the chain's CLIP stage, batch 256): plain vs each speed switch.

The model is configs/clip/kshapes.yaml's (a from-scratch BERT text tower with knowledge fused at
layer 0, a ResNet-18 image tower at 128², entity names always hidden), with a KnowledgeStore
trained on the data's KG (``rapiddiff kg train`` for a few epochs, or ``--kg``). Every variant is
its own Lightning Trainer on the same data, seed and data order; each records its per-step losses,
which are compared with the plain step's (same arithmetic: bit-identical; fused AdamW rounds
differently). ``old_hide`` is the plain step with the entity hiding of before 2026-11-23 (two host
syncs a step), to measure what taking them out gave.

    python benchmarks/train_clip_step.py --data DIR --out $OUT          # GPU (DIR: rapiddiff data kshapes)
    python benchmarks/train_clip_step.py --device cpu --precision 32 --tiny --batch 8 --steps 3 \\
        --warmup 4 --images 64 --workers 0 --variants plain,all --out /tmp/x   # smoke test

Writes ``train_clip_step.{json,md}`` under ``--out`` (and ``profile_<variant>.txt`` with --profile);
the generated data and store go to ``--work`` (default: ``--out``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))

from train_kshapes_step import make_data, release, step_probe, timed_fit  # noqa: E402  (the same harness)

VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {"fused_adamw": False},
    "old_hide": {"fused_adamw": False},  # plain + the old hide_entity_tokens (linked.any(), int(n))
    "fused": {"fused_adamw": True},
    "sync10": {"fused_adamw": False, "sync_every": 10},
    "gpu_data": {"fused_adamw": False, "gpu_data": True},
    "cuda_graph": {"fused_adamw": False, "cuda_graph": True},
    "no_graph": {"fused_adamw": True, "gpu_data": True, "sync_every": 10},
    "all": {"fused_adamw": True, "gpu_data": True, "sync_every": 10, "cuda_graph": True},
    # `all` with the loss read on the host every step, as Lightning did for the progress bar before
    # train/loss left it at sync_every > 1 (the same-run baseline for that change)
    "all_read": {"fused_adamw": True, "gpu_data": True, "sync_every": 10, "cuda_graph": True},
}
TINY = {"text_tower": "tiny", "image_tower": "resnet10", "image_size": 32, "embed_dim": 16}


def make_store(data: Path, out: Path, epochs: int, device: str) -> Path:
    """A KnowledgeStore from the data's KG, as the chain's kg stage makes it (fewer epochs)."""
    if (out / "config.json").is_file():
        return out
    text = (REPO / "configs/kg/kshapes.yaml").read_text("utf-8").replace("data/kshapes", str(data))
    config = out.parent / "kg_bench.yaml"
    config.write_text(text, "utf-8")
    subprocess.run(
        [sys.executable, "-m", "rapiddiff", "kg", "train", "--config", str(config), "--out", str(out),
         "--epochs", str(epochs), "--device", device],
        check=True,
    )  # fmt: skip
    return out


def old_hide_module() -> type:
    """CLIPTraining with the entity hiding as it was before 2026-11-23 (host reads of the count)."""
    from rapiddiff.train.clip import CLIPTraining

    class OldHide(CLIPTraining):
        def hide_entity_tokens(self, input_ids: torch.Tensor, token_entity_ids: torch.Tensor) -> torch.Tensor:
            p = self.hparams.entity_token_dropout
            linked = token_entity_ids >= 0
            if p == 0 or not linked.any():
                return input_ids
            prev = F.pad(token_entity_ids[:, :-1], (1, 0), value=-1)
            starts = linked & (token_entity_ids != prev)
            span = (starts.flatten().cumsum(0) - 1).view_as(starts).clamp(min=0)
            n = int(starts.sum())
            hide = torch.rand(n, device=input_ids.device) < p
            use_mask = torch.rand(n, device=input_ids.device) < 0.5
            tokenizer = self.model.text_encoder.tokenizer
            mask_id = (
                tokenizer.mask_token_id if tokenizer.mask_token_id is not None else tokenizer.unk_token_id
            )
            low = max(tokenizer.all_special_ids) + 1
            random_ids = torch.randint(low, len(tokenizer), input_ids.shape, device=input_ids.device)
            replacement = torch.where(use_mask[span], torch.full_like(input_ids, mask_id), random_ids)
            return torch.where(linked & hide[span], replacement, input_ids)

    return OldHide


def build_module(args: argparse.Namespace, name: str, store: Path) -> Any:
    from rapiddiff.train.clip import CLIPSpeed, CLIPTraining

    model = yaml.safe_load((REPO / "configs/clip/kshapes.yaml").read_text("utf-8"))["model"]
    model.pop("speed", None)
    model["knowledge_store"] = str(store)
    if args.tiny:
        model.update(TINY)
    cls = old_hide_module() if name == "old_hide" else CLIPTraining
    return cls(**model, speed=CLIPSpeed(**VARIANTS[name]))


def run(args: argparse.Namespace, device: torch.device, data: Path, store: Path, name: str) -> dict[str, Any]:
    import pytorch_lightning as pl

    from rapiddiff.train.data import ImageTextData

    steps = args.warmup + args.steps
    profiled = args.profile and name in args.profile_variants.split(",")
    profile_path = Path(args.out) / f"profile_{name}.txt" if profiled else None
    # all_read: the loss read on the host each step, as Lightning's progress bar did (the baseline)
    probe = step_probe(device, args.warmup, steps, args.profile, profile_path, read_loss=name == "all_read")

    pl.seed_everything(0, verbose=False)
    module = build_module(args, name, store)
    datamodule = ImageTextData(
        str(data / "train"), image_size=module.image_size, batch_size=args.batch, num_workers=args.workers
    )
    row, trainer = timed_fit(module, datamodule, probe, device, args)
    row["resident_fill_s"] = getattr(module, "resident_seconds", None)
    row["fused_adamw"] = any(g.get("fused") for g in trainer.optimizers[0].param_groups)
    del trainer, module
    release(device)
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--data", default=None, help="a kshapes folder (default: generated under --out)")
    parser.add_argument("--images", type=int, default=20000, help="training images to generate (the chain's)")
    parser.add_argument("--kg", default=None, help="a KnowledgeStore folder (default: trained under --out)")
    parser.add_argument("--kg-epochs", type=int, default=20, help="TransE epochs for the default store")
    parser.add_argument("--batch", type=int, default=256, help="the chain's CLIP batch")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=8, help="untimed steps first (capture happens here)")
    parser.add_argument("--workers", type=int, default=4, help="the chain's data.num_workers")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "32"])
    parser.add_argument("--tiny", action="store_true", help="tiny towers at 32² (CPU smoke test)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--profile", type=int, default=0, help="profile this many steps after the timed ones")
    parser.add_argument("--profile-variants", default="plain,all", help="the variants --profile profiles")
    parser.add_argument(
        "--work", default=None, help="folder for the generated data and store (default: --out)"
    )
    parser.add_argument("--parity-steps", type=int, default=20, help="first losses compared with plain")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else args.device)
    if device.type == "auto":
        device = torch.device("cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else out
    work.mkdir(parents=True, exist_ok=True)
    data = Path(args.data) if args.data else make_data(work / "kshapes_data", args.images).parent
    started = time.perf_counter()
    store = Path(args.kg) if args.kg else make_store(data, work / "kg", args.kg_epochs, device.type)
    kg_seconds = time.perf_counter() - started
    results: list[dict[str, Any]] = []
    plain: list[float] | None = None
    for name in [v for v in args.variants.split(",") if v]:
        print(f"[{name}] ...", file=sys.stderr, flush=True)
        try:
            row = run(args, device, data, store, name)
        except Exception as err:  # one failing variant must not lose the others
            row = {"error": repr(err)[:600]}
        row = {"variant": name, **row}
        if name == "plain" and "losses" in row:
            plain = row["losses"]
        if plain is not None and "losses" in row:
            n = min(args.parity_steps, len(plain), len(row["losses"]))
            a, b = torch.tensor(row["losses"][:n]), torch.tensor(plain[:n])
            row["max_rel_loss_diff"] = float(((a - b).abs() / b.abs().clamp_min(1e-8)).max())
            row["identical_losses"] = row["losses"] == plain
            row["mean_loss"], row["plain_mean_loss"] = float(a.mean()), float(b.mean())
        print(f"[{name}] {json.dumps({k: v for k, v in row.items() if k != 'losses'})}", file=sys.stderr)
        results.append(row)
    base = next((r for r in results if r["variant"] == "plain" and "it_s" in r), None)
    for row in results:
        if base and "it_s" in row:
            row["x_plain"] = row["it_s"] / base["it_s"]
    report = {
        "benchmark": "train_clip_step",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "batch": args.batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "precision": args.precision,
        "tiny": args.tiny,
        "images": len((data / "train" / "metadata.jsonl").read_text("utf-8").splitlines()),
        "workers": args.workers,
        "kg_store_seconds": kg_seconds,
        "results": results,
    }
    (out / "train_clip_step.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    lines = [
        f"kshapes CLIP step, batch {args.batch}, {args.precision}, {report['device']}, {report['date']}, "
        f"{args.steps} timed steps after {args.warmup}, {report['images']} images, {args.workers} workers",
        "",
        f"| variant | it/s | images/s | ms/step | × plain | peak GiB | fill s | identical losses | max rel. loss diff (first {args.parity_steps}) |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]  # fmt: skip
    for r in results:
        if "it_s" not in r:
            lines.append(f"| {r['variant']} | failed: {r.get('error', '')[:200]} ||||||||")
            continue
        mem = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "–"
        fill = f"{r['resident_fill_s']:.1f}" if r["resident_fill_s"] is not None else "–"
        lines.append(
            f"| {r['variant']} | {r['it_s']:.2f} | {r['images_s']:.0f} | {r['ms_per_step']:.1f} | "
            f"{r.get('x_plain', 0):.2f} | {mem} | {fill} | {r.get('identical_losses', '–')} | "
            f"{r.get('max_rel_loss_diff', float('nan')):.1e} |"
        )
    (out / "train_clip_step.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return report


if __name__ == "__main__":
    main()
