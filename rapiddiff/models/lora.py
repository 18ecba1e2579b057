"""LoRA weights: read them (diffusers-format files and ``train finetune``'s LoRA folders) and merge
them into a model's weights, reversibly.

Generation (``pipe.load_lora``) and ``rapiddiff train finetune merge`` both go through
:func:`apply_lora`, so a merged folder and a LoRA applied at generation time give the same image.
The update is the one diffusers' ``fuse_lora`` makes: ``W ← W + scale · (alpha / rank) · B·A``.
It is merged into the weights (not a side branch) so that every fast-path switch (fused QKV
projections, CUDA graphs, ``torch.compile``) keeps working; :meth:`AppliedLora.restore` puts the
original weights back.

A ``train finetune`` LoRA folder holds::

    pytorch_lora_weights.safetensors   diffusers format: the U-Net's (and a CLIP text tower's) adapters
    text_encoder_lora.safetensors      peft format: a BERT text tower's adapters (Taiyi)
    knowledge_fusion.safetensors       the knowledge fusion, when it was trained
    rapiddiff_lora.json                base folder, parts, rank/alpha, and the alpha/rank scale
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rapiddiff.models.weights import TruncatedWeightsError, explained
from rapiddiff.utils.io import UnsafeCheckpointError
from rapiddiff.utils.logging import get_logger

if TYPE_CHECKING:
    import torch
    from torch import nn

log = get_logger(__name__)

LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
FUSION_FILE = "knowledge_fusion.safetensors"
INFO_FILE = "rapiddiff_lora.json"
# diffusers' text-encoder LoRA loader knows CLIP's projection names only (q_proj, ...); a BERT
# tower's adapters (Taiyi) go to this peft-format file beside the diffusers one.
TEXT_LORA_FILE = "text_encoder_lora.safetensors"

# (down, up) key suffixes of the formats diffusers reads and writes.
_PAIRS = (
    (".lora.down.weight", ".lora.up.weight"),
    (".lora_linear_layer.down.weight", ".lora_linear_layer.up.weight"),
    (".lora_A.weight", ".lora_B.weight"),
    (".lora_down.weight", ".lora_up.weight"),
)


@dataclass
class LoraPair:
    """One adapted layer: ``delta = scale · up @ down`` (``scale`` = alpha / rank)."""

    down: torch.Tensor  # (r, in) or (r, in, k, k)
    up: torch.Tensor  # (out, r) or (out, r, 1, 1)
    scale: float = 1.0


@dataclass
class LoraWeights:
    """What a LoRA file or folder holds, by target: module name → pair."""

    path: str
    unet: dict[str, LoraPair] = field(default_factory=dict)
    text: dict[str, LoraPair] = field(default_factory=dict)  # names inside the text tower
    fusion: dict[str, torch.Tensor] | None = None


def is_lora_folder(path: str | Path) -> bool:
    """A ``train finetune`` LoRA output or a diffusers LoRA folder (no ``unet/`` of its own)."""
    path = Path(path)
    return (
        path.is_dir()
        and not (path / "unet").is_dir()
        and any((path / name).is_file() for name in (LORA_WEIGHTS, INFO_FILE, TEXT_LORA_FILE))
    )


def read_info(path: str | Path) -> dict[str, Any]:
    """The LoRA folder's info file (what ``train finetune`` recorded); empty when absent."""
    from rapiddiff.utils.io import read_json_object

    return read_json_object(Path(path) / INFO_FILE)


def read_lora(path: str | Path) -> LoraWeights:
    """Read a LoRA: a ``.safetensors`` file in diffusers (or kohya) format, or a folder holding
    ``pytorch_lora_weights.safetensors`` and/or the files ``train finetune`` writes."""
    from rapiddiff.utils.io import load_weights

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"LoRA not found: {path}")
    info = read_info(path) if path.is_dir() else {}
    trained_scale = float(info.get("scale", 1.0))
    lora = LoraWeights(path=str(path.resolve()))
    weights_file = path / LORA_WEIGHTS if path.is_dir() else path
    if path.is_dir() and not any((path / f).is_file() for f in (LORA_WEIGHTS, TEXT_LORA_FILE, FUSION_FILE)):
        raise FileNotFoundError(
            f"{path}: no {LORA_WEIGHTS}, {TEXT_LORA_FILE} or {FUSION_FILE}; expected a `train finetune` "
            "LoRA output or a diffusers LoRA folder"
        )
    if weights_file.is_file():
        state, alphas = _diffusers_state(weights_file)
        for prefix, target in (("unet.", lora.unet), ("text_encoder.", lora.text)):
            part = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            part_alphas = {k[len(prefix) :]: v for k, v in alphas.items() if k.startswith(prefix)}
            target.update(_pairs(part, part_alphas, trained_scale, weights_file))
        if not lora.unet and not lora.text:
            raise ValueError(
                f"{weights_file}: no LoRA layers found (keys like unet.<module>.lora.down.weight)"
            )
    if path.is_dir() and (path / TEXT_LORA_FILE).is_file():
        lora.text.update(
            _pairs(load_weights(path / TEXT_LORA_FILE), {}, trained_scale, path / TEXT_LORA_FILE)
        )
    if path.is_dir() and (path / FUSION_FILE).is_file():
        lora.fusion = load_weights(path / FUSION_FILE)
    return lora


