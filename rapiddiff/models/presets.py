"""Model architectures by name, and tiny model folders in the real formats.

``sd15`` is the Stable Diffusion 1.5 architecture (what ``rapiddiff bench`` times, and what
Taiyi and every SD 1.x checkpoint use); ``kshapes`` is the size the chain trains the built-in model
at (small enough to ship, 128² images through an 8× VAE); ``tiny`` is for tests. Configs are plain dicts in
diffusers' own keys, so ``UNet2DConditionModel(**unet_config(name))`` builds the model and
``save_pretrained`` writes a config any diffusers user recognises.

:func:`write_tiny_sd_folder` writes a complete diffusers Stable Diffusion folder with random
weights: CLIP text tower (a plain SD 1.x folder) or BERT (a Taiyi-style folder, with the real
Chinese BERT vocabulary that cn-clip ships). Tests use it wherever a real checkpoint would go.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

PRESETS = ("sd15", "kshapes", "tiny")

_SD_SCHEDULER: dict[str, Any] = {
    # The scheduler config shipped with SD 1.5 (and Taiyi): scaled-linear betas, PNDM.
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "skip_prk_steps": True,
    "set_alpha_to_one": False,
    "steps_offset": 1,
    "prediction_type": "epsilon",
    "timestep_spacing": "leading",
    "trained_betas": None,
}

_UNETS: dict[str, dict[str, Any]] = {
    "sd15": {
        "sample_size": 64,
        "in_channels": 4,
        "out_channels": 4,
        "block_out_channels": [320, 640, 1280, 1280],
        "layers_per_block": 2,
        "down_block_types": ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
        "up_block_types": ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
        "cross_attention_dim": 768,
        "attention_head_dim": 8,
        "norm_num_groups": 32,
    },
    "kshapes": {
        # 128² images → 16² latents: three levels (16, 8, 4), attention at all of them. 9.6 M
        # parameters: with the text tower, VAE and upscaler the model folder is 24.8 MB of fp16 (≤ 25).
        # 128 channels at 16² (not 64) and 2 heads of 64 channels (not 8 of 16) drew attributes
        # better over 3 seeds; the wider [128, 256, 256] drew better still but is too big to ship.
        "sample_size": 16,
        "in_channels": 4,
        "out_channels": 4,
        "block_out_channels": [128, 128, 128],
        "layers_per_block": 1,
        "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
        "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
        "cross_attention_dim": 128,
        "attention_head_dim": 2,  # diffusers' legacy name: the number of heads
        "norm_num_groups": 32,
    },
    "tiny": {
        "sample_size": 8,
        "in_channels": 4,
        "out_channels": 4,
        "block_out_channels": [32, 64],
        "layers_per_block": 1,
        "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
        "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
        "cross_attention_dim": 32,
        "attention_head_dim": 8,
        "norm_num_groups": 32,
    },
}

_VAES: dict[str, dict[str, Any]] = {
    "sd15": {
        "sample_size": 512,
        "in_channels": 3,
        "out_channels": 3,
        "latent_channels": 4,
        "block_out_channels": [128, 256, 512, 512],
        "layers_per_block": 2,
        "down_block_types": ["DownEncoderBlock2D"] * 4,
        "up_block_types": ["UpDecoderBlock2D"] * 4,
        "norm_num_groups": 32,
        "scaling_factor": 0.18215,
    },
    "kshapes": {
        # Four blocks ⇒ three downsamplings ⇒ the same 8× factor as SD (~1.45 M parameters). 64
        # channels at 128² too: reconstructions read back right more often in the same time,
        # without specks.
        "sample_size": 128,
        "in_channels": 3,
        "out_channels": 3,
        "latent_channels": 4,
        "block_out_channels": [64, 64, 64, 64],
        "layers_per_block": 1,
        "down_block_types": ["DownEncoderBlock2D"] * 4,
        "up_block_types": ["UpDecoderBlock2D"] * 4,
        "norm_num_groups": 32,
        "scaling_factor": 0.18215,
    },
    "tiny": {
        # Two blocks ⇒ a 2× VAE: 16² images ↔ 8² latents keeps CPU tests fast.
        "sample_size": 16,
        "in_channels": 3,
        "out_channels": 3,
        "latent_channels": 4,
        "block_out_channels": [32, 64],
        "layers_per_block": 1,
        "down_block_types": ["DownEncoderBlock2D"] * 2,
        "up_block_types": ["UpDecoderBlock2D"] * 2,
        "norm_num_groups": 32,
        "scaling_factor": 0.18215,
    },
}

# Text towers: the transformers config kwargs for each preset (hidden = U-Net cross_attention_dim).
_CLIP_TEXT: dict[str, dict[str, Any]] = {
    "sd15": {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_attention_heads": 12,
        "num_hidden_layers": 12,
        "max_position_embeddings": 77,
        "projection_dim": 768,
        "hidden_act": "quick_gelu",
    },
    "tiny": {
        "hidden_size": 32,
        "intermediate_size": 37,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "max_position_embeddings": 77,
        "projection_dim": 32,
        "hidden_act": "quick_gelu",
    },
}
_BERT_TEXT: dict[str, dict[str, Any]] = {
    "sd15": {  # Taiyi-Stable-Diffusion-1B-Chinese-v0.1's text encoder: Chinese RoBERTa-wwm base.
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_attention_heads": 12,
        "num_hidden_layers": 12,
        "max_position_embeddings": 512,
    },
    "kshapes": {  # ~3.1 M parameters, 2.7 M of them the 21,128-token embedding table
        "hidden_size": 128,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_hidden_layers": 4,
        "max_position_embeddings": 128,
    },
    "tiny": {
        "hidden_size": 32,
        "intermediate_size": 37,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "max_position_embeddings": 128,
    },
}


def _check(name: str, table: dict[str, Any], what: str) -> None:
    if name not in table:
        raise ValueError(f"unknown {what} preset '{name}'; choose one of: {', '.join(table)}")


def unet_config(name: str = "sd15") -> dict[str, Any]:
    """``UNet2DConditionModel`` keyword arguments for a preset (a fresh copy)."""
    _check(name, _UNETS, "U-Net")
    return json.loads(json.dumps(_UNETS[name]))


def check_unet_config(config: dict[str, Any], where: str) -> None:
    """Raise ValueError unless ``config`` is ``UNet2DConditionModel`` keyword arguments: diffusers'
    ``from_config`` only warns about an unknown key and builds its default for it, so a typo (or a
    VAE's config.json) would silently train another architecture."""
    import inspect

    from diffusers import UNet2DConditionModel

    from rapiddiff.utils.config import did_you_mean

    kind = config.get("_class_name", "UNet2DConditionModel")
    if kind != "UNet2DConditionModel":
        raise ValueError(f"{where}: _class_name is {kind}; expected a UNet2DConditionModel config")
    valid = set(inspect.signature(UNet2DConditionModel.__init__).parameters) - {"self"}
    for key in config:
        if not key.startswith("_") and key not in valid:
            raise ValueError(f"{where}: {key!r} is not a UNet2DConditionModel key{did_you_mean(key, valid)}")


def read_unet_config(path: str | Path) -> dict[str, Any]:
    """A U-Net ``config.json`` file (``model.unet`` for a fresh U-Net of that architecture), checked
    by :func:`check_unet_config`; a file that is not one is a ValueError naming it."""
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a U-Net config.json ({err})") from err
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a U-Net config.json (a JSON {type(config).__name__}, not a mapping)")
    check_unet_config(config, str(path))
    return config


def vae_config(name: str = "sd15") -> dict[str, Any]:
    """``AutoencoderKL`` keyword arguments for a preset (a fresh copy)."""
    _check(name, _VAES, "VAE")
    return json.loads(json.dumps(_VAES[name]))


def scheduler_config() -> dict[str, Any]:
    """The SD 1.x noise schedule, as ``PNDMScheduler`` keyword arguments."""
    return dict(_SD_SCHEDULER)


def bert_text_config(name: str = "tiny", vocab_size: int | None = None) -> dict[str, Any]:
    """``BertConfig`` keyword arguments (vocab size of the cn-clip Chinese vocab by default)."""
    _check(name, _BERT_TEXT, "BERT text tower")
    config = dict(_BERT_TEXT[name])
    config["vocab_size"] = (
        vocab_size if vocab_size is not None else len(chinese_vocab_path().read_text("utf-8").splitlines())
    )
    return config


def clip_text_config(name: str = "tiny", vocab_size: int = 49408) -> dict[str, Any]:
    """``CLIPTextConfig`` keyword arguments."""
    _check(name, _CLIP_TEXT, "CLIP text tower")
    return {**_CLIP_TEXT[name], "vocab_size": vocab_size}


def chinese_vocab_path() -> Path:
    """The 21,128-token Chinese BERT vocabulary that Chinese-CLIP and Taiyi use (shipped by cn-clip)."""
    import cn_clip

    path = Path(cn_clip.__file__).parent / "clip" / "vocab.txt"
    if not path.is_file():
        raise FileNotFoundError(f"cn-clip is installed but its vocabulary is missing: {path}")
    return path


def _byte_level_alphabet() -> list[str]:
    """GPT-2/CLIP's byte → printable-character table (transformers 5 no longer exports it)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _write_byte_level_clip_tokenizer(folder: Path) -> int:
    """A CLIP BPE tokenizer with a byte-level vocabulary and no merges; returns its vocab size.

    The real CLIP vocabulary cannot be downloaded here; a byte-level one exercises the same
    tokenizer class and file format (vocab.json + merges.txt), and any text — Chinese
    included — tokenizes through its UTF-8 bytes.
    """
    symbols = _byte_level_alphabet()
    vocab = {tok: i for i, tok in enumerate(symbols + [s + "</w>" for s in symbols])}
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    return len(vocab)


def write_tiny_sd_folder(path: str | Path, text: Literal["clip", "bert"] = "clip", seed: int = 0) -> Path:
    """Write a tiny random-weight Stable Diffusion 1.x folder in diffusers' layout.

    ``text="clip"`` gives a plain SD folder (CLIPTextModel + CLIPTokenizer); ``text="bert"`` a
    Taiyi-style one (BertModel + BertTokenizer with the real Chinese vocabulary). Either loads
    with ``diffusers.StableDiffusionPipeline.from_pretrained(path, safety_checker=None)``.
    """
    import torch
    from diffusers import AutoencoderKL, PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    path = Path(path)
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(**unet_config("tiny"))
    vae = AutoencoderKL(**vae_config("tiny"))
    scheduler = PNDMScheduler.from_config(scheduler_config())
    tmp_tok = path / "_tokenizer_src"
    if text == "clip":
        from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

        vocab_size = _write_byte_level_clip_tokenizer(tmp_tok)
        tokenizer = CLIPTokenizer(
            str(tmp_tok / "vocab.json"), str(tmp_tok / "merges.txt"), model_max_length=77
        )
        text_encoder = CLIPTextModel(
            CLIPTextConfig(
                **clip_text_config("tiny", vocab_size),
                bos_token_id=vocab_size - 2,
                eos_token_id=vocab_size - 1,
                pad_token_id=vocab_size - 1,
            )
        )
    elif text == "bert":
        from transformers import BertConfig, BertModel, BertTokenizer

        # transformers 5 ignores vocab_file= in the constructor; from_pretrained reads vocab.txt.
        tokenizer = BertTokenizer.from_pretrained(str(chinese_vocab_path().parent), model_max_length=77)
        text_encoder = BertModel(BertConfig(**bert_text_config("tiny")), add_pooling_layer=False)
    else:
        raise ValueError(f"unknown text tower '{text}'; choose 'clip' or 'bert'")
    pipe = StableDiffusionPipeline(
        unet=unet,
        vae=vae,
        scheduler=scheduler,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(path, safe_serialization=True)
    # SD 1.5's own scheduler_config.json also says clip_sample=false (PNDM ignores it; DDIM, built
    # from the same file, would otherwise clip x0): write it as the real file has it.
    sched_file = path / "scheduler" / "scheduler_config.json"
    sched_json = json.loads(sched_file.read_text(encoding="utf-8"))
    sched_file.write_text(json.dumps({**sched_json, "clip_sample": False}, indent=2), encoding="utf-8")
    if tmp_tok.exists():
        for child in tmp_tok.iterdir():
            child.unlink()
        tmp_tok.rmdir()
    return path


def count_parameters(module: Any) -> int:
    return sum(p.numel() for p in module.parameters())
