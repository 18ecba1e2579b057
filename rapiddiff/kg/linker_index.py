"""The EntityLinker's index: jieba's dictionary and the lexicon's normalised forms in one MARISA
trie with a weight a key, built once and kept as memory-mapped files (in the per-user cache, or in
a KnowledgeStore folder for a large store). Below both :mod:`~rapiddiff.kg.linker` and
:mod:`~rapiddiff.kg.store`, which read and write it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import itertools
import json
import logging
import marshal
import math
import os
import shutil
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import marisa_trie
import numpy as np

from rapiddiff import __version__
from rapiddiff.kg import normalize as normalize_module
from rapiddiff.kg.cache import cache_file
from rapiddiff.kg.normalize import normalize, table_key
from rapiddiff.utils.io import atomic_open, atomic_write_bytes, atomic_write_text, file_sha256
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)

# jieba is imported where its own files are read (the caches below spare most processes its import),
# linker_dp where numba's start is worth it (word_check_module).


class StoreNames(Protocol):
    """What the index needs of a KnowledgeStore (a protocol: this module sits below store.py)."""

    ENTITIES_FILE: str
    path: Path | None

    def forms(self) -> Iterator[tuple[str, int]]: ...


@functools.cache
def jieba_dictionary() -> tuple[dict[str, int], int]:
    """jieba's main dictionary (word/prefix → frequency, total), loaded once per process."""
    import jieba

    jieba.setLogLevel(logging.WARNING)
    tok = jieba.Tokenizer()
    tok.initialize()
    return tok.FREQ, tok.total


@dataclass(frozen=True)
class JiebaDictionary:
    """jieba's main dictionary as a MARISA trie of its words and each word's weight
    log(freq) - log(total) (jieba's calc() term). The words starting at a position are one
    prefix query (jieba's get_DAG walks a dict of words and prefixes, one lookup a step): the
    same DAG, as fast, and the trie is memory-mapped from the on-disk cache
    (:mod:`rapiddiff.kg.cache`), so a fresh process pays nothing to load jieba's 350 k words.
    """

    trie: Any
    weights: list[float]
    logtotal: float
    longest: int

    def frequency(self, word: str) -> int:
        """A word's frequency in jieba's dictionary (0 if it is not a word there)."""
        key_id = self.trie.get(word)
        return 0 if key_id is None else round(math.exp(self.weights[key_id] + self.logtotal))


def _jieba_source() -> tuple[str, str, int, int]:
    """What identifies jieba's dictionary for the caches: its version, file, size and mtime."""
    import jieba

    source = Path(jieba.__file__).with_name("dict.txt")
    stat = source.stat()
    return version("jieba"), str(source), stat.st_size, stat.st_mtime_ns


@functools.cache
def _jieba_identity() -> tuple[str, int, str]:
    """jieba's dictionary by content (version, size, sha256 of dict.txt; ~10 ms once a process), for
    indexes that travel with a store: its path and mtime differ on every machine the store is
    copied to, and would make each one rebuild a 16 M-name index for nothing."""
    import jieba

    data = Path(jieba.__file__).with_name("dict.txt").read_bytes()
    return version("jieba"), len(data), hashlib.sha256(data).hexdigest()


@functools.cache
def jieba_words() -> JiebaDictionary:
    """jieba's dictionary, from the cache (built there from jieba's own files the first time)."""

    key = ("jieba-trie", 1, version("marisa-trie"), *_jieba_source())
    trie_file, data_file = cache_file("jieba", key, ".marisa"), cache_file("jieba", key, ".marshal")
    try:
        weights, logtotal, longest = marshal.loads(data_file.read_bytes())
        trie = marisa_trie.Trie()
        trie.mmap(str(trie_file))
        if len(trie) == len(weights):
            return JiebaDictionary(trie, weights, logtotal, longest)
    except (OSError, EOFError, ValueError, TypeError, RuntimeError):
        pass  # absent or damaged: build it again
    freq, total = jieba_dictionary()
    words = [w for w, f in freq.items() if f]  # freq 0: a prefix jieba keeps for its walk
    trie = marisa_trie.Trie(words)
    logtotal = math.log(total)
    weights = [0.0] * len(trie)
    for w in words:
        weights[trie[w]] = math.log(freq[w]) - logtotal
    longest = max(map(len, words))
    try:
        trie_file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(trie_file, trie.tobytes())
        atomic_write_bytes(data_file, marshal.dumps((weights, logtotal, longest)))
    except OSError as err:
        log.debug("cannot cache jieba's dictionary in %s (%s)", trie_file.parent, err)
    return JiebaDictionary(trie, weights, logtotal, longest)


