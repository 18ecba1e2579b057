"""KnowledgeCLIP: a KnowledgeTextEncoder and an image tower, aligned contrastively (CLIP).

Text features are the encoder's pooled hidden state ([CLS], as Chinese-CLIP does, or the mean over
the attention mask) through a linear projection; image features are the image tower's pooled
output through another. Both are L2-normalised; logits are their dot product times
``exp(logit_scale)``, clamped at 100 as in CLIP.

Image towers, by name:
- ``chinese_clip``: ``ChineseCLIPVisionModel`` (a ViT) — from a config, or from an OFA-Sys
  checkpoint via :meth:`KnowledgeCLIP.from_chinese_clip`;
- ``resnet18`` / ``resnet10``: torchvision ResNets with random init and a 3×3 pooling grid, for
  small domains such as kshapes, where a ViT would be needlessly slow to train from scratch.

Folder layout (:meth:`save_pretrained`): the text side exactly as
:meth:`KnowledgeTextEncoder.save_pretrained` writes it (so the folder is also a text-encoder
source for the U-Net stage), plus ``vision/`` (the image tower), ``clip.safetensors``
(projections, logit scale) and ``clip_config.json``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rapiddiff.models.text_encoder import KnowledgeTextEncoder
from rapiddiff.models.weights import explained
from rapiddiff.utils.io import atomic_write_text, load_weights, save_safetensors

IMAGE_TOWERS = ("chinese_clip", "resnet18", "resnet10")
CLIP_CONFIG = "clip_config.json"
CLIP_WEIGHTS = "clip.safetensors"
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_LOGIT_SCALE = math.log(100.0)
GRID = 3  # ResNet towers pool their last feature map to GRID × GRID cells


class ImageTower(nn.Module):
    """Normalised pixels [N, 3, S, S] → pooled features [N, width], for any tower by name."""

    def __init__(
        self, name: str, config: dict[str, Any] | None = None, module: nn.Module | None = None
    ) -> None:
        super().__init__()
        if name not in IMAGE_TOWERS:
            raise ValueError(f"unknown image tower '{name}'; choose one of: {', '.join(IMAGE_TOWERS)}")
        self.name = name
        self.config = dict(config or {})
        if name == "chinese_clip":
            from transformers import ChineseCLIPVisionConfig, ChineseCLIPVisionModel

            self.net = (
                module
                if module is not None
                else ChineseCLIPVisionModel(ChineseCLIPVisionConfig(**self.config))
            )
            self.width = int(self.net.config.hidden_size)
            self.config = self.net.config.to_dict() if module is not None else self.config
        else:
            from torchvision.models.resnet import BasicBlock, ResNet

            layers = [2, 2, 2, 2] if name == "resnet18" else [1, 1, 1, 1]
            self.net = module if module is not None else ResNet(BasicBlock, layers)
            # A 3×3 grid of pooled features instead of one global average: captions name where
            # the object is (左上方, 中间, ...), and a global pool would throw that away.
            self.net.avgpool = nn.AdaptiveAvgPool2d(GRID)
            self.net.fc = nn.Identity()
            self.width = 512 * GRID * GRID

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        if self.name == "chinese_clip":
            return self.net(pixel_values=pixels).pooler_output  # (N, width): post-layernorm [CLS]
        return self.net(pixels)  # (N, 512 * 3 * 3): features pooled over a 3×3 grid

    def save(self, folder: Path) -> None:
        if self.name == "chinese_clip":
            self.net.save_pretrained(folder, safe_serialization=True)
        else:
            save_safetensors(self.net.state_dict(), folder / "model.safetensors")
        atomic_write_text(folder / "tower.json", json.dumps({"name": self.name}) + "\n")

    @classmethod
    def load(cls, folder: Path) -> ImageTower:
        meta = folder / "tower.json"
        if not meta.is_file():
            raise FileNotFoundError(f"{meta}: missing; not an image tower folder written by rapiddiff")
        name = json.loads(meta.read_text(encoding="utf-8"))["name"]
        if name == "chinese_clip":
            from transformers import ChineseCLIPVisionModel

            with explained(folder, "image tower"):
                return cls(name, module=ChineseCLIPVisionModel.from_pretrained(str(folder)))
        tower = cls(name)
        tower.net.load_state_dict(load_weights(folder / "model.safetensors"))
        return tower


class KnowledgeCLIP(nn.Module):
    """Contrastive text–image model whose text side is a :class:`KnowledgeTextEncoder`."""

    def __init__(
        self,
        text_encoder: KnowledgeTextEncoder,
        image_tower: ImageTower,
        *,
        embed_dim: int = 256,
        image_size: int = 224,
        image_mean: Sequence[float] = OPENAI_CLIP_MEAN,
        image_std: Sequence[float] = OPENAI_CLIP_STD,
        pooling: str = "cls",
        logit_scale_init: float = math.log(1 / 0.07),
    ) -> None:
        super().__init__()
        if pooling not in ("cls", "mean"):
            raise ValueError(f"pooling must be 'cls' or 'mean', got {pooling!r}")
        self.text_encoder = text_encoder
        self.image_tower = image_tower
        self.embed_dim = embed_dim
        self.image_size = int(image_size)
        self.pooling = pooling
        self.text_projection = nn.Linear(text_encoder.hidden_size, embed_dim, bias=False)
        self.visual_projection = nn.Linear(image_tower.width, embed_dim, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(float(logit_scale_init)))
        self.register_buffer("image_mean", torch.tensor(image_mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("image_std", torch.tensor(image_std).view(1, 3, 1, 1), persistent=False)

    # ------------------------------------------------------------------ features
    def text_features(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_entity_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token tensors → projected, un-normalised text features [N, embed_dim]."""
        hidden = self.text_encoder(input_ids, attention_mask, token_entity_ids)  # (N, L, H)
        if self.pooling == "cls":
            pooled = hidden[:, 0]
        else:
            m = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1)
        return self.text_projection(pooled)

    def preprocess(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[-1, 1] pixels of any size → the tower's size and normalisation."""
        x = pixel_values.to(self.image_mean.device, self.visual_projection.weight.dtype)
        if x.shape[-2:] != (self.image_size, self.image_size):
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear", antialias=True)
        return ((x + 1) / 2 - self.image_mean) / self.image_std

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[-1, 1] pixels [N, 3, H, W] → projected, un-normalised image features [N, embed_dim]."""
        return self.visual_projection(self.image_tower(self.preprocess(pixel_values)))

    def encode_text(self, prompts: Sequence[str]) -> torch.Tensor:
        """Prompts → L2-normalised features [N, embed_dim]."""
        device = self.text_projection.weight.device
        batch = {k: v.to(device) for k, v in self.text_encoder.tokenize(list(prompts)).items()}
        return F.normalize(self.text_features(**batch), dim=-1)

    def encode_image(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[-1, 1] pixels [N, 3, H, W] → L2-normalised features [N, embed_dim]."""
        return F.normalize(self.image_features(pixel_values), dim=-1)

    def contrastive_loss(
        self, text: torch.Tensor, image: torch.Tensor, negative_valid: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Symmetric InfoNCE over the batch; rows of ``text`` and ``image`` are the positive pairs.

        With ``negative_valid`` [N] (hard negatives, NegCLIP), ``text`` is [2N, D]: the N captions,
        then each caption's hard negative. As in NegCLIP the negatives join every image's candidates
        in the image→text loss (a False entry leaves its negative out); text→image is unchanged.
        """
        text, image = F.normalize(text, dim=-1), F.normalize(image, dim=-1)
        scale = self.logit_scale.clamp(max=MAX_LOGIT_SCALE).exp()
        n = len(image)
        logits = scale * text @ image.T  # (N or 2N, N): text i vs image j
        target = torch.arange(n, device=text.device)
        text_to_image = F.cross_entropy(logits[:n], target)
        image_to_text = logits.T  # (N, N or 2N)
        if negative_valid is not None:
            keep = torch.cat([torch.ones_like(negative_valid), negative_valid])
            image_to_text = image_to_text.masked_fill(~keep, float("-inf"))
        return (text_to_image + F.cross_entropy(image_to_text, target)) / 2

    # ------------------------------------------------------------------ build / save / load
    @classmethod
    def build(
        cls,
        text_encoder: KnowledgeTextEncoder,
        image_tower: str = "resnet18",
        *,
        vision_config: dict[str, Any] | None = None,
        image_size: int = 224,
        embed_dim: int = 256,
        pooling: str = "cls",
    ) -> KnowledgeCLIP:
        """A fresh image tower by name; ResNets take pixels normalised to [-1, 1]."""
        tower = ImageTower(image_tower, vision_config)
        if image_tower == "chinese_clip":
            image_size = int(tower.net.config.image_size)
            mean, std = OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
        else:
            mean, std = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
        return cls(
            text_encoder,
            tower,
            embed_dim=embed_dim,
            image_size=image_size,
            image_mean=mean,
            image_std=std,
            pooling=pooling,
        )

    @classmethod
    def from_chinese_clip(cls, path: str | Path, store: Any = None, **text_kwargs: Any) -> KnowledgeCLIP:
        """Both towers, projections and temperature of an OFA-Sys ``ChineseCLIPModel`` folder."""
        from transformers import ChineseCLIPModel

        from rapiddiff.models.text_encoder import _model_type, load_tokenizer

        path = Path(path)
        if _model_type(path / "config.json") != "chinese_clip":
            raise ValueError(
                f"{path}: not a ChineseCLIPModel folder (config.json model_type must be chinese_clip)"
            )
        with explained(path, "Chinese-CLIP folder"):  # a pickle or a truncated file: named, with the reason
            full = ChineseCLIPModel.from_pretrained(str(path))
        text_kwargs.setdefault("use_attention_mask", True)  # as Chinese-CLIP encodes text
        text = KnowledgeTextEncoder(full.text_model, load_tokenizer(path), store, **text_kwargs)
        mean, std = OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
        pre = path / "preprocessor_config.json"
        if pre.is_file():
            conf = json.loads(pre.read_text(encoding="utf-8"))
            mean, std = conf.get("image_mean", mean), conf.get("image_std", std)
        model = cls(
            text,
            ImageTower("chinese_clip", module=full.vision_model),
            embed_dim=full.config.projection_dim,
            image_size=full.config.vision_config.image_size,
            image_mean=mean,
            image_std=std,
            pooling="cls",
        )
        if text.output_projection is not None:
            raise ValueError(
                "out_dim is not supported with a Chinese-CLIP checkpoint: its text_projection maps the tower width"
            )
        model.text_projection.load_state_dict(full.text_projection.state_dict())
        model.visual_projection.load_state_dict(full.visual_projection.state_dict())
        with torch.no_grad():
            model.logit_scale.copy_(full.logit_scale)
        return model

    def config(self) -> dict[str, Any]:
        return {
            "embed_dim": self.embed_dim,
            "image_size": self.image_size,
            "image_mean": self.image_mean.flatten().tolist(),
            "image_std": self.image_std.flatten().tolist(),
            "pooling": self.pooling,
        }

    def save_pretrained(self, folder: str | Path) -> None:
        folder = Path(folder)
        self.text_encoder.save_pretrained(folder)
        self.image_tower.save(folder / "vision")
        heads = {
            **{f"text_projection.{k}": v for k, v in self.text_projection.state_dict().items()},
            **{f"visual_projection.{k}": v for k, v in self.visual_projection.state_dict().items()},
            "logit_scale": self.logit_scale.detach(),
        }
        save_safetensors(heads, folder / CLIP_WEIGHTS)
        atomic_write_text(folder / CLIP_CONFIG, json.dumps(self.config(), indent=2) + "\n")

    @classmethod
    def from_pretrained(cls, folder: str | Path, knowledge: bool = True, **text_kwargs: Any) -> KnowledgeCLIP:
        """A folder written by :meth:`save_pretrained`, or an OFA-Sys ChineseCLIPModel folder."""
        folder = Path(folder)
        if not (folder / CLIP_CONFIG).is_file():
            from rapiddiff.models.text_encoder import _model_type

            if _model_type(folder / "config.json") == "chinese_clip":
                model = cls.from_chinese_clip(folder, **text_kwargs)
                model.text_encoder.knowledge = knowledge
                return model
            raise FileNotFoundError(
                f"{folder}: no {CLIP_CONFIG}; expected a KnowledgeCLIP folder (rapiddiff train clip) "
                "or a ChineseCLIPModel folder"
            )
        config = json.loads((folder / CLIP_CONFIG).read_text(encoding="utf-8"))
        text = KnowledgeTextEncoder.from_pretrained(folder, knowledge=knowledge, **text_kwargs)
        model = cls(text, ImageTower.load(folder / "vision"), **config)
        heads = load_weights(folder / CLIP_WEIGHTS)
        model.text_projection.load_state_dict({"weight": heads["text_projection.weight"]})
        model.visual_projection.load_state_dict({"weight": heads["visual_projection.weight"]})
        with torch.no_grad():
            model.logit_scale.copy_(heads["logit_scale"])
        return model
