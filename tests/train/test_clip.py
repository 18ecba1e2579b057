"""`rapiddiff train clip` from its shipped config on a tiny generated dataset (CPU), resume, configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from rapiddiff.kg.store import KnowledgeStore
from rapiddiff.train import clip as clip_train
from rapiddiff.train.common import RapidCLI
from rapiddiff.train.data import ImageTextData

REPO = Path(__file__).resolve().parents[2]
COLOURS = {"红色": (215, 35, 35), "黄色": (245, 215, 35), "蓝色": (30, 90, 225), "绿色": (40, 160, 60)}


def _write_imagefolder(folder: Path) -> None:
    """Eight 32² images (a coloured square on grey) with captions, as an imagefolder."""
    from PIL import Image, ImageDraw

    folder.mkdir(parents=True)
    rows = []
    for i, (name, rgb) in enumerate([*COLOURS.items(), *COLOURS.items()]):
        img = Image.new("RGB", (32, 32), (128, 128, 128))
        x = 4 if i < 4 else 16
        ImageDraw.Draw(img).rectangle([x, 8, x + 11, 19], fill=rgb)
        img.save(folder / f"{i:03d}.png")
        side = "左边" if i < 4 else "右边"
        text = (
            f"{side}有一个{name}的方形" if i % 2 == 0 else f"{side}有一个{'番茄' if name == '红色' else name}"
        )
        rows.append({"file_name": f"{i:03d}.png", "text": text})
    (folder / "metadata.jsonl").write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), "utf-8"
    )


@pytest.fixture
def tiny_setup(tmp_path, monkeypatch):
    _write_imagefolder(tmp_path / "data")
    names = ["番茄", "红色", "黄色", "蓝色", "绿色", "方形"]
    g = torch.Generator().manual_seed(0)
    KnowledgeStore.from_arrays(
        names,
        ["颜色", "形状"],
        torch.randn(6, 8, generator=g),
        torch.randn(2, 8, generator=g),
        [(0, 0, 1), (0, 1, 5)],
    ).save(tmp_path / "store")
    monkeypatch.chdir(tmp_path)  # the config's relative runs/ paths land here
    return tmp_path


def _config(tmp: Path, max_steps: int) -> Path:
    cfg = yaml.safe_load((REPO / "configs/clip/kshapes.yaml").read_text("utf-8"))
    cfg["trainer"].update(
        accelerator="cpu", precision="32-true", max_steps=max_steps, val_check_interval=2, log_every_n_steps=1
    )
    cfg["checkpoint"]["every_n_train_steps"] = 2
    cfg["output"] = str(tmp / "model")
    cfg["model"].update(
        text_tower="tiny",
        max_length=16,
        image_tower="resnet10",
        image_size=32,
        embed_dim=16,
        knowledge_store=str(tmp / "store"),
        warmup_steps=1,
    )
    cfg["data"].update(train=str(tmp / "data"), val=str(tmp / "data"), batch_size=4, num_workers=0)
    path = tmp / "clip.yaml"
    path.write_text(yaml.safe_dump(cfg, allow_unicode=True), "utf-8")
    return path


def test_train_clip_from_shipped_config_writes_a_loadable_model_and_resumes(tiny_setup):
    from rapiddiff.models.clip import KnowledgeCLIP

    tmp = tiny_setup
    clip_train.cli_main(["--config", str(_config(tmp, max_steps=4))])
    model = KnowledgeCLIP.from_pretrained(tmp / "model")
    assert model.text_encoder.has_knowledge and model.image_size == 32
    assert float(model.text_encoder.fusion.gates.detach().abs().sum()) > 0  # fusion trained
    assert (tmp / "runs/clip/kshapes/checkpoints/config.yaml").is_file(), (
        "resolved config not beside checkpoints"
    )
    metrics = next(tmp.glob("runs/clip/kshapes/csv/version_0/metrics.csv")).read_text()
    assert "train/loss" in metrics and "val/loss" in metrics
    last = tmp / "runs/clip/kshapes/checkpoints/last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 4
    # exact resume: continue from the checkpoint to step 6
    clip_train.cli_main(["--config", str(_config(tmp, max_steps=6)), "--ckpt_path", "last"])
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 6


def test_entity_tokens_are_hidden_whole_mentions_at_a_time(tiny_setup):
    module = clip_train.CLIPTraining(
        text_tower="tiny", max_length=16, image_tower="resnet10", image_size=32, embed_dim=16,
        knowledge_store=str(tiny_setup / "store"), entity_token_dropout=1.0,
    )  # fmt: skip
    encoder = module.model.text_encoder
    assert not encoder.mask_entity_mentions  # names stay visible at inference unless asked
    batch = encoder.tokenize(["左边有一个红色的方形", "一个番茄"])
    hidden = module.hide_entity_tokens(batch["input_ids"], batch["token_entity_ids"])
    linked = batch["token_entity_ids"] >= 0
    assert linked.sum() == 6  # 红色, 方形, 番茄
    assert (hidden[linked] != batch["input_ids"][linked]).all()
    assert torch.equal(hidden[~linked], batch["input_ids"][~linked])
    half = clip_train.CLIPTraining(
        text_tower="tiny", max_length=16, image_tower="resnet10", image_size=32, embed_dim=16,
        knowledge_store=str(tiny_setup / "store"), entity_token_dropout=0.5, mask_entity_mentions=True,
    )  # fmt: skip
    assert half.model.text_encoder.mask_entity_mentions  # the option reaches the saved encoder
    module.hparams.entity_token_dropout = 0.0
    assert torch.equal(
        module.hide_entity_tokens(batch["input_ids"], batch["token_entity_ids"]), batch["input_ids"]
    )


def test_entity_token_dropout_relations_hides_described_entities_and_keeps_attribute_words(tiny_setup):
    kwargs = dict(text_tower="tiny", max_length=16, image_tower="resnet10", image_size=32, embed_dim=16)
    store = str(tiny_setup / "store")
    module = clip_train.CLIPTraining(
        **kwargs, knowledge_store=store, entity_token_dropout=1.0, entity_token_dropout_relations=["颜色"]
    )
    batch = module.model.text_encoder.tokenize(["左边有一个红色的方形", "一个番茄"])
    ids, tokens = batch["token_entity_ids"], batch["input_ids"]
    hidden = module.hide_entity_tokens(tokens, ids)
    described = ids == 0  # 番茄 heads (番茄, 颜色, 红色); 红色 and 方形 head nothing
    assert described.sum() == 2 and ((ids >= 0) & ~described).sum() == 4
    assert (hidden[described] != tokens[described]).all()
    assert torch.equal(hidden[~described], tokens[~described])  # attribute words stay readable
    assert torch.equal(
        module.hide_entity_tokens(tokens, ids, fixed_shapes=True)[~described], tokens[~described]
    )
    # mask_entity_mentions then masks at inference exactly what training hid: 番茄, not 红色
    masking = clip_train.CLIPTraining(
        **kwargs, knowledge_store=store, mask_entity_mentions=True, entity_token_dropout_relations=["颜色"]
    ).model.text_encoder
    assert masking.mask_relations == ["颜色"]
    masked = masking.tokenize(["左边有一个红色的方形", "一个番茄"])["input_ids"]
    assert torch.equal(masked[~described], tokens[~described])
    assert (masked[described] == masking.tokenizer.mask_token_id).all()
    with pytest.raises(
        ValueError,
        match=r"entity_token_dropout_relations: \['材质'\] not in the store's relations \(颜色, 形状\)",
    ):
        clip_train.CLIPTraining(**kwargs, knowledge_store=store, entity_token_dropout_relations=["材质"])
    assert clip_train.CLIPTraining(**kwargs, entity_token_dropout_relations=["颜色"])._hideable is None


def test_knowledge_item_options_reach_the_saved_fusion_config(tiny_setup, tmp_path):
    """model.knowledge_entity_item=false and knowledge_relation_items=tail are architecture, not
    training tricks: the saved folder's fusion pools the same items when loaded again."""
    from rapiddiff.models.text_encoder import load_fusion

    kwargs = dict(text_tower="tiny", max_length=16, image_tower="resnet10", image_size=32, embed_dim=16)
    store = str(tiny_setup / "store")
    assert clip_train.CLIPTraining(
        **kwargs, knowledge_store=store
    ).model.text_encoder.fusion.config.entity_item
    module = clip_train.CLIPTraining(
        **kwargs,
        knowledge_store=store,
        knowledge_entity_item=False,
        knowledge_relation_items="tail",
        knowledge_relation_weights=True,
    )
    assert module.model.text_encoder.fusion.entity_tails.shape[0] > 0
    module.model.text_encoder.save_pretrained(tmp_path / "model")
    loaded = load_fusion(tmp_path / "model" / "knowledge").config
    assert loaded.entity_item is False and loaded.relation_items == "tail"
    assert loaded.relation_weights == len(KnowledgeStore.load(store).relation_names)
    # a checkpoint's fusion keeps what it was trained with, whatever the option's default says
    module.model.save_pretrained(tmp_path / "clip")
    resumed = clip_train.CLIPTraining(**kwargs, init_from=str(tmp_path / "clip"), knowledge_store=store)
    assert resumed.model.text_encoder.fusion.config.entity_item is False
    assert resumed.model.text_encoder.fusion.config.relation_items == "tail"
    assert resumed.model.text_encoder.fusion.config.relation_weights == loaded.relation_weights
    assert torch.equal(
        resumed.model.text_encoder.fusion.entity_tails, module.model.text_encoder.fusion.entity_tails
    )