@functools.cache
def jieba_table() -> tuple[np.ndarray, ...]:
    """jieba's dictionary as :func:`linker_dp.build_words`'s hash table over code points, plus the
    code point pool it points into (what :func:`linker_dp.check` walks where no form starts)."""

    d = jieba_words()
    # Cached beside jieba's trie: rebuilding it from 350 k Python strings costs ~0.6 s a process,
    # most of a small model's linking cost (`rapiddiff generate`'s cold start).
    cached = cache_file("jieba", ("jieba-table", 1, *_jieba_source()), ".npz")
    try:
        with np.load(cached) as arrays:
            return arrays["table"], arrays["slot_weight"], arrays["pool"]
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile):
        pass  # absent or damaged: build it again
    from rapiddiff.kg import linker_dp  # 350 k words: compiled (numba) whatever the budget

    items = list(d.trie.iteritems())
    words = [w for w, _ in items]
    pool = np.frombuffer("".join(words).encode("utf-32-le"), dtype=np.uint32)
    offsets = np.zeros(len(words) + 1, np.int64)
    offsets[1:] = np.cumsum(np.fromiter(map(len, words), np.int64, len(words)))
    weights = np.asarray([d.weights[i] for _, i in items], np.float64)
    table, slot_weight = linker_dp.build_words(pool, offsets, weights)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        with atomic_open(cached, "wb") as f:
            np.savez(f, table=table, slot_weight=slot_weight, pool=pool)
    except OSError as err:
        log.debug("cannot cache jieba's word table in %s (%s)", cached.parent, err)
    return table, slot_weight, pool


def head_set(heads: set[str]) -> tuple[np.ndarray, bool]:
    """The forms' first two characters as :func:`linker_dp.form_starts` reads them: a hash set of
    ``c0 << 21 | c1`` (and ``c << 21 | SINGLE`` for a one-character form); whether any form has
    one character."""
    dp = word_check_module(len(heads))
    codes = [(ord(h[0]) << 21) | (ord(h[1]) if len(h) == 2 else dp.SINGLE) for h in heads]
    return dp.build_set(np.asarray(codes, np.int64)), any(len(h) == 1 for h in heads)


# The word check's loops run as linker_dp's plain-Python twin (the same code, not compiled) until
# the process has given them this many characters, then compiled. numba's start in a process
# (its import, then loading the cached machine code) costs ~0.5 s on an idle 2-core machine; the
# twin checks ~15 k characters a second, so it stops at about half that cost. A cold `rapiddiff
# generate` links one prompt (tens of characters) and never starts numba; a training or evaluation
# run pays at most this much extra before it switches. The results are the same either way.
_PLAIN_CHARS = 4_000
_plain_chars_used = 0


@functools.cache
def plain_dp() -> ModuleType:
    """:mod:`rapiddiff.kg.linker_dp` loaded as plain Python (:data:`linker_dp.PLAIN_TWIN`)."""

    origin = importlib.util.find_spec("rapiddiff.kg.linker_dp").origin  # type: ignore[union-attr]
    spec = importlib.util.spec_from_file_location("rapiddiff.kg._linker_dp_plain", origin)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def word_check_module(chars: int) -> ModuleType:
    """The module whose loops check ``chars`` characters (or build a table of that many keys):
    the plain twin while this process's budget lasts, else :mod:`rapiddiff.kg.linker_dp`."""
    global _plain_chars_used
    if _plain_chars_used + chars <= _PLAIN_CHARS:
        _plain_chars_used += chars
        return plain_dp()
    _plain_chars_used = _PLAIN_CHARS  # numba is started now: the compiled loops from here on
    from rapiddiff.kg import linker_dp

    return linker_dp


