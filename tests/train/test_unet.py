"""rapiddiff train unet: runs from its shipped config, learns, resumes exactly, stops on NaN, exports."""

from __future__ import annotations

from pathlib import Path

from pytorch_lightning.callbacks import Callback

from rapiddiff.train import unet as unet_stage
from tests.train.helpers import tiny_unet_args, write_imagefolder


class LossLog(Callback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[trainer.global_step] = float(outputs["loss"])


def test_unet_stage_runs_from_config_and_exports_a_diffusers_folder(tmp_path: Path) -> None:
    data = write_imagefolder(tmp_path / "data")
    root = tmp_path / "run"
    unet_stage.cli_main(tiny_unet_args(data, root, max_steps=3))
    ckpts = sorted((root / "checkpoints").glob("*.ckpt"))
    assert {p.name for p in ckpts} >= {"step=0000002.ckpt", "last.ckpt"}
    assert (root / "checkpoints" / "config.yaml").is_file()
    assert list(root.rglob("samples/step=*.png"))
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(root / "model", safety_checker=None)
    assert pipe.unet.config.cross_attention_dim == 32
    assert (root / "model" / "training_config.yaml").is_file()
