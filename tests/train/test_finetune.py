"""rapiddiff train finetune: LoRA (diffusers-loadable, mergeable) and full fine-tuning of model folders."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rapiddiff.models.presets import write_tiny_sd_folder
from rapiddiff.train import finetune
from rapiddiff.train.unet_samples import base_upscaler
from tests.train.helpers import REPO, trainer_args, write_imagefolder


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_imagefolder(tmp_path_factory.mktemp("ft") / "data")


def finetune_args(config: str, base: Path, data: Path, root: Path, *extra: str) -> list[str]:
    return [
        f"--config={REPO / config}",
        *trainer_args(root, max_steps=2),
        "--trainer.precision=32-true",
        f"--model.pretrained={base}",
        "--model.sampling.prompts=[番茄]",
        "--model.sampling.seeds=[0]",
        "--model.sampling.num_inference_steps=2",
        "--model.speed.gradient_checkpointing=false",
        "--model.optim.warmup_steps=0",
        "--model.optim.lr=1e-2",  # large enough that 2 steps move the weights visibly
        f"--data.train={data}",
        "--data.image_size=16",
        "--data.batch_size=2",
        "--data.num_workers=0",
        *extra,
    ]


def unet_output(unet: torch.nn.Module) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 8, 8, generator=generator)
    context = torch.randn(1, 5, unet.config.cross_attention_dim, generator=generator)
    with torch.no_grad():
        return unet(x, torch.tensor([500]), encoder_hidden_states=context).sample


@pytest.mark.parametrize("text", ["bert", "clip"])  # a Taiyi-style and a plain SD 1.x folder
def test_lora_weights_load_in_diffusers_and_merge_into_a_full_folder(
    data: Path, tmp_path: Path, text: str
) -> None:
    from diffusers import StableDiffusionPipeline

    base = write_tiny_sd_folder(tmp_path / "base", text=text)
    root = tmp_path / "run"
    parts = "[unet,text_encoder]" if text == "bert" else "[unet]"
    finetune.cli_main(
        finetune_args("configs/finetune/lora.yaml", base, data, root, f"--model.trainable={parts}")
    )
    lora = root / "model"
    assert (lora / "pytorch_lora_weights.safetensors").is_file()

    pipe = StableDiffusionPipeline.from_pretrained(base, safety_checker=None)
    before = unet_output(pipe.unet)
    pipe.load_lora_weights(lora)  # diffusers' own loader reads what we wrote
    assert not torch.allclose(before, unet_output(pipe.unet))
    pipe.fuse_lora()
    fused = unet_output(pipe.unet)

    merged = tmp_path / "merged"
    finetune.cli_main(["merge", f"--base={base}", f"--lora={lora}", f"--out={merged}"])
    merged_pipe = StableDiffusionPipeline.from_pretrained(merged, safety_checker=None)
    torch.testing.assert_close(unet_output(merged_pipe.unet), fused, rtol=1e-4, atol=1e-5)
    if text == "bert":
        ids = torch.tensor([[101, 2769, 102]])
        with torch.no_grad():
            base_text = StableDiffusionPipeline.from_pretrained(base, safety_checker=None).text_encoder(ids)[
                0
            ]
            merged_text = merged_pipe.text_encoder(ids)[0]
        assert not torch.allclose(base_text, merged_text)  # the text LoRA was merged too


def test_full_finetune_exports_a_model_folder(data: Path, tmp_path: Path) -> None:
    from diffusers import UNet2DConditionModel

    base = write_tiny_sd_folder(tmp_path / "base", text="bert")
    root = tmp_path / "run"
    finetune.cli_main(finetune_args("configs/finetune/full.yaml", base, data, root, "--model.ema=null"))
    tuned = UNet2DConditionModel.from_pretrained(root / "model" / "unet")
    original = UNet2DConditionModel.from_pretrained(base / "unet")
    assert not torch.allclose(unet_output(tuned), unet_output(original))


def test_lora_refuses_fused_qkv(tmp_path: Path) -> None:
    from rapiddiff.train.speed import SpeedConfig

    base = write_tiny_sd_folder(tmp_path / "base")
    with pytest.raises(ValueError, match="fuse_qkv"):
        finetune.FineTune(str(base), mode="lora", speed=SpeedConfig(fuse_qkv=True))


def test_merge_names_a_missing_lora(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="pytorch_lora_weights"):
        finetune.merge_lora(tmp_path, tmp_path, tmp_path / "out")


def test_builtin_start_carries_its_upscaler_and_defaults_into_the_export() -> None:
    """``pretrained: builtin:kshapes`` is resolved before export reads the start folder's upscaler/
    and rapiddiff.json (it once looked for a folder named "builtin" and exported without an upscaler)."""
    from rapiddiff.models.builtin import builtin_model_dir

    module = finetune.FineTune(pretrained="builtin:kshapes", mode="full", ema=None)
    assert module.hparams["pretrained"] == str(builtin_model_dir("kshapes"))
    assert base_upscaler(module) is not None
    # plain ``builtin`` is the default built-in model (or $RAPIDDIFF_MODEL), a folder stays a folder
    assert finetune._resolve_pretrained("builtin") == str(builtin_model_dir())
    assert finetune._resolve_pretrained("runs/model") == "runs/model"
