"""``rapiddiff train <stage> --config FILE [overrides]``: each stage is a LightningCLI.

Every module named here exposes ``cli_main(args: list[str]) -> None``, which runs its
LightningCLI on ``args`` (``--config``, ``--trainer.max_steps=...``, ``--print_config``, ...).
"""

from __future__ import annotations

import argparse
import importlib

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
    module = importlib.import_module(TRAIN_STAGES[args.stage][0])
    module.cli_main(list(args.args))
    return 0
