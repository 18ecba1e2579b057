"""KnowledgeTextEncoder: a Chinese (or any) transformers text tower with KG knowledge fused in.

The base tower is used as it is (``BertModel`` — e.g. Taiyi's text encoder —,
``ChineseCLIPTextModel`` or ``CLIPTextModel``); its ``forward`` is never changed. Knowledge
enters through forward pre-hooks on the chosen encoder layers: for every token inside a linked
entity span, ``gate * proj(knowledge(entity))`` is added to that layer's input hidden state
(see :mod:`rapiddiff.models.fusion`). The gates start at zero, and ``knowledge=False`` skips
the hooks' work entirely, so both give the base encoder's output exactly.

``knowledge_mode`` says how knowledge enters when it is on: "embed" (the fused vectors, above),
"text" (each entity's facts spelled into the prompt, :mod:`rapiddiff.models.expansion`; the tower
then runs as the base encoder on the expanded prompt) or "both". ``knowledge_as(mode)`` switches
on/off and mode for a block and restores them.

Folder layout written by :meth:`KnowledgeTextEncoder.save_pretrained` (the diffusers one, plus
``knowledge/``)::

    text_encoder/   transformers model (+ rapiddiff_encoder.json, output_projection.safetensors)
    tokenizer/      transformers tokenizer
    knowledge/      store/ (KnowledgeStore), fusion.safetensors, fusion_config.json
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from rapiddiff.kg.normalize import to_simplified
from rapiddiff.models.expansion import PromptExpander, check_mode
from rapiddiff.models.fusion import FusionConfig, KnowledgeFusion
from rapiddiff.models.weights import explained
from rapiddiff.utils.config import ConfigError, did_you_mean
from rapiddiff.utils.io import atomic_write_text, load_weights, save_safetensors
from rapiddiff.utils.logging import get_logger

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = get_logger(__name__)

SETTINGS_FILE = "rapiddiff_encoder.json"
PROJECTION_FILE = "output_projection.safetensors"
FUSION_FILE = "fusion.safetensors"
FUSION_CONFIG_FILE = "fusion_config.json"

# transformers model_type → class name of the text tower to load from a text_encoder/ folder
_TEXT_MODEL_CLASSES = {
    "bert": "BertModel",
    "roberta": "BertModel",  # Chinese RoBERTa-wwm checkpoints are BERT-architecture
    "chinese_clip_text_model": "ChineseCLIPTextModel",
    "clip_text_model": "CLIPTextModel",
}
# ... and the file each class lives in: imported from there with transformers.models' __init__
# deferred (it scans ~400 model folders on import; rapiddiff.utils.imports says how).
_TEXT_MODEL_MODULES = {
    "BertModel": "transformers.models.bert.modeling_bert",
    "ChineseCLIPTextModel": "transformers.models.chinese_clip.modeling_chinese_clip",
    "CLIPTextModel": "transformers.models.clip.modeling_clip",
}


def chinese_bert_tokenizer(model_max_length: int = 77) -> PreTrainedTokenizerBase:
    """A fast BERT tokenizer (with offsets) on the Chinese BERT vocabulary, for models trained here."""
    from transformers import BertTokenizerFast

    from rapiddiff.models.presets import chinese_vocab_path

    # from_pretrained on the folder works on transformers 4 and 5 alike (5 ignores vocab_file=).
    return BertTokenizerFast.from_pretrained(
        str(chinese_vocab_path().parent), model_max_length=model_max_length
    )


def encoder_layers(text_model: nn.Module) -> nn.ModuleList:
    """The transformer blocks of a BERT-family or CLIP text tower, in order."""
    for path in ("encoder.layer", "text_model.encoder.layers", "encoder.layers"):
        module: Any = text_model
        try:
            for attr in path.split("."):
                module = getattr(module, attr)
        except AttributeError:
            continue
        if isinstance(module, nn.ModuleList):
            return module
    raise TypeError(
        f"{type(text_model).__name__}: cannot find its encoder layers; expected a BertModel, "
        "ChineseCLIPTextModel or CLIPTextModel"
    )


def relation_ids(store: Any, relations: Sequence[str], what: str = "relations") -> list[int]:
    """The store's ids of ``relations``; an unknown name is an error naming ``what`` (the setting)
    and the store's relations."""
    names = store.relation_names
    unknown = [r for r in relations if r not in names]
    if unknown:
        raise ValueError(f"{what}: {unknown} not in the store's relations ({', '.join(names)})")
    return [names.index(r) for r in relations]