def surface_index(
    pairs: Iterable[tuple[str, int]], words: Iterable[str] = ()
) -> tuple[Any, Any, set[str], int, int]:
    """(MARISA trie of normalised forms, int32 entity id per trie key, the forms' first two
    characters, longest form, clashes).

    On a clash (two forms normalise alike) the first pair wins. ``words`` are put in the same trie
    with entity id -1 (not forms: the linker adds jieba's dictionary, so one prefix query a
    position finds both the forms and the segmentation's words).
    """

    keys: list[str] = []
    ids: list[int] = []
    longest = 0
    for surface, entity_id in pairs:
        key = normalize(surface.strip())
        if key:
            keys.append(key)
            ids.append(int(entity_id))
            longest = max(longest, len(key))
    # The first two characters of every form: most positions of a text start no form, and a set
    # lookup rejects them for a tenth of a trie query.
    heads = {k[:2] for k in keys}
    extra = list(words)
    trie = marisa_trie.Trie(keys + extra if extra else keys)
    key_ids = np.fromiter(map(trie.key_id, keys), dtype=np.int64, count=len(keys))
    id_array = np.asarray(ids, dtype=np.int64)
    del keys, ids
    _, first = np.unique(key_ids, return_index=True)  # the first pair of each key
    table = np.full(len(trie), -1, dtype=np.int32)
    table[key_ids[first]] = id_array[first]
    clashes = int(np.count_nonzero(table[key_ids] != id_array))
    return trie, table, heads, longest, clashes


@dataclass(frozen=True)
class LinkerIndex:
    """What :class:`EntityLinker` builds from its lexicon and jieba's dictionary (the costly part of
    making one: a trie of jieba's 350 k words plus the forms, and a weight for each key)."""

    trie: Any
    entity_ids: np.ndarray
    """int32 entity id per trie key; -1 for jieba's words that are not forms."""
    weights: np.ndarray
    """float64 segmentation weight per trie key, 8 bytes a key (131 MB at 16 M forms): jieba's
    log(freq) - log(total) for its words; NaN for a form, whose add_word weight (which replaces
    jieba's, as add_word does) the linker computes the first time the form is in a segmented
    block. A fixed array, so that memo is bounded by the lexicon, not the text."""
    heads: set[str]
    head_set: tuple[np.ndarray, bool]
    """:func:`head_set` of ``heads``."""
    longest: int
    clashes: int


# Bump when what _build_index computes, or how an index folder holds it, changes. An index also
# records a digest of the source of this file, normalize.py and linker_dp.py (the head set's hash
# layout), so an edited linker never reads an index an older one wrote.
_INDEX_VERSION = 2
# Cached indexes kept (the most recently used): each is ~6 MB for a small lexicon (jieba's words
# dominate), ~12 bytes a form more for a large one.
_KEEP_INDEXES = 8

# An index as files in one folder: in the per-user cache (one folder per lexicon) and in a
# KnowledgeStore folder (STORE_INDEX). The trie is memory-mapped, each array is a plain .npy
# (never pickled), and index.json, written last, says what the index was built from and each
# file's size: a complete index.json means a complete folder.
STORE_INDEX = "linker"
"""The folder of a KnowledgeStore that holds its linker's index (written by ``save`` for a large
store, read by :meth:`EntityLinker.from_store`)."""
_INDEX_META = "index.json"
_TRIE_FILE = "keys.marisa"
_ARRAYS = {"entity_ids": "<i4", "weights": "<f8", "heads": "<U2", "head_table": "<i8"}
_MAPPED = {"entity_ids", "weights"}  # one entry a trie key: memory-mapped (copy-on-write)


@functools.cache
def _code_digest() -> str:

    digest = hashlib.sha256()
    for module_file in (__file__, normalize_module.__file__, Path(__file__).with_name("linker_dp.py")):
        try:
            digest.update(Path(module_file).read_bytes())
        except (OSError, TypeError):  # no source file (a frozen install): the package version decides
            digest.update(__version__.encode())
    return digest.hexdigest()


