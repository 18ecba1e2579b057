"""KnowledgeStore: trained entity/relation vectors with their names, aliases and facts, as a folder.

Layout: ``entities.tsv`` (id, name, |-joined aliases), ``relations.tsv``, ``entity_embeddings`` and
``relation_embeddings.safetensors`` (float32 [n, dim]), ``triples.tsv`` (names, distinct, sorted by
id), ``config.json`` (dim, counts, training config, held-out metrics), and optional indexes
(``names.marisa``, ``triples.ids.npy``, ``linker/``). Loading never unpickles; vectors are
memory-mapped and names and triples read on first use, so a store of millions opens in milliseconds.
"""

from __future__ import annotations

import itertools
import json
import struct
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rapiddiff.kg.linker_index import STORE_INDEX, surface_index, write_store_index
from rapiddiff.kg.normalize import normalize
from rapiddiff.kg.triples import (
    KGFormatError,
    check_fields,
    group_triples,
    read_triples_array,
    write_triples_array,
)
from rapiddiff.utils.io import atomic_open, atomic_write_text, save_safetensors
from rapiddiff.utils.logging import get_logger

if TYPE_CHECKING:
    import torch

log = get_logger(__name__)

FORMAT_VERSION = 1
ENTITIES = "entities.tsv"
RELATIONS = "relations.tsv"
ENTITY_EMBEDDINGS = "entity_embeddings.safetensors"
RELATION_EMBEDDINGS = "relation_embeddings.safetensors"
TRIPLES = "triples.tsv"
CONFIG = "config.json"
# Name index (optional; written by save(), rebuilt in memory where absent): a MARISA trie of
# names and aliases and the entity id of each trie key, both memory-mapped, so a store of 16 M
# entities answers id_of() in microseconds right after load().
NAME_INDEX = "names.marisa"
NAME_INDEX_IDS = "names.ids.npy"
# Triple ids (optional; written by save() after triples.tsv, which stays the readable source of
# truth): the same rows as int64 store ids, memory-mapped on first use. Parsing a triples.tsv of
# 140 M lines takes minutes and ~30 GB of memory (its names, then a dictionary of 16 M of them);
# this file maps in milliseconds. Used only while triples.tsv keeps the size recorded in
# config.json ("triples_tsv_bytes"), so a hand-edited triples.tsv is read instead.
TRIPLE_IDS = "triples.ids.npy"
# The EntityLinker's index (optional; written by save() after entities.tsv, read by
# EntityLinker.from_store while it matches entities.tsv: rapiddiff.kg.linker.read_store_index):
# a MARISA trie of the normalised forms and jieba's words and a few per-key arrays, ~16 bytes a
# form. Without it, a fresh process reads every name (~58 s and ~10 GB at 16 M entities) and
# hashes them to find the index in the per-user cache, or builds it (minutes). save() writes it
# for stores of at least this many entities; a smaller store (the built-in model) stays small and
# links through the per-user cache, which costs it a fraction of a second.
LINKER_MIN_ENTITIES = 100_000
_KEY = "embeddings"