def _diffusers_state(file: Path) -> tuple[dict[str, Any], dict[str, float]]:
    """diffusers' own reader: converts kohya / A1111 key names to its format and returns alphas."""
    from diffusers import StableDiffusionPipeline

    try:
        with explained(file, "--lora"):  # a pickle or a cut-short file: said so, not diffusers' words
            state, alphas = StableDiffusionPipeline.lora_state_dict(str(file.parent), weight_name=file.name)
    except (UnsafeCheckpointError, TruncatedWeightsError):
        raise
    except Exception as err:  # diffusers raises many types for files it cannot read
        raise ValueError(f"{file}: not a LoRA file diffusers can read ({err})") from err
    return dict(state), {k: float(v) for k, v in (alphas or {}).items()}


def _pairs(
    state: dict[str, Any], alphas: dict[str, float], default_scale: float, where: Path
) -> dict[str, LoraPair]:
    pairs: dict[str, LoraPair] = {}
    for key, down in state.items():
        for down_suffix, up_suffix in _PAIRS:
            if not key.endswith(down_suffix):
                continue
            name = key[: -len(down_suffix)]
            name = re.sub(r"\.default$", "", name)
            up = state.get(key[: -len(down_suffix)] + up_suffix)
            if up is None:
                raise ValueError(f"{where}: {key} has no matching {up_suffix} weight")
            rank = int(down.shape[0])
            alpha = alphas.get(f"{name}.alpha", alphas.get(f"{key}.alpha"))
            scale = float(alpha) / rank if alpha is not None else default_scale
            pairs[name] = LoraPair(down=down, up=up, scale=scale)
    return pairs


@dataclass
class AppliedLora:
    """A LoRA merged into a model; :meth:`restore` puts back the weights it changed."""

    path: str
    scale: float
    saved: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (weight, original)
    fusion: tuple[nn.Module, dict[str, torch.Tensor]] | None = None

    def restore(self) -> None:
        import torch

        with torch.no_grad():
            for weight, original in reversed(self.saved):
                weight.copy_(original)
            if self.fusion is not None:
                module, state = self.fusion
                module.load_state_dict(state)
        self.saved.clear()
        self.fusion = None


def apply_lora(lora: LoraWeights, unet: nn.Module, text_encoder: Any, *, scale: float = 1.0) -> AppliedLora:
    """Merge ``lora`` into ``unet`` and ``text_encoder`` (a KnowledgeTextEncoder) in place."""
    import torch

    applied = AppliedLora(path=lora.path, scale=float(scale))
    try:
        with torch.no_grad():
            _merge(unet, lora.unet, scale, applied, "U-Net", lora.path)
            if lora.text:
                _merge(text_encoder.text_model, lora.text, scale, applied, "text tower", lora.path)
            if lora.fusion is not None:
                fusion = getattr(text_encoder, "fusion", None)
                if fusion is None:
                    raise ValueError(
                        f"{lora.path}: holds knowledge-fusion weights but the model has no knowledge/ folder"
                    )
                if scale != 1.0:
                    log.warning("LoRA %s: the knowledge fusion weights load as trained (scale %s is for adapters)",
                                lora.path, scale)  # fmt: skip
                applied.fusion = (fusion, {k: v.clone() for k, v in fusion.state_dict().items()})
                fusion.load_state_dict(lora.fusion)  # copy_ casts to the fusion's dtype
    except BaseException:
        applied.restore()
        raise
    log.info("LoRA %s applied at scale %s (%d layers)", lora.path, scale, len(applied.saved))
    return applied


def _merge(
    model: nn.Module, pairs: dict[str, LoraPair], scale: float, applied: AppliedLora, what: str, path: str
) -> None:
    for name, pair in pairs.items():
        layer = _find(model, name)
        if layer is None:
            raise ValueError(
                f"LoRA {path}: the {what} has no layer {name!r}: this LoRA was trained for another model"
            )
        weight = getattr(layer, "weight", None)
        if weight is None or weight.dtype not in _FLOAT_DTYPES():
            raise ValueError(
                f"LoRA {path}: layer {name!r} of the {what} holds no float weight ({type(layer).__name__}); "
                "load LoRAs before accelerate(fp8=True)"
            )
        down, up = pair.down.float().to(weight.device), pair.up.float().to(weight.device)
        delta = (up.flatten(1) @ down.flatten(1)).reshape(weight.shape)  # (out, in[, k, k])
        applied.saved.append((weight, weight.detach().clone()))
        weight.add_((scale * pair.scale * delta).to(weight.dtype))


def _FLOAT_DTYPES() -> tuple[torch.dtype, ...]:
    import torch

    return (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _find(model: nn.Module, name: str) -> nn.Module | None:
    """The layer a LoRA key names; CLIP towers are addressed without their ``text_model.`` prefix,
    and a peft-wrapped layer by its base layer."""
    for candidate in (name, f"text_model.{name}", name.removeprefix("text_model.")):
        try:
            layer = model.get_submodule(candidate)
        except AttributeError:
            continue
        return getattr(layer, "base_layer", layer)
    return None