def _lexicon_digest(surfaces: list[str], ids: np.ndarray) -> str:
    """sha256 of the (form, entity id) pairs, in order (the order decides clashes)."""

    digest = hashlib.sha256()
    digest.update(np.fromiter(map(len, surfaces), np.int64, len(surfaces)).tobytes())
    digest.update(ids.astype(np.int64).tobytes())
    digest.update("".join(surfaces).encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


def _index_sources() -> dict[str, Any]:
    """What an index depends on besides its lexicon (as JSON reads it back): the format, the code,
    marisa-trie, jieba's dictionary and the normalisation table."""

    sources = {
        "version": _INDEX_VERSION,
        "code": _code_digest(),
        "marisa_trie": version("marisa-trie"),
        "jieba": _jieba_identity(),
        "normalize": table_key(),
    }
    return json.loads(json.dumps(sources))  # tuples as lists, as index.json holds them


class _UnusableIndex(Exception):
    """Why an index folder cannot be read (the message says it in a few words)."""


# What a mismatch of each source means, for the log line.
_SOURCE_MISMATCH = {
    "version": "written by another linker version",
    "code": "written by another linker version",
    "marisa_trie": "written with another marisa-trie version",
    "jieba": "written for another jieba dictionary",
    "normalize": "written for another normalisation table",
}


def _write_index_folder(index: LinkerIndex, folder: Path, about: Mapping[str, Any] | None = None) -> None:
    """Write ``index`` into ``folder`` (each file atomically, index.json last). ``about`` goes into
    index.json as it is (a store's: what identifies its names)."""

    folder.mkdir(parents=True, exist_ok=True)
    (folder / _INDEX_META).unlink(missing_ok=True)  # the folder is incomplete until it is written again
    atomic_write_bytes(folder / _TRIE_FILE, index.trie.tobytes())
    arrays = {
        "entity_ids": index.entity_ids,
        "weights": index.weights,
        "heads": np.asarray(sorted(index.heads), dtype="<U2"),
        "head_table": index.head_set[0],
    }
    for name, array in arrays.items():
        with atomic_open(folder / f"{name}.npy", "wb") as f:
            np.save(f, np.ascontiguousarray(array, dtype=_ARRAYS[name]), allow_pickle=False)
    meta = {
        "format": "rapiddiff.EntityLinker index",
        **_index_sources(),
        **({"about": dict(about)} if about else {}),
        "keys": len(index.trie),
        "longest": index.longest,
        "clashes": index.clashes,
        "single_character_forms": index.head_set[1],
        "bytes": {f.name: f.stat().st_size for f in (folder / n for n in _index_files())},
    }
    atomic_write_text(folder / _INDEX_META, json.dumps(meta, ensure_ascii=False, indent=1) + "\n")


def _index_files() -> list[str]:
    return [_TRIE_FILE, *(f"{name}.npy" for name in _ARRAYS)]


def _read_index_meta(folder: Path) -> dict[str, Any]:
    """index.json of an index folder, checked against this process's sources; raises
    :class:`_UnusableIndex` saying why it cannot be used."""

    try:
        meta = json.loads((folder / _INDEX_META).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _UnusableIndex(f"no {_INDEX_META} (never written, or its write did not finish)") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise _UnusableIndex(f"damaged: {_INDEX_META}: {err}") from None
    if not isinstance(meta, dict) or meta.get("format") != "rapiddiff.EntityLinker index":
        raise _UnusableIndex(f"damaged: {_INDEX_META} is not a linker index's")
    for key, expected in _index_sources().items():
        if meta.get(key) != expected:
            raise _UnusableIndex(_SOURCE_MISMATCH[key])
    return meta


def _read_index_folder(folder: Path, meta: Mapping[str, Any]) -> LinkerIndex:
    """The index in ``folder`` whose index.json ``meta`` (:func:`_read_index_meta`) was checked: the
    trie and the per-key arrays memory-mapped, the rest read. Raises :class:`_UnusableIndex` on a
    missing, truncated or inconsistent file; never returns a partial index."""

    try:
        sizes = meta["bytes"]
        for name in _index_files():  # before mapping: a truncated trie must never be mapped
            size = (folder / name).stat().st_size
            if size != sizes[name]:
                raise _UnusableIndex(f"damaged: {name} has {size} bytes, {_INDEX_META} says {sizes[name]}")
        arrays = {}
        for name, dtype in _ARRAYS.items():
            array = np.load(
                folder / f"{name}.npy", mmap_mode="c" if name in _MAPPED else None, allow_pickle=False
            )
            if array.dtype != np.dtype(dtype) or array.ndim != 1:
                raise _UnusableIndex(f"damaged: {name}.npy holds {array.dtype} {list(array.shape)}")
            arrays[name] = np.asarray(array)  # a plain ndarray over the mapping (numba's type)
        trie = marisa_trie.Trie()
        trie.mmap(str(folder / _TRIE_FILE))
        keys = int(meta["keys"])
        if not len(trie) == keys == len(arrays["entity_ids"]) == len(arrays["weights"]):
            raise _UnusableIndex(
                f"damaged: {keys} keys in {_INDEX_META}, {len(trie)} in the trie, "
                f"{len(arrays['entity_ids'])} entity ids, {len(arrays['weights'])} weights"
            )
        heads = set(arrays["heads"].tolist())
        head_table = (arrays["head_table"], bool(meta["single_character_forms"]))
        return LinkerIndex(
            trie,
            arrays["entity_ids"],
            arrays["weights"],
            heads,
            head_table,
            int(meta["longest"]),
            int(meta["clashes"]),
        )
    except (OSError, KeyError, TypeError, AttributeError, ValueError, EOFError, RuntimeError) as err:
        raise _UnusableIndex(f"damaged: {type(err).__name__}: {err}") from None


def _lexicon(pairs: Iterable[tuple[str, int]]) -> tuple[list[str], np.ndarray]:
    """(forms, int64 entity ids) of ``pairs``, in order."""
    surfaces: list[str] = []
    id_list: list[int] = []
    for surface, entity_id in pairs:
        surfaces.append(surface)
        id_list.append(int(entity_id))
    return surfaces, np.asarray(id_list, dtype=np.int64)


def _cache_folder(surfaces: list[str], ids: np.ndarray) -> Path:
    """The per-user cache's folder for the index of this lexicon (:mod:`rapiddiff.kg.cache`)."""

    key = ("linker-index", *_index_sources().values(), _lexicon_digest(surfaces, ids))
    return cache_file("linker", key, "")


def _cached_index(folder: Path) -> LinkerIndex | None:
    try:
        index = _read_index_folder(folder, _read_index_meta(folder))
    except _UnusableIndex:
        return None  # absent or damaged: build it again
    _touch(folder / _INDEX_META)
    return index


def index_of(pairs: Iterable[tuple[str, int]]) -> LinkerIndex:
    """The linker's index of ``pairs``, from the on-disk cache (:mod:`rapiddiff.kg.cache`) when it
    holds one built from the same pairs, jieba dictionary, normalisation table and code; else built
    and written there. Building it costs ~0.6 s for any lexicon (jieba's words), minutes for OpenKG's
    16 M forms; reading it back, milliseconds (the trie and the per-key arrays are memory-mapped)."""
    surfaces, ids = _lexicon(pairs)
    folder = _cache_folder(surfaces, ids)
    index = _cached_index(folder)
    if index is not None:
        return index
    index = _build_index(surfaces, ids)
    try:
        _write_index_folder(index, folder)
        _evict_indexes(folder.parent)
    except OSError as err:  # a read-only home: correct, only slower
        log.debug("cannot cache the linker's index in %s (%s)", folder, err)
    return index


def _build_index(surfaces: list[str], ids: np.ndarray) -> LinkerIndex:
    words = jieba_words()
    pairs = zip(surfaces, ids.tolist(), strict=True)
    trie, entity_ids, heads, longest, clashes = surface_index(pairs, words.trie.keys())
    weights = np.full(len(trie), np.nan)
    key_id = trie.key_id
    for word, i in words.trie.iteritems():
        weights[key_id(word)] = words.weights[i]
    weights[entity_ids >= 0] = np.nan
    return LinkerIndex(trie, entity_ids, weights, heads, head_set(heads), longest, clashes)


def _entities_file(store: StoreNames, store_folder: Path, *, with_sha256: bool = True) -> dict[str, Any]:
    """What identifies a store's names: its entities.tsv's size, modification time and sha256."""
    name = store.ENTITIES_FILE
    file = store_folder / name
    stat = file.stat()
    found: dict[str, Any] = {"file": name, "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    if with_sha256:
        found["sha256"] = file_sha256(file)
    return found


def write_store_index(store: StoreNames, store_folder: Path) -> Path:
    """Write the linker's index of ``store``'s names and aliases into ``store_folder/linker``
    (:data:`STORE_INDEX`), after its entities.tsv: what :meth:`EntityLinker.from_store` loads
    instead of reading every name. Taken from the linker/ of the folder ``store`` was loaded from
    (``store.path``: the save's caller has not changed it yet) where it still describes the names,
    else from the per-user cache where it holds this lexicon's index, else built (minutes and
    several GB at 16 M names); returns the folder."""
    folder = store_folder / STORE_INDEX
    index, _ = read_store_index(store)
    if index is None:
        surfaces, ids = _lexicon(store.forms())
        index = _cached_index(_cache_folder(surfaces, ids)) or _build_index(surfaces, ids)
        del surfaces, ids
    _write_index_folder(index, folder, {"entities": _entities_file(store, store_folder)})
    return folder


def read_store_index(store: StoreNames) -> tuple[LinkerIndex | None, str]:
    """(the index saved in ``store``'s folder, "") when it is there and describes the store's
    names, else (None, why not). Reads no names; hashes entities.tsv only where its modification
    time differs from the recorded one (a copied store)."""
    if store.path is None:
        return None, "the store has no folder (not loaded or saved)"
    folder = store.path / STORE_INDEX
    if not folder.is_dir():
        return None, f"no {STORE_INDEX}/ folder"
    try:
        meta = _read_index_meta(folder)
        about = meta.get("about")
        recorded = about.get("entities") if isinstance(about, dict) else None
        if not isinstance(recorded, dict):
            raise _UnusableIndex(f"damaged: {_INDEX_META} does not identify the store's names")
        try:
            found = _entities_file(store, store.path, with_sha256=False)
        except OSError as err:
            raise _UnusableIndex(f"cannot read {recorded.get('file')}: {err}") from None
        changed = f"{found['file']} changed since the index was written"
        if found["bytes"] != recorded.get("bytes"):
            raise _UnusableIndex(changed)
        if (  # another modification time: a copied store (the same names) or an edited one
            found["mtime_ns"] != recorded.get("mtime_ns")
            and _entities_file(store, store.path)["sha256"] != recorded.get("sha256")
        ):
            raise _UnusableIndex(changed)
        return _read_index_folder(folder, meta), ""
    except _UnusableIndex as why:
        return None, str(why)


def _touch(file: Path) -> None:

    with contextlib.suppress(OSError):
        os.utime(file)  # most recently used: the last one _evict_indexes removes


def _evict_indexes(folder: Path) -> None:
    """Keep the :data:`_KEEP_INDEXES` most recently used linker indexes in the cache folder."""

    def used(index: Path) -> int:
        try:
            return (index / _INDEX_META).stat().st_mtime_ns
        except OSError:
            return 0  # incomplete: the first to go

    indexes = sorted((f for f in folder.glob("linker-*") if f.is_dir()), key=used, reverse=True)
    for old in indexes[_KEEP_INDEXES:]:
        shutil.rmtree(old, ignore_errors=True)
    for old in itertools.chain(folder.glob("linker-*.npz"), folder.glob("linker-*.marisa")):
        old.unlink(missing_ok=True)  # the one-file-pair layout of _INDEX_VERSION 1
