"""Every shipped training config runs: two optimizer steps on CPU against tiny inputs in the real
formats (a ChineseCLIPModel.save_pretrained folder, Taiyi/SD folders in diffusers' layout, an
imagefolder with metadata.jsonl, kshapes' LR/HR pairs, a KnowledgeStore).

Only sizes are overridden (tiny towers, 16² images, batch 2, CPU fp32); every other setting is the
shipped file's, so a config whose settings cannot work together fails here, not in a user's run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from rapiddiff.kg.store import KnowledgeStore
from rapiddiff.models.presets import bert_text_config, chinese_vocab_path, write_tiny_sd_folder
from tests.train.helpers import REPO, trainer_args, write_imagefolder, write_pairs

TRAIN_STAGES = ("clip", "unet", "vae", "upscaler", "finetune", "controlnet")
# Config folders that are not training runs, and the tests that load or run them.
OTHER_CONFIGS = {
    "data": "tests/data/test_configs.py",
    "kg": "tests/kg/test_transe.py",
    "kshapes": "tests/train/test_shipped_configs.py::test_chain_config_loads",
    "emoji": "tests/train/test_shipped_configs.py::test_chain_config_loads",
}


def tiny_store(path: Path) -> Path:
    names = ["番茄", "红色", "黄色", "蓝色", "绿色", "方形", "圆形", "三角形"]
    g = torch.Generator().manual_seed(0)
    KnowledgeStore.from_arrays(
        names,
        ["颜色", "形状"],
        torch.randn(len(names), 8, generator=g),
        torch.randn(2, 8, generator=g),
        [(0, 0, 1), (0, 1, 6)],
    ).save(path)
    return path


def tiny_emoji_store(path: Path) -> Path:
    """emoji-zh's shape: emoji that head 子类 / 类别 facts, their subcategories and categories as entities."""
    names = ["西红柿", "熊猫", "水果", "动物", "饮食"]
    g = torch.Generator().manual_seed(0)
    KnowledgeStore.from_arrays(
        names,
        ["子类", "类别"],
        torch.randn(len(names), 8, generator=g),
        torch.randn(2, 8, generator=g),
        [(0, 0, 2), (1, 0, 3), (0, 1, 4)],
    ).save(path)
    return path


def _clip_emoji(tmp: Path, data: Path) -> list[str]:
    args = _clip_kshapes(tmp, data)
    return [a for a in args if not a.startswith("--model.knowledge_store=")] + [
        f"--model.knowledge_store={tiny_emoji_store(tmp / 'emoji_store')}"
    ]


def tiny_chinese_clip(path: Path) -> Path:
    """An OFA-Sys format folder: ChineseCLIPModel.save_pretrained + its BERT tokenizer."""
    from transformers import BertTokenizer, ChineseCLIPConfig, ChineseCLIPModel

    vision = {"hidden_size": 32, "intermediate_size": 37, "num_attention_heads": 4, "num_hidden_layers": 2}
    config = ChineseCLIPConfig(
        text_config=bert_text_config("tiny"),
        vision_config={**vision, "image_size": 32, "patch_size": 8},
        projection_dim=16,
    )
    torch.manual_seed(0)
    ChineseCLIPModel(config).save_pretrained(path)
    BertTokenizer.from_pretrained(str(chinese_vocab_path().parent)).save_pretrained(path)
    return path


def _clip_kshapes(tmp: Path, data: Path) -> list[str]:
    return [
        "--model.text_tower=tiny",
        "--model.max_length=16",
        "--model.image_tower=resnet10",
        "--model.image_size=32",
        "--model.embed_dim=16",
        f"--model.knowledge_store={tiny_store(tmp / 'store')}",
        "--model.warmup_steps=1",
        f"--data.train={data}",
        "--data.val=null",
        "--data.batch_size=4",
        "--data.num_workers=0",
    ]


def _clip_finetune(tmp: Path, data: Path) -> list[str]:
    # Nothing about the image size is set: it comes from the checkpoint (32² here, 224² for ViT-B/16).
    return [
        f"--model.init_from={tiny_chinese_clip(tmp / 'cnclip')}",
        f"--model.knowledge_store={tiny_store(tmp / 'store')}",
        "--model.fusion_layers=[0,1]",  # the tiny BERT has 2 layers; the preset fuses at 0 and 6 of 12
        "--model.warmup_steps=1",
        f"--data.train={data}",
        "--data.val=null",
        "--data.batch_size=4",
        "--data.num_workers=0",
    ]


def _unet(tmp: Path, data: Path) -> list[str]:
    return [
        "--model.unet=tiny",
        "--model.vae=tiny",
        "--model.text_encoder=tiny",
        f"--model.knowledge={tiny_store(tmp / 'store')}",  # the preset trains the fusion too
        "--model.sampling.num_inference_steps=2",
        "--model.sampling.seeds=[0]",
        f"--data.train={data}",
        "--data.val=null",
        "--data.image_size=16",
        "--data.batch_size=2",
        "--data.num_workers=0",
    ]


def _vae(tmp: Path, data: Path) -> list[str]:
    return [
        "--model.vae=tiny",
        "--model.num_samples=2",
        f"--data.train={data}",
        "--data.val=null",
        "--data.image_size=16",
        "--data.batch_size=2",
        "--data.num_workers=0",
    ]


def _upscaler(tmp: Path, data: Path) -> list[str]:
    lr_dir, hr_dir = write_pairs(tmp / "pairs")
    return [
        "--model.network.num_feat=8",
        "--model.network.num_conv=2",
        "--model.num_samples=2",
        f"--data.train_lr={lr_dir}",
        f"--data.train_hr={hr_dir}",
        "--data.val_lr=null",
        "--data.val_hr=null",
        "--data.patch_size=4",
        "--data.batch_size=2",
        "--data.num_workers=0",
    ]


