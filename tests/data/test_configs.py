"""Every YAML in configs/data/ loads into its schema (a typo in a key fails here, not in a run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rapiddiff.data.emoji import EmojiConfig
from rapiddiff.data.kshapes import KShapesConfig
from rapiddiff.data.loader import ImageTextDataConfig
from rapiddiff.utils.config import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "data"
# file name → schema; every other YAML here is an ImageTextDataConfig.
SCHEMAS = {"kshapes.yaml": KShapesConfig, "emoji.yaml": EmojiConfig}


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_data_config_loads(path):
    cfg = load_config(SCHEMAS.get(path.name, ImageTextDataConfig), path)
    if isinstance(cfg, ImageTextDataConfig):
        assert cfg.source and cfg.image_size >= 8


def test_there_are_configs_and_a_typo_is_named(tmp_path):
    assert len(list(CONFIGS.glob("*.yaml"))) >= 3
    bad = tmp_path / "bad.yaml"
    bad.write_text("source: x\nimage_szie: 64\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="did you mean 'image_size'"):
        load_config(ImageTextDataConfig, bad)
