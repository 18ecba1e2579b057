"""Read knowledge-graph triples and aliases from UTF-8 TSV (the form of OpenKG / CN-DBpedia dumps).

- Triples: ``head<TAB>relation<TAB>tail``, one a line; ``#`` starts a comment line; blank lines
  are skipped; fields are stripped of surrounding spaces. Duplicate triples are dropped (the
  first occurrence keeps its place) and counted in the log.
- Aliases: ``entity<TAB>alias1|alias2|...``; an entity may have several lines (they merge).

Every problem raises :class:`KGFormatError` naming the file and the 1-based line, so a bad line
in a 100-million-line dump can be found and fixed.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from pathlib import Path

from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)

Triple = tuple[str, str, str]


class KGFormatError(ValueError):
    """A triples or alias file does not follow the TSV format; the message names file and line."""


def _lines(path: Path, what: str) -> Iterator[tuple[int, str]]:
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
                raise KGFormatError(
                    f"{path}:{number}: not valid UTF-8 (byte {raw[err.start : err.start + 1]!r} at column "
                    f"{err.start + 1}); convert the file to UTF-8, e.g. iconv -f GB18030 -t UTF-8"
                ) from err
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
            f"{path}:{number}: expected {expected} tab-separated columns ({form}), got {len(parts)}: {line[:80]!r}"
        )
    for i, part in enumerate(parts):
        if not part:
            raise KGFormatError(f"{path}:{number}: column {i + 1} is empty ({form}): {line[:80]!r}")
    return parts


def read_triples(path: str | Path) -> list[Triple]:
    """All distinct ``(head, relation, tail)`` triples of a TSV file, in file order."""
    path = Path(path)
    seen: set[Triple] = set()
    triples: list[Triple] = []
    duplicates = 0
    for number, line in _lines(path, "triples"):
        h, r, t = _fields(path, number, line, 3, "head<TAB>relation<TAB>tail")
        triple = (h, r, t)
        if triple in seen:
            duplicates += 1
            continue
        seen.add(triple)
        triples.append(triple)
    if not triples:
        raise KGFormatError(f"{path}: no triples found (expected lines of head<TAB>relation<TAB>tail)")
    log.info("%s: %d triples read, %d duplicates dropped", path, len(triples), duplicates)
    return triples


def read_aliases(path: str | Path, entities: Collection[str] | None = None) -> dict[str, list[str]]:
    """Entity name → its aliases (order kept, repeats removed) from ``entity<TAB>a1|a2|...``.

    With ``entities`` given, an alias line for a name not among them is an error: an alias of
    an entity the KG does not have cannot be linked to anything, and is usually a typo.
    """
    path = Path(path)
    known = set(entities) if entities is not None and not isinstance(entities, (set, dict)) else entities
    aliases: dict[str, list[str]] = {}
    for number, line in _lines(path, "aliases"):
        name, joined = _fields(path, number, line, 2, "entity<TAB>alias1|alias2|...")
        if known is not None and name not in known:
            raise KGFormatError(
                f"{path}:{number}: alias line for unknown entity {name!r}; every entity here must "
                "appear as a head or tail in the triples file"
            )
        items = [a.strip() for a in joined.split("|")]
        if any(not a for a in items):
            raise KGFormatError(f"{path}:{number}: empty alias in {joined!r} (aliases are separated by '|')")
        merged = aliases.setdefault(name, [])
        merged.extend(a for a in items if a != name and a not in merged)
    log.info("%s: aliases for %d entities", path, len(aliases))
    return aliases


def write_triples(path: str | Path, triples: Collection[Triple], header: str | None = None) -> None:
    """Write triples as TSV (atomically); names may not hold tabs or line breaks."""
    from rapiddiff.utils.io import atomic_open

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