def entities_with_facts(
    store: Any, relations: Sequence[str] | None, what: str = "relations"
) -> torch.Tensor | None:
    """[n_entities] bool: the heads of a fact of one of ``relations`` (the objects the KG describes,
    for [颜色, 形状]: not the attribute words 红色, 三角形, which are entities too); None when
    ``relations`` or ``store`` is None. ``what`` names the setting in the error for an unknown relation."""
    if relations is None or store is None:
        return None
    triples = store.triples
    chosen = torch.isin(triples[:, 1], torch.tensor(relation_ids(store, relations, what)))
    heads = torch.zeros(len(store), dtype=torch.bool)
    heads[triples[chosen, 0]] = True
    return heads


def _tower_width(text_model: nn.Module) -> int:
    return int(text_model.config.hidden_size)


class KnowledgeTextEncoder(nn.Module):
    """Text tower + tokenizer + optional KnowledgeStore; outputs last hidden states [B, L, hidden_size].

    Args:
        text_model: a transformers ``BertModel``, ``ChineseCLIPTextModel`` or ``CLIPTextModel``.
        tokenizer: its tokenizer; a fast one (offsets) is needed to link entities.
        store: a ``KnowledgeStore``; ``None`` gives the base encoder.
        fusion_layers: indices of the encoder layers whose *input* receives knowledge
            (0 = the embedding output).
        out_dim: output width; a linear projection is added when it differs from the tower's.
        max_length: tokens per prompt (padded and truncated to it); default: the tokenizer's
            ``model_max_length`` (what diffusers' StableDiffusionPipeline pads to), capped by the
            tower's position embeddings.
        max_relations: ``e + r`` items per entity.
        entity_item: whether an entity's own vector ``e`` is one of its knowledge items
            (:class:`~rapiddiff.models.fusion.FusionConfig`); for a new fusion only: a loaded one keeps
            the setting it was trained with.
        relation_items: "translation" (``e + r``) or "tail" (the fact's tail ``t``) for each of an
            entity's relations (:class:`~rapiddiff.models.fusion.FusionConfig`); for a new fusion only.
        relation_weights: pool an entity's items by a learned weight per relation (softmax) instead of
            their mean; for a new fusion only.
        use_attention_mask: pass the padding mask to the tower. Default: the text config's
            ``use_attention_mask`` if set (diffusers reads the same flag), else False — SD 1.x
            and Taiyi pipelines encode without it, and pretrained weights expect that.
        linker: an ``EntityLinker``; default ``EntityLinker.from_store(store)``.
        fusion: fusion weights to use (e.g. loaded); default a fresh module (gates at zero).
        mask_entity_mentions: with knowledge on, ``tokenize`` replaces the tokens of every linked
            entity mention by [MASK], so an entity is known only through the KG. Set it for an
            encoder trained that way (CLIP stage ``entity_token_dropout: 1.0``): inference then sees
            what training saw, and seen and held-out entities go through the same path.
        mask_relations: with ``mask_entity_mentions``, mask only mentions of entities that head a
            fact of one of these relations (the CLIP stage's ``entity_token_dropout_relations``);
            None masks every linked mention.
        fusion_relations: add knowledge only at mentions of entities that head a fact of one of
            these relations (the objects the KG describes: 番茄 has a 颜色); other linked mentions —
            the attribute words 红色, 三角形, which are entities too — are read as plain words.
            None: knowledge at every linked mention. A value word's TransE vector says what the KG
            says about it, and on kshapes that makes neighbouring hues' states alike; yet without the
            vectors the kshapes chain drew worse (3 seeds), so the shipped configs leave it None.
        knowledge_mode: "embed" (fused TransE vectors), "text" (facts spelled into the prompt)
            or "both"; used while ``knowledge`` is on.
        expansion_relations: relations whose facts "text"/"both" spell, in order; default
            :data:`rapiddiff.models.expansion.DEFAULT_RELATIONS` where the store has them.
        simplified_text: ``tokenize`` writes traditional characters as simplified ones first
            (:func:`rapiddiff.kg.normalize.to_simplified`, one character for one): for a tower that
            only ever read simplified text — the built-in model, whose pruned vocabulary reads a
            traditional character as [UNK]. The linker already matches either form.
    """

    def __init__(
        self,
        text_model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        store: Any = None,
        *,
        fusion_layers: Sequence[int] = (0,),
        out_dim: int | None = None,
        max_length: int | None = None,
        max_relations: int = 8,
        entity_item: bool = True,
        relation_items: str = "translation",
        relation_weights: bool = False,
        use_attention_mask: bool | None = None,
        linker: Any = None,
        fusion: KnowledgeFusion | None = None,
        mask_entity_mentions: bool = False,
        mask_relations: Sequence[str] | None = None,
        fusion_relations: Sequence[str] | None = None,
        knowledge_mode: str = "embed",
        expansion_relations: Sequence[str] | None = None,
        simplified_text: bool = False,
    ) -> None:
        super().__init__()
        self.text_model = text_model
        self.tokenizer = tokenizer
        layers = encoder_layers(text_model)
        self.fusion_layers = [int(i) for i in fusion_layers]
        for i in self.fusion_layers:
            if not 0 <= i < len(layers):
                raise ValueError(f"fusion layer {i} out of range: the text tower has {len(layers)} layers")
        if len(set(self.fusion_layers)) != len(self.fusion_layers):
            raise ValueError(f"fusion_layers has duplicates: {self.fusion_layers}")
        width = _tower_width(text_model)
        self.output_projection = nn.Linear(width, out_dim) if out_dim and out_dim != width else None
        positions = getattr(text_model.config, "max_position_embeddings", None)
        if max_length is None:
            max_length = int(min(tokenizer.model_max_length, positions or 512))
        if positions is not None and max_length > positions:
            raise ValueError(f"max_length={max_length} exceeds the tower's {positions} position embeddings")
        self.max_length = int(max_length)
        if use_attention_mask is None:
            use_attention_mask = bool(getattr(text_model.config, "use_attention_mask", False))
        self.use_attention_mask = use_attention_mask
        self.max_relations = max_relations
        self.entity_item = entity_item
        self.relation_items = relation_items
        self.relation_weights = relation_weights
        self.mask_entity_mentions = mask_entity_mentions
        if not isinstance(simplified_text, bool):  # a hand-edited rapiddiff_encoder.json
            raise ValueError(
                f"simplified_text must be true or false (the {SETTINGS_FILE} key), got {simplified_text!r}"
            )
        self.simplified_text = simplified_text
        self._mask_relations = list(mask_relations) if mask_relations is not None else None
        self._fusion_relations = list(fusion_relations) if fusion_relations is not None else None
        # [n_entities] bool per (setting, relations): the heads entities_with_facts finds in the store
        self._heads: dict[tuple[str, tuple[str, ...]], torch.Tensor] = {}
        self.knowledge = True
        self.knowledge_mode = knowledge_mode
        self.expansion_relations = list(expansion_relations) if expansion_relations is not None else None
        self.store = None
        self.linker = None
        self.expander: PromptExpander | None = None
        self.fusion: KnowledgeFusion | None = None
        self._deltas: dict[int, torch.Tensor] | None = None  # set only while forward runs
        for i in self.fusion_layers:
            layers[i].register_forward_pre_hook(functools.partial(self._add_knowledge, i), with_kwargs=True)
        if store is not None:
            self.set_store(store, linker=linker, fusion=fusion)

    # ------------------------------------------------------------------ knowledge
    def set_store(self, store: Any, *, linker: Any = None, fusion: KnowledgeFusion | None = None) -> None:
        """Attach a KnowledgeStore (and its linker); a new fusion module starts with gates at zero."""
        if fusion is None:
            fusion = KnowledgeFusion(
                FusionConfig(
                    kg_dim=int(store.dim),
                    hidden_size=_tower_width(self.text_model),
                    num_layers=len(self.fusion_layers),
                    max_relations=self.max_relations,
                    entity_item=self.entity_item,
                    relation_items=self.relation_items,
                    relation_weights=len(store.relation_names) if self.relation_weights else 0,
                )
            )
        elif fusion.config.num_layers != len(self.fusion_layers):
            raise ValueError(
                f"fusion weights are for {fusion.config.num_layers} layers, fusion_layers has {len(self.fusion_layers)}"
            )
        # The fusion's architecture is the encoder's from now on: a later set_store without fusion
        # weights (the U-Net stage's store replacement) builds the same kind of fusion.
        self.max_relations = fusion.config.max_relations
        self.entity_item = fusion.config.entity_item
        self.relation_items = fusion.config.relation_items
        self.relation_weights = bool(fusion.config.relation_weights)
        param = next(self.text_model.parameters())
        fusion = fusion.to(param.device)
        fusion.set_knowledge(store.entity_vectors, store.relation_vectors, store.triples)
        if linker is None:
            from rapiddiff.kg.linker import EntityLinker

            linker = EntityLinker.from_store(store)
        self.store, self.linker, self.fusion = store, linker, fusion
        self._heads = {}  # recomputed for this store when masking or fusion first needs them
        self.expander = PromptExpander(store, linker, self.expansion_relations)
        if not getattr(self.tokenizer, "is_fast", False):
            log.warning(
                "tokenizer %s is not a fast tokenizer: no character offsets, so entities cannot be "
                "linked and knowledge has no effect; load a *TokenizerFast",
                type(self.tokenizer).__name__,
            )

    @property
    def mask_entity_mentions(self) -> bool:
        return self._mask_entity_mentions

    @mask_entity_mentions.setter
    def mask_entity_mentions(self, value: bool) -> None:
        if value and self.tokenizer.mask_token_id is None:
            raise ValueError(
                f"mask_entity_mentions: the tokenizer ({type(self.tokenizer).__name__}) has no [MASK] token"
            )
        self._mask_entity_mentions = bool(value)

    @property
    def mask_relations(self) -> list[str] | None:
        return self._mask_relations

    @mask_relations.setter
    def mask_relations(self, relations: Sequence[str] | None) -> None:
        self._mask_relations = self._checked(relations, "mask_relations")

    @property
    def fusion_relations(self) -> list[str] | None:
        return self._fusion_relations

    @fusion_relations.setter
    def fusion_relations(self, relations: Sequence[str] | None) -> None:
        self._fusion_relations = self._checked(relations, "fusion_relations")

    def _checked(self, relations: Sequence[str] | None, setting: str) -> list[str] | None:
        """``relations`` as a list, their names checked against the store when there is one."""
        if relations is None:
            return None
        if self.store is not None:
            relation_ids(self.store, relations, setting)
        return list(relations)

    def _heads_of(self, setting: str) -> torch.Tensor | None:
        """[n_entities] bool: the heads of a fact of the relations ``setting`` ("mask_relations" or
        "fusion_relations") names; None when it is unset (every linked entity). Built on first use,
        so a folder saved with relations another store lacks still loads while knowledge is off."""
        relations = getattr(self, setting)
        if relations is None or self.store is None:
            return None
        key = (setting, tuple(relations))
        if key not in self._heads:
            heads = entities_with_facts(self.store, relations, setting)
            assert heads is not None
            self._heads[key] = heads
        return self._heads[key]

    @property
    def knowledge_mode(self) -> str:
        return self._knowledge_mode

    @knowledge_mode.setter
    def knowledge_mode(self, mode: str) -> None:
        self._knowledge_mode = check_mode(mode)

    @property
    def has_knowledge(self) -> bool:
        """Are the fused vectors used (knowledge on, a fusion module, mode "embed" or "both")?"""
        return self.knowledge and self.fusion is not None and self._knowledge_mode != "text"

    @property
    def expands_prompts(self) -> bool:
        """Are the facts spelled into prompts (knowledge on, a store, mode "text" or "both")?"""
        return self.knowledge and self.expander is not None and self._knowledge_mode != "embed"

    def set_knowledge(self, mode: bool | str) -> None:
        """True / False: knowledge on / off (mode unchanged); "off"; or a mode ("embed", "text",
        "both"), which also switches knowledge on. What ``--knowledge embed|text|both|off`` sets."""
        if isinstance(mode, bool):
            self.knowledge = mode
        elif mode == "off":
            self.knowledge = False
        else:
            self.knowledge_mode = mode
            self.knowledge = True

    @contextlib.contextmanager
    def knowledge_as(self, mode: bool | str | None) -> Iterator[KnowledgeTextEncoder]:
        """``with encoder.knowledge_as("text"): ...`` — :meth:`set_knowledge` for the block, then
        the previous on/off and mode again (None: leave both as they are)."""
        previous = (self.knowledge, self._knowledge_mode)
        if mode is not None:
            self.set_knowledge(mode)
        try:
            yield self
        finally:
            self.knowledge, self._knowledge_mode = previous

    def expand(self, prompts: Sequence[str]) -> list[str]:
        """The prompts as the tower will read them: facts spelled in when :attr:`expands_prompts`."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        return self.expander(prompts) if self.expands_prompts and self.expander is not None else prompts

    def _add_knowledge(
        self, index: int, module: nn.Module, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict] | None:
        delta = self._deltas.get(index) if self._deltas else None
        if delta is None:
            return None
        if args:
            args = (args[0] + delta.to(args[0].dtype), *args[1:])
        else:
            kwargs = {
                **kwargs,
                "hidden_states": kwargs["hidden_states"] + delta.to(kwargs["hidden_states"].dtype),
            }
        return args, kwargs

    # ------------------------------------------------------------------ properties
    @property
    def hidden_size(self) -> int:
        """Output width (what a U-Net's cross_attention_dim must equal)."""
        if self.output_projection is not None:
            return self.output_projection.out_features
        return _tower_width(self.text_model)

    @property
    def device(self) -> torch.device:
        return next(self.text_model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.text_model.parameters()).dtype

    # ------------------------------------------------------------------ text → tensors
    def tokenize(self, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Prompts → input_ids, attention_mask [B, max_length] and token_entity_ids (-1 = none)."""
        prompts = self.expand(prompts)  # unchanged unless knowledge_mode is "text" or "both"
        if self.simplified_text:
            prompts = [to_simplified(p) for p in prompts]
        fast = bool(getattr(self.tokenizer, "is_fast", False))
        enc = self.tokenizer(
            prompts,
            padding="max_length",
            max_length=self.max_length,
            truncation=True,
            return_offsets_mapping=fast,
            return_tensors="pt",
        )
        self._warn_truncated(prompts, enc["attention_mask"])
        ids = torch.full(enc["input_ids"].shape, -1, dtype=torch.long)
        if self.linker is not None and fast:
            offsets = enc["offset_mapping"]
            for b, text in enumerate(prompts):
                for span in self.linker.link_affirmed(text):  # "…，不是苹果": no knowledge for 苹果
                    start, end = offsets[b, :, 0], offsets[b, :, 1]
                    # A token belongs to a span when their character ranges overlap; special and
                    # padding tokens have empty (0, 0) ranges and never do.
                    inside = (end > start) & (start < span.end) & (end > span.start)
                    ids[b, inside] = span.entity_id
        fusable = self._heads_of("fusion_relations") if self.has_knowledge else None
        if fusable is not None:  # attribute words: read as words, no knowledge
            ids = ids.masked_fill((ids >= 0) & ~fusable[ids.clamp(min=0)], -1)
        input_ids = enc["input_ids"]
        if self.mask_entity_mentions and self.has_knowledge:
            masked = ids >= 0
            maskable = self._heads_of("mask_relations")
            if maskable is not None:
                masked &= maskable[ids.clamp(min=0)]
            input_ids = input_ids.masked_fill(masked, self.tokenizer.mask_token_id)
        return {
            "input_ids": input_ids,
            "attention_mask": enc["attention_mask"],
            "token_entity_ids": ids,
        }

    def _warn_truncated(self, prompts: list[str], attention_mask: torch.Tensor) -> None:
        # Only a row that fills every position can have been cut; re-tokenize just those.
        full_rows = (attention_mask.sum(1) >= self.max_length).nonzero().flatten().tolist()
        if not full_rows:
            return
        texts = [prompts[i] for i in full_rows]
        full = self.tokenizer(texts, truncation=False, add_special_tokens=True)["input_ids"]
        for text, ids in zip(texts, full, strict=True):
            if len(ids) > self.max_length:
                kept = self.tokenizer.decode(ids[: self.max_length], skip_special_tokens=True)
                log.warning(
                    "prompt truncated to %d tokens: %d of %d tokens dropped (kept: %r; prompt: %r)",
                    self.max_length,
                    len(ids) - self.max_length,
                    len(ids),
                    kept,
                    text,
                )

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_entity_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids [B, L] → last hidden states [B, L, hidden_size] (knowledge added where linked)."""
        deltas = None
        if self.has_knowledge and token_entity_ids is not None:
            assert self.fusion is not None
            deltas = self.fusion(token_entity_ids.to(input_ids.device), dtype=self.dtype)
        mask = attention_mask if self.use_attention_mask else None
        self._deltas = dict(zip(self.fusion_layers, deltas, strict=True)) if deltas else None
        try:
            hidden = self.text_model(input_ids=input_ids, attention_mask=mask).last_hidden_state  # (B, L, W)
        finally:
            self._deltas = None
        if self.output_projection is not None:
            hidden = self.output_projection(hidden)  # (B, L, out_dim)
        return hidden

    def encode(self, prompts: Sequence[str]) -> torch.Tensor:
        """Tokenize and run on the module's device → [B, L, hidden_size]."""
        batch = {k: v.to(self.device) for k, v in self.tokenize(prompts).items()}
        return self(**batch)

    # ------------------------------------------------------------------ save / load
    def settings(self) -> dict[str, Any]:
        return {
            "fusion_layers": self.fusion_layers,
            "out_dim": self.output_projection.out_features if self.output_projection is not None else None,
            "max_length": self.max_length,
            "max_relations": self.max_relations,
            "use_attention_mask": self.use_attention_mask,
            "mask_entity_mentions": self.mask_entity_mentions,
            "mask_relations": self.mask_relations,
            "fusion_relations": self.fusion_relations,
            "knowledge_mode": self.knowledge_mode,
            "expansion_relations": self.expansion_relations,
            "simplified_text": self.simplified_text,
        }

    def save_pretrained(self, model_dir: str | Path) -> None:
        """Write text_encoder/, tokenizer/ and (with a store) knowledge/ under ``model_dir``."""
        model_dir = Path(model_dir)
        text_dir = model_dir / "text_encoder"
        self.text_model.save_pretrained(text_dir, safe_serialization=True)
        atomic_write_text(text_dir / SETTINGS_FILE, json.dumps(self.settings(), indent=2) + "\n")
        if self.output_projection is not None:
            save_safetensors(self.output_projection.state_dict(), text_dir / PROJECTION_FILE)
        save_tokenizer(self.tokenizer, model_dir / "tokenizer")
        if self.store is not None and self.fusion is not None:
            kdir = model_dir / "knowledge"
            self.store.save(kdir / "store")
            save_safetensors(self.fusion.state_dict(), kdir / FUSION_FILE)
            atomic_write_text(
                kdir / FUSION_CONFIG_FILE, json.dumps(self.fusion.config.to_dict(), indent=2) + "\n"
            )

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        knowledge: bool = True,
        *,
        store: Any = None,
        **overrides: Any,
    ) -> KnowledgeTextEncoder:
        """Load a rapiddiff, Taiyi-style (BertModel) or SD 1.x (CLIPTextModel) model folder.

        A ChineseCLIPModel folder (OFA-Sys format) is passed on to :meth:`from_chinese_clip`.
        ``knowledge=False`` switches fusion off (the store is still loaded when present).
        ``store`` replaces the folder's own KnowledgeStore; ``overrides`` go to the constructor.
        """
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"model folder not found: {model_dir}")
        text_dir = model_dir / "text_encoder"
        if not (text_dir / "config.json").is_file():
            if _model_type(model_dir / "config.json") == "chinese_clip":
                return cls.from_chinese_clip(model_dir, store=store, knowledge=knowledge, **overrides)
            raise FileNotFoundError(
                f"{model_dir}: no text_encoder/config.json; expected a rapiddiff or diffusers model folder "
                "(text_encoder/ + tokenizer/) or a ChineseCLIPModel folder (config.json of model_type chinese_clip)"
            )
        text_model = load_text_model(text_dir)
        tok_dir = model_dir / "tokenizer"
        if not tok_dir.is_dir():
            raise FileNotFoundError(f"{model_dir}: no tokenizer/ folder beside text_encoder/")
        tokenizer = load_tokenizer(tok_dir)
        saved: dict[str, Any] = {}
        if (text_dir / SETTINGS_FILE).is_file():
            saved = json.loads((text_dir / SETTINGS_FILE).read_text(encoding="utf-8"))
            _check_settings(saved, text_dir / SETTINGS_FILE)
        settings = {**saved, **overrides}
        fusion = None
        kdir = model_dir / "knowledge"
        if (kdir / FUSION_CONFIG_FILE).is_file():
            fusion = load_fusion(kdir)
            if store is None:
                from rapiddiff.kg.store import KnowledgeStore

                store = KnowledgeStore.load(kdir / "store")
        encoder = cls(text_model, tokenizer, store, fusion=fusion, **settings)
        # A saved projection is loaded; one that out_dim= newly asks for starts fresh.
        if encoder.output_projection is not None and settings.get("out_dim") == saved.get("out_dim"):
            proj = text_dir / PROJECTION_FILE
            if not proj.is_file():
                raise FileNotFoundError(
                    f"{proj}: missing; {SETTINGS_FILE} says out_dim={saved.get('out_dim')}"
                )
            encoder.output_projection.load_state_dict(load_weights(proj))
        encoder.knowledge = knowledge
        return encoder

    @classmethod
    def from_chinese_clip(
        cls, path: str | Path, store: Any = None, *, knowledge: bool = True, **kwargs: Any
    ) -> KnowledgeTextEncoder:
        """The text tower and tokenizer of an OFA-Sys ``ChineseCLIPModel`` folder."""
        from transformers import ChineseCLIPModel

        path = Path(path)
        if _model_type(path / "config.json") != "chinese_clip":
            raise ValueError(
                f"{path}: not a ChineseCLIPModel folder (config.json model_type must be chinese_clip)"
            )
        with explained(path, "Chinese-CLIP folder"):  # a pickle or a truncated file: named, with the reason
            model = ChineseCLIPModel.from_pretrained(str(path))
        # Chinese-CLIP masks padding (cn_clip: attention_mask = text != pad); keep its behaviour.
        kwargs.setdefault("use_attention_mask", True)
        encoder = cls(model.text_model, load_tokenizer(path), store, **kwargs)
        encoder.knowledge = knowledge
        return encoder


