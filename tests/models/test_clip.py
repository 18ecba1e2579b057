"""KnowledgeCLIP: parity with transformers' ChineseCLIPModel, save/load, overfitting a tiny batch."""

from __future__ import annotations

import torch

from rapiddiff.models.clip import KnowledgeCLIP
from rapiddiff.models.text_encoder import KnowledgeTextEncoder, chinese_bert_tokenizer
from tests.models.test_text_encoder import PROMPT, _bert_model, chinese_clip_dir, store  # noqa: F401 (fixtures)


def test_chinese_clip_checkpoint_matches_transformers(chinese_clip_dir, store):  # noqa: F811
    from transformers import ChineseCLIPModel

    ref = ChineseCLIPModel.from_pretrained(str(chinese_clip_dir)).eval()
    model = KnowledgeCLIP.from_pretrained(chinese_clip_dir, store=store, max_length=16).eval()
    assert model.image_size == 32
    prompts = [PROMPT, "一个柠檬"]
    pixels = torch.rand(2, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        tok = model.text_encoder.tokenizer(
            prompts, padding="max_length", max_length=16, truncation=True, return_tensors="pt"
        )
        want_t = ref.get_text_features(
            input_ids=tok["input_ids"], attention_mask=tok["attention_mask"]
        ).pooler_output
        torch.testing.assert_close(model.encode_text(prompts), torch.nn.functional.normalize(want_t, dim=-1))
        want_i = ref.get_image_features(pixel_values=model.preprocess(pixels)).pooler_output
        torch.testing.assert_close(model.encode_image(pixels), torch.nn.functional.normalize(want_i, dim=-1))
    torch.testing.assert_close(model.logit_scale.detach(), ref.logit_scale.detach())


def _tiny_resnet_clip(store) -> KnowledgeCLIP:  # noqa: F811
    text_model = _bert_model()
    text_model.config.use_attention_mask = True
    encoder = KnowledgeTextEncoder(text_model, chinese_bert_tokenizer(16), store)
    return KnowledgeCLIP.build(encoder, "resnet10", image_size=32, embed_dim=16, pooling="mean")


def test_save_and_load_resnet_clip(tmp_path, store):  # noqa: F811
    model = _tiny_resnet_clip(store).eval()
    with torch.no_grad():
        model.text_encoder.fusion.gates.fill_(0.3)
    pixels = torch.rand(2, 3, 48, 48) * 2 - 1  # any size: resized to image_size
    with torch.no_grad():
        t, i = model.encode_text([PROMPT, "一个柠檬"]), model.encode_image(pixels)
    model.save_pretrained(tmp_path / "clip")
    loaded = KnowledgeCLIP.from_pretrained(tmp_path / "clip").eval()
    assert loaded.image_size == 32 and loaded.text_encoder.use_attention_mask
    with torch.no_grad():
        torch.testing.assert_close(loaded.encode_text([PROMPT, "一个柠檬"]), t)
        torch.testing.assert_close(loaded.encode_image(pixels), i)
    assert torch.allclose(t.norm(dim=-1), torch.ones(2))


def test_contrastive_loss_falls_when_overfitting_a_tiny_batch(store):  # noqa: F811
    model = _tiny_resnet_clip(store).train()
    texts = ["红色的圆形", "黄色的方形", "一个番茄", "一个柠檬"]
    pixels = torch.rand(4, 3, 32, 32) * 2 - 1
    batch = model.text_encoder.tokenize(texts)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(30):
        loss = model.contrastive_loss(model.text_features(**batch), model.image_features(pixels))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert model.text_encoder.fusion.gates.abs().sum() > 0  # the zero gate did learn
