"""Read knowledge-graph triples and aliases from UTF-8 TSV (the form of OpenKG / CN-DBpedia dumps).

- Triples: ``head<TAB>relation<TAB>tail``, one a line; ``#`` starts a comment line; blank lines
  are skipped; fields are stripped of surrounding spaces. Duplicate triples are dropped (the
  first occurrence keeps its place) and counted in the log.
- Aliases: ``entity<TAB>alias1|alias2|...``; an entity may have several lines (they merge).

Every problem raises :class:`KGFormatError` naming the file and the 1-based line, so a bad line
in a 100-million-line dump can be found and fixed. A reader given a ``skipped`` list instead skips
each malformed line and appends ``(file:line, reason)`` to it (``rapiddiff kg train`` with
``bad_lines: skip``: a real dump's few broken lines should not stop a day's training, but each is
counted and named).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rapiddiff.utils.io import atomic_open
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)

Triple = tuple[str, str, str]


class KGFormatError(ValueError):
    """A triples or alias file does not follow the TSV format; the message names file and line."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: {reason}")
        self.where, self.reason = where, reason


Skipped = list[tuple[str, str]]
"""Malformed lines a lenient read skipped: ``(file:line, reason)``, in file order."""


def _skip_or_raise(problem: KGFormatError, skipped: Skipped | None) -> None:
    if skipped is None:
        raise problem
    skipped.append((problem.where, problem.reason))


def _report_skipped(path: Path, skipped: Skipped | None, before: int) -> None:
    if skipped is not None and len(skipped) > before:
        mine = skipped[before:]
        log.warning(
            "%s: %d malformed line(s) skipped, first: %s",
            path,
            len(mine),
            "; ".join(f"{where}: {reason}" for where, reason in mine[:3]),
        )


def _lines(path: Path, what: str, skipped: Skipped | None = None) -> Iterator[tuple[int, str]]:
    """(line number, text) for every non-blank, non-comment line; decodes each line strictly.

    Reading bytes and decoding line by line (rather than ``open(encoding="utf-8")``) lets a bad
    byte be reported with its line number instead of a file offset.
    """
    if not path.is_file():
        raise FileNotFoundError(f"{what} file not found: {path}")
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                _skip_or_raise(
                    KGFormatError(
                        f"{path}:{number}",
                        f"not valid UTF-8 (byte {raw[err.start : err.start + 1]!r} at column {err.start + 1}); "
                        "convert the file to UTF-8, e.g. iconv -f GB18030 -t UTF-8",
                    ),
                    skipped,
                )
                continue
            if number == 1:
                line = line.removeprefix("\ufeff")  # a byte-order mark from Windows editors
            line = line.rstrip("\r\n")
            stripped = line.strip()
            if not stripped or stripped.startswith("#"):
                continue
            yield number, line


def _fields(path: Path, number: int, line: str, expected: int, form: str) -> list[str]:
    parts = [p.strip() for p in line.split("\t")]
    if len(parts) != expected:
        raise KGFormatError(
            f"{path}:{number}",
            f"expected {expected} tab-separated columns ({form}), got {len(parts)}: {line[:80]!r}",
        )
    for i, part in enumerate(parts):
        if not part:
            raise KGFormatError(f"{path}:{number}", f"column {i + 1} is empty ({form}): {line[:80]!r}")
    return parts


def read_triples(path: str | Path, skipped: Skipped | None = None) -> list[Triple]:
    """All distinct ``(head, relation, tail)`` triples of a TSV file, in file order. A malformed
    line raises :class:`KGFormatError`, or with ``skipped`` given is skipped and appended to it."""
    path = Path(path)
    seen: set[Triple] = set()
    triples: list[Triple] = []
    duplicates = 0
    before = len(skipped) if skipped is not None else 0
    for number, line in _lines(path, "triples", skipped):
        try:
            h, r, t = _fields(path, number, line, 3, "head<TAB>relation<TAB>tail")
        except KGFormatError as problem:
            _skip_or_raise(problem, skipped)
            continue
        triple = (h, r, t)
        if triple in seen:
            duplicates += 1
            continue
        seen.add(triple)
        triples.append(triple)
    _report_skipped(path, skipped, before)
    if not triples:
        raise KGFormatError(str(path), "no triples found (expected lines of head<TAB>relation<TAB>tail)")
    log.info("%s: %d triples read, %d duplicates dropped", path, len(triples), duplicates)
    return triples