def _check_settings(saved: dict[str, Any], path: Path) -> None:
    """A key the constructor does not take (a typo, or a setting from another rapiddiff version) is
    named with the valid ones, instead of surfacing as an unexpected-keyword TypeError."""
    not_settings = {"self", "text_model", "tokenizer", "store", "linker", "fusion"}
    valid = [k for k in inspect.signature(KnowledgeTextEncoder.__init__).parameters if k not in not_settings]
    unknown = [k for k in saved if k not in valid]
    if unknown:
        raise ConfigError(
            f"{path}: unknown key {unknown[0]!r}{did_you_mean(unknown[0], valid)}; "
            f"this rapiddiff reads {', '.join(sorted(valid))}"
        )


def _model_type(config_path: Path) -> str | None:
    if not config_path.is_file():
        return None
    try:
        return json.loads(config_path.read_text(encoding="utf-8")).get("model_type")
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_path}: not valid JSON ({err})") from err


def load_text_model(text_dir: Path) -> PreTrainedModel:
    """A text tower from a transformers folder, by its config's model_type."""
    from rapiddiff.utils.imports import import_module

    model_type = _model_type(text_dir / "config.json")
    name = _TEXT_MODEL_CLASSES.get(model_type or "")
    if name is None:
        raise ValueError(
            f"{text_dir}/config.json: model_type {model_type!r} is not a supported text tower; "
            f"supported: {', '.join(sorted(_TEXT_MODEL_CLASSES))}"
        )
    cls = getattr(import_module(_TEXT_MODEL_MODULES[name], defer=["transformers.models"]), name)
    if name == "CLIPTextModel":
        with explained(text_dir, "text encoder"):
            return cls.from_pretrained(str(text_dir))
    # The pooler is never used. A checkpoint that has one (Taiyi's) loads it, so transformers reports
    # no UNEXPECTED pooler keys (real mismatches are still reported), and it is dropped after.
    kwargs = {"add_pooling_layer": _has_pooler(text_dir)}
    model = _load_own_weights(cls, text_dir, kwargs) if name == "BertModel" else None
    if model is None:
        with explained(text_dir, "text encoder"):
            model = cls.from_pretrained(str(text_dir), **kwargs)
    model.pooler = None
    return model


