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
}


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="metric", metavar="<metric>")
    sub.required = True
    for name, (module_name, help_text) in EVAL_COMMANDS.items():
        module = importlib.import_module(module_name)
        command = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(command)
        command.set_defaults(func=module.run)