class KnowledgeStore:
    """Entities (names, aliases, vectors), relations (names, vectors) and facts of one KG."""

    ENTITIES_FILE = ENTITIES  # for the linker's index, which identifies a store by this file

    def __init__(
        self,
        *,
        entity_vectors: torch.Tensor,
        relation_vectors: torch.Tensor,
        config: dict[str, Any] | None = None,
        entity_names: list[str] | None = None,
        relation_names: list[str] | None = None,
        aliases: list[list[str]] | None = None,
        triples: torch.Tensor | None = None,
        path: Path | None = None,
    ) -> None:
        # Use from_arrays() or load(); names/aliases/triples left None are read lazily from path.
        self.entity_vectors = entity_vectors
        self.relation_vectors = relation_vectors
        self.config: dict[str, Any] = dict(config or {})
        self.path = path
        self._entity_names = entity_names
        self._relation_names = relation_names
        self._aliases = aliases
        self._triples = triples
        self._index: tuple[Any, Any] | None = None
        self._norm_index: tuple[Any, Any] | None = None
        self._facts: tuple[torch.Tensor, torch.Tensor] | None = None
        self._line_starts: Any = None  # byte offset of each entity's line in entities.tsv (name_of)

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_arrays(
        cls,
        entity_names: Sequence[str],
        relation_names: Sequence[str],
        entity_vectors: Any,
        relation_vectors: Any,
        triples: Sequence[tuple[int, int, int]] | Any = (),
        aliases: Sequence[Sequence[str]] | Mapping[str, Sequence[str]] | None = None,
        config: dict[str, Any] | None = None,
    ) -> KnowledgeStore:
        """Build a store from names, vectors (tensor or array) and id triples; validates shapes.

        ``aliases`` is a list parallel to ``entity_names`` or a mapping name → aliases.
        """
        import torch

        names = [str(n) for n in entity_names]
        rel_names = [str(n) for n in relation_names]
        ent = torch.as_tensor(entity_vectors, dtype=torch.float32).detach().cpu()
        rel = torch.as_tensor(relation_vectors, dtype=torch.float32).detach().cpu()
        if ent.ndim != 2 or ent.shape[0] != len(names):
            raise ValueError(f"entity_vectors must be [{len(names)}, dim], got {list(ent.shape)}")
        if rel.ndim != 2 or rel.shape[0] != len(rel_names):
            raise ValueError(f"relation_vectors must be [{len(rel_names)}, dim], got {list(rel.shape)}")
        if rel.shape[1] != ent.shape[1]:
            raise ValueError(f"entity dim {ent.shape[1]} != relation dim {rel.shape[1]}")
        for label, items in (("entity", names), ("relation", rel_names)):
            if len(set(items)) != len(items):
                seen: set[str] = set()
                for n in items:  # the first repeat, for the message
                    if n in seen:
                        raise ValueError(f"{label} names must be unique; {n!r} appears twice")
                    seen.add(n)
            check_fields(items, f"{label} name")
        if aliases is None:
            alias_lists: list[list[str]] = [[] for _ in names]
        elif isinstance(aliases, Mapping):
            known = set(names)  # once: a set per alias key made a 16 M-name store's aliases O(keys x names)
            unknown = [k for k in aliases if k not in known]
            if unknown:
                raise ValueError(f"aliases given for unknown entity {unknown[0]!r}")
            alias_lists = [list(aliases.get(n, ())) for n in names]
        else:
            if len(aliases) != len(names):
                raise ValueError(f"aliases must have one list per entity ({len(names)}), got {len(aliases)}")
            alias_lists = [list(a) for a in aliases]
        all_aliases = [a for items in alias_lists for a in items]
        check_fields(all_aliases, "alias")
        if "|" in "\x00".join(all_aliases):
            bad = next(a for a in all_aliases if "|" in a)
            raise ValueError(f"alias {bad!r} contains '|', the alias separator of entities.tsv")
        trip = torch.as_tensor(triples if len(triples) else torch.empty(0, 3), dtype=torch.long).reshape(
            -1, 3
        )
        if len(trip) and (
            int(trip.min()) < 0
            or int(trip[:, [0, 2]].max()) >= len(names)
            or int(trip[:, 1].max()) >= len(rel_names)
        ):
            raise ValueError("triples hold ids outside the entity/relation ranges")
        return cls(
            entity_vectors=ent.contiguous(),
            relation_vectors=rel.contiguous(),
            config=config,
            entity_names=names,
            relation_names=rel_names,
            aliases=alias_lists,
            triples=trip,
        )

    # ----------------------------------------------------------------- persistence
    def save(self, path: str | Path, *, linker: bool | None = None) -> Path:
        """Write the store folder (each file atomically); returns the folder path, which the store
        then calls its own (``path``).

        The facts are written distinct and sorted by (head, relation, tail) id, and the store in
        memory takes that order too (``triples`` afterwards equals a reload's).

        ``linker``: also write the EntityLinker's index into ``path/linker`` (True), or not (False);
        None (the default) writes it for a store of at least :data:`LINKER_MIN_ENTITIES` entities.
        Where it is not written, an earlier one in ``path`` is removed.
        """
        import numpy as np

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        with atomic_open(path / ENTITIES, "w", encoding="utf-8") as f:
            f.write("id\tname\taliases\n")
            # One write per 1 M lines: a line-by-line write costs minutes for 16 M entities.
            rows = zip(self.entity_names, self.aliases, strict=True)
            for begin in range(0, len(self), 1 << 20):
                f.write(
                    "".join(
                        f"{i}\t{name}\t{'|'.join(al)}\n"
                        for i, (name, al) in enumerate(itertools.islice(rows, 1 << 20), start=begin)
                    )
                )
        with atomic_open(path / RELATIONS, "w", encoding="utf-8") as f:
            f.write("id\tname\n")
            for i, name in enumerate(self.relation_names):
                f.write(f"{i}\t{name}\n")
        meta = {"format": "rapiddiff.KnowledgeStore"}
        save_safetensors({_KEY: self.entity_vectors.float()}, path / ENTITY_EMBEDDINGS, metadata=meta)
        save_safetensors({_KEY: self.relation_vectors.float()}, path / RELATION_EMBEDDINGS, metadata=meta)
        # Grouped by (head, relation) and distinct on disk, so every reader of the store gets its
        # facts in order (fusion's relation table then skips its sort); the store in memory takes
        # the same order, so it equals what load() reads back.
        import torch

        triples = self.triples.numpy()
        grouped = group_triples(triples, len(self), len(self.relation_names))
        if grouped is not triples:
            self._triples, self._facts = torch.from_numpy(grouped), None
        write_triples_array(
            path / TRIPLES,
            grouped,
            self.entity_names,
            self.relation_names,
            header="head\trelation\ttail",
        )
        with atomic_open(path / TRIPLE_IDS, "wb") as f:
            np.save(f, np.ascontiguousarray(grouped, dtype=np.int64), allow_pickle=False)
        trie, ids = self._name_index()
        with atomic_open(path / NAME_INDEX, "wb") as f:
            trie.write(f)
        with atomic_open(path / NAME_INDEX_IDS, "wb") as f:
            np.save(f, ids, allow_pickle=False)
        config = {
            **self.config,
            "format_version": FORMAT_VERSION,
            "dim": self.dim,
            "n_entities": len(self),
            "n_relations": len(self.relation_names),
            "n_triples": len(self.triples),
            "triples_tsv_bytes": (path / TRIPLES).stat().st_size,
        }
        atomic_write_text(path / CONFIG, json.dumps(config, ensure_ascii=False, indent=2) + "\n")
        self.config = config
        # Last: the store is complete without it, should its build run out of memory. Taken from
        # the folder the store was loaded from where that has a matching one (self.path, still).
        if len(self) >= LINKER_MIN_ENTITIES if linker is None else linker:
            write_store_index(self, path)
        elif (path / STORE_INDEX).exists():
            import shutil

            shutil.rmtree(path / STORE_INDEX)  # an earlier store's, in this folder
        self.path = path  # what it holds is now this folder's: EntityLinker.from_store reads its index
        return path

    @classmethod
    def load(cls, path: str | Path) -> KnowledgeStore:
        """Open a store folder: vectors memory-mapped now, names and triples read on first use."""
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"knowledge store folder not found: {path}")
        missing = [
            n
            for n in (ENTITIES, RELATIONS, ENTITY_EMBEDDINGS, RELATION_EMBEDDINGS, CONFIG)
            if not (path / n).is_file()
        ]
        if missing:
            raise FileNotFoundError(
                f"{path} is not a KnowledgeStore folder: missing {', '.join(missing)} "
                "(make one with `rapiddiff kg train --config ...`)"
            )
        try:
            config = json.loads((path / CONFIG).read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path / CONFIG}: not valid JSON ({err})") from err
        ent = _mmap_safetensors(path / ENTITY_EMBEDDINGS)
        rel = _mmap_safetensors(path / RELATION_EMBEDDINGS)
        if ent.shape[1] != rel.shape[1]:
            raise ValueError(f"{path}: entity dim {ent.shape[1]} != relation dim {rel.shape[1]}")
        n = config.get("n_entities")
        if n is not None and n != ent.shape[0]:
            raise ValueError(
                f"{path}: config.json says {n} entities, {ENTITY_EMBEDDINGS} holds {ent.shape[0]}"
            )
        return cls(entity_vectors=ent, relation_vectors=rel, config=config, path=path)

    # ----------------------------------------------------------------- lazy parts
    @property
    def entity_names(self) -> list[str]:
        if self._entity_names is None:
            self._read_entities()
        assert self._entity_names is not None
        return self._entity_names

    @property
    def aliases(self) -> list[list[str]]:
        if self._aliases is None:
            self._read_entities()
        assert self._aliases is not None
        return self._aliases

    @property
    def relation_names(self) -> list[str]:
        if self._relation_names is None:
            assert self.path is not None
            rows = _read_table(self.path / RELATIONS, 2, len(self.relation_vectors))
            self._relation_names = [r[1] for r in rows]
        return self._relation_names

    @property
    def triples(self) -> torch.Tensor:
        """[T, 3] long: (head_id, relation_id, tail_id)."""
        if self._triples is None:
            self._triples = self._read_triples()
        return self._triples

    def name_of(self, entity_id: int) -> str:
        """One entity's name, without reading them all: from the names in memory when they are
        there, else from its own line of the saved entities.tsv (an index of line starts, built on
        first use in one pass over the file: ~1 s and 8 bytes an entity at 16 M, where
        :attr:`entity_names` takes ~58 s and ~10 GB; prompt expansion needs only the few names of
        the facts it spells)."""
        if not 0 <= entity_id < len(self):
            raise IndexError(f"entity id {entity_id} is not in 0..{len(self) - 1}")
        if self._entity_names is not None or self.path is None:
            return self.entity_names[entity_id]
        starts = self._entity_line_starts()
        if starts is None:  # the file does not have one line per entity: read it (and say what is wrong)
            return self.entity_names[entity_id]
        with (self.path / ENTITIES).open("rb") as f:
            f.seek(int(starts[entity_id]))
            line = f.read(int(starts[entity_id + 1] - starts[entity_id])).decode("utf-8")
        parts = line.rstrip("\n").rstrip("\r").split("\t")
        if len(parts) != 3 or parts[0] != str(entity_id):
            raise ValueError(
                f"{self.path / ENTITIES}:{entity_id + 2}: expected 'id<TAB>name<TAB>aliases' for entity "
                f"{entity_id}, got {line[:80]!r}"
            )
        return parts[1]

    def _entity_line_starts(self) -> Any:
        """Byte offsets of the lines of entities.tsv after its header, plus the end of the last
        (n + 1 values); None when the file does not hold exactly one line per entity."""
        if self._line_starts is None:
            import mmap

            import numpy as np

            assert self.path is not None
            newlines = []
            with (
                (self.path / ENTITIES).open("rb") as f,
                mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm,
            ):
                data = np.frombuffer(mm, dtype=np.uint8)
                chunk = 1 << 26  # 64 MB at a time: the comparison's mask stays small
                for start in range(0, len(data), chunk):
                    newlines.append(np.flatnonzero(data[start : start + chunk] == 10) + start)
                del data  # the mmap cannot close while a view of it lives
            starts = np.concatenate(newlines) if newlines else np.zeros(0, dtype=np.int64)
            del newlines
            starts += 1  # in place: a line starts after the newline before it
            # the header's newline, then one per entity line (the writer ends every line with one)
            self._line_starts = starts if len(starts) == len(self) + 1 else False
        return None if self._line_starts is False else self._line_starts

    def _read_entities(self) -> None:
        assert self.path is not None
        rows = _read_table(self.path / ENTITIES, 3, len(self.entity_vectors))
        self._entity_names = [r[1] for r in rows]
        self._aliases = [r[2].split("|") if r[2] else [] for r in rows]

    def _read_triples(self) -> torch.Tensor:
        import torch

        assert self.path is not None
        file = self.path / TRIPLES
        if not file.is_file():
            log.warning("%s: no %s; the store has no facts", self.path, TRIPLES)
            return torch.empty(0, 3, dtype=torch.long)
        saved = self._saved_triple_ids(file)
        if saved is not None:
            return saved
        import numpy as np

        ids, file_entities, file_relations = read_triples_array(file)
        columns = []
        for column, names, ours, what in (
            (0, file_entities, self.entity_names, "entity"),
            (1, file_relations, self.relation_names, "relation"),
            (2, file_entities, self.entity_names, "entity"),
        ):
            # The file's ids are its names in sorted order; map them onto the store's ids.
            if names == ours:
                columns.append(ids[:, column])
                continue
            to_ours = _ids_in(names, ours)
            missing = np.flatnonzero(to_ours < 0)
            if len(missing):
                raise KGFormatError(
                    str(file),
                    f"a triple names the {what} {names[missing[0]]!r}, which the store does not have",
                )
            columns.append(to_ours[ids[:, column]])
        return torch.from_numpy(np.stack(columns, axis=1))

    def _saved_triple_ids(self, tsv: Path) -> torch.Tensor | None:
        """The triples from TRIPLE_IDS, memory-mapped copy-on-write; None (read ``tsv``) where the
        store has none, or it does not match triples.tsv and config.json (a warning says why)."""
        assert self.path is not None
        file = self.path / TRIPLE_IDS
        if not file.is_file():
            return None  # an older store's layout, or the file deleted: the TSV is read
        import numpy as np
        import torch

        expected_rows = self.config.get("n_triples")
        expected_bytes = self.config.get("triples_tsv_bytes")
        problem = None
        tsv_bytes = tsv.stat().st_size
        if expected_bytes != tsv_bytes:
            problem = f"{tsv.name} has {tsv_bytes} bytes, config.json says {expected_bytes}"
        else:
            try:
                ids = np.load(file, mmap_mode="c", allow_pickle=False)
            except (ValueError, OSError) as err:
                problem = f"not a readable .npy file ({err})"
            else:
                if ids.dtype != np.int64 or ids.ndim != 2 or ids.shape[1] != 3:
                    problem = f"holds {ids.dtype} {list(ids.shape)}, not int64 [T, 3]"
                elif ids.shape[0] != expected_rows:
                    problem = f"holds {ids.shape[0]} triples, config.json says {expected_rows}"
        if problem is not None:
            log.warning(
                "%s: %s; reading %s instead (delete %s, or save the store again, to stop this warning)",
                file,
                problem,
                tsv.name,
                TRIPLE_IDS,
            )
            return None
        if len(ids) == 0:
            return torch.empty(0, 3, dtype=torch.long)
        return torch.from_numpy(ids)

    # ----------------------------------------------------------------- queries
    @property
    def dim(self) -> int:
        return int(self.entity_vectors.shape[1])

    def __len__(self) -> int:
        return int(self.entity_vectors.shape[0])

    def __repr__(self) -> str:
        return f"KnowledgeStore(n_entities={len(self)}, n_relations={len(self.relation_vectors)}, dim={self.dim}, path={self.path})"

    def id_of(self, name_or_alias: str) -> int | None:
        """Entity id of a name or alias (exact first, then after normalisation); None if unknown.

        On a clash a name beats an alias and the lower id wins.
        """
        trie, ids = self._name_index()
        key_id = trie.get(name_or_alias)
        if key_id is not None:
            return int(ids[key_id])
        if self._norm_index is None:  # built only when an exact lookup misses
            norm_trie, norm_ids, *_ = surface_index(self.forms())
            self._norm_index = (norm_trie, norm_ids)

        norm_trie, norm_ids = self._norm_index
        key_id = norm_trie.get(normalize(name_or_alias.strip()))
        return None if key_id is None else int(norm_ids[key_id])

    def forms(self) -> Iterator[tuple[str, int]]:
        """(name or alias, entity id): names first, so a name beats another entity's alias."""
        yield from ((name, i) for i, name in enumerate(self.entity_names))
        yield from ((alias, i) for i, forms in enumerate(self.aliases) for alias in forms)

    def _name_index(self) -> tuple[Any, Any]:
        """(MARISA trie of names and aliases, entity id per trie key): the saved one, memory-mapped,
        or one built now from the names (first form wins)."""
        if self._index is None:
            import numpy as np

            if self.path is not None and (self.path / NAME_INDEX).is_file():
                import marisa_trie

                trie = marisa_trie.Trie()
                trie.mmap(str(self.path / NAME_INDEX))
                ids = np.load(self.path / NAME_INDEX_IDS, mmap_mode="r", allow_pickle=False)
                if len(ids) != len(trie):
                    raise ValueError(
                        f"{self.path}: {NAME_INDEX_IDS} holds {len(ids)} ids for {len(trie)} names in "
                        f"{NAME_INDEX}; delete both files to have them rebuilt"
                    )
            else:
                import marisa_trie

                forms = list(self.forms())
                trie = marisa_trie.Trie([f for f, _ in forms])
                ids = np.full(len(trie), -1, dtype=np.int32)
                for form, i in reversed(forms):  # reversed: the first form of a key is written last
                    ids[trie[form]] = i
            self._index = (trie, ids)
        return self._index

    def facts(self, entity_id: int) -> list[tuple[int, int]]:
        """(relation_id, tail_id) of every triple whose head is ``entity_id``."""
        import torch

        if self._facts is None:
            rows = self.triples
            heads = rows[:, 0]
            if len(rows) > 1 and bool((heads[1:] < heads[:-1]).any()):
                order = torch.argsort(heads, stable=True)  # a store not (yet) saved: any order
                rows = rows[order]
                heads = rows[:, 0]
            # One offset per entity into the head-ordered rows (8 bytes an entity), rather than a
            # sorted copy of the heads beside the triples: a saved store's rows are already in
            # head order, so at 140 M facts this is one counting pass over the mapped file.
            offsets = torch.zeros(len(self) + 1, dtype=torch.long)
            if len(rows):
                torch.cumsum(torch.bincount(heads, minlength=len(self)), 0, out=offsets[1:])
            self._facts = (rows, offsets)
        rows, offsets = self._facts
        if not 0 <= entity_id < len(offsets) - 1:
            return []
        lo, hi = int(offsets[entity_id]), int(offsets[entity_id + 1])
        return [(int(r), int(t)) for _, r, t in rows[lo:hi].tolist()]

    def vector(self, name_or_alias: str) -> torch.Tensor:
        """The entity vector [dim] of a name or alias; KeyError names the entity if unknown."""
        i = self.id_of(name_or_alias)
        if i is None:
            raise KeyError(f"unknown entity {name_or_alias!r}")
        return self.entity_vectors[i]


