"""Prune a text encoder's WordPiece vocabulary to the tokens a model was trained on.

The built-in kshapes model trains its small BERT text tower from scratch on the 21,128-token
Chinese BERT vocabulary, yet its captions, entity names and aliases use only a few hundred
characters. The word-embedding rows of every other token were never updated by training: they
are their random initialisation and carry nothing. :func:`prune_vocabulary` drops them (and
their tokenizer entries), which shrinks the shipped encoder several-fold and changes nothing for
any text made of kept tokens.

Why outputs stay identical for kept text: WordPiece picks, at each position of a word, the
longest piece in the vocabulary. Pruning only removes pieces, and every piece the full
vocabulary picked for a kept text is kept, so no longer piece can appear and the same pieces
are picked (and a word that was ``[UNK]`` stays ``[UNK]``). The rows are sliced in their old
order, so each kept token still looks up the same vector; positions, token types, the padding
mask and the character offsets used for entity linking do not depend on the vocabulary.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from rapiddiff.utils.logging import get_logger

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rapiddiff.models.text_encoder import KnowledgeTextEncoder

log = get_logger(__name__)

_BATCH = 1024  # texts per tokenizer call (the fast tokenizer batches in Rust)


def prune_vocabulary(text_encoder: KnowledgeTextEncoder, texts: Iterable[str]) -> dict[str, Any]:
    """Keep only the vocabulary that ``texts`` and the encoder's KnowledgeStore use; in place.

    Kept: every token that tokenizing ``texts`` produces, all special and added tokens
    (``[PAD] [UNK] [CLS] [SEP] [MASK]`` …) and the tokens of every entity name and alias of
    ``text_encoder.store`` (if it has one). The tokenizer is rebuilt on the reduced vocabulary
    with the same normalisation (lower-casing, Chinese-character splitting, accent stripping),
    the word-embedding rows are sliced to the kept ids in their old order, and the tower's
    ``config.vocab_size`` / ``pad_token_id`` follow, so ``save_pretrained`` / ``from_pretrained``
    round-trip the smaller model.

    Any other token now maps to ``[UNK]``. That is honest for a model trained from scratch on
    ``texts``: the rows of tokens it never saw are untrained random noise, so the model never
    knew them; ``[UNK]`` (a trained row) says so instead of feeding noise. Do NOT prune a
    pretrained encoder (e.g. Taiyi or Chinese-CLIP) this way: its other rows carry meaning.

    For every text made only of kept tokens, ``tokenize`` gives the same attention mask and
    ``token_entity_ids`` and ``forward`` the same hidden states as before (see the module doc).

    Args:
        text_encoder: a ``KnowledgeTextEncoder`` whose tokenizer is a fast WordPiece (BERT)
            tokenizer, e.g. the built-in model's.
        texts: the training captions (and any prompts that must stay exact).

    Returns:
        ``{"kept", "dropped", "rows_before", "rows_after", "bytes_saved"}`` — kept/dropped
        tokenizer entries, word-embedding rows before/after and the embedding bytes saved.
    """
    tokenizer = text_encoder.tokenizer
    backend = _wordpiece_backend(tokenizer)
    embeddings = text_encoder.text_model.get_input_embeddings()
    if not isinstance(embeddings, nn.Embedding):
        raise TypeError(
            f"text tower's input embeddings are {type(embeddings).__name__}, expected nn.Embedding"
        )
    vocab = tokenizer.get_vocab()
    id_to_token = {i: tok for tok, i in vocab.items()}
    if sorted(id_to_token) != list(range(len(id_to_token))):
        raise ValueError("tokenizer ids are not contiguous from 0; cannot prune its vocabulary")
    rows_before = int(embeddings.num_embeddings)
    if len(id_to_token) > rows_before:
        raise ValueError(
            f"tokenizer has {len(id_to_token)} tokens but the text tower only {rows_before} embedding rows"
        )

    keep = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    keep |= _token_ids(tokenizer, texts)
    store = text_encoder.store
    if store is not None:
        surfaces = list(store.entity_names) + [a for names in store.aliases for a in names]
        keep |= _token_ids(tokenizer, surfaces)
    kept_ids = sorted(keep)

    new_tokenizer = _rebuild_tokenizer(tokenizer, [id_to_token[i] for i in kept_ids], backend)
    _slice_embeddings(text_encoder.text_model, embeddings, kept_ids, tokenizer, new_tokenizer)
    text_encoder.tokenizer = new_tokenizer

    rows_after = len(kept_ids)
    row_bytes = embeddings.embedding_dim * embeddings.weight.element_size()
    report = {
        "kept": rows_after,
        "dropped": len(id_to_token) - rows_after,
        "rows_before": rows_before,
        "rows_after": rows_after,
        "bytes_saved": (rows_before - rows_after) * row_bytes,
    }
    log.info(
        "vocabulary pruned: %d of %d tokens kept, embedding rows %d → %d (%.2f MB saved)",
        rows_after,
        len(id_to_token),
        rows_before,
        rows_after,
        report["bytes_saved"] / 1e6,
    )
    return report


def _batches(items: Iterable[str], size: int) -> Iterator[list[str]]:
    it = iter(items)
    while batch := list(islice(it, size)):
        yield batch


def _token_ids(tokenizer: PreTrainedTokenizerBase, texts: Iterable[str]) -> set[int]:
    ids: set[int] = set()
    for batch in _batches(texts, _BATCH):
        for row in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            ids.update(row)
    return ids


def _wordpiece_backend(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """The fast tokenizer's backend as JSON; refuses anything but a BERT-style WordPiece one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not getattr(tokenizer, "is_fast", False) or backend is None:
        raise TypeError(f"{type(tokenizer).__name__}: a fast tokenizer is needed to prune the vocabulary")
    spec = json.loads(backend.to_str())
    if spec["model"]["type"] != "WordPiece" or (spec.get("normalizer") or {}).get("type") != "BertNormalizer":
        raise TypeError(
            f"{type(tokenizer).__name__}: only BERT WordPiece tokenizers can be pruned "
            f"(this one is {spec['model']['type']} with normaliser {(spec.get('normalizer') or {}).get('type')}); "
            "a BPE vocabulary cannot drop tokens without breaking its merges"
        )
    return spec


