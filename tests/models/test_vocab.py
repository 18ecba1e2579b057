"""prune_vocabulary: identical outputs on kept text, [UNK] for the rest, a smaller saved folder."""

from __future__ import annotations

import pytest
import torch

from rapiddiff.kg.store import KnowledgeStore
from rapiddiff.models.presets import bert_text_config
from rapiddiff.models.text_encoder import KnowledgeTextEncoder, chinese_bert_tokenizer
from rapiddiff.models.vocab import prune_vocabulary

TRAIN = ["蓝色背景上有一个番茄", "画面左边是一个黄色的圆形", "一个葱头在浅蓝色背景的右边", "red apple ok"]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _store() -> KnowledgeStore:
    # 柠檬 and its alias 黎檬 appear in no caption: the store alone must keep their characters.
    names = ["番茄", "红色", "圆形", "柠檬", "黄色", "洋葱"]
    aliases = [["西红柿"], [], [], ["黎檬"], [], ["葱头"]]
    g = torch.Generator().manual_seed(1)
    triples = [(0, 0, 1), (0, 1, 2), (3, 0, 4), (3, 1, 2)]
    return KnowledgeStore.from_arrays(
        names,
        ["颜色", "形状"],
        torch.randn(6, 8, generator=g),
        torch.randn(2, 8, generator=g),
        triples,
        aliases=aliases,
    )


def _encoder(kind: str = "bert") -> KnowledgeTextEncoder:
    from transformers import BertConfig, BertModel, ChineseCLIPTextConfig, ChineseCLIPTextModel

    torch.manual_seed(0)
    if kind == "bert":
        tower = BertModel(BertConfig(**bert_text_config("tiny")), add_pooling_layer=False)
    else:
        tower = ChineseCLIPTextModel(
            ChineseCLIPTextConfig(**bert_text_config("tiny")), add_pooling_layer=False
        )
    encoder = KnowledgeTextEncoder(
        tower,
        chinese_bert_tokenizer(),
        _store(),
        fusion_layers=[0, 1],
        max_length=24,
        use_attention_mask=True,
    ).eval()
    with torch.no_grad():
        encoder.fusion.gates.fill_(1.0)  # knowledge on, so linking errors would show in the outputs
    return encoder


@pytest.fixture(scope="module")
def pruned(tmp_path_factory):
    """(kept texts, outputs before, report, pruned encoder, its reloaded copy, folder sizes)."""
    root = tmp_path_factory.mktemp("vocab")
    encoder = _encoder()
    kept_texts = [*TRAIN, "西红柿 黎檬", "柠檬 黄色 圆形"]
    batch = encoder.tokenize(kept_texts)
    with torch.no_grad():
        before = encoder(**batch)
    encoder.save_pretrained(root / "full")
    report = prune_vocabulary(encoder, TRAIN)
    encoder.save_pretrained(root / "pruned")
    reloaded = KnowledgeTextEncoder.from_pretrained(root / "pruned").eval()
    sizes = {
        name: sum(f.stat().st_size for f in (root / name).rglob("*") if f.is_file())
        for name in ("full", "pruned")
    }
    return kept_texts, batch, before, report, encoder, reloaded, sizes


def test_kept_texts_give_identical_ids_and_hidden_states_after_prune_save_reload(pruned):
    kept_texts, batch, before, _, encoder, reloaded, _ = pruned
    assert (batch["token_entity_ids"] >= 0).sum() >= 10  # entity linking is exercised
    for model in (encoder, reloaded):
        new = model.tokenize(kept_texts)
        assert torch.equal(new["attention_mask"], batch["attention_mask"])
        assert torch.equal(new["token_entity_ids"], batch["token_entity_ids"])
        old_tokens = [encoder_tokens(_full_tokenizer(), row) for row in batch["input_ids"]]
        assert [encoder_tokens(model.tokenizer, row) for row in new["input_ids"]] == old_tokens
        with torch.no_grad():
            torch.testing.assert_close(model(**new), before, rtol=0, atol=0)


def test_offsets_and_token_types_unchanged(pruned):
    kept_texts, _, _, _, _, reloaded, _ = pruned
    full = _full_tokenizer()(kept_texts, return_offsets_mapping=True, padding=True)
    new = reloaded.tokenizer(kept_texts, return_offsets_mapping=True, padding=True)
    assert new["offset_mapping"] == full["offset_mapping"]
    assert new["token_type_ids"] == full["token_type_ids"]


def test_unseen_text_maps_to_unk_and_specials_are_kept(pruned):
    _, _, _, report, encoder, reloaded, _ = pruned
    for model in (encoder, reloaded):
        tok = model.tokenizer
        assert tok.tokenize("鑫番茄Zebra") == ["[UNK]", "番", "茄", "[UNK]"]
        assert tok.tokenize("RED Apple") == ["red", "apple"]  # lower-casing kept
        assert set(SPECIALS) <= set(tok.get_vocab())
        ids = tok("番茄")["input_ids"]
        assert tok.convert_ids_to_tokens(ids) == ["[CLS]", "番", "茄", "[SEP]"]
        assert model.text_model.config.vocab_size == len(tok) == report["kept"]
        assert model.text_model.get_input_embeddings().num_embeddings == report["kept"]
        assert model.text_model.config.pad_token_id == tok.pad_token_id


def test_report_and_folder_shrink(pruned):
    _, _, _, report, _, _, sizes = pruned
    full_rows = bert_text_config("tiny")["vocab_size"]
    chars = set("".join(TRAIN).replace(" ", "")) - set("redapplok") | set("西红柿黎檬柠洋葱")
    # every distinct character + the words red/apple/ok (whatever pieces they split into) + specials
    assert len(chars) + len(SPECIALS) <= report["kept"] <= len(chars) + len(SPECIALS) + 6
    assert report["rows_before"] == full_rows and report["rows_after"] == report["kept"]
    # the tower has 21,130 rows, the tokenizer 21,128 tokens (vocab.txt repeats two lines)
    assert report["dropped"] == len(_full_tokenizer()) - report["kept"]
    assert report["bytes_saved"] == (full_rows - report["kept"]) * bert_text_config("tiny")["hidden_size"] * 4
    assert sizes["full"] - sizes["pruned"] > report["bytes_saved"]  # embedding rows + tokenizer files


def test_chinese_clip_tower_prunes_too():
    encoder = _encoder("chinese_clip")
    batch = encoder.tokenize(TRAIN)
    with torch.no_grad():
        before = encoder(**batch)
        prune_vocabulary(encoder, TRAIN)
        new = encoder.tokenize(TRAIN)
        assert torch.equal(new["token_entity_ids"], batch["token_entity_ids"])
        torch.testing.assert_close(encoder(**new), before, rtol=0, atol=0)


def test_non_wordpiece_tokenizer_is_refused(tmp_path):
    from rapiddiff.models.presets import write_tiny_sd_folder

    encoder = KnowledgeTextEncoder.from_pretrained(write_tiny_sd_folder(tmp_path / "sd", text="clip"))
    with pytest.raises(TypeError, match="WordPiece"):
        prune_vocabulary(encoder, TRAIN)


def _full_tokenizer():
    return chinese_bert_tokenizer()


def encoder_tokens(tokenizer, ids: torch.Tensor) -> list[str]:
    return tokenizer.convert_ids_to_tokens(ids.tolist())
