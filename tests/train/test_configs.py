"""Every shipped training YAML parses against its stage's LightningCLI (nothing is built or run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rapiddiff.train import finetune, unet, upscaler, vae
from rapiddiff.train.data import ImageTextData, PairedImageData
from rapiddiff.train.lightning_cli import RapidCLI
from tests.train.helpers import REPO

STAGES = {
    "unet": (unet.LatentDiffusion, ImageTextData),
    "vae": (vae.VAETraining, ImageTextData),
    "upscaler": (upscaler.UpscalerTraining, PairedImageData),
    "finetune": (finetune.FineTune, ImageTextData),
}
CONFIGS = sorted(p for stage in STAGES for p in (REPO / "configs" / stage).glob("*.yaml"))


class ParseOnly(RapidCLI):
    def instantiate_classes(self) -> None:  # parse and type-check only
        pass


def test_every_stage_ships_configs() -> None:
    names = {str(p.relative_to(REPO / "configs")) for p in CONFIGS}
    assert names >= {
        "unet/kshapes.yaml",
        "vae/kshapes.yaml",
        "upscaler/kshapes.yaml",
        "finetune/lora.yaml",
        "finetune/full.yaml",
        "finetune/ecommerce.yaml",
        "finetune/chinese_painting.yaml",
        "finetune/food.yaml",
    }


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_config_parses(path: Path) -> None:
    model_class, data_class = STAGES[path.parent.name]
    # What a user adds on the command line for the fine-tuning presets (their model and data).
    required = ["--model.pretrained=MODEL", "--data.train=DATA"] if path.parent.name == "finetune" else []
    cli = ParseOnly(model_class, data_class, args=[f"--config={path}", *required], run=False)
    config = cli.config
    assert config.trainer.max_steps > 0
    assert config.checkpoint.every_n_train_steps > 0
    if path.parent.name == "finetune" and path.stem not in ("full",):
        prompts = config.model.sampling.prompts
        assert prompts and all(any("\u4e00" <= ch <= "\u9fff" for ch in p) for p in prompts)  # Chinese


def test_a_typo_in_a_config_key_is_an_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        (REPO / "configs/vae/kshapes.yaml").read_text(encoding="utf-8").replace("kl_weight", "kl_wieght")
    )
    with pytest.raises(SystemExit):
        ParseOnly(vae.VAETraining, ImageTextData, args=[f"--config={bad}"], run=False)


@pytest.mark.parametrize(
    ("given", "error", "hint"),
    [
        # a typo in a YAML file
        ("yaml", "Group 'model' does not accept option 'lora.rnak'", "did you mean 'model.lora.rank'?"),
        # a key from another tool's vocabulary: the group's valid keys are listed
        ("--model.optim.learning_rate=1e-4", "unrecognized arguments", "did you mean 'model.optim.lr'?"),
        # prefix matching is off: max_step is not silently taken as max_steps
        ("--trainer.max_step=5", "unrecognized arguments", "did you mean 'trainer.max_steps'?"),
    ],
)
def test_a_config_key_typo_names_the_closest_key(
    given: str, error: str, hint: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    if given == "yaml":
        typo = tmp_path / "typo.yaml"
        typo.write_text("model:\n  lora:\n    rnak: 4\n", encoding="utf-8")
        given = f"--config={typo}"
    args = [
        f"--config={REPO / 'configs/finetune/lora.yaml'}",
        "--model.pretrained=M",
        "--data.train=D",
        given,
    ]
    with pytest.raises(SystemExit):
        ParseOnly(finetune.FineTune, ImageTextData, args=args, run=False)
    err = capsys.readouterr().err
    assert error in err and hint in err
    if "optim" in hint:
        assert "Valid keys in model.optim: betas, eps, fused, lr, schedule, warmup_steps, weight_decay" in err
