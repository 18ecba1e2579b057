"""``rapiddiff train clip``: contrastive training of a KnowledgeCLIP (LightningCLI).

The story of one step: captions are tokenized and entity-linked (in the main process, before
the batch moves to the device); entity mentions are sometimes hidden (see below); text and image
features are computed; gathered across GPUs; symmetric InfoNCE. At the end of fit the model is
written with ``KnowledgeCLIP.save_pretrained`` to ``--output`` (default
``<trainer.default_root_dir>/model``), where ``rapiddiff eval recall`` and the U-Net stage read it.
The plumbing (seeded resumable data order, rolling checkpoints, Ctrl-C save, export) is the one
every stage shares: :func:`rapiddiff.train.common.run_cli`.

Entity-token dropout (knowledge on only): with probability ``entity_token_dropout`` an entity
mention's tokens are replaced — half the time by [MASK], half by random vocabulary tokens — while
its knowledge is still injected. A model that can always read the entity's name memorises names
and ignores the KG; hiding the name makes it learn to read the injected knowledge, which is the
only thing a held-out entity (a name never seen in training, i.e. untrained tokens) brings.

Run: ``rapiddiff train clip --config configs/clip/kshapes.yaml [--trainer.max_steps=...]``;
``--ckpt_path=last`` (or a file) resumes exactly; the resolved config is saved beside the checkpoints.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from rapiddiff.models.clip import KnowledgeCLIP
from rapiddiff.models.text_encoder import KnowledgeTextEncoder, chinese_bert_tokenizer
from rapiddiff.train.common import RapidModule, run_cli
from rapiddiff.train.data import ImageTextData, TokenMemo
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)

DEFAULT_IMAGE_SIZE = 128  # from scratch, when model.image_size is unset
Freeze = Literal["none", "image", "text", "all_but_fusion"]


def _load_store(path: str) -> Any:
    from rapiddiff.kg.store import KnowledgeStore

    if not Path(path).is_dir():
        raise FileNotFoundError(
            f"knowledge_store: folder not found: {path}; train one with `rapiddiff kg train --config ...`"
        )
    return KnowledgeStore.load(path)


def build_clip(
    *,
    init_from: str | None,
    text_tower: str,
    max_length: int,
    image_tower: str,
    image_size: int,
    embed_dim: int,
    pooling: str,
    store: Any,
    fusion_layers: list[int],
    max_relations: int,
) -> KnowledgeCLIP:
    """A KnowledgeCLIP from a checkpoint folder (Chinese-CLIP or KnowledgeCLIP) or from scratch."""
    text_kwargs = {"fusion_layers": fusion_layers, "max_relations": max_relations}
    if init_from:
        model = KnowledgeCLIP.from_pretrained(init_from, **text_kwargs)
        if store is not None and model.text_encoder.store is None:
            model.text_encoder.set_store(store)
        elif store is None and model.text_encoder.store is not None:
            model.text_encoder.knowledge = False
        return model
    from transformers import BertConfig, BertModel

    from rapiddiff.models.presets import bert_text_config

    config = BertConfig(**bert_text_config(text_tower))
    config.use_attention_mask = True  # saved in config.json; diffusers reads the same flag
    config.max_position_embeddings = max(config.max_position_embeddings, max_length)
    text = KnowledgeTextEncoder(
        BertModel(config, add_pooling_layer=False), chinese_bert_tokenizer(max_length), store, **text_kwargs
    )
    return KnowledgeCLIP.build(text, image_tower, image_size=image_size, embed_dim=embed_dim, pooling=pooling)


class CLIPTraining(RapidModule):
    """Contrastive training of a KnowledgeCLIP.

    Args:
        init_from: a Chinese-CLIP (OFA-Sys) or KnowledgeCLIP folder; None builds from scratch.
        text_tower: BERT preset for a text tower from scratch (rapiddiff.models.presets), with the
            Chinese BERT vocabulary.
        max_length: tokens per caption (from scratch only).
        image_tower: resnet18 / resnet10 / chinese_clip (from scratch only).
        image_size: the image tower's input size. Unset: 128 from scratch, or the size the
            ``init_from`` checkpoint was trained at (224 for ViT-B/16). The data is resized to
            this size (``data.image_size`` follows it; there is one setting, not two).
        embed_dim: width of the joint embedding (from scratch only).
        pooling: text pooling, [CLS] or mean over the mask (from scratch only).
        knowledge_store: a KnowledgeStore folder (``rapiddiff kg train`` output); None: no knowledge.
        knowledge: False trains without knowledge even when a store is given (the ablation).
        fusion_layers: encoder layers whose input receives knowledge.
        max_relations: ``e + r`` items per entity.
        entity_token_dropout: chance that an entity mention's tokens are hidden (knowledge on only).
        mask_entity_mentions: the saved encoder replaces entity mentions by [MASK] at inference
            (knowledge on), so an entity is known only through the KG. On kshapes (H200,
            2026-11-22) it lowered held-out R@1 (18.8 → 9.4 with entity_token_dropout 1.0): off.
        knowledge_item_dropout: chance that one of an entity's knowledge items (``e``, ``e + r``)
            is left out of its pooled knowledge during training.
        freeze: what not to train: the image tower, the text tower, or all but the fusion.
        lr: learning rate of the towers and heads.
        fusion_lr: learning rate of the fusion module and gates (default: lr).
        weight_decay: AdamW weight decay (not on biases, norms, gates, temperature).
        warmup_steps: linear warm-up, then cosine decay to zero over the run.
    """

    def __init__(
        self,
        *,
        init_from: str | None = None,
        text_tower: str = "kshapes",
        max_length: int = 32,
        image_tower: Literal["resnet18", "resnet10", "chinese_clip"] = "resnet18",
        image_size: int | None = None,
        embed_dim: int = 256,
        pooling: Literal["cls", "mean"] = "cls",
        knowledge_store: str | None = None,
        knowledge: bool = True,
        fusion_layers: list[int] | None = None,
        max_relations: int = 8,
        entity_token_dropout: float = 0.5,
        mask_entity_mentions: bool = False,
        knowledge_item_dropout: float = 0.0,
        freeze: Freeze = "none",
        lr: float = 5e-4,
        fusion_lr: float | None = None,
        weight_decay: float = 0.05,
        warmup_steps: int = 200,
    ) -> None:
        super().__init__()
        if not 0.0 <= entity_token_dropout <= 1.0:
            raise ValueError(f"entity_token_dropout must be in [0, 1], got {entity_token_dropout}")
        store = _load_store(knowledge_store) if knowledge and knowledge_store else None
        self.model = build_clip(
            init_from=init_from,
            text_tower=text_tower,
            max_length=max_length,
            image_tower=image_tower,
            image_size=image_size or DEFAULT_IMAGE_SIZE,
            embed_dim=embed_dim,
            pooling=pooling,
            store=store,
            fusion_layers=list(fusion_layers) if fusion_layers is not None else [0],
            max_relations=max_relations,
        )
        if image_size is not None and image_size != self.model.image_size:
            raise ValueError(
                f"model.image_size={image_size}, but {init_from} was trained at {self.model.image_size}²: "
                "leave model.image_size unset to use the checkpoint's own size"
            )
        self.save_hyperparameters()
        # The resolved size is the one setting: data.image_size is linked to it, and the hparams
        # record it (LightningCLI records the arguments as given, where it may be unset).
        self.image_size = self.model.image_size
        self.hparams["image_size"] = self._hparams_initial["image_size"] = self.image_size
        if self.model.text_encoder.fusion is not None:
            self.model.text_encoder.fusion.item_dropout = knowledge_item_dropout
            self.model.text_encoder.mask_entity_mentions = mask_entity_mentions
        self._apply_freeze(freeze)

    # ------------------------------------------------------------------ setup
    def _apply_freeze(self, freeze: str) -> None:
        m = self.model
        frozen: list[torch.nn.Module] = []
        if freeze == "image":
            frozen = [m.image_tower, m.visual_projection]
        elif freeze == "text":
            frozen = [m.text_encoder.text_model]
        elif freeze == "all_but_fusion":
            if m.text_encoder.fusion is None:
                raise ValueError("freeze=all_but_fusion needs a knowledge_store: there is no fusion to train")
            frozen = [c for c in m.children() if c is not m.text_encoder]
            frozen += [c for c in m.text_encoder.children() if c is not m.text_encoder.fusion]
            m.logit_scale.requires_grad_(False)
        for module in frozen:
            module.requires_grad_(False)
        self._frozen = frozen

    def train(self, mode: bool = True) -> CLIPTraining:
        # Frozen parts stay in eval mode: no dropout, and BatchNorm statistics stay as loaded.
        super().train(mode)
        for module in getattr(self, "_frozen", []):
            module.eval()
        return self

    def export(self, path: Path) -> Path:
        self.model.save_pretrained(path)
        return path

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        fusion = self.model.text_encoder.fusion
        fusion_ids = {id(p) for p in fusion.parameters()} if fusion is not None else set()
        groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
        for name, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            no_decay = p.ndim < 2 or "logit_scale" in name  # biases, norms, gates, temperature
            groups.setdefault((id(p) in fusion_ids, no_decay), []).append(p)
        param_groups = [
            {
                "params": params,
                "lr": (hp.fusion_lr or hp.lr) if is_fusion else hp.lr,
                "weight_decay": 0.0 if no_decay else hp.weight_decay,
            }
            for (is_fusion, no_decay), params in groups.items()
        ]
        optimizer = torch.optim.AdamW(param_groups, betas=(0.9, 0.98), eps=1e-6)
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup = min(hp.warmup_steps, total // 2)

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ------------------------------------------------------------------ one step
    def on_before_batch_transfer(self, batch: dict[str, Any], dataloader_idx: int) -> dict[str, Any]:
        # Tokenizing and linking are CPU string work: done here, once per batch, before the copy.
        # Memoised per caption (captions repeat every epoch); the same tensors tokenize() returns.
        if getattr(self, "_tokenize", None) is None:
            self._tokenize = TokenMemo(self.model.text_encoder.tokenize)
        batch.update(self._tokenize(list(batch["text"])))
        return batch

    def hide_entity_tokens(self, input_ids: torch.Tensor, token_entity_ids: torch.Tensor) -> torch.Tensor:
        """Replace whole entity mentions, each with probability p, by [MASK] or random tokens."""
        p = self.hparams.entity_token_dropout
        linked = token_entity_ids >= 0
        if p == 0 or not linked.any():
            return input_ids
        prev = F.pad(token_entity_ids[:, :-1], (1, 0), value=-1)
        starts = linked & (token_entity_ids != prev)
        span = (starts.flatten().cumsum(0) - 1).view_as(starts).clamp(min=0)  # mention index per token
        n = int(starts.sum())
        hide = torch.rand(n, device=input_ids.device) < p
        use_mask = torch.rand(n, device=input_ids.device) < 0.5
        tokenizer = self.model.text_encoder.tokenizer
        mask_id = tokenizer.mask_token_id if tokenizer.mask_token_id is not None else tokenizer.unk_token_id
        low = max(tokenizer.all_special_ids) + 1
        random_ids = torch.randint(low, len(tokenizer), input_ids.shape, device=input_ids.device)
        replacement = torch.where(use_mask[span], torch.full_like(input_ids, mask_id), random_ids)
        return torch.where(linked & hide[span], replacement, input_ids)

    def _features(self, batch: dict[str, Any], train: bool) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids = batch["input_ids"]
        if train and self.model.text_encoder.has_knowledge:
            input_ids = self.hide_entity_tokens(input_ids, batch["token_entity_ids"])
        text = self.model.text_features(input_ids, batch["attention_mask"], batch["token_entity_ids"])
        image = self.model.image_features(batch["pixel_values"])
        if self.trainer.world_size > 1:  # negatives from every GPU, as Chinese-CLIP does
            text = self.all_gather(text, sync_grads=True).flatten(0, 1)
            image = self.all_gather(image, sync_grads=True).flatten(0, 1)
        return text, image

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        text, image = self._features(batch, train=True)
        loss = self.model.contrastive_loss(text, image)
        self.check_finite(loss)
        self.log("train/loss", loss, prog_bar=True, batch_size=len(text))
        self.log("train/logit_scale", self.model.logit_scale.exp(), batch_size=len(text))
        fusion = self.model.text_encoder.fusion
        if fusion is not None and self.model.text_encoder.knowledge:
            self.log("train/gate", fusion.gates.abs().mean(), batch_size=len(text))
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        text, image = self._features(batch, train=False)
        loss = self.model.contrastive_loss(text, image)
        sim = F.normalize(text, dim=-1) @ F.normalize(image, dim=-1).T
        target = torch.arange(len(text), device=text.device)
        acc = (sim.argmax(1) == target).float().mean()  # in-batch text→image top-1
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=len(text))
        self.log("val/t2i_acc", acc, sync_dist=True, batch_size=len(text))


def cli_main(args: list[str] | None = None) -> None:
    """Run ``rapiddiff train clip`` with ``args`` (``--config FILE``, overrides, ``--help``)."""
    run_cli(
        CLIPTraining,
        ImageTextData,
        args,
        description=__doc__.split("\n\n")[0],
        # The image tower decides the input size; the data follows it (a second setting could disagree).
        links={"model.image_size": "data.image_size"},
    )
