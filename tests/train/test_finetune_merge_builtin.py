"""`train finetune merge --base builtin` takes the built-in model, as `pretrained: builtin` does."""

from __future__ import annotations

from rapiddiff.models.bundle import load_model_folder
from rapiddiff.train.finetune import cli_main


def test_merge_base_builtin_is_the_builtin_model(tiny_folders, diffusers_lora, tmp_path, monkeypatch):
    monkeypatch.setenv("RAPIDDIFF_MODEL", str(tiny_folders["clip"]))  # plain `builtin`'s override
    out = tmp_path / "merged"
    cli_main(["merge", "--base", "builtin", "--lora", str(diffusers_lora), "--out", str(out)])
    merged, base = load_model_folder(out), load_model_folder(tiny_folders["clip"])
    assert (out / "model_index.json").is_file()
    changed = [
        name
        for (name, p), q in zip(merged.unet.named_parameters(), base.unet.parameters(), strict=True)
        if not p.detach().equal(q.detach())
    ]
    assert changed  # the LoRA is folded into the built-in model's U-Net
