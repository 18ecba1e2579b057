"""Value contrast: attribute words sharpened against the other values of their KG relation."""

from __future__ import annotations

import pytest
import torch

from rapiddiff.kg.store import KnowledgeStore
from rapiddiff.models import contrast
from rapiddiff.models.contrast import ValueContrast, check_strength
from rapiddiff.models.presets import bert_text_config
from rapiddiff.models.text_encoder import KnowledgeTextEncoder, chinese_bert_tokenizer

NAMES = ["番茄", "红色", "圆形", "柠檬", "黄色", "三角形", "海", "蓝色", "方形", "绿色"]


def _store() -> KnowledgeStore:
    g = torch.Generator().manual_seed(1)
    # 颜色 values: 红色, 黄色, 蓝色 (绿色 is an entity but no fact's tail); 形状: 圆形, 三角形, 方形
    triples = [(0, 0, 1), (0, 1, 2), (3, 0, 4), (3, 1, 5), (6, 0, 7), (6, 1, 8)]
    return KnowledgeStore.from_arrays(
        NAMES,
        ["颜色", "形状"],
        torch.randn(len(NAMES), 8, generator=g),
        torch.randn(2, 8, generator=g),
        triples,
    )


@pytest.fixture(scope="module")
def encoder(tmp_path_factory) -> KnowledgeTextEncoder:
    from transformers import BertConfig, BertModel

    root = tmp_path_factory.mktemp("contrast")
    torch.manual_seed(0)
    BertModel(BertConfig(**bert_text_config("tiny")), add_pooling_layer=False).save_pretrained(
        root / "text_encoder"
    )
    chinese_bert_tokenizer().save_pretrained(root / "tokenizer")
    encoder = KnowledgeTextEncoder.from_pretrained(root, store=_store(), max_length=24).eval()
    with torch.no_grad():
        encoder.fusion.gates.fill_(0.5)  # the variants' own vectors matter too
    return encoder


@torch.no_grad()
def test_contrast_is_the_formula_over_same_length_values(encoder):
    """s + S·Σ_mentions (s − mean of the other values' states); 三角形 (3 tokens) is left out of
    圆形's (2 tokens) alternatives, 绿色 (no 颜色 fact names it) is no value at all."""
    prompt = "一个红色的圆形"
    s = encoder.encode([prompt])
    colour = encoder.encode(["一个黄色的圆形", "一个蓝色的圆形"]).mean(0)
    shape = encoder.encode(["一个红色的方形"])[0]
    expected = s[0] + 0.3 * ((s[0] - colour) + (s[0] - shape))
    got = encoder.contrast([prompt], s, 0.3)
    torch.testing.assert_close(got[0], expected, rtol=1e-5, atol=1e-5)
    assert encoder._contrast[1].relations == ["颜色", "形状"]  # default: what expansion spells


@torch.no_grad()
def test_rows_without_a_contrasted_mention_and_off_switches_are_unchanged(encoder):
    prompts = ["一个绿色的东西", "画一只猫，不是红色的", "", "一个红色的圆形"]
    s = encoder.encode(prompts)
    out = encoder.contrast(prompts, s, 0.5)
    assert torch.equal(out[:3], s[:3])  # no value, a negated one, the empty negative prompt
    assert not torch.allclose(out[3], s[3])
    assert torch.equal(encoder.contrast(prompts, s, 0.0), s)
    with encoder.knowledge_as("off"):  # knowledge off is the base encoder exactly: no contrast either
        assert torch.equal(encoder.contrast(prompts, s, 0.5), s)


@torch.no_grad()
def test_text_mode_contrasts_the_spelled_facts(encoder):
    """Mode "text": 番茄 is read as "红色的圆形，番茄", and the spelled 红色 and 圆形 are sharpened."""
    with encoder.knowledge_as("text"):
        s = encoder.encode(["一个番茄"])
        assert encoder.readable(["一个番茄"]) == ["一个红色的圆形，番茄"]
        assert [len(v) for v in encoder._contrast_for().variants("一个红色的圆形，番茄")] == [2, 2]
        assert not torch.allclose(encoder.contrast(["一个番茄"], s, 0.5), s)


def test_relations_checked_and_large_value_sets_skipped(encoder, monkeypatch, caplog):
    with pytest.raises(ValueError, match=r"contrast relations \['材质'\] are not relations of the store"):
        ValueContrast(encoder, ["材质"])
    monkeypatch.setattr(contrast, "MAX_VALUES", 2)
    with caplog.at_level("INFO", logger="rapiddiff.models.contrast"):
        assert ValueContrast(encoder).alternatives == {}
    assert "颜色 has 3 values (> 2), not contrasted" in caplog.text


@pytest.mark.parametrize("bad", [-0.1, 2.5, True, "0.2", float("nan")])
def test_strength_checked(bad):
    with pytest.raises(ValueError, match=r"--value-contrast must be a number in \[0, 2\]"):
        check_strength(bad, "--value-contrast")
    assert check_strength(1) == 1.0
