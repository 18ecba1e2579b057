"""benchmarks/emoji_chain.py's own logic: the config's checks, the guidance choice on validation only,
and the summary's mean ± sd over seeds (no model runs here: the stages are the tested CLIs)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import emoji_chain as ec  # noqa: E402

from rapiddiff.utils.config import ConfigError  # noqa: E402


def _write_eval(run: Path, seen_top1: float, val_sub: float, val_top5: float, frechet: float) -> None:
    table = [
        {"split": "seen", "knowledge": "embed", "top1": seen_top1, "top5": 99.0, "subcategory": 99.0,
         "background": 98.0, "position": 97.0},
        {"split": "alias", "kind": "keyword", "knowledge": "off", "top1": 3.0, "top5": 9.0, "subcategory": 20.0,
         "background": 98.0, "position": None},
        {"split": "val", "knowledge": "embed", "top1": 5.0, "top5": val_top5, "subcategory": val_sub,
         "background": 98.0, "position": None},
    ]  # fmt: skip
    details = {
        "frechet": [
            {"split": "seen", "knowledge": "embed", "generated_vs_real": frechet, "style_vs_style": 40.0}
        ]
    }
    (run / "metrics").mkdir(parents=True)
    (run / "metrics" / "emoji.json").write_text(json.dumps({"table": table, "details": details}), "utf-8")


def test_config_checks_name_the_key(tmp_path: Path) -> None:
    config = tmp_path / "chain.yaml"
    config.write_text("main_arm: big\narms: {s16: {latent: 16}}\n", "utf-8")
    with pytest.raises(ConfigError, match="main_arm 'big' is not one of the arms: s16"):
        ec.load_chain_config(config)
    config.write_text("main_arm: s\narms: {s: {latent: 24}}\n", "utf-8")
    with pytest.raises(ConfigError, match=r"arms\.s\.latent: 16 or 32, got 24"):
        ec.load_chain_config(config)
    config.write_text("main_arm: s\narms: {s: {latent: 32, vae: c9}}\nvaes: {c4: {latent: 32}}\n", "utf-8")
    with pytest.raises(ConfigError, match=r"arms\.s\.vae: 'best' or one of c4, got 'c9'"):
        ec.load_chain_config(config)
    config.write_text("main_arm: s\narms: {s: {latent: 16, vae: c4}}\nvaes: {c4: {latent: 32}}\n", "utf-8")
    with pytest.raises(ConfigError, match=r"arms\.s\.vae: c4 has 32² latents, the arm 16²"):
        ec.load_chain_config(config)
    config.write_text("main_arm: s\narms: {s: {latent: 16}}\nvaes: {c4: {latent: 32}}\n", "utf-8")
    with pytest.raises(ConfigError, match=r"arms\.s\.latent: 16, but no VAE of vaes has that latent side"):
        ec.load_chain_config(config)
    shipped = ec.load_chain_config(REPO / "configs/emoji/chain.yaml")
    assert shipped.arms[shipped.main_arm].seeds == shipped.seeds  # the main arm runs every seed
    # without vaes, one per latent side the arms ask for, that side's base
    config.write_text("main_arm: a\narms: {a: {latent: 16}, b: {latent: 32}}\n", "utf-8")
    derived = ec.load_chain_config(config)
    assert {n: v.latent for n, v in derived.vaes.items()} == {"16": 16, "32": 32}
    assert derived.vaes["32"].architecture()["block_out_channels"] == [64, 64, 64]


def test_vae_best_is_chosen_on_validation_reconstructions_and_sets_the_unet_channels(tmp_path: Path) -> None:
    config = tmp_path / "chain.yaml"
    config.write_text(
        "main_arm: a\narms: {a: {latent: 32}}\n"
        "vaes: {c4: {latent: 32}, c8: {latent: 32, changes: {latent_channels: 8}}}\n",
        "utf-8",
    )
    chain = ec.EmojiChain(tmp_path / "run", ec.load_chain_config(config), [], smoke=True)
    # c4 is better on the test side, c8 on validation: validation decides
    for name, val, test in (("c4", 60.0, 90.0), ("c8", 70.0, 50.0)):
        record = {"val": {"top1": val}, "test": {"top1": test}}
        (chain.results / f"vae_judge_{name}.json").write_text(json.dumps(record), "utf-8")
        chain.vae_dir(name).mkdir(parents=True)
        channels = 8 if name == "c8" else 4
        (chain.vae_dir(name) / "config.json").write_text(json.dumps({"latent_channels": channels}), "utf-8")
    arm = chain.cfg.arms["a"]
    assert chain.arm_vae(arm) == "c8"
    unet = json.loads(Path(chain.architecture("a", arm)).read_text("utf-8"))
    assert (unet["in_channels"], unet["out_channels"], unet["sample_size"]) == (8, 8, 32)
    job = chain.unet_jobs()["unet_a_s0"]
    assert f"--model.vae={chain.vae_dir('c8')}" in job


def test_summary_is_mean_and_sd_over_seeds_and_the_seed_is_chosen_on_validation(tmp_path: Path) -> None:
    config = tmp_path / "chain.yaml"
    config.write_text(
        "seeds: [0, 1, 2]\nmain_arm: a\narms: {a: {latent: 16}}\nguidance_candidates: [3.0]\n", "utf-8"
    )
    chain = ec.EmojiChain(tmp_path / "run", ec.load_chain_config(config), [], smoke=True)
    # seed 1 is the best on the test side (seen), seed 2 on validation: validation decides
    for seed, (seen, val_sub, val_top5) in enumerate(
        [(80.0, 50.0, 60.0), (90.0, 40.0, 50.0), (85.0, 70.0, 60.0)]
    ):
        _write_eval(chain.seed_dir(seed) / "eval_a", seen, val_sub, val_top5, frechet=10.0 + seed)
    summary = ec.summarise(chain)
    seen = summary["arms"]["a"]["measures"]["seen/embed/top1"]
    assert seen["mean"] == 85.0 and seen["sd"] == 5.0 and seen["values"] == [80.0, 90.0, 85.0]
    assert summary["arms"]["a"]["measures"]["alias/keyword/off/top1"]["mean"] == 3.0
    assert summary["arms"]["a"]["measures"]["seen/embed/frechet"]["mean"] == 11.0
    assert summary["best_seed"] == 2
    text = (tmp_path / "run" / "summary.md").read_text("utf-8")
    assert "| seen, top-1 | 85.0 ± 5.0 |" in text and "best seed (main arm, on validation): 2" in text


def test_guidance_score_reads_validation_only(tmp_path: Path) -> None:
    _write_eval(tmp_path / "g", seen_top1=99.0, val_sub=30.0, val_top5=20.0, frechet=1.0)
    assert ec.val_score(tmp_path / "g") == 50.0
    assert ec.val_score(tmp_path / "missing") == float("-inf")


def test_unet_steps_are_read_off_the_log_not_the_last_checkpoint(tmp_path: Path) -> None:
    # a run of 3,600 steps checkpoints every 1,000: last.ckpt says 3,000, the log's progress 3,600
    log = tmp_path / "unet_a_s0.log"
    log.write_text("cmd\n\nstep 50/3600  loss 0.2\nstep 3550/3600  loss 0.04\nstep 3600/3600  loss 0.03\n"
                   "step 3600/3600 ━━━━ 166/166 (the progress bar)\n", "utf-8")  # fmt: skip
    assert ec._last_step(log) == 3600
    assert ec._last_step(tmp_path / "missing.log") is None
