"""KnowledgeTextEncoder: base-encoder parity at gate zero, span-local fusion, save/load, formats."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from rapiddiff.kg.store import KnowledgeStore
from rapiddiff.models.fusion import relation_table
from rapiddiff.models.presets import bert_text_config
from rapiddiff.models.text_encoder import KnowledgeTextEncoder, chinese_bert_tokenizer

PROMPT = "蓝色背景上有一个番茄和黄色的圆形"


@pytest.fixture(scope="module")
def store() -> KnowledgeStore:
    return _store()


def _store() -> KnowledgeStore:
    names = ["番茄", "红色", "圆形", "柠檬", "黄色", "蓝色"]
    g = torch.Generator().manual_seed(1)
    triples = [(0, 0, 1), (0, 1, 2), (3, 0, 4), (3, 1, 2)]  # 番茄 颜色 红色, 番茄 形状 圆形, ...
    return KnowledgeStore.from_arrays(
        names, ["颜色", "形状"], torch.randn(6, 8, generator=g), torch.randn(2, 8, generator=g), triples
    )


def _bert_model():
    from transformers import BertConfig, BertModel

    return BertModel(BertConfig(**bert_text_config("tiny")), add_pooling_layer=False).eval()


@pytest.fixture(scope="module")
def taiyi_dir(tmp_path_factory):
    """A Taiyi-style diffusers text side: BertModel text_encoder/ + BertTokenizer tokenizer/."""
    root = tmp_path_factory.mktemp("taiyi")
    torch.manual_seed(0)
    _bert_model().save_pretrained(root / "text_encoder")
    chinese_bert_tokenizer().save_pretrained(root / "tokenizer")
    return root


@pytest.fixture(scope="module")
def chinese_clip_dir(tmp_path_factory):
    """An OFA-Sys format folder: ChineseCLIPModel.save_pretrained + its BERT tokenizer."""
    from transformers import ChineseCLIPConfig, ChineseCLIPModel

    root = tmp_path_factory.mktemp("cnclip")
    text = {**bert_text_config("tiny")}
    vision = {"hidden_size": 32, "intermediate_size": 37, "num_attention_heads": 4, "num_hidden_layers": 2}
    vision.update(image_size=32, patch_size=8)
    config = ChineseCLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    torch.manual_seed(0)
    ChineseCLIPModel(config).save_pretrained(root)
    chinese_bert_tokenizer().save_pretrained(root)
    return root


def _base_output(encoder: KnowledgeTextEncoder, batch: dict) -> torch.Tensor:
    mask = batch["attention_mask"] if encoder.use_attention_mask else None
    return encoder.text_model(input_ids=batch["input_ids"], attention_mask=mask).last_hidden_state


def _load(kind: str, taiyi_dir, chinese_clip_dir, store, **kwargs) -> KnowledgeTextEncoder:
    if kind == "bert":
        return KnowledgeTextEncoder.from_pretrained(taiyi_dir, store=store, **kwargs).eval()
    return KnowledgeTextEncoder.from_chinese_clip(chinese_clip_dir, store, **kwargs).eval()


@pytest.mark.parametrize("kind", ["bert", "chinese_clip"])
def test_gate_zero_equals_base_encoder(kind, taiyi_dir, chinese_clip_dir, store):
    encoder = _load(kind, taiyi_dir, chinese_clip_dir, store, fusion_layers=[0, 1], max_length=24)
    batch = encoder.tokenize([PROMPT, "一个柠檬"])
    assert (batch["token_entity_ids"] >= 0).sum() >= 6  # 番茄 黄色 圆形 柠檬: two tokens each
    with torch.no_grad():
        out = encoder(**batch)
        torch.testing.assert_close(out, _base_output(encoder, batch), rtol=0, atol=0)
        encoder.knowledge = False
        torch.testing.assert_close(encoder(**batch), out, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["bert", "chinese_clip"])
def test_nonzero_gate_changes_only_entity_tokens_at_first_fused_layer(
    kind, taiyi_dir, chinese_clip_dir, store
):
    from rapiddiff.models.text_encoder import encoder_layers

    encoder = _load(kind, taiyi_dir, chinese_clip_dir, store, fusion_layers=[1], max_length=24)
    with torch.no_grad():
        encoder.fusion.gates.fill_(1.0)
    seen = []
    # Registered after the fusion hook, so it sees the fused layer's input as the layer does.
    encoder_layers(encoder.text_model)[1].register_forward_pre_hook(
        lambda m, args: seen.append(args[0].clone())
    )
    batch = encoder.tokenize([PROMPT])
    with torch.no_grad():
        fused = encoder(**batch)
        encoder.knowledge = False
        plain = encoder(**batch)
    changed = (seen[0] - seen[1]).abs().amax(-1) > 0  # (B, L)
    linked = batch["token_entity_ids"] >= 0
    assert torch.equal(changed, linked)
    tokens = encoder.tokenizer.convert_ids_to_tokens(batch["input_ids"][0][linked[0]].tolist())
    assert "".join(tokens) == "蓝色番茄黄色圆形"
    assert not torch.allclose(fused, plain)


def test_tokenize_maps_entity_spans_to_tokens(taiyi_dir, store):
    encoder = KnowledgeTextEncoder.from_pretrained(taiyi_dir, store=store, max_length=24)
    batch = encoder.tokenize([PROMPT])
    ids = batch["token_entity_ids"][0]
    tokens = encoder.tokenizer.convert_ids_to_tokens(batch["input_ids"][0].tolist())
    by_entity = {}
    for tok, e in zip(tokens, ids.tolist(), strict=True):
        if e >= 0:
            by_entity.setdefault(store.entity_names[e], []).append(tok)
    assert by_entity == {
        "蓝色": ["蓝", "色"],
        "番茄": ["番", "茄"],
        "黄色": ["黄", "色"],
        "圆形": ["圆", "形"],
    }
    assert batch["input_ids"].shape == (1, 24)
    # no store, or no linker: no entity ids
    plain = KnowledgeTextEncoder.from_pretrained(taiyi_dir, max_length=24)
    assert (plain.tokenize([PROMPT])["token_entity_ids"] == -1).all()


def test_save_load_roundtrip_with_knowledge_and_projection(tmp_path, taiyi_dir, store):
    encoder = KnowledgeTextEncoder.from_pretrained(taiyi_dir, store=store, out_dim=48, max_length=20).eval()
    with torch.no_grad():
        encoder.fusion.gates.fill_(0.5)
    assert encoder.hidden_size == 48
    out = encoder.encode([PROMPT])
    assert out.shape == (1, 20, 48)
    encoder.save_pretrained(tmp_path / "m")
    assert (tmp_path / "m/knowledge/store").is_dir()
    assert (tmp_path / "m/knowledge/fusion.safetensors").is_file()
    assert (tmp_path / "m/tokenizer/vocab.txt").is_file()
    loaded = KnowledgeTextEncoder.from_pretrained(tmp_path / "m").eval()
    assert loaded.max_length == 20 and loaded.fusion_layers == [0]
    with torch.no_grad():
        torch.testing.assert_close(loaded.encode([PROMPT]), out)
        off = KnowledgeTextEncoder.from_pretrained(tmp_path / "m", knowledge=False).eval()
        assert not torch.allclose(off.encode([PROMPT]), out)


def test_long_prompt_is_truncated_with_a_warning(taiyi_dir, caplog):
    encoder = KnowledgeTextEncoder.from_pretrained(taiyi_dir, max_length=8)
    with caplog.at_level(logging.WARNING, logger="rapiddiff"):
        batch = encoder.tokenize(["一二三四五六七八九十"])  # 10 chars + [CLS] [SEP] = 12 tokens
    assert batch["input_ids"].shape == (1, 8)
    assert "4 of 12 tokens dropped" in caplog.text


def test_plain_sd_clip_folder_loads_and_links_with_fast_tokenizer(tmp_path, store):
    from rapiddiff.models.presets import write_tiny_sd_folder

    folder = write_tiny_sd_folder(tmp_path / "sd", text="clip")
    encoder = KnowledgeTextEncoder.from_pretrained(folder, store=store).eval()
    assert encoder.max_length == 77 and encoder.tokenizer.is_fast
    batch = encoder.tokenize([PROMPT])
    assert (batch["token_entity_ids"] >= 0).any()
    with torch.no_grad():
        torch.testing.assert_close(encoder(**batch), _base_output(encoder, batch), rtol=0, atol=0)


def test_bad_inputs_raise_clear_errors(tmp_path, taiyi_dir):
    with pytest.raises(FileNotFoundError, match=r"text_encoder/config\.json"):
        KnowledgeTextEncoder.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="out of range"):
        KnowledgeTextEncoder.from_pretrained(taiyi_dir, fusion_layers=[5])


def test_relation_table_keeps_distinct_relations_per_head():
    triples = torch.tensor([[0, 1, 2], [0, 0, 3], [0, 1, 4], [2, 2, 0], [0, 2, 1]])
    table = relation_table(triples, num_entities=3, max_relations=2)
    assert table.tolist() == [[0, 1], [-1, -1], [2, -1]]


def test_knowledge_item_dropout_acts_only_in_training_and_never_empties_an_entity(store):
    from rapiddiff.models.fusion import FusionConfig, KnowledgeFusion

    fusion = KnowledgeFusion(FusionConfig(kg_dim=8, hidden_size=16, max_relations=4))
    fusion.set_knowledge(store.entity_vectors, store.relation_vectors, store.triples)
    ids = torch.arange(len(store))
    reference = fusion.eval().entity_features(ids)
    fusion.item_dropout = 1.0  # every item drawn for dropping: all are kept instead
    torch.testing.assert_close(fusion.train().entity_features(ids), reference)
    fusion.item_dropout = 0.5
    torch.testing.assert_close(fusion.eval().entity_features(ids), reference)
    torch.manual_seed(3)
    dropped = fusion.train().entity_features(ids)
    assert torch.isfinite(dropped).all() and not torch.allclose(dropped, reference)


def test_mask_entity_mentions_hides_names_only_with_knowledge_and_is_saved(tmp_path, taiyi_dir, store):
    encoder = KnowledgeTextEncoder.from_pretrained(
        taiyi_dir, store=store, max_length=24, mask_entity_mentions=True
    )
    plain = encoder.tokenize([PROMPT])
    assert encoder.mask_entity_mentions
    linked = plain["token_entity_ids"][0] >= 0
    mask_id = encoder.tokenizer.mask_token_id
    assert linked.any() and (plain["input_ids"][0][linked] == mask_id).all()
    assert (plain["input_ids"][0][~linked] != mask_id).all()  # the rest of the caption is untouched
    encoder.knowledge = False  # without knowledge the name is all there is: never hidden
    assert not (encoder.tokenize([PROMPT])["input_ids"] == mask_id).any()
    encoder.knowledge = True
    encoder.save_pretrained(tmp_path / "m")
    loaded = KnowledgeTextEncoder.from_pretrained(tmp_path / "m")
    assert loaded.mask_entity_mentions
    assert torch.equal(loaded.tokenize([PROMPT])["input_ids"], plain["input_ids"])
    default = KnowledgeTextEncoder.from_pretrained(taiyi_dir, store=store, max_length=24)
    assert not (default.tokenize([PROMPT])["input_ids"] == mask_id).any()


def test_mask_relations_mask_only_the_objects_the_kg_describes(tmp_path, taiyi_dir, store):
    """mask_relations=[颜色]: 番茄 (which heads a 颜色 fact) becomes [MASK], 红色 (an entity too, but
    the tail of that fact) stays readable; saved and loaded; an unknown relation is named."""
    encoder = KnowledgeTextEncoder.from_pretrained(
        taiyi_dir, store=store, max_length=24, mask_entity_mentions=True, mask_relations=["颜色"]
    )
    batch = encoder.tokenize(["一个红色的番茄"])
    ids, tokens = batch["token_entity_ids"][0], batch["input_ids"][0]
    mask_id = encoder.tokenizer.mask_token_id
    tomato, red = ids == store.id_of("番茄"), ids == store.id_of("红色")
    assert tomato.any() and red.any()
    assert (tokens[tomato] == mask_id).all() and not (tokens[red] == mask_id).any()
    encoder.save_pretrained(tmp_path / "m")
    loaded = KnowledgeTextEncoder.from_pretrained(tmp_path / "m")
    assert loaded.mask_relations == ["颜色"]
    assert torch.equal(loaded.tokenize(["一个红色的番茄"])["input_ids"], batch["input_ids"])
    encoder.mask_relations = None  # every linked mention again
    assert (encoder.tokenize(["一个红色的番茄"])["input_ids"][0][red] == mask_id).all()
    with pytest.raises(ValueError, match=r"mask_relations: \['材质'\] not in the store's relations"):
        encoder.mask_relations = ["材质"]


def test_fusion_relations_add_knowledge_only_to_the_objects_the_kg_describes(tmp_path, taiyi_dir, store):
    """fusion_relations=[颜色]: 番茄 (head of a 颜色 fact) keeps its entity id and its knowledge, 红色
    (an entity too, the fact's tail) is read as a plain word: its states are those of knowledge off
    where nothing else in the prompt is linked; saved and loaded; an unknown relation is named."""
    encoder = KnowledgeTextEncoder.from_pretrained(taiyi_dir, store=store, max_length=24).eval()
    encoder.fusion.gates.data.fill_(1.0)  # gates start at zero: open them so knowledge shows
    everywhere = encoder.tokenize(["一个红色的番茄"])["token_entity_ids"][0]
    tomato, red = everywhere == store.id_of("番茄"), everywhere == store.id_of("红色")
    assert tomato.any() and red.any()
    encoder.fusion_relations = ["颜色"]
    ids = encoder.tokenize(["一个红色的番茄"])["token_entity_ids"][0]
    assert (ids[tomato] == store.id_of("番茄")).all() and (ids[red] == -1).all()
    with torch.no_grad():
        word_only = encoder.encode(["一个红色"])
        with encoder.knowledge_as(False):
            plain = encoder.encode(["一个红色"])
        encoder.fusion_relations = None
        fused = encoder.encode(["一个红色"])
    assert torch.allclose(word_only, plain) and not torch.allclose(fused, plain)
    encoder.fusion_relations = ["颜色"]
    encoder.save_pretrained(tmp_path / "m")
    loaded = KnowledgeTextEncoder.from_pretrained(tmp_path / "m")
    assert loaded.fusion_relations == ["颜色"]
    assert torch.equal(loaded.tokenize(["一个红色的番茄"])["token_entity_ids"][0], ids)
    with pytest.raises(ValueError, match=r"fusion_relations: \['材质'\] not in the store's relations"):
        encoder.fusion_relations = ["材质"]


def test_a_saved_mask_scope_loads_with_another_store_while_masking_is_off(tmp_path, taiyi_dir, store):
    """A folder saved with mask_relations its new store lacks still loads and encodes with masking
    off (the scope is built on first use); asked to mask, it names the setting."""
    from rapiddiff.kg.store import KnowledgeStore

    encoder = KnowledgeTextEncoder.from_pretrained(
        taiyi_dir, store=store, max_length=24, mask_relations=["颜色"]
    )
    encoder.save_pretrained(tmp_path / "m")
    other = KnowledgeStore.from_arrays(
        ["番茄", "红色"], ["color"], torch.randn(2, 8), torch.randn(1, 8), [(0, 0, 1)]
    )
    loaded = KnowledgeTextEncoder.from_pretrained(tmp_path / "m", store=other)
    assert loaded.mask_relations == ["颜色"] and not loaded.mask_entity_mentions
    loaded.tokenize(["一个红色的番茄"])
    loaded.mask_entity_mentions = True
    with pytest.raises(
        ValueError, match=r"mask_relations: \['颜色'\] not in the store's relations \(color\)"
    ):
        loaded.tokenize(["一个红色的番茄"])


def test_a_new_store_keeps_the_loaded_fusion_kind(taiyi_dir, store):
    """set_store without fusion weights (the U-Net stage's store replacement) builds a fusion of the
    kind the encoder's fusion was: tail items stay tail items."""
    from rapiddiff.models.fusion import FusionConfig, KnowledgeFusion

    encoder = KnowledgeTextEncoder.from_pretrained(taiyi_dir)
    width = encoder.text_model.config.hidden_size
    config = FusionConfig(
        kg_dim=8,
        hidden_size=width,
        max_relations=3,
        entity_item=False,
        relation_items="tail",
        relation_weights=2,
    )
    encoder.set_store(store, fusion=KnowledgeFusion(config))
    assert (encoder.relation_items, encoder.entity_item, encoder.max_relations) == ("tail", False, 3)
    encoder.set_store(store)
    assert encoder.fusion.config.relation_items == "tail" and not encoder.fusion.config.entity_item
    assert encoder.fusion.config.max_relations == 3 and torch.all(encoder.fusion.gates == 0)
    assert encoder.fusion.config.relation_weights == 2 and torch.all(encoder.fusion.item_logits == 0)


def test_a_hand_edited_fusion_config_is_refused_by_file_and_key(tmp_path, taiyi_dir, store):
    import json

    from rapiddiff.models.text_encoder import load_fusion

    KnowledgeTextEncoder.from_pretrained(taiyi_dir, store=store).save_pretrained(tmp_path / "m")
    config = tmp_path / "m" / "knowledge" / "fusion_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "relation_items": "tails"}))
    with pytest.raises(
        ValueError, match=r"fusion_config.json: not a valid fusion config .*relation_items must be"
    ):
        load_fusion(tmp_path / "m" / "knowledge")


def test_mask_entity_mentions_needs_a_mask_token(tmp_path, store):
    from rapiddiff.models.presets import write_tiny_sd_folder

    clip_folder = write_tiny_sd_folder(tmp_path / "sd", text="clip")  # CLIPTokenizer: no [MASK]
    with pytest.raises(ValueError, match="has no \\[MASK\\] token"):
        KnowledgeTextEncoder.from_pretrained(clip_folder, store=store, mask_entity_mentions=True)


def test_text_mode_equals_the_base_encoder_on_the_expanded_prompt(taiyi_dir, store):
    """knowledge_mode "text": the facts are spelled into the prompt and the tower runs as the base
    encoder on it (the fused vectors unused, even with open gates); "both": the vectors too."""
    encoder = KnowledgeTextEncoder.from_pretrained(taiyi_dir, store=store, max_length=32).eval()
    with torch.no_grad():
        encoder.fusion.gates.fill_(1.0)  # so the embed path would change the states
    expanded = "蓝色背景上有一个红色的圆形，番茄和黄色的圆形"  # 黄色/圆形 have no 颜色/形状 facts
    assert encoder.expand([PROMPT]) == [PROMPT]  # default mode "embed": prompts as given
    with torch.no_grad():
        embed_on_expanded = encoder.encode([expanded])
        with encoder.knowledge_as("text"):
            assert encoder.expand([PROMPT, "一个柠檬"]) == [expanded, "一个黄色的圆形，柠檬"]
            text_mode = encoder.encode([PROMPT])
        with encoder.knowledge_as("off"):
            base_on_expanded = encoder.encode([expanded])
            assert encoder.expand([PROMPT]) == [PROMPT]  # off: no expansion either
        with encoder.knowledge_as("both"):
            both = encoder.encode([PROMPT])
    torch.testing.assert_close(text_mode, base_on_expanded, rtol=0, atol=0)
    torch.testing.assert_close(both, embed_on_expanded, rtol=0, atol=0)
    assert not torch.allclose(both, text_mode)
    assert (encoder.knowledge, encoder.knowledge_mode) == (True, "embed")  # restored after each block


def test_knowledge_mode_is_checked_saved_and_loaded(tmp_path, taiyi_dir, store):
    encoder = KnowledgeTextEncoder.from_pretrained(taiyi_dir, store=store, max_length=24)
    with pytest.raises(ValueError, match="choose one of embed, text, both"):
        encoder.set_knowledge("vectors")
    with pytest.raises(ValueError, match=r"not relations of the KnowledgeStore \(it has: 颜色, 形状\)"):
        KnowledgeTextEncoder.from_pretrained(taiyi_dir, store=store, expansion_relations=["材质"])
    encoder.set_knowledge(False)
    encoder.set_knowledge("both")  # a mode switches knowledge on
    assert (encoder.knowledge, encoder.knowledge_mode, encoder.has_knowledge) == (True, "both", True)
    encoder.set_knowledge("text")
    assert (encoder.has_knowledge, encoder.expands_prompts) == (False, True)
    only_shape = KnowledgeTextEncoder.from_pretrained(
        taiyi_dir, store=store, max_length=24, knowledge_mode="text", expansion_relations=["形状"]
    )
    assert only_shape.expand(["一个番茄"]) == ["一个圆形，番茄"]
    only_shape.save_pretrained(tmp_path / "m")
    loaded = KnowledgeTextEncoder.from_pretrained(tmp_path / "m")
    assert (loaded.knowledge_mode, loaded.expansion_relations) == ("text", ["形状"])
    assert loaded.expand(["一个番茄"]) == ["一个圆形，番茄"]
    assert KnowledgeTextEncoder.from_pretrained(tmp_path / "m", knowledge=False).expand(["一个番茄"]) == [
        "一个番茄"
    ]
    # Without a store there is nothing to spell: every mode gives the prompt as it is.
    plain = KnowledgeTextEncoder.from_pretrained(taiyi_dir, max_length=24, knowledge_mode="text")
    assert plain.expand(["一个番茄"]) == ["一个番茄"]


def test_a_negated_mention_gets_no_knowledge(taiyi_dir, store):
    """ "画一个番茄，不是柠檬": 柠檬's tokens get no vectors and its facts are not spelled (they would draw
    a yellow object); 番茄 is linked as before."""
    encoder = KnowledgeTextEncoder.from_pretrained(taiyi_dir, store=store, max_length=32)
    prompt = "画一个番茄，不是柠檬"
    ids = encoder.tokenize([prompt, "画一个番茄，就是柠檬"])["token_entity_ids"]
    tokens = encoder.tokenizer.convert_ids_to_tokens(encoder.tokenize([prompt])["input_ids"][0])
    lemon = [i for i, t in enumerate(tokens) if t in ("柠", "檬")]
    tomato = [i for i, t in enumerate(tokens) if t in ("番", "茄")]
    assert len(lemon) == 2 and len(tomato) == 2
    assert (ids[0, lemon] == -1).all() and (ids[0, tomato] >= 0).all()
    assert (ids[1, lemon] >= 0).all()  # the same positions, not negated: linked
    with encoder.knowledge_as("text"):
        assert encoder.expand([prompt]) == ["画一个红色的圆形，番茄，不是柠檬"]


def test_simplified_text_reads_traditional_prompts_as_simplified(tmp_path, taiyi_dir, store):
    simple, traditional = "浅蓝色背景上有一个番茄，画面中间", "淺藍色背景上有一個番茄，畫面中間"
    plain = KnowledgeTextEncoder.from_pretrained(taiyi_dir, store=store, max_length=32)
    ids = plain.tokenize([simple, traditional])["input_ids"]
    assert not torch.equal(ids[0], ids[1])  # off (the default): the characters as written
    plain.simplified_text = True
    plain.save_pretrained(tmp_path / "m")
    loaded = KnowledgeTextEncoder.from_pretrained(tmp_path / "m", max_length=32)
    assert loaded.simplified_text
    batch = loaded.tokenize([simple, traditional])
    for key in ("input_ids", "attention_mask", "token_entity_ids"):
        assert torch.equal(batch[key][0], batch[key][1]), key
    assert "，" in loaded.tokenizer.decode(batch["input_ids"][0])  # punctuation stays full-width


def test_a_hand_edited_simplified_text_is_refused(taiyi_dir, store):
    with pytest.raises(
        ValueError, match=r"simplified_text must be true or false \(the rapiddiff_encoder.json key\)"
    ):
        KnowledgeTextEncoder.from_pretrained(taiyi_dir, store=store, simplified_text="false")


def test_an_unknown_saved_setting_is_named_with_the_valid_ones(tmp_path, taiyi_dir, store):
    """A typo in rapiddiff_encoder.json (or a key another rapiddiff version wrote) names the file, the
    key, the likely meant one and what this version reads — not an unexpected-keyword TypeError."""
    KnowledgeTextEncoder.from_pretrained(taiyi_dir, store=store, max_length=24).save_pretrained(
        tmp_path / "m"
    )
    settings = tmp_path / "m" / "text_encoder" / "rapiddiff_encoder.json"
    saved = json.loads(settings.read_text(encoding="utf-8"))
    saved["knowledge_mod"] = saved.pop("knowledge_mode")
    settings.write_text(json.dumps(saved), encoding="utf-8")
    with pytest.raises(
        ValueError,
        match=r"rapiddiff_encoder.json: unknown key 'knowledge_mod' \(did you mean 'knowledge_mode'\?\); this rapiddiff reads .*simplified_text",
    ):
        KnowledgeTextEncoder.from_pretrained(tmp_path / "m")
