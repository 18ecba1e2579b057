"""Which VAE recipe reconstructs kshapes' flat shapes crisply? Several recipes, the same budget, side by side.

Each recipe is `rapiddiff train vae --config configs/vae/kshapes.yaml` plus its overrides, run for the
same wall-clock time (all at once: the models are small, one GPU holds them all), then scored by
``benchmarks/kshapes_vae_recon.py`` (detector accuracy of reconstructions, object/image PSNR,
latent std) on fresh test renders (seed 1234, never trained on).

    python benchmarks/kshapes_vae_recipes.py --out runs/vae_recipes --minutes 2
    python benchmarks/kshapes_vae_recipes.py --out /tmp/v --smoke          # CPU, a few steps each

Results: OUT/results.md and OUT/results.json; each recipe's VAE in OUT/<name>/model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name → overrides of configs/vae/kshapes.yaml. "shipped": the config before this comparison.
LR = ["--model.optim.lr=1e-3", "--model.optim.warmup_steps=200"]
# Every recipe names its architecture: configs/vae/kshapes.yaml itself changed with this comparison.
PRESET = '--model.architecture={"block_out_channels": [32, 64, 64, 64]}'  # the kshapes preset's own
C64 = '--model.architecture={"block_out_channels": [64, 64, 64, 64]}'
F4 = "--model.architecture=" + json.dumps(
    {
        "block_out_channels": [64, 64, 64],
        "down_block_types": ["DownEncoderBlock2D"] * 3,
        "up_block_types": ["UpDecoderBlock2D"] * 3,
    }
)
RECIPES: dict[str, list[str]] = {
    # The config before this comparison (the preset's channels, lr 2e-4).
    "shipped": [PRESET, "--model.optim.lr=2e-4", "--model.optim.warmup_steps=500"],
    "lr1e-3": [PRESET, *LR],
    # 1.73 M parameters: a second ResNet block per level.
    "lr1e-3_deep": [
        *LR,
        '--model.architecture={"block_out_channels": [32, 64, 64, 64], "layers_per_block": 2}',
    ],
    # 1.45 M: 64 channels at the full-resolution level, where the edges are.
    "lr1e-3_c64": [*LR, C64],
    # 3.88 M (7.8 MB fp16): more channels at the 32² and 16² levels; a capacity reference.
    "lr1e-3_c128": [*LR, '--model.architecture={"block_out_channels": [32, 64, 128, 128]}'],
    # A KL weight 100× larger: better-behaved latent scales (one channel blew up at lr 1e-3, kl 1e-6).
    "lr1e-3_kl1e-4": [PRESET, *LR, "--model.loss.kl_weight=1e-4"],
    # L1 alone (no SSIM term) at lr 2e-3: flat shapes need no perceptual term.
    "lr2e-3_l1only": [
        PRESET,
        "--model.optim.lr=2e-3",
        "--model.optim.warmup_steps=200",
        "--model.loss.perceptual=none",
    ],
    # MSE: the loss PSNR measures.
    "lr1e-3_l2": [PRESET, *LR, "--model.loss.reconstruction=l2"],
    # After the first comparison (lr 1e-3 blew one latent channel up, 64 channels at 128² helped).
    # "c64" is configs/vae/kshapes.yaml since 2026-11-23.
    "c64": [C64, "--model.optim.lr=2e-4", "--model.optim.warmup_steps=500"],
    "c64_lr5e-4_kl1e-4": [C64, "--model.optim.lr=5e-4", "--model.loss.kl_weight=1e-4"],
    "kl1e-4": [PRESET, "--model.optim.lr=2e-4", "--model.loss.kl_weight=1e-4"],
    # A 4× VAE (three blocks, two downsamplings): 128² images ↔ 32² × 4 latents, so an object the
    # U-Net draws is twice as many latent pixels wide (a circle ~8 instead of ~4; issue 18's shape
    # misses are ellipses read as circles). 1.2 M parameters: the 8× c64 without its 16² level.
    "f4": [F4, "--model.optim.lr=2e-4", "--model.optim.warmup_steps=500"],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--data", type=Path, help="a kshapes folder (default: OUT/data, written if absent)")
    parser.add_argument("--minutes", type=float, default=2.0, help="training wall time per recipe")
    parser.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated names of RECIPES")
    parser.add_argument("--train-images", type=int, default=8000)
    parser.add_argument("--eval-images", type=int, default=300)
    parser.add_argument("--workers", type=int, default=3, help="data-loader workers per recipe")
    parser.add_argument("--smoke", action="store_true", help="tiny data, 3 steps each, CPU")
    parser.add_argument(
        "--calibration-images",
        type=int,
        default=256,
        help="images the exported scaling_factor is measured on (export runs on the CPU after training)",
    )
    parser.add_argument(
        "--best-to",
        type=Path,
        help="write the best recipe's VAE folder here as a .tgz (both %%, then object PSNR)",
    )
    parser.add_argument(
        "--init",
        type=Path,
        help="warm-start every recipe from this VAE folder (its architecture; scaling_factor re-measured)",
    )
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    data = (args.data or out / "data").resolve()
    size = 64 if args.smoke else 128
    if not (data / "train" / "metadata.jsonl").exists():
        train = "40" if args.smoke else str(args.train_images)
        subprocess.run(
            [python, "-m", "rapiddiff", "data", "kshapes", "--out", str(data), "--size", str(size),
             "--train", train, "--val", "16" if args.smoke else "200", "--test", "0", "--hr-scale", "0",
             "--workers", str(min(16, os.cpu_count() or 1))],
            check=True, cwd=ROOT,
        )  # fmt: skip
    import torch

    gpu = torch.cuda.is_available()
    seconds = 20 if args.smoke else int(args.minutes * 60)
    procs = {}
    names = [n.strip() for n in args.recipes.split(",") if n.strip()]
    for name in names:
        root = out / name
        cmd = [
            python, "-m", "rapiddiff", "train", "vae", "--config", str(ROOT / "configs/vae/kshapes.yaml"),
            *_recipe(name, args.init),
            f"--trainer.max_steps={3 if args.smoke else 100000}",
            f"--trainer.max_time=00:00:{seconds // 60:02d}:{seconds % 60:02d}",
            f"--trainer.precision={'bf16-mixed' if gpu else '32-true'}",
            "--trainer.enable_progress_bar=false", "--trainer.val_check_interval=1000000", "--trainer.log_every_n_steps=10",
            "--checkpoint.every_n_train_steps=1000000", "--samples.every_n_steps=1000000",
            f"--trainer.default_root_dir={root}", f"--output={root / 'model'}",
            f"--data.train={data / 'train'}", f"--data.val={data / 'val'}", f"--data.image_size={size}",
            f"--model.calibration_images={args.calibration_images}",
            f"--data.batch_size={4 if args.smoke else 32}", f"--data.num_workers={0 if args.smoke else args.workers}",
        ]  # fmt: skip
        log = open(out / f"{name}.log", "w", encoding="utf-8")  # noqa: SIM115 (closed below)
        procs[name] = (
            subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT),
            log,
            time.time(),
        )
        print(f"[recipes] start {name}", flush=True)
    trained = []
    for name, (proc, log, start) in procs.items():
        code = proc.wait()
        log.close()
        print(f"[recipes] {name}: exit {code} after {time.time() - start:.0f} s", flush=True)
        if code:  # one failing recipe does not cost the others' results
            print((out / f"{name}.log").read_text("utf-8")[-3000:], flush=True)
        else:
            trained.append(name)
    scorers = {}
    for name in trained:
        cmd = [python, str(ROOT / "benchmarks/kshapes_vae_recon.py"), "--vae", str(out / name / "model"),
               "--n", "8" if args.smoke else str(args.eval_images), "--size", str(size), "--out", str(out / name / "recon")]  # fmt: skip
        score_log = open(out / f"{name}.score.log", "w", encoding="utf-8")  # noqa: SIM115 (child owns it)
        scorers[name] = subprocess.Popen(cmd, stdout=score_log, stderr=subprocess.STDOUT, cwd=ROOT)
    results: dict[str, dict] = {}
    for name, proc in scorers.items():
        if proc.wait():
            print(f"[recipes] scoring {name} failed", flush=True)
            continue
        results[name] = json.loads((out / name / "recon" / "kshapes_vae_recon.json").read_text("utf-8"))
        results[name]["steps"] = _steps(out / name)
        _write(out, results, seconds, args, gpu)  # after each recipe: a cut-off call keeps what was scored
    if args.best_to and results:
        import tarfile

        best = max(
            results, key=lambda n: (results[n]["accuracy_recon"]["both"], results[n]["psnr_object_db"])
        )
        half = out / "best_fp16"  # fp16 weights: small enough to travel to the next device call
        shutil.rmtree(half, ignore_errors=True)
        shutil.copytree(out / best / "model", half)
        for file in half.rglob("*.safetensors"):
            from safetensors.torch import load_file, save_file

            save_file({k: v.half() if v.is_floating_point() else v for k, v in load_file(file).items()}, file)
        with tarfile.open(args.best_to, "w:gz") as tar:
            tar.add(half, arcname="vae")
        print(f"[recipes] best: {best} → {args.best_to}", flush=True)
    return 0 if len(results) == len(names) else 1


def _recipe(name: str, init: Path | None) -> list[str]:
    """A recipe's overrides; warm-started, the folder's config replaces the recipe's architecture."""
    if init is None:
        return RECIPES[name]
    keep = [o for o in RECIPES[name] if not o.startswith("--model.architecture=")]
    return [*keep, f"--model.vae={init.resolve()}", "--model.latent_scaling=data"]


