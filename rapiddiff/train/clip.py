"""``rapiddiff train clip``: contrastive training of a KnowledgeCLIP (LightningCLI).

The story of one step: captions are tokenized and entity-linked (in the main process, before
the batch moves to the device); entity mentions are sometimes hidden (see below); text and image
features are computed; gathered across GPUs; symmetric InfoNCE. At the end of fit the model is
written with ``KnowledgeCLIP.save_pretrained`` to ``--output`` (default
``<trainer.default_root_dir>/model``), where ``rapiddiff eval recall`` and the U-Net stage read it.
The plumbing (seeded resumable data order, rolling checkpoints, Ctrl-C save, export) is the one
every stage shares: :func:`rapiddiff.train.lightning_cli.run_cli`.

Entity-token dropout (knowledge on only): with probability ``entity_token_dropout`` an entity
mention's tokens are replaced — half the time by [MASK], half by random vocabulary tokens — while
its knowledge is still injected. A model that can always read the entity's name memorises names
and ignores the KG; hiding the name makes it learn to read the injected knowledge, which is the
only thing a held-out entity (a name never seen in training, i.e. untrained tokens) brings.
``entity_token_dropout_relations`` limits it to the entities the KG describes (heads of those
relations): attribute words that are KG entities too (红色, 三角形) stay readable, or the tower never
learns them as words.

Speed (``model.speed``, :class:`CLIPSpeed`): none of the switches changes what the model learns.
``gpu_data`` decodes every training image once and keeps images and tokens on the GPU (the loader
hands over indices only), ``fused_adamw`` (default on CUDA) is torch's one-kernel AdamW,
``sync_every`` reads the non-finite-loss flag every N steps, ``cuda_graph`` replays the step's
forward and backward as one CUDA graph. The step itself has no host sync: entity mentions are
hidden with fixed-shape draws (:meth:`CLIPTraining.hide_entity_tokens`), and the temperature and
gate are logged on logging steps only. ``tests/train/test_clip_speed.py`` compares the losses.

Run: ``rapiddiff train clip --config configs/clip/kshapes.yaml [--trainer.max_steps=...]``;
``--ckpt_path=last`` (or a file) resumes exactly; the resolved config is saved beside the checkpoints.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from rapiddiff.models.clip import KnowledgeCLIP
from rapiddiff.models.text_encoder import KnowledgeTextEncoder, chinese_bert_tokenizer, entities_with_facts
from rapiddiff.train.callbacks import FrozenGC
from rapiddiff.train.data import ImageTextData, TokenMemo
from rapiddiff.train.lightning_cli import run_cli
from rapiddiff.train.module import RapidModule
from rapiddiff.train.negatives import ValueSwap
from rapiddiff.train.optim import use_fused_adamw
from rapiddiff.train.speed import GRAPH_WARMUP_STEPS, GraphedLoss
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)

DEFAULT_IMAGE_SIZE = 128  # from scratch, when model.image_size is unset
# The hard negatives' tensors, after the four of a step (model.hard_negative_relations)
NEGATIVE_KEYS = ("neg_input_ids", "neg_attention_mask", "neg_token_entity_ids", "neg_valid")
# Hard negatives kept per caption, one drawn a step; a few cover most swaps over a run
NEGATIVE_VARIANTS = 4
Freeze = Literal["none", "image", "text", "all_but_fusion"]


@dataclass(frozen=True)
class CLIPSpeed:
    """How the CLIP step runs (none of these changes what the model learns)."""

    gpu_data: bool = False
    """Decode every training image once at the start (with the loader's workers) and keep the images
    (uint8, exactly the loader's pixel values) and the captions' tokens on the GPU; every batch is
    gathered there from the indices the (resumable) sampler draws, so no image crosses from the host
    per step. Random horizontal flips (``data.dataset_options.hflip``) are then drawn on the GPU, same
    chance; random crops are refused (they would be frozen at the first decode)."""
    fused_adamw: bool | None = None
    """torch's fused AdamW kernel. None (default): fused when every trained parameter is on a CUDA GPU,
    as the U-Net stage's ``optim.fused``; false: foreach (fused rounds differently, ~1e-4 on a loss)."""
    sync_every: int = 1
    """Read the device's non-finite-loss flag every N steps instead of every step (the host queues the
    next step while the GPU works). A NaN still stops the run before any checkpoint or the export
    holds it (the flag is read before every save), up to N - 1 steps later. Above 1 the progress bar
    shows no per-step loss (reading it is a sync); it is in the logs every log_every_n_steps. 1: every step."""
    cuda_graph: bool = False
    """Capture the step's forward, loss and backward (both towers, fusion, entity hiding) as one CUDA
    graph after a few eager steps and replay it every step. One GPU only (not DDP: the gathered
    negatives), no gradient accumulation, bf16 or fp32; batches must keep one shape (drop_last)."""

    def __post_init__(self) -> None:
        if self.sync_every < 1:
            raise ValueError(
                f"speed.sync_every is a number of steps >= 1 (1: every step), got {self.sync_every}"
            )


_SPEED = CLIPSpeed()


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
    entity_item: bool = True,
    relation_items: str = "translation",
    relation_weights: bool = False,
) -> KnowledgeCLIP:
    """A KnowledgeCLIP from a checkpoint folder (Chinese-CLIP or KnowledgeCLIP) or from scratch."""
    text_kwargs = {
        "fusion_layers": fusion_layers,
        "max_relations": max_relations,
        "entity_item": entity_item,
        "relation_items": relation_items,
        "relation_weights": relation_weights,
    }
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
        entity_token_dropout_relations: hide only mentions of entities that head a fact of one of
            these relations (the things the KG describes: 番茄 has 颜色; the attribute word 红色
            has no 颜色 of its own), so attribute words stay readable and the tower learns them as
            words. None: every linked mention. On kshapes with None and dropout 1.0 the tower never
            saw a colour, shape or background word (they are KG entities too): a U-Net trained on
            its states without knowledge draws them at chance.
        fusion_relations: add knowledge only at mentions of entities that head a fact of one of
            these relations, so the attribute words (红色, entities too) are read as words with no
            TransE vector added; saved with the encoder, so the U-Net stage and inference do the same.
            None: knowledge at every linked mention. On kshapes it drew worse (measured on 3 seeds).
        hard_negative_relations: add, for each caption that names a value of one of these relations
            (红色 for 颜色), the caption with that value swapped for another (黄色) as an extra negative
            of its image (NegCLIP's hard negatives, chosen by the KG: :mod:`rapiddiff.train.negatives`),
            so the text side must tell neighbouring values apart in the same context. None: in-batch
            negatives only. Needs a knowledge store.
        mask_entity_mentions: the saved encoder replaces entity mentions by [MASK] at inference
            (knowledge on), so an entity is known only through the KG. On kshapes it lowered
            held-out recall: off.
        knowledge_item_dropout: chance that one of an entity's knowledge items (``e``, ``e + r``)
            is left out of its pooled knowledge during training.
        knowledge_entity_item: whether an entity's own TransE vector ``e`` is one of its knowledge
            items (saved in the fusion config, so inference pools the same; a checkpoint's fusion keeps
            its own). False keeps only the ``e + r`` translations, which land near tails that training
            captions share. No gain on kshapes.
        knowledge_relation_items: what each of an entity's relations adds as an item: "translation",
            TransE's ``e + r`` (a prediction of the tail), or "tail", the vector of the tail of the
            entity's fact in the KG (saved in the fusion config, like knowledge_entity_item).
        knowledge_relation_weights: pool an entity's knowledge items by a learned weight per relation
            (softmax, zero at start: the mean) instead of their plain mean (saved in the fusion config).
        freeze: what not to train: the image tower, the text tower, or all but the fusion.
        lr: learning rate of the towers and heads.
        fusion_lr: learning rate of the fusion module and gates (default: lr).
        weight_decay: AdamW weight decay (not on biases, norms, gates, temperature).
        warmup_steps: linear warm-up, then cosine decay to zero over the run.
        speed: GPU-resident data, fused AdamW, deferred non-finite check, a CUDA-graph step.
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
        entity_token_dropout_relations: list[str] | None = None,
        fusion_relations: list[str] | None = None,
        hard_negative_relations: list[str] | None = None,
        mask_entity_mentions: bool = False,
        knowledge_item_dropout: float = 0.0,
        knowledge_entity_item: bool = True,
        knowledge_relation_items: Literal["translation", "tail"] = "translation",
        knowledge_relation_weights: bool = False,
        freeze: Freeze = "none",
        lr: float = 5e-4,
        fusion_lr: float | None = None,
        weight_decay: float = 0.05,
        warmup_steps: int = 200,
        speed: CLIPSpeed = _SPEED,
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
            entity_item=knowledge_entity_item,
            relation_items=knowledge_relation_items,
            relation_weights=knowledge_relation_weights,
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
            self.model.text_encoder.fusion_relations = fusion_relations
        self._apply_freeze(freeze)
        self.speed = speed
        self.sync_every = speed.sync_every
        self._tokenize: TokenMemo | None = None
        self._resident: ResidentPairs | None = None  # speed.gpu_data: the training set on the device
        self._graphed: GraphedLoss | None = None  # speed.cuda_graph, from step GRAPH_WARMUP_STEPS on
        self._hide_ids: tuple[int, int, int] | None = None  # [MASK] id, random-id range (cached)
        # Which entity ids may be hidden (None: all); a buffer, so it follows the module's device.
        hideable = entities_with_facts(
            store, entity_token_dropout_relations, "entity_token_dropout_relations"
        )
        self.register_buffer("_hideable", hideable, persistent=False)
        if mask_entity_mentions and hideable is not None:  # inference masks what training hid
            self.model.text_encoder.mask_relations = entity_token_dropout_relations
        self._swap: ValueSwap | None = None
        if hard_negative_relations is not None and store is None:
            # The knowledge-off ablation (model.knowledge=false) of a config that sets them: no KG
            # to name the values, so no hard negatives — logged, not an error, so the ablation runs.
            log.warning(
                "hard_negative_relations %s: no knowledge store, so no hard negatives",
                hard_negative_relations,
            )
        elif hard_negative_relations is not None:
            self._swap = ValueSwap(self.model.text_encoder, hard_negative_relations)
            if not self._swap.values:  # the tower would encode copies for nothing
                log.warning(
                    "hard_negative_relations %s: no relation has two values in this KG to swap; no hard negatives",
                    hard_negative_relations,
                )
                self._swap = None

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
        fused = self.speed.fused_adamw
        fused = use_fused_adamw(param_groups) if fused is None else fused
        optimizer = torch.optim.AdamW(param_groups, betas=(0.9, 0.98), eps=1e-6, fused=fused or None)
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
        # (speed.gpu_data: training batches are positions; their tokens are on the device already.)
        if "text" in batch:
            batch.update(self._tokens(list(batch["text"])))
        return batch

    def _tokens(self, captions: list[str]) -> dict[str, torch.Tensor]:
        if self._tokenize is None:
            self._tokenize = TokenMemo(self._tokens_and_negatives)
        return self._tokenize(captions)

    def _tokens_and_negatives(self, captions: list[str]) -> dict[str, torch.Tensor]:
        """``tokenize``'s rows and, with hard negatives, each caption's variants (``neg_*``, [N, K, ...]):
        memoised together, and on the device beside the tokens with ``speed.gpu_data``; the training
        step draws one variant per caption."""
        tokens = self.model.text_encoder.tokenize(captions)
        if self._swap is not None:
            tokens.update(self._swap(tokens, NEGATIVE_VARIANTS))
        return tokens

    def hide_entity_tokens(
        self, input_ids: torch.Tensor, token_entity_ids: torch.Tensor, fixed_shapes: bool | None = None
    ) -> torch.Tensor:
        """Replace whole entity mentions, each with probability p, by [MASK] or random tokens.

        One uniform number per mention decides whether it is hidden, a second whether by [MASK] or by
        random tokens (half each), then one random id per token position. On the host the mentions
        are counted (free there). On a GPU (``fixed_shapes``, default: where the ids are not on the
        CPU) counting would be a host sync, so one number per token slot is drawn instead and
        mention k reads number k. CUDA's Philox draws give element k the value of thread k, whatever
        the draw's size, and advance the generator by the same offset, while the draw fits one pass
        of the GPU's threads (SMs × threads per SM: hundreds of thousands; B·L is 8 k at batch 256): so
        these are the numbers the counted draw gave, without the sync and with fixed shapes (a CUDA
        graph can capture it). Only a GPU batch without any mention differs: it draws anyway (the
        counted draw skipped), which shifts that one step's later draws (dropout).
        """
        p = self.hparams.entity_token_dropout
        if p == 0:
            return input_ids
        if fixed_shapes is None:
            fixed_shapes = input_ids.device.type != "cpu"
        linked = token_entity_ids >= 0
        if self._hideable is not None:  # only the entities the KG describes (entity_token_dropout_relations)
            linked = linked & self._hideable[token_entity_ids.clamp(min=0)]
        if not fixed_shapes and not bool(linked.any()):
            return input_ids
        prev = F.pad(token_entity_ids[:, :-1], (1, 0), value=-1)
        starts = linked & (token_entity_ids != prev)
        span = (starts.flatten().cumsum(0) - 1).view_as(starts).clamp(min=0)  # mention index per token
        n = starts.numel() if fixed_shapes else int(starts.sum())
        device = input_ids.device
        hide = torch.rand(n, device=device) < p
        use_mask = torch.rand(n, device=device) < 0.5
        mask_id, low, high = self._hidden_ids()
        random_ids = torch.randint(low, high, input_ids.shape, device=device)
        replacement = torch.where(use_mask[span], torch.full_like(input_ids, mask_id), random_ids)
        return torch.where(linked & hide[span], replacement, input_ids)

    def _hidden_ids(self) -> tuple[int, int, int]:
        """[MASK] (or [UNK]) and the range of random replacement ids (read from the tokenizer once)."""
        if self._hide_ids is None:
            tokenizer = self.model.text_encoder.tokenizer
            mask = tokenizer.mask_token_id if tokenizer.mask_token_id is not None else tokenizer.unk_token_id
            self._hide_ids = (int(mask), max(tokenizer.all_special_ids) + 1, len(tokenizer))
        return self._hide_ids

    def _features(self, batch: dict[str, Any], train: bool) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids, mask, entities = batch["input_ids"], batch["attention_mask"], batch["token_entity_ids"]
        negatives = train and "neg_input_ids" in batch
        if negatives:  # the hard negatives go through the tower with their captions, in one call
            input_ids = torch.cat([input_ids, batch["neg_input_ids"]])
            mask = torch.cat([mask, batch["neg_attention_mask"]])
            entities = torch.cat([entities, batch["neg_token_entity_ids"]])
        if train and self.model.text_encoder.has_knowledge:
            input_ids = self.hide_entity_tokens(input_ids, entities)
        text = self.model.text_features(input_ids, mask, entities)
        image = self.model.image_features(batch["pixel_values"])
        if self.trainer.world_size > 1:  # negatives from every GPU, as Chinese-CLIP does

            def gather(x: torch.Tensor) -> torch.Tensor:
                return self.all_gather(x, sync_grads=True).flatten(0, 1)

            if negatives:  # captions and hard negatives gathered apart: positives stay rows 0..N-1
                half = len(batch["input_ids"])
                text = torch.cat([gather(text[:half]), gather(text[half:])])
            else:
                text = gather(text)
            image = gather(image)
        return text, image

    def _negative_valid(self, batch: dict[str, Any]) -> torch.Tensor | None:
        if "neg_valid" not in batch:
            return None
        valid = batch["neg_valid"]
        return self.all_gather(valid).flatten(0, 1) if self.trainer.world_size > 1 else valid

    def step_loss(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_entity_ids: torch.Tensor,
        pixel_values: torch.Tensor,
        *negatives: torch.Tensor,
    ) -> torch.Tensor:
        """Entity hiding → both towers → symmetric InfoNCE (the part of a step speed.cuda_graph captures).
        ``negatives``: the hard negatives' tensors, in :data:`NEGATIVE_KEYS` order, when there are some."""
        batch = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "token_entity_ids": token_entity_ids,
            "pixel_values": pixel_values,
            **dict(zip(NEGATIVE_KEYS, negatives, strict=False)),
        }
        text, image = self._features(batch, train=True)
        return self.model.contrastive_loss(text, image, self._negative_valid(batch))

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        if self._resident is not None:  # speed.gpu_data: gathered on the device
            batch = self._resident.batch(batch["position"])
        if "neg_valid" in batch:  # one of each caption's hard negative variants, drawn on the device
            variants = batch["neg_valid"]
            pick = torch.randint(variants.shape[1], (len(variants),), device=variants.device)
            rows = torch.arange(len(variants), device=variants.device)
            batch = {**batch, **{k: batch[k][rows, pick] for k in NEGATIVE_KEYS}}
        inputs = [batch[k] for k in ("input_ids", "attention_mask", "token_entity_ids", "pixel_values")]
        inputs += [batch[k] for k in NEGATIVE_KEYS if k in batch]
        if self.speed.cuda_graph and self.global_step >= GRAPH_WARMUP_STEPS:
            loss = self._graph_step(inputs)
        else:
            loss = self.step_loss(*inputs)
        self.check_finite(loss)
        size = len(inputs[0])
        # Lightning turns every prog_bar value into a Python number at every batch end (a host
        # sync, progress bar shown or not): with sync_every > 1 the loss goes to the loggers
        # and the plain progress lines on logging steps only.
        self.log("train/loss", loss, prog_bar=self.sync_every == 1, batch_size=size)
        if self._logging_step():
            # Read by the loggers on logging steps only: not queued (nor stored) on the others.
            self.log("train/logit_scale", self.model.logit_scale.detach().exp(), batch_size=size)
            fusion = self.model.text_encoder.fusion
            if fusion is not None and self.model.text_encoder.knowledge:
                self.log("train/gate", fusion.gates.detach().abs().mean(), batch_size=size)
        return loss

    def _logging_step(self) -> bool:
        connector = getattr(self._trainer, "_logger_connector", None) if self._trainer is not None else None
        return bool(getattr(connector, "should_update_logs", True))

    # ------------------------------------------------------------------ speed: data and the captured step
    def setup(self, stage: str) -> None:
        if self.speed.cuda_graph:
            self._check_graph_trainer()

    def _check_graph_trainer(self) -> None:
        trainer = self.trainer
        if trainer.world_size > 1:
            raise ValueError(
                "speed.cuda_graph runs on one GPU: the CLIP step gathers every GPU's features for its "
                "negatives, which a replay cannot do; set speed.cuda_graph: false for several GPUs"
            )
        super()._check_graph_trainer()

    def _graph_step(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        if self._graphed is None:
            from torch.nn.modules.batchnorm import _BatchNorm

            precision = str(self.trainer.precision) if self._trainer is not None else "32-true"
            norms = [m for m in self.modules() if isinstance(m, _BatchNorm) and m.training]
            self._graphed = GraphedLoss(
                self.step_loss,
                [p for p in self.parameters() if p.requires_grad],
                autocast_dtype=torch.bfloat16
                if precision.startswith("bf16") and "mixed" in precision
                else None,
                capture=inputs[0].device.type == "cuda",
                buffers=[b for m in norms for b in m.buffers()],  # running statistics: updated once a step
            )
        return self._graphed(*inputs)

    def configure_callbacks(self) -> list[Any]:
        return [FrozenGC()]  # no full GC pauses in a host-bound step

    def on_train_start(self) -> None:
        if self.speed.gpu_data and self._resident is None:
            loader = self.trainer.train_dataloader
            dataset = getattr(loader, "dataset", None)
            workers = getattr(self.trainer.datamodule, "num_workers", 0) if self._trainer else 0
            started = time.perf_counter()
            self._resident = ResidentPairs.build(
                getattr(dataset, "source", dataset), self._tokens, self.device, loader.batch_size, workers
            )
            self.resident_seconds = time.perf_counter() - started
            log.info(
                "speed.gpu_data: %d images and their tokens on %s (%.2f GiB) in %.1f s",
                len(self._resident.images),
                self.device,
                self._resident.nbytes() / 2**30,
                self.resident_seconds,
            )

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        text, image = self._features(batch, train=False)
        loss = self.model.contrastive_loss(text, image)
        sim = F.normalize(text, dim=-1) @ F.normalize(image, dim=-1).T
        target = torch.arange(len(text), device=text.device)
        acc = (sim.argmax(1) == target).float().mean()  # in-batch text→image top-1
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=len(text))
        self.log("val/t2i_acc", acc, sync_dist=True, batch_size=len(text))


class ResidentPairs:
    """The training set on the device (``speed.gpu_data``): every position's pixels — uint8, from
    which the loader's float pixels are recomputed exactly (``u · (1/127.5) - 1``, the transform's
    own arithmetic; float32 where a custom transform gives other values) — and its caption's tokens.
    Positions are the dataset's: an item that failed to decode holds what the loader gave in its
    place (the next good item), as the plain step would see it."""

    def __init__(self, images: torch.Tensor, tokens: dict[str, torch.Tensor], hflip: bool) -> None:
        self.images = images  # (N, 3, S, S) uint8 or float32
        self.tokens = tokens  # {name: (N, L)}, and the hard negatives' {neg_*: (N, K, ...)}
        self.hflip = hflip

    @classmethod
    @torch.no_grad()
    def build(
        cls, dataset: Any, tokenize: Any, device: torch.device, batch_size: int, workers: int
    ) -> ResidentPairs:
        from torch.utils.data import DataLoader

        transform = getattr(dataset, "transform", None)
        if getattr(transform, "crop", "center") == "random":
            raise ValueError(
                "speed.gpu_data decodes every image once, so a random crop would be the same crop every "
                "epoch: set data.dataset_options.crop: center, or speed.gpu_data: false"
            )
        hflip = bool(getattr(transform, "hflip", False))
        if hflip:  # decoded unflipped; the flips are drawn per step on the device
            import copy

            dataset = copy.copy(dataset)
            dataset.transform = copy.copy(transform)
            dataset.transform.hflip = False
        loader = DataLoader(dataset, batch_size=batch_size or 64, num_workers=workers, shuffle=False)
        images: list[torch.Tensor] = []
        texts: list[str] = []
        exact = True
        for batch in loader:
            pixels = batch["pixel_values"]  # (B, 3, S, S) in [-1, 1]
            codes = ((pixels + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
            exact = exact and torch.equal(pixels_of(codes), pixels)
            images.append(codes if exact else pixels)
            texts.extend(batch["text"])
        if not exact:  # a transform whose values are not u/127.5 - 1: keep the floats themselves
            log.info("speed.gpu_data: the images are not 8-bit levels; kept as float32")
            images = [pixels_of(x) if x.dtype == torch.uint8 else x for x in images]
        tokens = {k: v.to(device) for k, v in tokenize(texts).items()}
        return cls(torch.cat(images).to(device), tokens, hflip)

    def nbytes(self) -> int:
        tensors = [self.images, *self.tokens.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def batch(self, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """Pixels (B, 3, S, S) float32 in [-1, 1] and the tokens (B, L) of these sampler positions."""
        positions = positions.to(self.images.device, non_blocking=True)
        pixels = self.images[positions]
        pixels = pixels_of(pixels) if pixels.dtype == torch.uint8 else pixels
        if self.hflip:  # the loader's transform flips each image with chance 1/2
            flip = torch.rand(len(positions), device=pixels.device) < 0.5
            pixels = torch.where(flip.view(-1, 1, 1, 1), pixels.flip(-1), pixels)
        return {"pixel_values": pixels, **{k: v[positions] for k, v in self.tokens.items()}}


def pixels_of(codes: torch.Tensor) -> torch.Tensor:
    """8-bit levels → [-1, 1] float32 with the loader's arithmetic (ImageTransform: × 1/127.5, − 1)."""
    return codes.float().mul_(1.0 / 127.5).sub_(1.0)


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
