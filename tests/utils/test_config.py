from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from rapiddiff.utils.config import ConfigError, load_config, save_config


@dataclass
class Optim:
    lr: float = 1e-3
    name: Literal["adam", "sgd"] = "adam"


@dataclass
class Cfg:
    dim: int = 32
    out: Path = Path("out")
    optim: Optim = field(default_factory=Optim)
    layers: list[int] = field(default_factory=lambda: [1])
    device: str | None = None


def test_yaml_round_trip(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("dim: 8\noptim:\n  lr: 1e-2\n  name: sgd\nlayers: [2, 3]\n", encoding="utf-8")
    cfg = load_config(Cfg, path)
    assert cfg.dim == 8 and cfg.optim.lr == 0.01 and cfg.optim.name == "sgd" and cfg.layers == [2, 3]
    save_config(cfg, tmp_path / "resolved.yaml")
    assert load_config(Cfg, tmp_path / "resolved.yaml") == cfg


def test_unknown_key_names_valid_ones_and_closest(tmp_path):
    with pytest.raises(
        ConfigError, match=r"unknown key 'dimm'.*did you mean 'dim'.*Valid keys for Cfg: device, dim"
    ):
        load_config(Cfg, {"dimm": 3})
    with pytest.raises(ConfigError, match=r"unknown key 'rate'.*Valid keys for Optim: lr, name"):
        load_config(Cfg, {"optim": {"rate": 3}})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"dim": "8"}, "expected an integer"),
        ({"dim": True}, "expected an integer"),
        ({"optim": {"name": "adamw"}}, "is not one of 'adam', 'sgd'"),
        ({"optim": {"lr": "fast"}}, "expected a number"),
        ({"layers": 3}, "expected a list"),
    ],
)
def test_wrong_types_are_named(data, message):
    with pytest.raises(ConfigError, match=message):
        load_config(Cfg, data)


def test_missing_and_non_mapping_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(Cfg, tmp_path / "nope.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(Cfg, bad)