def read_aliases(
    path: str | Path, entities: Collection[str] | None = None, skipped: Skipped | None = None
) -> dict[str, list[str]]:
    """Entity name → its aliases (order kept, repeats removed) from ``entity<TAB>a1|a2|...``.

    With ``entities`` given, an alias line for a name not among them is malformed: an alias of
    an entity the KG does not have cannot be linked to anything, and is usually a typo. A malformed
    line raises :class:`KGFormatError`, or with ``skipped`` given is skipped and appended to it.
    """
    path = Path(path)
    known = set(entities) if entities is not None and not isinstance(entities, (set, dict)) else entities
    aliases: dict[str, list[str]] = {}
    before = len(skipped) if skipped is not None else 0
    for number, line in _lines(path, "aliases", skipped):
        try:
            name, items = _alias_fields(path, number, line, known)
        except KGFormatError as problem:
            _skip_or_raise(problem, skipped)
            continue
        merged = aliases.setdefault(name, [])
        merged.extend(a for a in items if a != name and a not in merged)
    _report_skipped(path, skipped, before)
    log.info("%s: aliases for %d entities", path, len(aliases))
    return aliases


def _alias_fields(path: Path, number: int, line: str, known: Collection[str] | None) -> tuple[str, list[str]]:
    name, joined = _fields(path, number, line, 2, "entity<TAB>alias1|alias2|...")
    if known is not None and name not in known:
        raise KGFormatError(
            f"{path}:{number}",
            f"alias line for unknown entity {name!r}; every entity here must appear as a head or tail "
            "in the triples file",
        )
    items = [a.strip() for a in joined.split("|")]
    if any(not a for a in items):
        raise KGFormatError(f"{path}:{number}", f"empty alias in {joined!r} (aliases are separated by '|')")
    return name, items


def write_triples(path: str | Path, triples: Collection[Triple], header: str | None = None) -> None:
    """Write triples as TSV (atomically); names may not hold tabs or line breaks."""

    with atomic_open(path, "w", encoding="utf-8") as handle:
        if header:
            handle.write(f"# {header}\n")
        for triple in triples:
            for field in triple:
                _check_field(field, path)
            handle.write("\t".join(triple) + "\n")


def _check_field(value: str, where: str | Path) -> None:
    if not value or value != value.strip() or any(c in value for c in "\t\r\n"):
        raise ValueError(
            f"{where}: name {value!r} cannot be written to TSV (empty, surrounding spaces, tab or line break)"
        )


def check_fields(values: Sequence[str], where: str | Path) -> None:
    """:func:`_check_field` for every value, the all-fine case in passes that run no Python code
    per value (``all``, ``in`` on one joined string, ``map``): 16 M names in seconds instead of
    a minute; a bad value is then found by the per-value check, which names it."""
    joined = "\x00".join(values)
    if (
        not all(values)
        or "\t" in joined
        or "\r" in joined
        or "\n" in joined
        or any(map(str.__ne__, values, map(str.strip, values)))
    ):
        for value in values:
            _check_field(value, where)


