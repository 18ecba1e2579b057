"""The U-Net stage's parts: U-Net, VAE, text encoder and schedule from presets or folders, and
the checks their settings must pass before training starts."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rapiddiff.models.sampling import zero_terminal_snr_config
from rapiddiff.train.speed import (
    SpeedConfig,
)
from rapiddiff.train.unet_config import DiffusionLoss
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)


def training_schedule(config: Any, loss: DiffusionLoss) -> dict[str, Any]:
    """The start model's scheduler config with the loss's prediction type and schedule applied;
    raises when the two do not fit (ε-prediction on a zero-terminal-SNR schedule)."""
    from rapiddiff.models.sampling import zero_terminal_snr

    out = dict(config)
    if loss.prediction_type is not None:
        out["prediction_type"] = loss.prediction_type
    if loss.zero_terminal_snr:
        out = zero_terminal_snr_config(out)
    prediction = out.get("prediction_type", "epsilon")
    if prediction not in ("epsilon", "v_prediction"):
        raise ValueError(f"prediction_type {prediction!r}: use epsilon or v_prediction")
    if zero_terminal_snr(out) and prediction != "v_prediction":
        raise ValueError(
            "a zero-terminal-SNR schedule (model.loss.zero_terminal_snr, or a start model trained with "
            "one) needs model.loss.prediction_type: v_prediction — at the last timestep x_T is pure "
            "noise, so an ε-prediction says nothing about the image (and min-SNR weights divide by 0)"
        )
    return out


def plain_name(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "")


def check_speed(speed: SpeedConfig, cache_latents: bool, trainable: list[str]) -> None:
    if speed.gpu_data and not cache_latents:
        raise ValueError("speed.gpu_data keeps the latent cache on the GPU: set model.cache_latents: true")
    if speed.cache_text and not speed.gpu_data:
        raise ValueError("speed.cache_text needs speed.gpu_data: true (the states live beside the latents)")
    if speed.cache_text and {"fusion", "text_encoder"} & set(trainable):
        raise ValueError(
            "speed.cache_text needs a frozen text side, but model.trainable has "
            f"{sorted({'fusion', 'text_encoder'} & set(trainable))}: set cache_text: false"
        )
    if speed.cuda_graph and speed.compile:
        raise ValueError(
            "speed.cuda_graph and speed.compile: choose one (a compiled U-Net is not captured here)"
        )
    if speed.sync_every < 1:
        raise ValueError(
            f"speed.sync_every is a number of steps >= 1 (1: every step), got {speed.sync_every}"
        )


def frozen_dtype(precision: str) -> torch.dtype:
    """dtype for frozen modules under a Trainer precision ("bf16-mixed" → bfloat16, ...)."""
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return torch.float32


def _is_preset(value: str, names: Sequence[str]) -> bool:
    return value in names and not Path(value).exists()


def _subfolder(path: Path, name: str, marker: str = "config.json") -> Path:
    """``path/name`` when it holds the component, else ``path`` itself (a bare component folder)."""
    if (path / name / marker).is_file():
        return path / name
    if (path / marker).is_file():
        return path
    raise FileNotFoundError(
        f"{path}: no {name}/{marker} or {marker}; expected a {name} folder or a model folder"
    )


def load_components(
    *,
    pretrained: str | None,
    unet: str,
    vae: str,
    text_encoder: str,
    scheduler: str | None,
    knowledge: str | None,
    fusion_layers: list[int],
) -> dict[str, Any]:
    """U-Net, VAE, KnowledgeTextEncoder and the scheduler config, from presets or folders."""
    import json

    from diffusers import AutoencoderKL, UNet2DConditionModel

    from rapiddiff.models import presets
    from rapiddiff.models.text_encoder import KnowledgeTextEncoder

    if pretrained is not None:
        from rapiddiff.models.bundle import load_model_folder

        bundle = load_model_folder(pretrained, load_upscaler=False)
        parts: dict[str, Any] = {
            "unet": bundle.unet,
            "vae": bundle.vae,
            "text_encoder": bundle.text_encoder,
            "scheduler_config": dict(bundle.scheduler.config),
        }
    else:
        if _is_preset(unet, presets.PRESETS):
            unet_model = UNet2DConditionModel(**presets.unet_config(unet))
        elif Path(unet).is_file():  # a config.json alone: another architecture, random init
            unet_model = UNet2DConditionModel.from_config(presets.read_unet_config(unet))
        else:
            unet_model = UNet2DConditionModel.from_pretrained(str(_subfolder(Path(unet), "unet")))
        if _is_preset(vae, presets.PRESETS):
            log.warning("VAE preset %r: random weights — only for tests and benchmarks", vae)
            vae_model = AutoencoderKL(**presets.vae_config(vae))
        else:
            vae_model = AutoencoderKL.from_pretrained(str(_subfolder(Path(vae), "vae")))
        if _is_preset(text_encoder, presets.PRESETS):
            from transformers import BertConfig, BertModel

            from rapiddiff.models.text_encoder import chinese_bert_tokenizer

            tower = BertModel(BertConfig(**presets.bert_text_config(text_encoder)), add_pooling_layer=False)
            encoder = KnowledgeTextEncoder(
                tower,
                chinese_bert_tokenizer(),
                fusion_layers=fusion_layers,
                out_dim=unet_model.config.cross_attention_dim,
            )
        else:
            encoder = KnowledgeTextEncoder.from_pretrained(text_encoder)
        config = presets.scheduler_config()
        if scheduler is not None:
            file = _subfolder(Path(scheduler), "scheduler", "scheduler_config.json") / "scheduler_config.json"
            config = json.loads(file.read_text(encoding="utf-8"))
        parts = {"unet": unet_model, "vae": vae_model, "text_encoder": encoder, "scheduler_config": config}
    if knowledge is not None:
        from rapiddiff.kg.store import KnowledgeStore

        if parts["text_encoder"].store is not None:
            log.warning(
                "replacing the text encoder's KnowledgeStore with %s (fusion weights restart at zero)",
                knowledge,
            )
        parts["text_encoder"].set_store(KnowledgeStore.load(knowledge))
    for name in ("unet", "vae", "text_encoder"):
        parts[name].train().requires_grad_(True)
    return parts