def _upscaler_emoji(tmp: Path, data: Path) -> list[str]:
    # emoji-zh's hr folders hold a subset (glyphs without a matching SVG): one lr image has no partner.
    args = _upscaler(tmp, data)
    (tmp / "pairs" / "hr" / "train" / "0003.png").unlink()
    return args


def _finetune(text: str) -> Callable[[Path, Path], list[str]]:
    def args(tmp: Path, data: Path) -> list[str]:
        return [
            f"--model.pretrained={write_tiny_sd_folder(tmp / 'base', text=text)}",
            "--model.sampling.num_inference_steps=2",
            "--model.sampling.seeds=[0]",
            f"--data.train={data}",
            "--data.image_size=16",
            "--data.batch_size=2",
            "--data.num_workers=0",
        ]

    return args


def _finetune_builtin(tmp: Path, data: Path) -> list[str]:
    # The real built-in model (builtin:kshapes), as the preset names it: only sizes change.
    return [
        "--model.sampling.num_inference_steps=2",
        "--model.sampling.seeds=[0]",
        f"--data.train={data}",
        "--data.image_size=32",
        "--data.batch_size=2",
        "--data.num_workers=0",
    ]


def _controlnet(tmp: Path, data: Path) -> list[str]:
    # A tiny rapiddiff model folder with a KnowledgeStore as the frozen base; the tiny data has no
    # mask column, so the shipped column route is checked on a copy that has one.
    import json

    from rapiddiff.models.bundle import load_model_folder, save_model_folder

    bundle = load_model_folder(write_tiny_sd_folder(tmp / "sd", text="bert"))
    bundle.text_encoder.set_store(KnowledgeStore.load(tiny_store(tmp / "store")))
    base = save_model_folder(bundle, tmp / "base")
    rows = [json.loads(line) for line in (data / "metadata.jsonl").read_text(encoding="utf-8").splitlines()]
    rows = [r | {"mask": r["file_name"]} for r in rows]  # any image file is a readable control image
    (data / "metadata.jsonl").write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), "utf-8"
    )
    return [
        f"--model.pretrained={base}",
        "--model.sampling.num_inference_steps=2",
        "--model.grid_images=1",
        f"--data.train={data}",
        "--data.val=null",
        "--data.image_size=16",
        "--data.batch_size=2",
        "--data.num_workers=0",
    ]


# config → the tiny inputs and size overrides it runs with
CASES: dict[str, Callable[[Path, Path], list[str]]] = {
    "clip/kshapes.yaml": _clip_kshapes,
    "clip/emoji.yaml": _clip_emoji,
    "clip/chinese_clip_finetune.yaml": _clip_finetune,
    "unet/kshapes.yaml": _unet,
    "unet/emoji.yaml": _unet,
    "vae/kshapes.yaml": _vae,
    "vae/emoji.yaml": _vae,
    "upscaler/kshapes.yaml": _upscaler,
    "upscaler/emoji.yaml": _upscaler_emoji,
    "finetune/lora.yaml": _finetune("clip"),  # a plain SD 1.x folder
    "finetune/full.yaml": _finetune("bert"),  # a Taiyi-style folder
    "finetune/chinese_painting.yaml": _finetune("bert"),
    "finetune/ecommerce.yaml": _finetune("bert"),
    "finetune/food.yaml": _finetune("bert"),
    "finetune/kshapes.yaml": _finetune_builtin,
    "controlnet/kshapes.yaml": _controlnet,
    "controlnet/emoji.yaml": _controlnet,
}


def test_every_shipped_config_has_a_run_test() -> None:
    shipped = {str(p.relative_to(REPO / "configs")) for p in (REPO / "configs").glob("*/*.yaml")}
    training = {name for name in shipped if name.split("/")[0] in TRAIN_STAGES}
    assert training == set(CASES), "add the new config to CASES (or drop the removed one)"
    others = {name.split("/")[0] for name in shipped - training}
    assert others <= set(OTHER_CONFIGS)


def _cli_main(stage: str) -> Callable[[list[str]], object]:
    import importlib

    return importlib.import_module(f"rapiddiff.train.{stage}").cli_main


# > 20 s on a 2-core CPU (the real built-in model at its own size); run with -m slow
SLOW = {"finetune/kshapes.yaml"}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in sorted(CASES)]
)
def test_shipped_config_trains_two_steps_on_cpu(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # relative runs/ paths in the config (loggers) land here
    data = write_imagefolder(tmp_path / "data", n=4, size=32)
    root = tmp_path / "run"
    args = [
        f"--config={REPO / 'configs' / name}",
        *CASES[name](tmp_path, data),
        *trainer_args(root, max_steps=2),
        "--trainer.val_check_interval=null",
    ]
    _cli_main(name.split("/")[0])(args)
    last = torch.load(root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert last["global_step"] == 2
    assert (root / "model").is_dir() and any((root / "model").iterdir())


def test_chain_config_loads() -> None:
    import yaml

    chain = yaml.safe_load((REPO / "configs/kshapes/chain.yaml").read_text(encoding="utf-8"))
    assert {"clip", "vae", "upscaler", "unet"} <= set(chain)
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    from emoji_chain import load_chain_config  # the emoji chain's own typed loader

    emoji = load_chain_config(REPO / "configs/emoji/chain.yaml")
    assert emoji.unet.minutes > 0 and emoji.seeds