def _rebuild_tokenizer(
    old: PreTrainedTokenizerBase, tokens: list[str], old_spec: dict[str, Any]
) -> PreTrainedTokenizerBase:
    """The same tokenizer class and settings on ``tokens`` (in id order)."""
    norm = old_spec["normalizer"]
    with tempfile.TemporaryDirectory(prefix="rapiddiff-vocab-") as tmp:
        # As presets/text_encoder do: from_pretrained on a folder with vocab.txt works on
        # transformers 4 and 5 (5 silently ignores the constructor's vocab_file=).
        (Path(tmp) / "vocab.txt").write_text("".join(f"{t}\n" for t in tokens), encoding="utf-8")
        new = type(old).from_pretrained(
            tmp,
            do_lower_case=norm["lowercase"],
            tokenize_chinese_chars=norm["handle_chinese_chars"],
            strip_accents=norm["strip_accents"],
            unk_token=old.unk_token,
            sep_token=old.sep_token,
            pad_token=old.pad_token,
            cls_token=old.cls_token,
            mask_token=old.mask_token,
            model_max_length=old.model_max_length,
            padding_side=old.padding_side,
            truncation_side=old.truncation_side,
        )
    new_spec = json.loads(new.backend_tokenizer.to_str())
    if new.get_vocab() != {t: i for i, t in enumerate(tokens)}:
        raise RuntimeError("rebuilt tokenizer does not hold the pruned vocabulary")
    # Everything but the ids must match, or kept texts could tokenize differently.
    for part in ("normalizer", "pre_tokenizer", "decoder"):
        if new_spec.get(part) != old_spec.get(part):
            raise RuntimeError(
                f"rebuilt tokenizer's {part} differs: {new_spec.get(part)} vs {old_spec.get(part)}"
            )
    old_model = {k: v for k, v in old_spec["model"].items() if k != "vocab"}
    new_model = {k: v for k, v in new_spec["model"].items() if k != "vocab"}
    if old_model != new_model:
        raise RuntimeError(f"rebuilt tokenizer's WordPiece settings differ: {new_model} vs {old_model}")
    return new


def _slice_embeddings(
    text_model: nn.Module,
    embeddings: nn.Embedding,
    kept_ids: list[int],
    old_tok: PreTrainedTokenizerBase,
    new_tok: PreTrainedTokenizerBase,
) -> None:
    weight = embeddings.weight.detach()
    pad_id = new_tok.pad_token_id
    sliced = nn.Embedding(len(kept_ids), embeddings.embedding_dim, padding_idx=pad_id)
    sliced = sliced.to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        sliced.weight.copy_(weight[torch.as_tensor(kept_ids, device=weight.device)])
    sliced.weight.requires_grad_(embeddings.weight.requires_grad)
    text_model.set_input_embeddings(sliced)
    config = text_model.config
    config.vocab_size = len(kept_ids)
    if getattr(config, "pad_token_id", None) is not None and old_tok.pad_token_id is not None:
        # from_pretrained builds nn.Embedding(padding_idx=config.pad_token_id): it must be the new id.
        config.pad_token_id = pad_id