def _write(out: Path, results: dict[str, dict], seconds: int, args: argparse.Namespace, gpu: bool) -> None:
    import torch

    lines = [
        f"VAE recipes, {seconds} s of training each, all at once ({'GPU: ' + torch.cuda.get_device_name() if gpu else 'CPU'}); "
        f"{args.eval_images if not args.smoke else 8} test renders (seed 1234):",
        "",
        "| recipe | parameters | steps | colour % | shape % | both % | PSNR image dB | PSNR object dB | latent std |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        a = r["accuracy_recon"]
        lines.append(
            f"| {name} | {r['parameters'] / 1e6:.2f} M | {r['steps']} | {a['colour']} | {a['shape']} | {a['both']} | "
            f"{r['psnr_image_db']} | {r['psnr_object_db']} | {r['latent_std']} |"
        )
    (out / "results.md").write_text("\n".join(lines) + "\n", "utf-8")
    (out / "results.json").write_text(json.dumps(results, ensure_ascii=False, indent=1), "utf-8")
    print("\n".join(lines), flush=True)


def _steps(run: Path) -> int | None:
    """Optimizer steps the run made (from the checkpoint-free config Lightning saved: the logs)."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        return None
    steps = None
    for events in run.rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        if "train/loss" in acc.Tags().get("scalars", []):
            steps = max(steps or 0, acc.Scalars("train/loss")[-1].step + 1)
    return steps


if __name__ == "__main__":
    sys.exit(main())