def _ids_in(names: list[str], ours: list[str]) -> Any:
    """For each of ``names``, its index in ``ours`` (int64; -1 where absent), vectorised."""
    import pyarrow as pa
    import pyarrow.compute as pc

    found = pc.index_in(pa.array(names, pa.large_string()), value_set=pa.array(ours, pa.large_string()))
    return found.fill_null(-1).to_numpy(zero_copy_only=False).astype("int64")


def _read_table(file: Path, columns: int, expected_rows: int) -> list[list[str]]:
    """Rows of an id-numbered TSV with a header; checks the shape and that ids run 0..n-1.

    Whole-file split rather than a per-line loop with checks: a million-entity store reads
    its names in about a second.
    """
    lines = file.read_text(encoding="utf-8").split("\n")[1:]  # header first
    if lines and lines[-1] == "":
        lines.pop()
    rows = [line.rstrip("\r").split("\t") for line in lines]
    for number, parts in enumerate(rows):
        if len(parts) != columns:
            raise ValueError(
                f"{file}:{number + 2}: expected {columns} tab-separated columns, got {lines[number][:80]!r}"
            )
    if len(rows) != expected_rows:
        raise ValueError(f"{file}: {len(rows)} rows but the embeddings hold {expected_rows}")
    if rows and (rows[0][0] != "0" or rows[-1][0] != str(len(rows) - 1)):
        raise ValueError(f"{file}: ids must run 0..{len(rows) - 1} in order")
    return rows


