"""Typed YAML configs: a dataclass is the schema, a wrong key names the valid ones.

Lightning stages get this from LightningCLI/jsonargparse; stages that are not Lightning
modules (``kg train``, ``data kshapes``) use :func:`load_config` so they behave the same way.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from rapiddiff.utils.io import atomic_write_text

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or mapping does not match its schema."""


def load_config(cls: type[T], source: str | Path | dict[str, Any] | None = None, **overrides: Any) -> T:
    """Build dataclass ``cls`` from a YAML file or a mapping, then apply ``overrides``.

    Unknown keys raise :class:`ConfigError` naming the valid keys (and the closest one);
    nested dataclass fields take nested mappings; types are checked for the simple cases
    (bool/int/float/str/Path, Optional, list) so a typo like ``lr: 1e-3x`` fails early.
    """
    if source is None:
        data: dict[str, Any] = {}
        where = cls.__name__
    elif isinstance(source, dict):
        data, where = dict(source), cls.__name__
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from err
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(loaded).__name__}")
        data, where = loaded, str(path)
    data.update({k: v for k, v in overrides.items() if v is not None})
    return _build(cls, data, where)


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """A dataclass config as plain YAML-safe data (Paths become strings)."""

    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, Path):
            return str(value)
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    return plain(cfg)


def save_config(cfg: Any, path: str | Path) -> None:
    """Write the resolved config as YAML (atomically), to sit beside what it produced."""

    atomic_write_text(path, yaml.safe_dump(config_to_dict(cfg), allow_unicode=True, sort_keys=False))


def did_you_mean(key: str, valid: Iterable[str]) -> str:
    """The hint " (did you mean 'x'?)" for the valid key closest to a mistyped one; "" if none is close."""
    close = difflib.get_close_matches(key, list(valid), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _build(cls: type[T], data: dict[str, Any], where: str) -> T:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = unknown[0]
        raise ConfigError(
            f"{where}: unknown key '{key}'{did_you_mean(key, fields)}. Valid keys for {cls.__name__}: "
            f"{', '.join(sorted(fields))}"
        )
    hints = get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints.get(name, Any), value, f"{where}: {cls.__name__}.{name}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{where}: {err}") from err


def _coerce(tp: Any, value: Any, where: str) -> Any:
    """``value`` as type ``tp`` (a field's annotation), or a ConfigError naming ``where``."""
    if tp is Any:
        return value
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return _coerce_union(get_args(tp), value, where)
    if origin is typing.Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, choices))}")
        return value
    if origin in (list, tuple):
        return _coerce_sequence(origin, get_args(tp), value, where)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping for {tp.__name__}, got {value!r}")
        return _build(tp, value, where)
    if tp is float:
        return _coerce_float(value, where)
    return _coerce_scalar(tp, value, where)


def _coerce_union(args: tuple[Any, ...], value: Any, where: str) -> Any:
    if value is None and type(None) in args:
        return None
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _coerce(arg, value, where)
        except ConfigError as err:
            errors.append(str(err))
    raise ConfigError(errors[0] if errors else f"{where}: invalid value {value!r}")


def _coerce_sequence(origin: type, args: tuple[Any, ...], value: Any, where: str) -> Any:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{where}: expected a list, got {value!r}")
    (item,) = args[:1] or (Any,)
    items = [_coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    return items if origin is list else tuple(items)


def _coerce_float(value: Any, where: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    try:
        return float(value)  # YAML reads "1e-3" as a string; accept it
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{where}: expected a number, got {value!r}") from err


# What a scalar field accepts, and how the error names it. bool is checked before int can take it.
_SCALARS: dict[Any, tuple[Any, str]] = {
    bool: (lambda v: isinstance(v, bool), "true or false"),
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    str: (lambda v: isinstance(v, str), "a string"),
    Path: (lambda v: isinstance(v, (str, Path)), "a path"),
}


def _coerce_scalar(tp: Any, value: Any, where: str) -> Any:
    if tp not in _SCALARS:
        return value
    accepts, expected = _SCALARS[tp]
    if not accepts(value):
        raise ConfigError(f"{where}: expected {expected}, got {value!r}")
    return Path(value) if tp is Path else value