def _has_pooler(text_dir: Path) -> bool:
    """Whether the folder's weights hold a pooler (read from the safetensors header or index only)."""
    index = text_dir / "model.safetensors.index.json"
    if index.is_file():
        keys: Iterable[str] = json.loads(index.read_text("utf-8")).get("weight_map", {})
    elif (text_dir / "model.safetensors").is_file():
        from safetensors import safe_open

        with safe_open(str(text_dir / "model.safetensors"), "pt") as handle:
            keys = list(handle.keys())
    else:
        return (
            True  # a pytorch_model.bin: BERT checkpoints (Taiyi's) ship the pooler they were pretrained with
        )
    return any("pooler" in key.split(".") for key in keys)


def _load_own_weights(cls: Any, text_dir: Path, kwargs: dict[str, Any]) -> PreTrainedModel | None:
    """``from_pretrained`` for the BERT towers rapiddiff writes: the module built from its config,
    then ``model.safetensors`` put in place in one ``load_state_dict`` (in the file's dtype, which
    is what transformers' default ``dtype="auto"`` gives when the config names it).

    Why not ``cls.from_pretrained``: transformers 5 builds its checkpoint-conversion table (~1,100
    compiled regexes, ~0.2 s of CPU) on every load, for a tower whose keys need no conversion.
    Anything else — no safetensors file, keys that are not exactly the module's (a ``bert.``
    prefix, a pooler), a dtype the config does not name — returns None: ``from_pretrained``.
    tests/models/test_fast_load.py compares the two (config, tensors, outputs).
    """
    from safetensors.torch import load_file

    file = text_dir / "model.safetensors"
    if not file.is_file():
        return None
    config = cls.config_class.from_pretrained(str(text_dir))
    state = load_file(file)
    if {v.dtype for v in state.values() if v.is_floating_point()} != {config.dtype}:
        return None
    model = cls(config, **kwargs)
    own = model.state_dict()
    if set(state) != set(own) or any(state[k].shape != v.shape for k, v in own.items()):
        return None
    model.load_state_dict(state, strict=True, assign=True)
    model.config.name_or_path = str(text_dir)  # what from_pretrained records
    return model.eval()


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """AutoTokenizer, fast where one exists (offsets are needed for entity linking)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), use_fast=True)


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, path: Path) -> None:
    """save_pretrained, plus vocab.txt for WordPiece tokenizers (slow BertTokenizer and older
    transformers read only vocab.txt; transformers 5 writes tokenizer.json alone)."""
    tokenizer.save_pretrained(str(path))
    vocab_file = path / "vocab.txt"
    if not vocab_file.exists() and type(tokenizer).__name__.startswith("BertTokenizer"):
        vocab = tokenizer.get_vocab()
        ordered = sorted(vocab.items(), key=lambda kv: kv[1])
        if [i for _, i in ordered] == list(range(len(ordered))):
            atomic_write_text(vocab_file, "".join(f"{tok}\n" for tok, _ in ordered))


def load_fusion(kdir: Path) -> KnowledgeFusion:
    cfg_path = kdir / FUSION_CONFIG_FILE
    try:
        config = FusionConfig(**json.loads(cfg_path.read_text(encoding="utf-8")))
    except (TypeError, ValueError) as err:  # ValueError: bad JSON, or a value FusionConfig refuses
        raise ValueError(f"{cfg_path}: not a valid fusion config ({err})") from err
    fusion = KnowledgeFusion(config)
    weights = kdir / FUSION_FILE
    missing, unexpected = fusion.load_state_dict(load_weights(weights), strict=False)
    if missing or unexpected:
        raise ValueError(f"{weights}: does not match {cfg_path} (missing {missing}, unexpected {unexpected})")
    return fusion
