"""``rapiddiff <command> ...``: one subcommand per stage, each defined in its stage.

Only this module knows every stage (DESIGN.md's import order). Each entry below names a module
with ``register(parser)``, which adds the command's arguments (or its own subcommands) and sets
``func``. Those modules import nothing heavy at import time, so ``rapiddiff --help`` is instant.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
from typing import Any

from rapiddiff import __version__
from rapiddiff.utils.logging import setup_logging

# command name → (module with register(parser), one-line help)
# (in pipeline order, which is the order `rapiddiff --help` lists them)
COMMANDS: dict[str, tuple[str, str]] = {
    "kg": (
        "rapiddiff.kg.cli",
        "knowledge graph: train TransE into a KnowledgeStore, link entities in text, inspect a store",
    ),
    "data": ("rapiddiff.data.cli", "datasets: write the kshapes benchmark, inspect image–caption data"),
    "train": (
        "rapiddiff.train.cli",
        "train from a YAML config (LightningCLI): clip, unet, finetune, vae, upscaler",
    ),
    "generate": (
        "rapiddiff.infer.generate_cli",
        "text → images: sample a model folder to PNGs that record their settings",
    ),
    "accelerate": (
        "rapiddiff.infer.accelerate_cli",
        "AOTInductor packages of the fast path beside a model folder: export, check",
    ),
    "bench": (
        "rapiddiff.infer.bench_cli",
        "benchmark: stock diffusers vs torch.compile recipe vs rapiddiff's fast path",
    ),
    "eval": (
        "rapiddiff.eval.cli",
        "evaluate: sample, FID, CLIP score, recall, knowledge accuracy, HTML report",
    ),
    "serve": (
        "rapiddiff.serve.cli",
        "HTTP API (OpenAI images), micro-batching, web page; --ray for Ray Serve",
    ),
}


class SuggestingParser(argparse.ArgumentParser):
    """argparse with "did you mean" for a mistyped subcommand or choice (Python 3.14's
    ``suggest_on_error``, which this Python lacks). Subcommand parsers inherit the class."""

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if action.choices is not None and value not in action.choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in action.choices], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            choices = ", ".join(map(repr, action.choices))
            raise argparse.ArgumentError(action, f"invalid choice: {value!r}{hint}; choose from {choices}")
        super()._check_value(action, value)


def build_parser() -> argparse.ArgumentParser:
    parser = SuggestingParser(
        prog="rapiddiff",
        description="Chinese knowledge-enhanced text-to-image: knowledge graph → CLIP → latent diffusion → ESRGAN.",
    )
    parser.add_argument("--version", action="version", version=f"rapiddiff {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).register(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(-1 if args.quiet else args.verbose)
    if not hasattr(args, "func"):
        parser.parse_args([*(argv if argv is not None else sys.argv[1:]), "--help"])
    try:
        result = args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, PermissionError, RuntimeError) as err:
        # Errors we raise on purpose carry a message meant for the user: show it, not a traceback.
        if args.verbose > 1:
            raise
        print(f"rapiddiff {args.command}: error: {err}", file=sys.stderr)
        return 2
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
