"""A small on-disk cache for tables the KG stage derives from installed data (jieba's dictionary,
the normalisation table) and from a store (the entity linker's index): built once per machine,
then loaded in a fraction of the build time.

Files live in ``$RAPIDDIFF_CACHE_DIR``, else ``$XDG_CACHE_HOME/rapiddiff``, else
``~/.cache/rapiddiff``; the name carries a hash of everything the table depends on (package
versions, source file size and time, a store's forms), so a changed source gets a new file. They
hold plain data — :mod:`marshal` (dicts of str/int/float, as jieba's own cache), MARISA tries,
numpy ``.npz`` arrays — never pickle. Where the folder cannot be written, the table is simply
built each time.
"""

from __future__ import annotations

import hashlib
import marshal
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from rapiddiff.utils.io import atomic_write_bytes
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)
T = TypeVar("T")


def cache_dir() -> Path:
    env = os.environ.get("RAPIDDIFF_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rapiddiff"


def cache_file(name: str, key: Any, suffix: str) -> Path:
    """``cache_dir()/name-<hash of key><suffix>``: where a table derived from ``key`` is kept."""
    digest = hashlib.sha256(repr(key).encode("utf-8")).hexdigest()[:16]
    return cache_dir() / f"{name}-{digest}{suffix}"


def cached(name: str, key: Any, build: Callable[[], T]) -> T:
    """``build()``'s result, from ``cache_file(name, key, ".marshal")`` when it is there."""
    file = cache_file(name, key, ".marshal")
    try:
        with file.open("rb") as handle:
            return marshal.load(handle)
    except (OSError, EOFError, ValueError, TypeError):
        pass  # absent, unreadable or damaged: build it again
    value = build()
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(file, marshal.dumps(value))
    except OSError as err:  # a read-only home: correct, only slower
        log.debug("cannot write the cache file %s (%s)", file, err)
    return value
