"""Tiny data and CLI arguments shared by the training tests (real formats, CPU-sized)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from pytorch_lightning.callbacks import Callback

REPO = Path(__file__).resolve().parents[2]
CAPTIONS = [
    "蓝色背景上有一个红色的圆形",
    "白色背景上有一个绿色的方形",
    "黄色背景上有一个番茄",
    "灰色背景上有一个蓝色的三角形",
]


def write_imagefolder(folder: Path, n: int = 4, size: int = 16, seed: int = 0) -> Path:
    """An imagefolder with metadata.jsonl: flat-coloured squares on a background."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        image = np.zeros((size, size, 3), dtype=np.uint8) + rng.integers(0, 255, 3, dtype=np.uint8)
        a = size // 4
        image[a : size - a, a : size - a] = rng.integers(0, 255, 3, dtype=np.uint8)
        name = f"{i:04d}.png"
        Image.fromarray(image).save(folder / name)
        rows.append({"file_name": name, "text": CAPTIONS[i % len(CAPTIONS)]})
    (folder / "metadata.jsonl").write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8"
    )
    return folder


def write_pairs(root: Path, n: int = 4, size: int = 8, scale: int = 4, seed: int = 0) -> tuple[Path, Path]:
    """kshapes' layout: root/train/ at base size, root/hr/train/ at scale×, same names."""
    rng = np.random.default_rng(seed)
    lr_dir, hr_dir = root / "train", root / "hr" / "train"
    lr_dir.mkdir(parents=True, exist_ok=True)
    hr_dir.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        hr = rng.integers(0, 255, (size * scale, size * scale, 3), dtype=np.uint8)
        hr = np.asarray(
            Image.fromarray(hr).resize((size, size)).resize((size * scale, size * scale), Image.BICUBIC)
        )
        Image.fromarray(hr).save(hr_dir / f"{i:04d}.png")
        Image.fromarray(hr).resize((size, size), Image.BICUBIC).save(lr_dir / f"{i:04d}.png")
    return lr_dir, hr_dir


def trainer_args(root: Path, max_steps: int, every: int = 2) -> list[str]:
    """CPU, fp32, no progress bar; checkpoints and sample grids every ``every`` steps."""
    return [
        f"--trainer.default_root_dir={root}",
        f"--trainer.max_steps={max_steps}",
        "--trainer.precision=32-true",
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
        "--trainer.strategy=auto",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.log_every_n_steps=1",
        f"--checkpoint.every_n_train_steps={every}",
        f"--samples.every_n_steps={every}",
        f"--output={root / 'model'}",
    ]


def tiny_unet_args(
    data: Path, root: Path, max_steps: int, config: str = "configs/unet/kshapes.yaml"
) -> list[str]:
    return [
        f"--config={REPO / config}",
        *trainer_args(root, max_steps),
        "--trainer.val_check_interval=null",
        "--model.unet=tiny",
        "--model.vae=tiny",
        "--model.text_encoder=tiny",
        "--model.trainable=[unet]",
        "--model.cache_latents=false",
        "--model.sampling.prompts=[蓝色背景上有一个番茄]",
        "--model.sampling.seeds=[0]",
        "--model.sampling.num_inference_steps=2",
        "--model.optim.warmup_steps=0",
        f"--data.train={data}",
        "--data.val=null",
        "--data.image_size=16",
        "--data.batch_size=2",
        "--data.num_workers=0",
    ]


@contextlib.contextmanager
def rapiddiff_log(caplog: Any, level: int = logging.INFO) -> Iterator[None]:
    """Capture rapiddiff's own log records (its logger does not propagate to the root once set up)."""
    logger = logging.getLogger("rapiddiff")
    logger.addHandler(caplog.handler)
    old = logger.level
    logger.setLevel(level)
    caplog.handler.setLevel(level)
    try:
        yield
    finally:
        logger.removeHandler(caplog.handler)
        logger.setLevel(old)


class RecordLosses(Callback):
    """Appends "global_step loss" per optimizer step to ``path`` (the logged per-step losses)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(f"{trainer.global_step} {float(outputs['loss']):.10g}\n")


def read_losses(path: Path) -> dict[int, float]:
    pairs = (line.split() for line in path.read_text(encoding="utf-8").splitlines())
    return {int(step): float(loss) for step, loss in pairs}


class SendCtrlC(Callback):
    """Sends SIGINT to this process after optimizer step ``step`` (as a user's Ctrl-C would)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGINT)


class PoisonWeights(Callback):
    """Sets every trained weight to NaN before the batch of optimizer step ``step`` (a diverged run),
    on every rank or on ``rank`` only."""

    def __init__(self, step: int, rank: int | None = None) -> None:
        self.step = step
        self.rank = rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and self.rank in (None, trainer.global_rank):
            with torch.no_grad():
                for p in pl_module.parameters():
                    if p.requires_grad:
                        p.fill_(float("nan"))


def launch_train_unet(
    cwd: Path, argv: list[str], timeout: int = 400, stage: str = "unet"
) -> subprocess.CompletedProcess[str]:
    """`python -m rapiddiff train STAGE ARGV` in a new process, as a user launches it (DDP/FSDP need
    their own processes); one OpenMP thread each, this tree on the path. Returns the finished run."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "rapiddiff", "train", stage, *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class RecordProgressBarKeys(Callback):
    """Writes the names in ``trainer.progress_bar_metrics`` after every optimizer step to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(" ".join(sorted(trainer.progress_bar_metrics)) + "\n")