def read_triples_array(
    path: str | Path, *, sort: bool = False, skipped: Skipped | None = None
) -> tuple[Any, list[str], list[str]]:
    """The distinct triples of a TSV file as ids: ``(ids, entity_names, relation_names)``.

    ``ids`` is an int64 array [T, 3] of (head, relation, tail) in file order (first occurrences),
    or with ``sort`` in (head, relation, tail) order (:func:`group_triples`: one sort instead of
    the file order's stable argsort, for a reader that sorts them anyway, as TransE does);
    names are sorted by code point (pykeen's labelling, so ids match
    ``TriplesFactory.from_labeled_triples(read_triples(path))``). The same file format and rules
    as :func:`read_triples`, but parsed by pyarrow's multi-threaded CSV reader and deduplicated
    with numpy: 140 M triples take seconds and a few bytes per triple, where a Python tuple per
    triple would take tens of GB. A file the fast reader cannot take as it is (bad UTF-8, a
    line without three columns, an empty field) goes through :func:`read_triples`, which names
    the file and line of the problem, or with ``skipped`` given skips and records it (that reader
    holds a Python tuple per triple: a huge file reads fastest once its bad lines are fixed).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"triples file not found: {path}")
    if path.stat().st_size < _SMALL_FILE:
        # A small file (a model's own store): the plain reader, without importing pyarrow (whose
        # compute module takes half a second to import: a tenth of a fresh `rapiddiff generate`).
        return _ordered(*_ids_of(read_triples(path, skipped)), sort)
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pacsv

    bad_rows = 0

    def invalid(row: Any) -> str:
        nonlocal bad_rows
        text = row.text.strip()
        if text and not text.startswith("#"):  # blank and comment lines are skipped, as in _lines
            bad_rows += 1
        return "skip"

    columns = ["head", "relation", "tail"]
    try:
        table = pacsv.read_csv(
            path,
            read_options=pacsv.ReadOptions(column_names=columns, block_size=64 << 20),
            parse_options=pacsv.ParseOptions(
                delimiter="\t", quote_char=False, escape_char=False, invalid_row_handler=invalid
            ),
            convert_options=pacsv.ConvertOptions(
                column_types=dict.fromkeys(columns, pa.large_string()),
                strings_can_be_null=False,
                quoted_strings_can_be_null=False,
            ),
        )
    except (pa.ArrowInvalid, UnicodeDecodeError):
        table = None
    if table is not None and not bad_rows:
        fields = [pc.utf8_trim_whitespace(table[c].combine_chunks()) for c in columns]
        if len(fields[0]):
            fields[0] = pc.utf8_ltrim(fields[0], characters="\ufeff")  # a byte-order mark
        comment = pc.starts_with(fields[0], "#")  # a comment line that happens to hold two tabs
        if pc.any(comment).as_py():
            keep = pc.invert(comment)
            fields = [pc.filter(f, keep) for f in fields]
        if any(pc.any(pc.equal(pc.utf8_length(f), 0)).as_py() for f in fields):
            table = None  # an empty field: the exact reader names its line
    if table is None or bad_rows:  # raises KGFormatError naming the line, or skips and names it
        if skipped is not None:
            log.warning("%s: malformed lines: reading it with the exact reader to name them (slower)", path)
        return _ordered(*_ids_of(read_triples(path, skipped)), sort)
    # Entities: one dictionary for heads and tails, sorted so ids follow code-point order.
    n = len(fields[0])
    entities = pc.dictionary_encode(pa.chunked_array([fields[0], fields[2]]).combine_chunks())
    relations = pc.dictionary_encode(fields[1])
    ent_ids, entity_names = _sorted_codes(entities)
    rel_ids, relation_names = _sorted_codes(relations)
    ids = np.stack([ent_ids[:n], rel_ids, ent_ids[n:]], axis=1)
    del ent_ids, rel_ids
    if sort:
        ids = group_triples(ids, len(entity_names), len(relation_names))
        duplicates = n - len(ids)
    else:
        ids, duplicates = _distinct_rows(ids, len(entity_names), len(relation_names))
    log.info("%s: %d triples read, %d duplicates dropped", path, len(ids), duplicates)
    return ids, entity_names, relation_names


_SMALL_FILE = 16 << 20


def _ordered(ids: Any, entity_names: list[str], relation_names: list[str], sort: bool) -> Any:
    if sort:
        ids = group_triples(ids, len(entity_names), len(relation_names))
    return ids, entity_names, relation_names


def _ids_of(triples: list[Triple]) -> tuple[Any, list[str], list[str]]:
    """:func:`read_triples_array`'s result from distinct name triples (sorted names, file order)."""
    import numpy as np

    entity_names = sorted({h for h, _, _ in triples} | {t for _, _, t in triples})
    relation_names = sorted({r for _, r, _ in triples})
    ent = {n: i for i, n in enumerate(entity_names)}
    rel = {n: i for i, n in enumerate(relation_names)}
    ids = np.array([(ent[h], rel[r], ent[t]) for h, r, t in triples], dtype=np.int64).reshape(-1, 3)
    return ids, entity_names, relation_names


def _sorted_codes(encoded: Any) -> tuple[Any, list[str]]:
    """int64 codes and the dictionary of a pyarrow DictionaryArray, renumbered in sorted order."""
    import numpy as np
    import pyarrow.compute as pc

    order = pc.sort_indices(encoded.dictionary).to_numpy().astype(np.int64)  # UTF-8 order = code points
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    codes = rank[encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)]
    return codes, encoded.dictionary.take(order).to_pylist()


def _distinct_rows(ids: Any, n_entities: int, n_relations: int) -> tuple[Any, int]:
    """The first occurrence of each distinct row of an int64 [T, 3] array, in order; and the count dropped."""
    import numpy as np

    if n_entities * n_entities * n_relations < 2**63:
        keys = (ids[:, 0] * n_relations + ids[:, 1]) * n_entities + ids[:, 2]
        _, first = np.unique(keys, return_index=True)
    else:  # ids too large for one int64 key
        _, first = np.unique(ids, axis=0, return_index=True)
    if len(first) == len(ids):
        return ids, 0
    first.sort()
    return ids[first], len(ids) - len(first)