class _ParseOnly(RapidCLI):
    def instantiate_classes(self) -> None:  # parse and type-check the YAML, build nothing
        pass


@pytest.mark.parametrize("path", sorted((REPO / "configs/clip").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_clip_config_parses(path):
    cli = _ParseOnly(
        clip_train.CLIPTraining, ImageTextData, args=["--config", str(path)], run=False,
        auto_configure_optimizers=False,
    )  # fmt: skip
    assert cli.config.model.lr > 0 and cli.config.data.train


def test_freeze_options_leave_only_the_chosen_parts_trainable(tiny_setup):
    kwargs = dict(text_tower="tiny", max_length=16, image_tower="resnet10", image_size=32, embed_dim=16)
    store = str(tiny_setup / "store")
    module = clip_train.CLIPTraining(**kwargs, knowledge_store=store, freeze="all_but_fusion")
    fusion = {id(p) for p in module.model.text_encoder.fusion.parameters()}
    assert {id(p) for p in module.parameters() if p.requires_grad} == fusion
    module = clip_train.CLIPTraining(**kwargs, knowledge_store=store, freeze="image").train()
    assert not module.model.image_tower.training and module.model.text_encoder.training
    assert not any(p.requires_grad for p in module.model.image_tower.parameters())
    with pytest.raises(ValueError, match="needs a knowledge_store"):
        clip_train.CLIPTraining(**kwargs, freeze="all_but_fusion")


def test_image_size_comes_from_the_checkpoint_and_a_different_one_is_named(tmp_path):
    from tests.train.test_shipped_configs import tiny_chinese_clip

    folder = tiny_chinese_clip(tmp_path / "cnclip")
    assert clip_train.CLIPTraining(init_from=str(folder)).hparams.image_size == 32
    with pytest.raises(ValueError, match=r"model.image_size=224, but .*cnclip was trained at 32²"):
        clip_train.CLIPTraining(init_from=str(folder), image_size=224)
