"""The models shipped inside the package, each a model folder ``rapiddiff/assets/<name>/``.

Wherever a model is given (``rapiddiff generate --model``, ``serve --model``, ``pretrained:`` in a
fine-tuning config, ``finetune merge --base``), ``builtin:<name>`` names one of them and plain
``builtin`` (or no model at all) the default one; ``$RAPIDDIFF_MODEL`` replaces the default. Images
and servers name a built-in model ``builtin:<name>``, so what it made can be remade with it after the
default changes.

A built-in folder may say what it is in its ``rapiddiff.json``: ``"about": {"summary": ...,
"entities": N, "licence": ...}`` (what ``rapiddiff generate --list-models`` prints), and may hold
``ATTRIBUTION.md`` and ``LICENSES/`` beside its weights (a model trained on licensed data must).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from rapiddiff.utils.config import did_you_mean
from rapiddiff.utils.io import read_json_object

DEFAULT_BUILTIN = "emoji"
"""The built-in model used without ``--model``; while the package has no folder of that name,
the first built-in by name is the default instead."""
PREFIX = "builtin"
ATTRIBUTION = "ATTRIBUTION.md"  # as rapiddiff.data.licenses writes it into a model folder


def assets_root() -> Path:
    """The folder that holds the built-in models (a function, so tests can point it elsewhere)."""
    import rapiddiff

    return Path(rapiddiff.__file__).parent / "assets"


def builtin_names() -> list[str]:
    """The built-in models of this installation, by name (folders with a ``model_index.json``)."""
    root = assets_root()
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / "model_index.json").is_file())


def default_builtin() -> str:
    """:data:`DEFAULT_BUILTIN`, or the first built-in by name while its folder is absent."""
    names = builtin_names()
    return DEFAULT_BUILTIN if DEFAULT_BUILTIN in names or not names else names[0]


def builtin_model_dir(name: str | None = None) -> Path:
    """The folder of built-in model ``name``; without a name, ``$RAPIDDIFF_MODEL`` or the default
    built-in. An unknown name raises ValueError listing the valid ones."""
    if name is None:
        env = os.environ.get("RAPIDDIFF_MODEL")
        return Path(env) if env else assets_root() / default_builtin()
    names = builtin_names()
    if name not in names:
        ids = [f"{PREFIX}:{n}" for n in names]
        raise ValueError(
            f"no built-in model '{PREFIX}:{name}'{did_you_mean(f'{PREFIX}:{name}', ids)}; the built-in "
            f"models are: {', '.join(ids) or 'none in this installation'} (`rapiddiff generate --list-models`)"
        )
    return assets_root() / name


def is_builtin_spec(model: str | Path | None) -> bool:
    """Whether ``model`` names a built-in model (``builtin`` or ``builtin:NAME``) rather than a folder."""
    text = str(model) if model is not None else ""
    return text == PREFIX or text.startswith(f"{PREFIX}:")


def resolve_model(model: str | Path | None) -> Path:
    """A model as a user gives it → its folder: None or ``builtin`` → :func:`builtin_model_dir`,
    ``builtin:NAME`` → that built-in, anything else → the path itself (not checked here)."""
    if model is None or not is_builtin_spec(model):
        return builtin_model_dir() if model is None else Path(model)
    _, _, name = str(model).partition(":")
    return builtin_model_dir(name or None)


def builtin_name_of(folder: str | Path) -> str | None:
    """``NAME`` when ``folder`` is the built-in model ``builtin:NAME``, else None."""
    path, root = Path(folder).resolve(), assets_root()
    return next((name for name in builtin_names() if (root / name).resolve() == path), None)


def model_id(folder: str | Path) -> str:
    """How a model folder is named to users (the PNG's ``model``, serve's model id):
    ``builtin:NAME`` for a built-in one, else the folder's own name."""
    name = builtin_name_of(folder)
    return f"{PREFIX}:{name}" if name else Path(folder).resolve().name


@dataclass(frozen=True)
class BuiltinInfo:
    """What ``rapiddiff generate --list-models`` says of one built-in model."""

    name: str
    summary: str
    entities: str
    size_mb: float
    licence: str

    def line(self, default: bool = False) -> str:
        mark = " (default)" if default else ""
        return (
            f"{PREFIX}:{self.name}{mark}  {self.summary}; {self.entities}, {self.size_mb:.1f} MB; "
            f"licence: {self.licence}"
        )


def describe(name: str) -> BuiltinInfo:
    """A built-in model's ``rapiddiff.json`` "about", its size on disk, and where its licences are;
    a folder without an "about" is described by its knowledge store's entity count."""
    folder = builtin_model_dir(name)
    about = read_json_object(folder / "rapiddiff.json").get("about") or {}
    if "entities" in about:
        entities = f"{about['entities']} entities"
    else:
        table = folder / "knowledge" / "store" / "entities.tsv"  # a header line, then one a line
        count = len(table.read_text("utf-8").splitlines()) - 1 if table.is_file() else 0
        entities = f"{count} KG entities"
    licence = str(about.get("licence", "not stated"))
    if (folder / ATTRIBUTION).is_file():  # the data's licences, which the weights carry along
        licence += f"; see {ATTRIBUTION} and LICENSES/ in {folder}"
    return BuiltinInfo(
        name=name,
        summary=str(about.get("summary", "no summary in its rapiddiff.json")),
        entities=entities,
        size_mb=sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 1e6,
        licence=licence,
    )


def list_builtins() -> list[str]:
    """One line a built-in model, the default marked (``rapiddiff generate --list-models``)."""
    default = default_builtin()
    return [describe(name).line(default=name == default) for name in builtin_names()]
