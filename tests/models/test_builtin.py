"""Built-in models by name (rapiddiff.models.builtin), on fake assets folders made in the test:
the default and its fallback, ``builtin:NAME``, the error for an unknown name, the listing."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import pytest

from rapiddiff.models import builtin

ROOT = Path(__file__).resolve().parents[2]


def fake_builtin(root: Path, name: str, about: dict | None = None, licensed: bool = False) -> Path:
    """A folder that counts as a built-in model: what builtin reads of one, no weights."""
    folder = root / name
    (folder / "knowledge" / "store").mkdir(parents=True)
    (folder / "model_index.json").write_text("{}", encoding="utf-8")
    (folder / "rapiddiff.json").write_text(json.dumps({"about": about} if about else {}), encoding="utf-8")
    (folder / "knowledge" / "store" / "entities.tsv").write_text(
        "id\tname\taliases\n0\t番茄\t\n1\t香蕉\t\n", "utf-8"
    )
    if licensed:
        (folder / "ATTRIBUTION.md").write_text("# Attribution\n", encoding="utf-8")
        (folder / "LICENSES").mkdir()
        (folder / "LICENSES" / "x.LICENSE").write_text("MIT\n", encoding="utf-8")
    return folder


@pytest.fixture
def assets(tmp_path, monkeypatch):
    """An empty assets folder in place of the package's; $RAPIDDIFF_MODEL unset."""
    root = tmp_path / "assets"
    root.mkdir()
    monkeypatch.setattr(builtin, "assets_root", lambda: root)
    monkeypatch.delenv("RAPIDDIFF_MODEL", raising=False)
    return root


def test_the_default_falls_back_to_the_first_builtin_while_its_folder_is_absent(assets):
    assert builtin.DEFAULT_BUILTIN == "emoji"
    fake_builtin(assets, "kshapes")
    (assets / "notes").mkdir()  # a folder without model_index.json is no model
    assert builtin.builtin_names() == ["kshapes"]
    assert builtin.default_builtin() == "kshapes"
    assert builtin.resolve_model(None) == builtin.resolve_model("builtin") == assets / "kshapes"


def test_the_default_is_emoji_once_its_folder_is_there(assets):
    fake_builtin(assets, "kshapes")
    fake_builtin(assets, "emoji")
    assert builtin.default_builtin() == "emoji"
    assert builtin.resolve_model("builtin") == assets / "emoji"
    assert builtin.resolve_model("builtin:kshapes") == assets / "kshapes"  # the old one, by name


def test_an_unknown_name_lists_the_valid_ones(assets):
    fake_builtin(assets, "kshapes")
    fake_builtin(assets, "emoji")
    with pytest.raises(ValueError) as err:
        builtin.resolve_model("builtin:kshape")
    message = str(err.value)
    assert "did you mean 'builtin:kshapes'" in message
    assert "builtin:emoji, builtin:kshapes" in message and "--list-models" in message


def test_env_replaces_the_default_only_and_folders_pass_through(assets, monkeypatch, tmp_path):
    fake_builtin(assets, "kshapes")
    monkeypatch.setenv("RAPIDDIFF_MODEL", str(tmp_path / "mine"))
    assert builtin.resolve_model(None) == builtin.resolve_model("builtin") == tmp_path / "mine"
    assert builtin.resolve_model("builtin:kshapes") == assets / "kshapes"
    assert builtin.resolve_model("runs/model") == Path("runs/model")
    assert not builtin.is_builtin_spec("builtins/model") and builtin.is_builtin_spec("builtin:x")


def test_model_id_names_builtin_folders_by_name(assets, tmp_path):
    fake_builtin(assets, "kshapes")
    (tmp_path / "linked").symlink_to(assets / "kshapes")  # the same folder by another path
    assert builtin.model_id(assets / "kshapes") == builtin.model_id(tmp_path / "linked") == "builtin:kshapes"
    assert builtin.model_id(fake_builtin(tmp_path, "kshapes")) == "kshapes"  # a copy is a folder of its own


def test_list_models_reads_each_folders_about_and_licences(assets):
    fake_builtin(assets, "kshapes", about={"summary": "flat shapes", "entities": 66, "licence": "Apache-2.0"})
    fake_builtin(assets, "emoji", licensed=True)  # no "about": counted from its knowledge store
    emoji, kshapes = builtin.list_builtins()
    assert emoji.startswith("builtin:emoji (default)  ") and "2 KG entities" in emoji
    assert f"see ATTRIBUTION.md and LICENSES/ in {assets / 'emoji'}" in emoji
    assert (
        kshapes.startswith("builtin:kshapes  flat shapes; 66 entities, ") and "licence: Apache-2.0" in kshapes
    )


def test_the_shipped_builtins():
    """The package ships kshapes; the default is emoji where its folder is there, kshapes until then."""
    names = builtin.builtin_names()
    assert "kshapes" in names
    assert builtin.default_builtin() == ("emoji" if "emoji" in names else "kshapes")
    info = builtin.describe("kshapes")
    assert info.entities == "66 entities" and info.licence.startswith("Apache-2.0") and 20 < info.size_mb < 30


def test_package_data_takes_a_builtins_licences(tmp_path):
    """pyproject's package-data globs (setuptools expands them as glob(recursive=True)) take a
    built-in folder's ATTRIBUTION.md and LICENSES/ files into the wheel with its weights."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))["tool"]["setuptools"][
        "package-data"
    ]
    package = tmp_path / "rapiddiff"
    fake_builtin(package / "assets", "emoji", licensed=True)
    (package / "assets" / "emoji" / "LICENSES" / "Apache-2.0").write_text("text\n", encoding="utf-8")
    taken = {f for p in patterns["rapiddiff"] for f in glob.glob(p, root_dir=package, recursive=True)}
    for file in ("ATTRIBUTION.md", "LICENSES/x.LICENSE", "LICENSES/Apache-2.0", "model_index.json"):
        assert f"assets/emoji/{file}" in taken
