"""``rapiddiff train finetune``: adapt a pretrained model folder to a user's image–caption folder.

The start is any model folder: a rapiddiff one, Taiyi (BERT text tower) or a plain SD 1.x folder.
``mode: full`` trains the chosen parts outright and exports a new model folder. ``mode: lora``
adds peft LoRA adapters to the U-Net's attention projections (and optionally the text tower's)
and exports only those, in diffusers' format (``pytorch_lora_weights.safetensors``), as
diffusers' train_text_to_image_lora.py does, so ``pipe.load_lora_weights(dir)`` reads them.
``rapiddiff train finetune merge`` folds a LoRA into its base and writes a full model folder.

    rapiddiff train finetune --config configs/finetune/lora.yaml --model.pretrained MODEL --data.train DATA
    rapiddiff train finetune merge --base MODEL --lora runs/finetune/lora/model --out merged/
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from rapiddiff.models.builtin import resolve_model
from rapiddiff.models.lora import FUSION_FILE, INFO_FILE, LORA_WEIGHTS, TEXT_LORA_FILE
from rapiddiff.train.data import ImageTextData
from rapiddiff.train.lightning_cli import RapidCLI, run_cli
from rapiddiff.train.optim import OptimConfig
from rapiddiff.train.unet import EMAConfig, LatentDiffusion, TrainableName
from rapiddiff.utils.io import atomic_folder, atomic_write_text, save_safetensors
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)

# Attention projections of the text towers a model folder can hold (peft matches name suffixes).
TEXT_LORA_TARGETS = {
    "bert": ("query", "key", "value"),
    "roberta": ("query", "key", "value"),
    "chinese_clip_text_model": ("query", "key", "value"),
    "clip_text_model": ("q_proj", "k_proj", "v_proj", "out_proj"),
}


@dataclass(frozen=True)
class LoraSettings:
    """LoRA adapters (peft) for ``mode: lora``."""

    rank: int = 8
    """Rank of each adapter: 4–16 for a style or domain, 32–64 for many new concepts."""
    alpha: float | None = None
    """Scale numerator (alpha / rank); None = rank (scale 1), as diffusers' LoRA script does."""
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
    """U-Net modules that get adapters: the attention projections."""
    text_target_modules: tuple[str, ...] | None = None
    """Text-tower modules (when ``trainable`` has text_encoder); None: the tower's q/k/v(/out)."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"lora.rank must be >= 1, got {self.rank}")


def _resolve_pretrained(pretrained: str) -> str:
    """``builtin`` → the model `rapiddiff generate` uses without --model, ``builtin:NAME`` → that
    built-in model (the one rule, in models); a folder stays as given."""
    return str(resolve_model(pretrained))


_LORA = LoraSettings()
_FINETUNE_OPTIM = OptimConfig(lr=1e-4, warmup_steps=100)
_FINETUNE_EMA = EMAConfig()


class FineTune(LatentDiffusion):
    """Fine-tune a pretrained model folder, fully or with LoRA adapters.

    Args:
        pretrained: the model folder to start from (rapiddiff, Taiyi or SD 1.x diffusers layout);
            ``builtin``: the default built-in model, ``builtin:NAME`` a built-in model by name
            (``builtin:kshapes`` in configs/finetune/kshapes.yaml; `rapiddiff generate --list-models`).
        mode: "full" (train the parts outright; export a model folder) or "lora" (adapters only;
            export diffusers LoRA weights).
        lora: adapter rank, alpha, dropout and target modules (mode lora).
        trainable: parts to train: "unet", "text_encoder" (both get adapters in LoRA mode) and
            "fusion" (the knowledge fusion, trained outright in either mode).
        optim: AdamW and its learning-rate schedule (fine-tuning's lower default learning rate).
        ema: EMA of the trained weights (the adapters in mode lora); null = off (usual for LoRA).
        **kwargs: the other arguments of :class:`~rapiddiff.train.unet.LatentDiffusion` (knowledge,
            loss, sampling, speed, cache_latents, seed), passed on as they are.
    """

    def __init__(
        self,
        pretrained: str,
        mode: Literal["full", "lora"] = "lora",
        lora: LoraSettings = _LORA,
        trainable: Sequence[TrainableName] = ("unet",),
        optim: OptimConfig = _FINETUNE_OPTIM,
        ema: EMAConfig | None = _FINETUNE_EMA,
        **kwargs: Any,
    ) -> None:
        pretrained = _resolve_pretrained(pretrained)
        speed = kwargs.get("speed")
        if mode == "lora" and speed is not None and speed.fuse_qkv:
            raise ValueError(
                "speed.fuse_qkv cannot be combined with mode: lora (the adapters sit on to_q/to_k/to_v)"
            )
        super().__init__(
            pretrained=pretrained,
            trainable=trainable if mode == "full" else (),
            optim=optim,
            ema=ema if mode == "full" else None,
            **kwargs,
        )
        self.mode, self.lora_cfg, self.pretrained = mode, lora, pretrained
        # The resolved folder, not "builtin:NAME": export reads its upscaler/ and sampling defaults from it.
        self.hparams["pretrained"] = pretrained
        if mode == "lora":
            self._add_adapters(list(trainable), lora)
            self.ema = self._make_ema(ema)
            self.train()

    def _add_adapters(self, trainable: list[str], cfg: LoraSettings) -> None:
        from peft import LoraConfig

        self._select_trainable(trainable)  # validates names; adapters replace the full parts below
        self.requires_grad_(False)

        def config(targets: Sequence[str]) -> LoraConfig:
            return LoraConfig(
                r=cfg.rank,
                lora_alpha=cfg.alpha or cfg.rank,
                lora_dropout=cfg.dropout,
                init_lora_weights="gaussian",
                target_modules=list(targets),
            )

        if "unet" in trainable:
            self.unet.add_adapter(config(cfg.target_modules))
        if "text_encoder" in trainable:
            tower = self.text_encoder.text_model
            targets = cfg.text_target_modules or TEXT_LORA_TARGETS.get(tower.config.model_type)
            if not targets:
                raise ValueError(
                    f"no default LoRA targets for a {tower.config.model_type} text tower; set lora.text_target_modules"
                )
            tower.add_adapter(config(targets))
        if "fusion" in trainable:
            self._part("fusion").requires_grad_(True)
        self.trained = trainable

    def export(self, path: Path) -> Path:
        """mode full: a model folder; mode lora: diffusers LoRA weights (+ fusion weights if trained)."""
        if self.mode == "full":
            return super().export(path)
        from diffusers import StableDiffusionPipeline
        from diffusers.utils import convert_state_dict_to_diffusers
        from peft.utils import get_peft_model_state_dict

        if self.ema is not None:
            self.ema.copy_to(self.trainable_parameters())
        layers: dict[str, Any] = {}
        if "unet" in self.trained:
            layers["unet_lora_layers"] = convert_state_dict_to_diffusers(get_peft_model_state_dict(self.unet))
        text_state = None
        if "text_encoder" in self.trained:
            tower = self.text_encoder.text_model
            text_state = get_peft_model_state_dict(tower)
            if tower.config.model_type == "clip_text_model":
                layers["text_encoder_lora_layers"] = convert_state_dict_to_diffusers(text_state)
                text_state = None
        path = Path(path)
        with atomic_folder(path) as tmp:
            if layers:
                StableDiffusionPipeline.save_lora_weights(tmp, safe_serialization=True, **layers)
            if text_state is not None:
                save_safetensors(text_state, tmp / TEXT_LORA_FILE)
            if "fusion" in self.trained:
                save_safetensors(self._part("fusion").state_dict(), tmp / FUSION_FILE)
            info = {
                "base": str(self.pretrained),
                "parts": self.trained,
                "lora": asdict(self.lora_cfg),
                "scale": (self.lora_cfg.alpha or self.lora_cfg.rank) / self.lora_cfg.rank,
            }
            atomic_write_text(tmp / INFO_FILE, json.dumps(info, indent=2, ensure_ascii=False) + "\n")
        return path


def merge_lora(base: str | Path, lora: str | Path, out: str | Path, scale: float = 1.0) -> Path:
    """Fold a LoRA (a ``train finetune`` LoRA folder or a diffusers-format LoRA) into ``base`` and
    write a full model folder to ``out`` (``base`` ``builtin`` or ``builtin:NAME``: a built-in model).

    The same code merges a LoRA at generation time (``pipe.load_lora`` → rapiddiff.models.lora),
    so the merged folder makes the images ``--lora`` makes. The base folder's knowledge/,
    upscaler/ and sampling defaults carry over (logged when it has no upscaler).
    """
    from rapiddiff.models.bundle import load_model_folder, save_model_folder
    from rapiddiff.models.lora import apply_lora, read_lora

    base, lora = Path(_resolve_pretrained(str(base))), Path(lora)
    if lora.is_dir() and not any((lora / f).is_file() for f in (LORA_WEIGHTS, TEXT_LORA_FILE, FUSION_FILE)):
        raise FileNotFoundError(f"{lora}: no {LORA_WEIGHTS}; expected a `train finetune` LoRA output")
    weights = read_lora(lora)
    bundle = load_model_folder(base)
    apply_lora(weights, bundle.unet, bundle.text_encoder, scale=scale)
    if bundle.upscaler is None:
        log.info("merge: %s has no upscaler/; the merged folder has none either", base)
    return save_model_folder(bundle, out)


def _merge_main(args: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="rapiddiff train finetune merge",
        description="Fold LoRA weights into their base model and write a full model folder.",
    )
    parser.add_argument(
        "--base",
        required=True,
        help="the model folder the LoRA was trained on; builtin: the default built-in model, "
        "builtin:NAME a built-in model by name (as `pretrained:` in a finetune config)",
    )
    parser.add_argument(
        "--lora",
        required=True,
        help="the LoRA output folder (pytorch_lora_weights.safetensors) or a diffusers LoRA file",
    )
    parser.add_argument("--out", required=True, help="where to write the merged model folder")
    parser.add_argument("--scale", type=float, default=1.0, help="LoRA strength (1.0 = as trained)")
    ns = parser.parse_args(args)
    path = merge_lora(ns.base, ns.lora, ns.out, ns.scale)
    print(f"merged model folder: {path}")


def cli_main(args: list[str] | None = None) -> RapidCLI | None:
    """``rapiddiff train finetune [merge]``: LightningCLI over FineTune + ImageTextData."""
    if args and args[0] == "merge":
        _merge_main(args[1:])
        return None
    return run_cli(
        FineTune,
        ImageTextData,
        args,
        prog="rapiddiff train finetune",
        description=(
            "Fine-tune a model folder (rapiddiff, Taiyi, SD 1.x) on an image–caption folder, fully or "
            "with LoRA. `rapiddiff train finetune merge --help` folds a LoRA into its base."
        ),
    )
