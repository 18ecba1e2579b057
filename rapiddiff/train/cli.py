"""``rapiddiff train <stage> --config FILE [overrides]``: each stage is a LightningCLI.

Every module named here exposes ``cli_main(args: list[str]) -> None``, which runs its
LightningCLI on ``args`` (``--config``, ``--trainer.max_steps=...``, ``--print_config``, ...).

``rapiddiff train <stage> --help`` answers from a text file instead: building the LightningCLI
parser imports torch, Lightning, diffusers and transformers (25–35 s on a 2-core machine). The
files in ``rapiddiff/train/help/`` are that parser's own help, each stamped with a fingerprint of
the sources and library versions it was made from; a stale or missing one is regenerated once into
``~/.cache/rapiddiff/help/``. ``python -m rapiddiff.train.cli --write-help`` refreshes the shipped
files (after changing a stage's arguments).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import io
import os
import sys
from importlib import metadata
from pathlib import Path

# stage → (module with cli_main(args), one-line help)
TRAIN_STAGES: dict[str, tuple[str, str]] = {
    "clip": (
        "rapiddiff.train.clip",
        "contrastive knowledge-enhanced Chinese CLIP (text encoder + image tower)",
    ),
    "vae": ("rapiddiff.train.vae", "an AutoencoderKL for a domain (reconstruction + KL, SSIM, PatchGAN)"),
    "unet": ("rapiddiff.train.unet", "a latent-diffusion U-Net on the knowledge-enhanced text encoder"),
    "finetune": (
        "rapiddiff.train.finetune",
        "fine-tune a model folder (full or LoRA); `finetune merge` folds a LoRA",
    ),
    "upscaler": ("rapiddiff.train.upscaler", "a ×4 upscaler, ESRGAN RRDB or Real-ESRGAN compact"),
    "controlnet": (
        "rapiddiff.train.controlnet",
        "a ControlNet (mask, canny or a data column) on a frozen model folder",
    ),
}


def register(parser: argparse.ArgumentParser) -> None:
    lines = "\n".join(f"  {name:10s} {help_text}" for name, (_, help_text) in TRAIN_STAGES.items())
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        f"stages:\n{lines}\n\n"
        "Everything after the stage goes to its LightningCLI: e.g. "
        "`rapiddiff train unet --config configs/unet/kshapes.yaml --trainer.max_steps=100`; "
        "`rapiddiff train unet --help` lists every option."
    )
    parser.add_argument("stage", choices=sorted(TRAIN_STAGES), help="what to train")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="options for the stage's LightningCLI")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if list(args.args) in (["--help"], ["-h"]):
        print(stage_help(args.stage), end="")
        return 0
    module = importlib.import_module(TRAIN_STAGES[args.stage][0])
    module.cli_main(list(args.args))
    return 0


# ----------------------------------------------------------------------------- fast --help
HELP_DIR = Path(__file__).parent / "help"
HELP_COLUMNS = "100"  # the width the help is formatted at, whatever the terminal
_STAMP = "# rapiddiff help fingerprint: "


def help_fingerprint() -> str:
    """A hash of what the help is generated from: the training sources (every stage's signature
    and docstrings live in rapiddiff/train/) and the versions of the libraries that format it."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    for name in ("pytorch-lightning", "jsonargparse"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            digest.update(f"{name}=={metadata.version(name)}".encode())
    return digest.hexdigest()[:16]


def generate_help(stage: str) -> str:
    """The stage's LightningCLI help, as ``rapiddiff train <stage> --help`` printed it (slow)."""
    module = importlib.import_module(TRAIN_STAGES[stage][0])
    out = io.StringIO()
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    argv0, sys.argv[0] = sys.argv[0], "rapiddiff"  # the prog name LightningCLI shows by default
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            module.cli_main(["--help"])
    finally:
        sys.argv[0] = argv0
        if previous is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = previous
    return out.getvalue()


def _read_stamped(path: Path, fingerprint: str) -> str | None:
    try:
        stamp, text = path.read_text(encoding="utf-8").split("\n", 1)
    except (OSError, ValueError):
        return None
    return text if stamp == _STAMP + fingerprint else None


def stage_help(stage: str) -> str:
    """The help text: shipped, else cached, else generated (and cached) when the sources changed."""
    fingerprint = help_fingerprint()
    text = _read_stamped(HELP_DIR / f"{stage}.txt", fingerprint)
    if text is not None:
        return text
    from rapiddiff.kg.cache import cache_dir  # the project's one cache folder

    cached = cache_dir() / "help" / f"{stage}-{fingerprint}.txt"
    text = _read_stamped(cached, fingerprint)
    if text is None:
        text = generate_help(stage)
        with contextlib.suppress(OSError):  # a read-only home: answer anyway, slowly next time too
            from rapiddiff.utils.io import atomic_write_text

            atomic_write_text(cached, _STAMP + fingerprint + "\n" + text)
    return text


def write_help_files() -> list[Path]:
    """Regenerate the shipped help files (``python -m rapiddiff.train.cli --write-help``)."""
    from rapiddiff.utils.io import atomic_write_text

    fingerprint = help_fingerprint()
    written = []
    for stage in TRAIN_STAGES:
        path = HELP_DIR / f"{stage}.txt"
        atomic_write_text(path, _STAMP + fingerprint + "\n" + generate_help(stage))
        written.append(path)
    return written


if __name__ == "__main__":
    if sys.argv[1:] != ["--write-help"]:
        sys.exit("usage: python -m rapiddiff.train.cli --write-help")
    for written in write_help_files():
        print(written)