def _mmap_safetensors(file: Path) -> torch.Tensor:
    """The float32 "embeddings" tensor of a safetensors file, memory-mapped copy-on-write.

    safetensors' ``load_file``/``safe_open.get_tensor`` copy the data into memory; for a
    16 M × 64 table that is 4 GB read before the first lookup. The format is an 8-byte
    little-endian header length, a JSON header with each tensor's dtype/shape/offsets, then
    the raw bytes, so a numpy memmap over the data gives the same tensor without reading it.
    """
    import numpy as np
    import torch

    with file.open("rb") as handle:
        head = handle.read(8)
        if len(head) != 8:
            raise ValueError(f"{file}: not a safetensors file (too short)")
        (size,) = struct.unpack("<Q", head)
        if size > 100_000_000:
            raise ValueError(f"{file}: not a safetensors file (header length {size})")
        try:
            header = json.loads(handle.read(size))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{file}: not a safetensors file ({err})") from err
    info = header.get(_KEY)
    if not isinstance(info, dict):
        raise ValueError(
            f"{file}: no tensor named {_KEY!r} (has: {', '.join(k for k in header if k != '__metadata__')})"
        )
    if info.get("dtype") != "F32" or len(info.get("shape", ())) != 2:
        raise ValueError(
            f"{file}: {_KEY!r} must be float32 [n, dim], got {info.get('dtype')} {info.get('shape')}"
        )
    rows, dim = info["shape"]
    begin, end = info["data_offsets"]
    if end - begin != rows * dim * 4:
        raise ValueError(f"{file}: data offsets do not match shape {info['shape']}")
    if rows * dim == 0:
        return torch.zeros(rows, dim)
    array = np.memmap(file, dtype="<f4", mode="c", offset=8 + size + begin, shape=(rows, dim))
    return torch.from_numpy(array)
