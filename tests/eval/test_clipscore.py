"""CLIPScore and FID-CLIP with a tiny KnowledgeCLIP saved in the real format."""

from __future__ import annotations

import json

import pytest
import torch

from rapiddiff.cli import main
from rapiddiff.eval.clipscore import clip_scores
from tests.eval.test_report import _run


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    from transformers import BertConfig, BertModel

    from rapiddiff.models.clip import KnowledgeCLIP
    from rapiddiff.models.presets import bert_text_config
    from rapiddiff.models.text_encoder import KnowledgeTextEncoder, chinese_bert_tokenizer

    torch.manual_seed(0)
    text = BertModel(BertConfig(**bert_text_config("tiny")), add_pooling_layer=False).eval()
    encoder = KnowledgeTextEncoder(text, chinese_bert_tokenizer(16), None)
    model = KnowledgeCLIP.build(encoder, "resnet10", image_size=32, embed_dim=16).eval()
    path = tmp_path_factory.mktemp("clip") / "clip"
    model.save_pretrained(path)
    return path


def test_clip_scores_follow_the_clipscore_convention(clip_dir):
    from rapiddiff.models.clip import KnowledgeCLIP

    clip = KnowledgeCLIP.from_pretrained(clip_dir).eval()
    pixels = torch.rand(6, 3, 40, 40) * 2 - 1
    texts = ["一个番茄", "一个香蕉", "蓝色的圆形", "红色", "熊猫", "西瓜"]
    with torch.no_grad():
        got = clip_scores(clip, pixels, texts)
        cos = (clip.encode_image(pixels) * clip.encode_text(texts)).sum(-1)
    torch.testing.assert_close(got, 100 * cos.clamp(min=0))
    assert (got >= 0).all() and (got <= 100).all()


def test_clipscore_and_fid_clip_commands(tmp_path, clip_dir):
    run = _run(tmp_path, "run", n_prompts=3, per_prompt=2, size=32)
    assert main(["eval", "clipscore", str(run), "--clip-model", str(clip_dir), "--device", "cpu"]) == 0
    record = json.loads((run / "metrics" / "clipscore.json").read_text())
    assert record["label"] == "CLIPScore(KnowledgeCLIP clip)" and record["details"]["pairs"] == 6
    assert 0 <= record["value"] <= 100

    other = _run(tmp_path, "other", n_prompts=3, per_prompt=2, size=40)
    code = main(
        [
            "eval",
            "fid",
            "--real",
            str(other / "images"),
            "--fake",
            str(run),
            "--extractor",
            "clip",
            "--clip-model",
            str(clip_dir),
            "--device",
            "cpu",
        ]
    )
    assert code == 0
    fid = json.loads((run / "metrics" / "fid_clip.json").read_text())
    assert fid["label"] == "FID-CLIP(rapiddiff image tower)" and fid["metric"] == "fid_clip"
    assert fid["value"] >= 0 and fid["details"]["n_real"] == 6 and fid["warnings"]
