"""`rapiddiff train clip` from its shipped config on a tiny generated dataset (CPU), resume, configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from rapiddiff.kg.store import KnowledgeStore
from rapiddiff.train import clip as clip_train
from rapiddiff.train.data import ImageTextData
from rapiddiff.train.lightning_cli import RapidCLI

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


def test_fusion_relations_reach_the_saved_encoder(tiny_setup, tmp_path):
    """model.fusion_relations=[颜色] keeps knowledge for 番茄 only, in training and in the saved folder
    the U-Net stage loads; unset, every linked mention gets it."""
    from rapiddiff.models.text_encoder import KnowledgeTextEncoder

    kwargs = dict(text_tower="tiny", max_length=16, image_tower="resnet10", image_size=32, embed_dim=16)
    store = str(tiny_setup / "store")
    module = clip_train.CLIPTraining(**kwargs, knowledge_store=store, fusion_relations=["颜色"])
    ids = module.model.text_encoder.tokenize(["左边有一个红色的方形", "一个番茄"])["token_entity_ids"]
    assert ((ids >= 0) == (ids == 0)).all() and (ids == 0).sum() == 2  # 番茄 only
    module.export(tmp_path / "m")
    assert KnowledgeTextEncoder.from_pretrained(tmp_path / "m").fusion_relations == ["颜色"]
    every = clip_train.CLIPTraining(**kwargs, knowledge_store=store).model.text_encoder
    assert every.fusion_relations is None
    assert (every.tokenize(["左边有一个红色的方形"])["token_entity_ids"] >= 0).sum() == 4


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


def _value_store(path: Path) -> Path:
    """Objects with colours and shapes: 红色/黄色/蓝色 are the values of 颜色, 方形/三角形 of 形状."""
    names = ["番茄", "香蕉", "蓝莓", "红色", "黄色", "蓝色", "方形", "三角形"]
    facts = [(0, 0, 3), (1, 0, 4), (2, 0, 5), (0, 1, 6), (1, 1, 7), (2, 1, 6)]
    g = torch.Generator().manual_seed(0)
    vectors, relations = torch.randn(8, 8, generator=g), torch.randn(2, 8, generator=g)
    KnowledgeStore.from_arrays(names, ["颜色", "形状"], vectors, relations, facts).save(path)
    return path


@pytest.mark.parametrize("max_length", [16, 9])  # 9: the swapped captions are cut as tokenize cuts them
def test_value_swap_rows_equal_the_tokenized_swapped_captions(tmp_path, max_length):
    from rapiddiff.train.negatives import ValueSwap

    module = clip_train.CLIPTraining(
        text_tower="tiny", max_length=max_length, image_tower="resnet10", image_size=32, embed_dim=16,
        knowledge_store=str(_value_store(tmp_path / "store")),
    )  # fmt: skip
    encoder = module.model.text_encoder
    captions = ["左边有一个红色的方形", "一个番茄", "右边有一个黄色三角形，蓝色背景"]
    tokens = encoder.tokenize(captions)
    negatives = ValueSwap(encoder, ["颜色", "形状"])(tokens, 8)
    alone = ValueSwap(encoder, ["颜色", "形状"])({k: v[2:] for k, v in tokens.items()}, 8)
    assert all(torch.equal(alone[k][0], negatives[k][2]) for k in alone)  # a row's own draws
    assert negatives["neg_valid"].tolist() == [[True] * 8, [False] * 8, [True] * 8]
    assert torch.equal(negatives["neg_input_ids"][1, 0], tokens["input_ids"][1])  # nothing to swap
    values = {"颜色": ["红色", "黄色", "蓝色"], "形状": ["方形", "三角形"]}
    for row, caption in enumerate(captions):
        swaps = [
            caption.replace(old, new, 1)
            for group in values.values()
            for old in group
            if old in caption
            for new in group
            if new != old
        ]
        seen = set()
        for j in range(8):
            if not negatives["neg_valid"][row, j]:
                continue
            variant = {k: negatives[f"neg_{k}"][row, j] for k in ("input_ids", "token_entity_ids")}
            n = int(negatives["neg_attention_mask"][row, j].sum())
            matches = []
            for text in swaps:
                full = {k: v[0] for k, v in encoder.tokenize([text]).items()}
                same = all(torch.equal(variant[k][: n - 1], full[k][: n - 1]) for k in variant)
                # A row tokenize cut can only lose its tail: a shorter name then leaves the row shorter
                # than the swapped text would tokenize to (the cut words are not in the row).
                cut = bool(tokens["attention_mask"][row].all())
                if same and (n == int(full["attention_mask"].sum()) or cut):
                    assert variant["input_ids"][n - 1] == encoder.tokenizer.sep_token_id
                    assert (variant["input_ids"][n:] == encoder.tokenizer.pad_token_id).all()
                    matches.append(text)
            assert len(matches) == 1, (caption, j, matches)
            seen.add(matches[0])
        assert len(seen) > 1 or row == 1  # the variants differ: several swaps are drawn
    with pytest.raises(ValueError, match=r"hard_negative_relations: \['材质'\] not in the store's relations"):
        ValueSwap(encoder, ["材质"])


def test_hard_negatives_need_a_relation_with_two_values(tiny_setup, caplog):
    """tiny_setup's KG gives 颜色 one value (红色): nothing to swap, so the step keeps its plain
    shape and the log says why. Knowledge off (the chain's ablation, same config): no store to name
    the values, so none either, logged; ValueSwap itself refuses an encoder without a store."""
    from rapiddiff.train.negatives import ValueSwap

    kwargs = dict(text_tower="tiny", max_length=16, image_tower="resnet10", image_size=32, embed_dim=16)
    module = clip_train.CLIPTraining(
        **kwargs, knowledge_store=str(tiny_setup / "store"), hard_negative_relations=["颜色"]
    )
    assert module._swap is None and "no relation has two values" in caplog.text
    off = clip_train.CLIPTraining(
        **kwargs, knowledge_store=str(tiny_setup / "store"), knowledge=False, hard_negative_relations=["颜色"]
    )
    assert off._swap is None and "no knowledge store, so no hard negatives" in caplog.text
    with pytest.raises(ValueError, match="hard_negative_relations needs a knowledge store"):
        ValueSwap(off.model.text_encoder, ["颜色"])


def test_contrastive_loss_with_hard_negatives():
    """The negatives join the image→text candidates (a False one is left out); text→image is unchanged."""
    from rapiddiff.models.clip import KnowledgeCLIP

    g = torch.Generator().manual_seed(0)
    text, image = torch.randn(6, 4, generator=g), torch.randn(3, 4, generator=g)
    model = KnowledgeCLIP.__new__(KnowledgeCLIP)
    torch.nn.Module.__init__(model)
    model.logit_scale = torch.nn.Parameter(torch.tensor(1.0))
    plain = model.contrastive_loss(text[:3], image)
    assert torch.allclose(model.contrastive_loss(text, image, torch.zeros(3, dtype=torch.bool)), plain)
    valid = torch.tensor([True, False, True])
    logits = (
        torch.e * torch.nn.functional.normalize(text, dim=-1) @ torch.nn.functional.normalize(image, dim=-1).T
    )
    target = torch.arange(3)
    i2t = logits.T[:, [0, 1, 2, 3, 5]]  # the invalid negative (row 4) is not a candidate
    expected = (
        torch.nn.functional.cross_entropy(logits[:3], target) + torch.nn.functional.cross_entropy(i2t, target)
    ) / 2
    assert torch.allclose(model.contrastive_loss(text, image, valid), expected)
    assert model.contrastive_loss(text, image, valid) > plain  # harder: more candidates to beat


@pytest.mark.parametrize("gpu_data", [True, False])
def test_training_with_hard_negatives_feeds_them_to_the_loss(tiny_setup, monkeypatch, gpu_data):
    """model.hard_negative_relations: every training step scores each image against its caption's
    swapped variant too (the resident path draws from stored variants, the plain path swaps per
    batch); validation does not."""
    from rapiddiff.models.clip import KnowledgeCLIP

    tmp = tiny_setup
    _value_store(tmp / "store")
    seen: list[tuple[int, int, int]] = []
    loss = KnowledgeCLIP.contrastive_loss

    def recording(self, text, image, negative_valid=None):
        valid = -1 if negative_valid is None else int(negative_valid.sum())
        seen.append((len(text), len(image), valid))
        return loss(self, text, image, negative_valid)

    monkeypatch.setattr(KnowledgeCLIP, "contrastive_loss", recording)
    clip_train.cli_main(
        ["--config", str(_config(tmp, max_steps=3)), "--model.hard_negative_relations=[颜色,形状]",
         f"--model.speed.gpu_data={str(gpu_data).lower()}"]
    )  # fmt: skip
    train = [s for s in seen if s[0] == 2 * s[1]]
    assert len(train) == 3  # one a step
    assert all(valid >= 1 for _, _, valid in train)  # a batch of 4 holds attribute captions
    assert all(valid == -1 for n, m, valid in seen if n == m)  # validation: in-batch negatives only


@pytest.mark.slow
def test_hard_negatives_train_with_ddp_on_two_cpu_processes(tiny_setup):
    """Two ranks gather captions and hard negatives apart (positives stay rows 0..N-1) and the
    negatives' flags with them: the run finishes and writes its model."""
    from tests.train.helpers import launch_train_unet

    tmp = tiny_setup
    _value_store(tmp / "store")
    args = ["--config", str(_config(tmp, max_steps=2)), "--model.hard_negative_relations=[颜色,形状]",
            "--model.speed.cuda_graph=false", "--trainer.strategy=ddp", "--trainer.devices=2",
            "--trainer.logger=false", "--trainer.callbacks=null", "--trainer.val_check_interval=null",
            "--data.val=null"]  # fmt: skip
    result = launch_train_unet(tmp, args, timeout=300, stage="clip")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp / "model" / "text_encoder" / "model.safetensors").is_file()
