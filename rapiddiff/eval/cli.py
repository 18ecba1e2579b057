"""``rapiddiff eval <metric> ...``.

Each module named here exposes ``add_arguments(parser)`` and ``run(args) -> int | None`` and
keeps heavy imports (torch, models) inside ``run``, so ``--help`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib

# metric → (module with add_arguments/run, one-line help)
EVAL_COMMANDS: dict[str, tuple[str, str]] = {
    "recall": ("rapiddiff.eval.recall", "text↔image retrieval recall R@1/5/10 of a KnowledgeCLIP model"),
    "sample": ("rapiddiff.eval.sample", "generate the images of an evaluation (batched, resumable, indexed)"),
    "fid": (
        "rapiddiff.eval.fid",
        "FID between two image folders (InceptionV3, or the offline FID-CLIP variant)",
    ),
    "clipscore": ("rapiddiff.eval.clipscore", "CLIPScore of an eval run with rapiddiff's Chinese CLIP"),
    "knowledge": (
        "rapiddiff.eval.knowledge",
        "kshapes colour/shape accuracy, seen vs held-out, knowledge on vs off",
    ),
    "judge-train": (
        "rapiddiff.eval.judge_cli",
        "train the frozen emoji-zh judge on real emoji artwork (safetensors + judge.json + figures)",
    ),
    "emoji": (
        "rapiddiff.eval.emoji",
        "emoji-zh: the judge's entity/subcategory reads, background, position, judge-feature Fréchet distance",
    ),
    "report": (
        "rapiddiff.eval.report",
        "self-contained HTML report (sample grids, metrics, model config) + PNG grid",
    ),
}


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="metric", metavar="<metric>")
    sub.required = True
    for name, (module_name, help_text) in EVAL_COMMANDS.items():
        module = importlib.import_module(module_name)
        command = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(command)
        command.set_defaults(func=module.run)
