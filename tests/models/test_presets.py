from __future__ import annotations

import numpy as np
import pytest
import torch

from rapiddiff.models.presets import PRESETS, scheduler_config, unet_config, vae_config, write_tiny_sd_folder


@pytest.mark.parametrize("text", ["clip", "bert"])
def test_tiny_folder_loads_and_runs_in_diffusers(tmp_path, text):
    from diffusers import StableDiffusionPipeline

    folder = write_tiny_sd_folder(tmp_path / text, text=text)
    assert (folder / "model_index.json").is_file()
    assert not (folder / "_tokenizer_src").exists()
    pipe = StableDiffusionPipeline.from_pretrained(folder, safety_checker=None)
    assert pipe.text_encoder.__class__.__name__ == ("CLIPTextModel" if text == "clip" else "BertModel")
    image = pipe(
        "蓝色背景上有一个番茄",
        num_inference_steps=2,
        height=16,
        width=16,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    ).images
    assert image.shape == (1, 16, 16, 3) and np.isfinite(image).all()


def test_presets_build_and_sd15_matches_the_published_architecture():
    from diffusers import AutoencoderKL, UNet2DConditionModel

    unet = UNet2DConditionModel(**unet_config("tiny"))
    vae = AutoencoderKL(**vae_config("tiny"))
    assert unet.config.cross_attention_dim == 32 and vae.config.latent_channels == 4
    cfg = unet_config("sd15")
    assert cfg["block_out_channels"] == [320, 640, 1280, 1280] and cfg["cross_attention_dim"] == 768
    assert scheduler_config()["beta_schedule"] == "scaled_linear"
    assert set(PRESETS) == {"sd15", "kshapes", "tiny"}


def test_unknown_preset_lists_choices():
    with pytest.raises(ValueError, match="choose one of: sd15, kshapes, tiny"):
        unet_config("sdxl")


def test_tiny_folder_scheduler_file_matches_sd15_for_ddim(tmp_path):
    from diffusers import DDIMScheduler

    folder = write_tiny_sd_folder(tmp_path / "sd", text="clip")
    ddim = DDIMScheduler.from_pretrained(folder, subfolder="scheduler")
    assert ddim.config.clip_sample is False and ddim.config.steps_offset == 1


def test_taiyi_style_folder_has_the_real_chinese_vocabulary(tmp_path):
    from transformers import AutoTokenizer

    folder = write_tiny_sd_folder(tmp_path / "bert", text="bert")
    tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer")
    assert len(tokenizer) == 21128
    assert tokenizer.unk_token_id not in tokenizer("番茄")["input_ids"]
