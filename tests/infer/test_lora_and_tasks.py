"""LoRA at generation time (diffusers-format files and `train finetune` LoRA folders), img2img and
inpainting through `rapiddiff generate`, and `--from-png` remaking them exactly."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from rapiddiff.cli import main
from rapiddiff.infer.pipeline import RapidDiffusionPipeline
from rapiddiff.infer.png import read_png_metadata

peft = pytest.importorskip("peft")

GEN = {"num_inference_steps": 3, "seed": 2, "output_type": "np", "progress": False, "knowledge": False}
CLI = ["--steps", "2", "--device", "cpu", "--no-progress", "--seed", "4"]


def test_diffusers_lora_gives_diffusers_images_and_unloads(tiny_folders, diffusers_lora):
    from diffusers import StableDiffusionPipeline

    ref = StableDiffusionPipeline.from_pretrained(tiny_folders["clip"], safety_checker=None)
    ref.set_progress_bar_config(disable=True)
    ref.load_lora_weights(diffusers_lora)
    ref.fuse_lora(lora_scale=0.7)
    expected = ref(
        "一个番茄", num_inference_steps=3, generator=[torch.Generator().manual_seed(2)], output_type="np"
    ).images

    pipe = RapidDiffusionPipeline.from_pretrained(tiny_folders["clip"])
    plain = pipe("一个番茄", **GEN).images
    pipe.load_lora(diffusers_lora, scale=0.7)
    out = pipe("一个番茄", **GEN)
    torch.testing.assert_close(out.images, expected, atol=1e-5, rtol=1e-4)
    assert np.abs(out.images - plain).max() > 1e-3  # the LoRA changes the image
    assert out.metadata[0]["lora"] == [{"path": str(diffusers_lora.resolve()), "scale": 0.7}]
    pipe.unload_lora()
    np.testing.assert_array_equal(pipe("一个番茄", **GEN).images, plain)


def test_finetune_lora_folder_with_a_bert_text_tower(tiny_folders, tmp_path):
    """A `train finetune` LoRA folder (U-Net adapters in diffusers format, the BERT tower's peft adapters
    beside them): --lora gives the images of the trained (unmerged, peft) model; as --model it is refused."""
    from rapiddiff.train.finetune import FineTune

    base = tiny_folders["bert"]
    module = FineTune(str(base), mode="lora", trainable=("unet", "text_encoder"))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)  # as if trained (peft starts B at zero)
    lora = module.export(tmp_path / "lora")
    assert (lora / "text_encoder_lora.safetensors").is_file()
    module.eval()
    trained = RapidDiffusionPipeline(module.unet, module.vae, module.noise_scheduler, module.text_encoder)
    expected = trained("一个番茄", **GEN).images

    pipe = RapidDiffusionPipeline.from_pretrained(base)
    pipe.load_lora(lora)
    np.testing.assert_allclose(pipe("一个番茄", **GEN).images, expected, atol=1e-5)

    code = main(["generate", "x", "--model", str(lora), "--out", str(tmp_path / "o"), *CLI])
    assert code == 2
    out = tmp_path / "gen"
    assert (
        main(["generate", "一个番茄", "--model", str(base), "--lora", f"{lora}:0.5", "--out", str(out), *CLI])
        == 0
    )
    png = next(out.glob("*.png"))
    assert read_png_metadata(png)["lora"] == [{"path": str(lora.resolve()), "scale": 0.5}]
    again = tmp_path / "again"
    assert (
        main(["generate", "--from-png", str(png), "--out", str(again), "--no-progress", "--device", "cpu"])
        == 0
    )
    np.testing.assert_array_equal(
        np.asarray(Image.open(next(again.glob("*.png")))), np.asarray(Image.open(png))
    )


def test_lora_folder_as_model_says_what_to_do(tiny_folders, tmp_path, capsys):
    from rapiddiff.models.bundle import load_model_folder

    lora = tmp_path / "lora"
    lora.mkdir()
    (lora / "rapiddiff_lora.json").write_text(json.dumps({"base": "runs/base", "scale": 1.0}))
    (lora / "pytorch_lora_weights.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"is a LoRA, not a model folder; use --model runs/base --lora"):
        load_model_folder(lora)
    assert main(["generate", "x", "--model", str(lora), "--out", str(tmp_path / "o"), *CLI]) == 2
    assert "is a LoRA, not a model folder" in capsys.readouterr().err


@pytest.mark.parametrize("task", ["img2img", "inpaint"])
def test_generate_tasks_and_from_png_remakes_them(tiny_folders, tmp_path, task):
    rng = np.random.default_rng(1)
    init = tmp_path / "init.png"
    Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(init)
    mask = tmp_path / "mask.png"
    m = np.zeros((16, 16), np.uint8)
    m[4:12, 4:12] = 255
    Image.fromarray(m, "L").save(mask)
    flags = ["--init-image", str(init), "--strength", "0.6"]
    if task == "inpaint":
        flags += ["--mask", str(mask)]
    out = tmp_path / "out"
    assert (
        main(["generate", "一个番茄", "--model", str(tiny_folders["bert"]), *flags, "--out", str(out), *CLI])
        == 0
    )
    png = next(out.glob("*.png"))
    meta = read_png_metadata(png)
    assert meta["task"] == task and meta["strength"] == 0.6 and meta["init_image"] == str(init.resolve())
    assert ("mask_sha256" in meta) == (task == "inpaint")
    again = tmp_path / "again"
    assert (
        main(["generate", "--from-png", str(png), "--out", str(again), "--no-progress", "--device", "cpu"])
        == 0
    )
    np.testing.assert_array_equal(
        np.asarray(Image.open(next(again.glob("*.png")))), np.asarray(Image.open(png))
    )
    # The init image changed since: the PNG cannot be remade from it, and says so.
    Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(init)
    with pytest.raises(ValueError, match="has changed since"):
        from rapiddiff.infer.png import generation_kwargs

        generation_kwargs(read_png_metadata(png), where=png)
    init.unlink()
    assert (
        main(["generate", "--from-png", str(png), "--out", str(again), "--no-progress", "--device", "cpu"])
        == 2
    )


def test_upscaler_file_is_recorded_and_from_png_uses_it(tiny_folders, tmp_path):
    from rapiddiff.models.upscaler import build_rrdb, save_upscaler

    up = save_upscaler(build_rrdb(num_blocks=1, num_feat=8).eval(), tmp_path / "up.safetensors")
    out = tmp_path / "out"
    model = str(tiny_folders["bert"])
    assert (
        main(
            [
                "generate",
                "一个番茄",
                "--model",
                model,
                "--upscaler",
                str(up),
                "--upscale",
                "--out",
                str(out),
                *CLI,
            ]
        )
        == 0
    )
    png = next(out.glob("*.png"))
    assert read_png_metadata(png)["upscaler"] == str(up.resolve()) and Image.open(png).size == (64, 64)
    again = tmp_path / "again"
    assert (
        main(["generate", "--from-png", str(png), "--out", str(again), "--no-progress", "--device", "cpu"])
        == 0
    )
    np.testing.assert_array_equal(
        np.asarray(Image.open(next(again.glob("*.png")))), np.asarray(Image.open(png))
    )


def test_full_finetune_export_carries_upscaler_and_sampling_defaults(tiny_folders, tmp_path):
    """A fine-tune's folder, given to generate, gives the base's size (upscaled) and steps."""
    from rapiddiff.models.bundle import load_model_folder, read_sampling, save_model_folder
    from rapiddiff.models.sampling import SamplingDefaults
    from rapiddiff.models.upscaler import build_rrdb
    from rapiddiff.train.finetune import FineTune, merge_lora

    bundle = load_model_folder(tiny_folders["bert"])
    bundle.upscaler = build_rrdb(num_blocks=1, num_feat=8).eval()
    bundle.sampling = SamplingDefaults(num_inference_steps=3, scheduler="ddim")
    base = save_model_folder(bundle, tmp_path / "base")
    exported = FineTune(str(base), mode="full").export(tmp_path / "full")
    assert (exported / "upscaler").is_dir() and read_sampling(exported) == bundle.sampling
    out = tmp_path / "gen"
    assert main(["generate", "一个番茄", "--model", str(exported), "--out", str(out), "--device", "cpu",
                 "--no-progress", "--seed", "1"]) == 0  # fmt: skip
    meta = read_png_metadata(next(out.glob("*.png")))
    assert (meta["steps"], meta["scheduler"], meta["upscale"]) == (3, "ddim", True)
    assert Image.open(next(out.glob("*.png"))).size == (64, 64)
    # merge: the base's upscaler and defaults carry over too
    module = FineTune(str(base), mode="lora")
    lora = module.export(tmp_path / "lora")
    merged = merge_lora(base, lora, tmp_path / "merged")
    assert (merged / "upscaler").is_dir() and read_sampling(merged) == bundle.sampling
    shutil.rmtree(tmp_path / "gen")
