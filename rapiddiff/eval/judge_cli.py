"""``rapiddiff eval judge-train``: train, test and save the emoji-zh judge (:mod:`rapiddiff.eval.judge`).

Kept apart from the judge so that ``rapiddiff --help`` imports no torch."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from rapiddiff.eval.common import add_device_arguments

    archs = ("resnet18", "small", "tiny")  # rapiddiff.eval.judge.ARCHS (a test keeps them equal)

    parser.description = (
        "Train the emoji-zh judge: a classifier of every entity of a `rapiddiff data emoji` folder, on its real "
        "artwork only (glyphs/<style>/<id>.png composed onto augmented backgrounds), tested on renders from a "
        "seed training never draws; writes JUDGE_DIR/model.safetensors, judge.json and figures.json."
    )
    parser.add_argument("--data", required=True, type=Path, help="folder from `rapiddiff data emoji`")
    parser.add_argument("--out", required=True, type=Path, help="judge folder to write")
    parser.add_argument(
        "--epochs", type=float, default=40.0, help="renders seen ÷ training glyphs (default: 40)"
    )
    parser.add_argument("--minutes", type=float, help="train for this long instead of --epochs")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--arch", choices=archs, default="resnet18")
    parser.add_argument(
        "--input-size", type=int, default=64, help="the judge's input side in pixels (default: 64)"
    )
    parser.add_argument("--seed", type=int, default=0, help="training seed (test renders: seed + 1000003)")
    parser.add_argument("--test-renders", type=int, default=4, help="test renders per glyph (default: 4)")
    parser.add_argument("--leave-out-style", help="train without this style and test on it too")
    add_device_arguments(parser, dtype=False)  # bf16 autocast on CUDA, float32 on CPU


def run(args: argparse.Namespace) -> int:
    from rapiddiff.eval.judge import TrainSettings, train_judge

    settings = TrainSettings(
        epochs=args.epochs, minutes=args.minutes, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
        test_renders=args.test_renders,
    )  # fmt: skip
    figures = train_judge(
        args.data, args.out, settings, arch=args.arch, input_size=args.input_size, device=args.device,
        leave_out_style=args.leave_out_style,
    )  # fmt: skip
    t = figures["test"]["all"]
    print(f"judge on test renders: top-1 {t['top1']:.2f} %, top-5 {t['top5']:.2f} %, subcategory {t['subcategory']:.2f} % "
          f"({t['images']} images; {figures['training']['images_per_second']} images/s trained)")  # fmt: skip
    if "test_left_out" in figures:
        lo = figures["test_left_out"]["all"]
        print(
            f"left-out style {figures['left_out_style']}: top-1 {lo['top1']:.2f} %, top-5 {lo['top5']:.2f} %"
        )
    print(f"→ {args.out}")
    return 0