def group_triples(ids: Any, n_entities: int, n_relations: int) -> Any:
    """The distinct rows of an int64 [T, 3] id array sorted by (head, relation, tail).

    What a KnowledgeStore writes: every head's facts in one run, by relation, so fusion's
    relation table (``rapiddiff.models.fusion.relation_table``) finds its keys already in order
    and skips its sort (6 instead of 20 CPU-s at 140 M facts). Rows already in that order and
    distinct (a TransE run's triples) are returned as they are after one linear check; otherwise
    one sort of int64 keys (head·R + relation)·E + tail, decoded in place: 140 M rows take
    seconds and 2 × 8 bytes a row beyond the input and output.
    """
    import numpy as np

    ids = np.asarray(ids)
    if ids.ndim != 2 or ids.shape[1] != 3:
        raise ValueError(f"triples must be [T, 3] ids, got shape {list(ids.shape)}")
    if len(ids) < 2:
        return ids
    n_entities, n_relations = max(int(n_entities), 1), max(int(n_relations), 1)
    if n_entities * n_entities * n_relations >= 2**63:  # ids too large for one int64 key
        return np.unique(ids, axis=0)  # lexicographic rows: the same order
    keys = np.multiply(ids[:, 0], n_relations, dtype=np.int64)
    keys += ids[:, 1]
    keys *= n_entities
    keys += ids[:, 2]
    if bool((keys[1:] > keys[:-1]).all()):
        return ids
    keys.sort()
    distinct = np.empty(len(keys), dtype=bool)
    distinct[0] = True
    np.not_equal(keys[1:], keys[:-1], out=distinct[1:])
    if not distinct.all():
        keys = keys[distinct]
    del distinct
    out = np.empty((len(keys), 3), dtype=np.int64)
    np.floor_divide(keys, n_relations * n_entities, out=out[:, 0])
    np.remainder(keys, n_relations * n_entities, out=keys)
    np.floor_divide(keys, n_entities, out=out[:, 1])
    np.remainder(keys, n_entities, out=out[:, 2])
    return out


def write_triples_array(
    path: str | Path,
    ids: Any,
    entity_names: Sequence[str],
    relation_names: Sequence[str],
    header: str | None = None,
    chunk: int = 1 << 20,
) -> None:
    """Write id triples as a names TSV (atomically), as :func:`write_triples` would, but vectorised.

    Each name's UTF-8 bytes are stored once; the lines are gathered from them with numpy, a chunk
    of triples at a time, so 140 M triples take about a minute instead of a Python loop's ten.
    Lines are written in the order of ``ids``; a KnowledgeStore passes them through
    :func:`group_triples` first.
    """
    import numpy as np

    ent_tab, ent_tab_start, ent_len = _name_buffer(entity_names, b"\t", path)
    ent_nl, ent_nl_start, _ = _name_buffer(entity_names, b"\n", path)
    rel_tab, rel_start, rel_len = _name_buffer(relation_names, b"\t", path)
    buf = np.concatenate([ent_tab, rel_tab, ent_nl])
    rel_start = rel_start + len(ent_tab)
    ent_nl_start = ent_nl_start + len(ent_tab) + len(rel_tab)
    ids = np.asarray(ids, dtype=np.int64).reshape(-1, 3)

    def lines(begin: int) -> bytes:
        h, r, t = ids[begin : begin + chunk].T
        starts = np.stack([ent_tab_start[h], rel_start[r], ent_nl_start[t]], axis=1).reshape(-1)
        lengths = np.stack([ent_len[h], rel_len[r], ent_len[t]], axis=1).reshape(-1) + 1
        return _gather(buf, starts, lengths).tobytes()

    # numpy releases the GIL in repeat/take, so chunks are built by threads and written in order.
    workers = max(1, min(8, (os.cpu_count() or 1)))
    with atomic_open(path, "wb") as handle, ThreadPoolExecutor(workers) as pool:
        if header:
            handle.write(f"# {header}\n".encode())
        for block in pool.map(lines, range(0, len(ids), chunk)):
            handle.write(block)


def _name_buffer(names: Sequence[str], end: bytes, where: str | Path) -> tuple[Any, Any, Any]:
    """(all names' UTF-8 bytes, each followed by ``end``; start offsets; byte lengths)."""
    import numpy as np

    encoded = [n.encode("utf-8") for n in names]
    if any(not e or e != e.strip() or b"\t" in e or b"\n" in e or b"\r" in e for e in encoded):
        for n in names:  # find the offending one for the message
            _check_field(n, where)
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    buf = np.frombuffer(end.join(encoded) + end, dtype=np.uint8)
    starts = np.cumsum(lengths + 1) - (lengths + 1)
    return buf, starts, lengths


def _gather(buf: Any, starts: Any, lengths: Any) -> Any:
    """The segments ``buf[starts[i] : starts[i] + lengths[i]]`` concatenated, without a Python loop."""
    import numpy as np

    if not len(lengths):
        return buf[:0]
    index = np.int32 if len(buf) + int(lengths.sum()) < 2**31 else np.int64  # half the memory traffic
    ends = np.cumsum(lengths, dtype=index)
    shift = np.repeat((starts - (ends - lengths)).astype(index), lengths)  # source - destination
    shift += np.arange(int(ends[-1]), dtype=index)
    return buf.take(shift)
