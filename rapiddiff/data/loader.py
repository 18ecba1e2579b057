"""Image–caption datasets users already have, loaded through ``datasets``.

Sources: an image folder with ``metadata.jsonl`` (``.csv``/``.parquet``; the imagefolder
convention), a CSV/TSV/JSONL/parquet table with an image column (path or base64) and a text column,
a ``rapiddiff data prepare`` folder, or shards streamed (:class:`StreamingImageTextDataset`).
Images are decoded here so that a corrupt file costs one sample, not the run: bad items are
skipped, counted in ``.skipped`` and written to ``skip_log``.
"""

from __future__ import annotations

import glob
import json
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch.utils.data import Dataset, IterableDataset

from rapiddiff.data.images import BadImageError, describe, image_source, open_image, to_rgb
from rapiddiff.data.manifest import load_prepared, prepared_table
from rapiddiff.data.text import clean_caption
from rapiddiff.data.transforms import build_image_transform
from rapiddiff.utils.logging import get_logger

log = get_logger(__name__)

TABLE_SUFFIXES = {".csv": "csv", ".tsv": "csv", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
METADATA_NAMES = ("metadata.jsonl", "metadata.csv", "metadata.parquet")
Verify = Literal["none", "header", "full"]


@dataclass
class ImageTextDataConfig:
    """How to read and transform an image–caption dataset (the YAMLs in configs/data/)."""

    source: str = ""
    """Image folder with metadata.jsonl, or a CSV/TSV/JSONL/parquet file, or (streaming) a glob of shards."""
    image_size: int = 256
    """Training resolution: shorter side resized to this, then cropped square."""
    image_column: str = "image"
    """Column with the image path or base64 (folders fall back to ``file_name``)."""
    text_column: str = "text"
    """Column with the caption."""
    column_names: list[str] | None = None
    """Column names for a headerless CSV/TSV (e.g. Chinese-CLIP's ``[image_id, image]``)."""
    crop: Literal["center", "random"] = "center"
    """Crop after resizing; random crop is an augmentation for training."""
    hflip: bool = False
    """Random horizontal flips. Off by default: captions say 左/右."""
    small_images: Literal["upscale", "skip"] = "upscale"
    """Images whose shorter side is below image_size: upscale them, or skip them."""
    t2s: bool = False
    """Convert traditional Chinese captions to simplified (OpenCC t2s)."""
    verify: Verify = "header"
    """Checks when the dataset is built: header (exists, is an image, its size), full (decode), none."""
    streaming: bool = False
    """Stream rows instead of loading the table (for data that does not fit on disk)."""
    skip_log: str | None = None
    """JSON-lines file that lists every skipped item and why."""
    jpeg_draft: bool = True
    """Decode large JPEGs at 1/2-1/8 scale when that still covers image_size (much faster)."""

    def __post_init__(self) -> None:
        if self.image_size < 8:
            raise ValueError(f"image_size must be at least 8, got {self.image_size}")


def _builder(path: Path) -> tuple[str, dict[str, Any]]:
    """The ``datasets`` packaged builder and its options for a table file."""
    suffix = path.suffix.lower()
    if suffix not in TABLE_SUFFIXES:
        raise ValueError(
            f"{path}: unsupported table format {suffix!r}; use one of {', '.join(TABLE_SUFFIXES)} "
            "or an image folder with metadata.jsonl"
        )
    options: dict[str, Any] = {}
    if suffix == ".tsv":
        # QUOTE_NONE: captions contain quote marks, which csv quoting would swallow.
        options.update(delimiter="\t", quoting=3)
    return TABLE_SUFFIXES[suffix], options


def resolve_table(source: str | os.PathLike[str]) -> tuple[Path, Path]:
    """(table file, folder that relative image paths start from) for a folder or a file."""
    path = Path(source).expanduser()
    if path.is_dir():
        for name in METADATA_NAMES:
            if (path / name).is_file():
                return path / name, path
        raise FileNotFoundError(
            f'{path}: an image folder needs a metadata.jsonl ({{"file_name": ..., "text": ...}} per line); '
            f"none of {', '.join(METADATA_NAMES)} found"
        )
    if not path.is_file():
        raise FileNotFoundError(f"dataset source not found: {path}")
    return path, path.parent


def _prepared_source(source: str | os.PathLike[str]) -> Path | None:
    """The table a ``rapiddiff data prepare`` folder given as a dataset source stands for (None
    where ``source`` is a dataset itself: an image folder's own metadata file wins)."""
    path = Path(source).expanduser()
    if not path.is_dir() or any((path / name).is_file() for name in METADATA_NAMES):
        return None
    return prepared_table(path)


def read_table(
    table: Path,
    *,
    column_names: Sequence[str] | None = None,
    streaming: bool = False,
    data_files: Any = None,
    quiet: bool = False,
) -> Any:
    """The rows of ``table`` as a ``datasets.Dataset`` (or ``IterableDataset`` when streaming).

    A malformed line makes this raise; :func:`read_table_lenient` skips it instead. ``quiet``
    silences ``datasets``' own error log (the caller reports the failure).
    """
    import datasets

    builder, options = _builder(table)
    if column_names:
        if builder != "csv":
            raise ValueError(f"{table}: column_names only applies to headerless CSV/TSV files")
        options["column_names"] = list(column_names)
    if builder == "csv":
        options["keep_default_na"] = False  # an empty caption stays "", not NaN
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL if quiet else datasets.logging.ERROR)
    datasets.disable_progress_bars()
    try:
        return datasets.load_dataset(
            builder, data_files=data_files or str(table), split="train", streaming=streaming, **options
        )
    except (ValueError, TypeError, OSError) as err:
        raise ValueError(f"{table}: cannot read as {builder} ({err})") from err
    except Exception as err:  # pyarrow/pandas parser errors have many types
        raise ValueError(f"{table}: cannot read as {builder}: {type(err).__name__}: {err}") from err
    finally:
        datasets.logging.set_verbosity(verbosity)
        datasets.enable_progress_bars()


# Columns of a table read line by line: the 1-based line of each record, and why it is unusable.
LINE_COLUMN = "__rapiddiff_line__"
ERROR_COLUMN = "__rapiddiff_error__"
CONTENT_COLUMN = "__rapiddiff_content__"
_INTERNAL = (LINE_COLUMN, ERROR_COLUMN, CONTENT_COLUMN)
_FILE_KEY = "__rapiddiff_file__"  # which shard a streamed record came from
LINE_FORMATS = (".jsonl", ".json", ".csv", ".tsv")


def _snippet(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def _is_json_array(path: Path) -> bool:
    with path.open("rb") as handle:
        return handle.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[")


def _type_name(value: Any) -> str:
    return (
        "number" if isinstance(value, (int, float)) and not isinstance(value, bool) else type(value).__name__
    )


def _bad_json_line(number: int, raw: bytes, reason: str) -> dict[str, Any]:
    # Built only for a bad line: the good ones (every line of a streamed shard) skip the snippet.
    content = _snippet(raw.decode("utf-8", "replace").strip())
    return {LINE_COLUMN: number, CONTENT_COLUMN: content, ERROR_COLUMN: f"malformed line ({reason})"}


def parse_json_lines(path: Path) -> Iterator[dict[str, Any]]:
    """One dict per non-blank line of a JSON-lines file; a line that is not a JSON object (or whose
    field types differ from the lines before it) becomes ``{ERROR_COLUMN: reason, ...}``.
    Every record carries its 1-based line in ``LINE_COLUMN``."""
    types: dict[str, str] = {}
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8-sig" if number == 1 else "utf-8"))
            except UnicodeDecodeError as err:
                yield _bad_json_line(number, raw, f"not valid UTF-8 at byte {err.start + 1}")
                continue
            except json.JSONDecodeError as err:
                yield _bad_json_line(number, raw, f"{err.msg} at column {err.colno}")
                continue
            if not isinstance(row, dict):
                yield _bad_json_line(number, raw, f"a JSON {type(row).__name__}, not an object")
                continue
            clash = next(
                (
                    f"field {key!r} is {_type_name(value)} where earlier lines have {types[key]}"
                    for key, value in row.items()
                    if value is not None and types.get(key, _type_name(value)) != _type_name(value)
                ),
                None,
            )
            if clash:
                yield _bad_json_line(number, raw, clash)
                continue
            for key, value in row.items():
                if value is not None:
                    types.setdefault(key, _type_name(value))
            yield {**row, LINE_COLUMN: number}


def parse_delimited_lines(path: Path, column_names: Sequence[str] | None = None) -> Iterator[dict[str, Any]]:
    """One dict per record of a CSV/TSV file (strings), as :func:`read_table` reads it (TSV without
    quoting); a record with the wrong number of fields or bytes that are not UTF-8 becomes
    ``{ERROR_COLUMN: reason, ...}``. Every record carries its 1-based first line in ``LINE_COLUMN``."""
    import csv
    import io

    tsv = path.suffix.lower() == ".tsv"
    csv.field_size_limit(1 << 30)  # base64 images are long fields
    with path.open("rb") as raw:
        text = io.TextIOWrapper(raw, encoding="utf-8-sig", errors="surrogateescape", newline="")
        reader = csv.reader(text, delimiter="\t", quoting=csv.QUOTE_NONE) if tsv else csv.reader(text)
        header = list(column_names) if column_names else None
        end = 0
        for record in reader:
            start, end = end + 1, reader.line_num
            if not record or record == [""]:
                continue
            if header is None:
                header = record
                continue
            reason = None
            if len(record) != len(header):
                reason = f"malformed line ({len(record)} fields where the header has {len(header)})"
            else:
                try:
                    "".join(record).encode("utf-8")
                except UnicodeEncodeError:
                    reason = "malformed line (not valid UTF-8)"
            if reason is not None:
                # The snippet only for a bad record: good ones (every record streamed) skip it.
                content = _snippet(
                    ("\t" if tsv else ",")
                    .join(record)
                    .encode("utf-8", "surrogateescape")
                    .decode("utf-8", "replace")
                )
                yield {LINE_COLUMN: start, ERROR_COLUMN: reason, CONTENT_COLUMN: content}
                continue
            yield {**dict(zip(header, record, strict=True)), LINE_COLUMN: start}


def parse_lines(path: Path, column_names: Sequence[str] | None = None) -> Iterator[dict[str, Any]]:
    """Records of a JSONL/CSV/TSV file read line by line (see :func:`parse_json_lines`)."""
    if path.suffix.lower() in (".jsonl", ".json"):
        return parse_json_lines(path)
    return parse_delimited_lines(path, column_names)


def read_table_lenient(table: Path, *, column_names: Sequence[str] | None = None) -> Any:
    """:func:`read_table`, except that a JSONL/CSV/TSV file with malformed lines is read line by
    line: the table then has every record, each with its line (``LINE_COLUMN``), and a bad line's
    record has the reason in ``ERROR_COLUMN`` for the dataset to skip and log. Row ``k`` is the
    ``k``-th record either way (the ``k``-th non-blank line of a JSONL file)."""
    try:
        return read_table(table, column_names=column_names, quiet=True)
    except ValueError as err:
        suffix = table.suffix.lower()
        if suffix not in LINE_FORMATS or (suffix == ".json" and _is_json_array(table)):
            raise
        if column_names and suffix not in (".csv", ".tsv"):
            raise
        records = list(parse_lines(table, column_names))
        bad = [r for r in records if r.get(ERROR_COLUMN)]
        if not bad:
            raise  # not a malformed line: datasets' error stands
        if len(bad) == len(records):
            raise ValueError(
                f"{table}: no line could be read (line {bad[0][LINE_COLUMN]}: {bad[0][ERROR_COLUMN]})"
            ) from err
        log.warning(
            "%s: %d malformed line(s) skipped (first: line %d, %s); the rest read line by line",
            table,
            len(bad),
            bad[0][LINE_COLUMN],
            bad[0][ERROR_COLUMN],
        )
        import datasets

        keys = list(dict.fromkeys(k for r in records for k in r))
        return datasets.Dataset.from_dict({k: [r.get(k) for r in records] for k in keys})


def record_lines(table: Path, column_names: Sequence[str] | None = None) -> list[int] | None:
    """The 1-based first line of each record of a JSONL/CSV/TSV table (``None`` for other formats)."""
    suffix = table.suffix.lower()
    if suffix not in LINE_FORMATS or (suffix == ".json" and _is_json_array(table)):
        return None
    if suffix in (".jsonl", ".json"):
        with table.open("rb") as handle:
            return [n for n, raw in enumerate(handle, start=1) if raw.strip()]
    return [int(r[LINE_COLUMN]) for r in parse_delimited_lines(table, column_names)]


def _pick_image_column(columns: Sequence[str], wanted: str, where: Path) -> str:
    if wanted in columns:
        return wanted
    for fallback in ("file_name", "image", "img", "image_base64", "jpg", "png", "webp"):
        if fallback in columns:
            return fallback
    raise ValueError(
        f"{where}: no image column {wanted!r}; columns are {', '.join(columns)} (set image_column)"
    )


def _check_text_column(columns: Sequence[str], wanted: str, where: Path) -> None:
    if wanted not in columns:
        raise ValueError(
            f"{where}: no text column {wanted!r}; columns are {', '.join(columns)} (set text_column)"
        )


class SkipLog:
    """Counts skipped items and appends them to a JSON-lines file (safe from several workers:
    each line is one ``O_APPEND`` write)."""

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = Path(path) if path else None
        self.items: list[tuple[dict[str, Any], str]] = []
        self._lock = threading.Lock()
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, item: dict[str, Any], reason: str) -> None:
        with self._lock:
            self.items.append((item, reason))
            if self.path:
                line = json.dumps({**item, "reason": reason}, ensure_ascii=False) + "\n"
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, line.encode("utf-8"))
                finally:
                    os.close(fd)

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers under "spawn" pickle us
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def counts(self) -> Counter[str]:
        return Counter(reason_kind(reason) for _, reason in self.items)


def reason_kind(reason: str) -> str:
    """The first words of a reason, without the file name: "missing file", "empty caption"..."""
    return reason.split(" (")[0].split(" /")[0].split(":")[0]


class _Annotations:
    """Entity spans and token ids computed once per caption (so no epoch links twice)."""

    def __init__(
        self,
        texts: Sequence[str],
        linker: Any = None,
        tokenizer: Any = None,
        max_length: int = 77,
        spans: list[list[tuple[int, int, int]]] | None = None,
    ):
        self.spans: list[list[tuple[int, int, int]]] | None = spans  # from `rapiddiff data prepare`
        self.tokens: dict[str, torch.Tensor] | None = None
        if linker is not None:
            self.spans = [[(s.start, s.end, s.entity_id) for s in linker.link_affirmed(t)] for t in texts]
        if tokenizer is not None:
            self.tokens = tokenize_with_entities(texts, tokenizer, self.spans, max_length=max_length)

    def item(self, i: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.spans is not None:
            out["entities"] = self.spans[i]
        if self.tokens is not None:
            out.update({k: v[i].long() for k, v in self.tokens.items()})
        return out


def tokenize_with_entities(
    texts: Sequence[str],
    tokenizer: Any,
    spans: Sequence[Sequence[tuple[int, int, int]]] | None,
    *,
    max_length: int = 77,
) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask and token_entity_ids [N, L] (-1 where a token is in no entity).

    A token belongs to an entity when its character span lies inside the entity's span (the
    offsets come from the fast tokenizer's ``offset_mapping``).
    """
    encoded = tokenizer(
        list(texts),
        padding="max_length",
        truncation=True,
        max_length=max_length,
        return_tensors="pt",
        return_offsets_mapping=spans is not None,
    )
    out = {
        "input_ids": encoded["input_ids"].to(torch.int32),
        "attention_mask": encoded["attention_mask"].to(torch.int8),
    }
    if spans is not None:
        offsets = encoded["offset_mapping"]  # (N, L, 2)
        ids = torch.full(offsets.shape[:2], -1, dtype=torch.int32)
        for row, row_spans in enumerate(spans):
            starts, ends = offsets[row, :, 0], offsets[row, :, 1]
            real = ends > starts  # special and padding tokens have empty offsets
            for start, end, entity in row_spans:
                ids[row, real & (starts >= start) & (ends <= end)] = entity
        out["token_entity_ids"] = ids
    return out


class ImageTextDataset(Dataset):
    """A map-style dataset of ``{"pixel_values": [3, H, W] in [-1, 1], "text": str, "index": int}``.

    Items with an empty caption, a missing/undecodable image or (with ``small_images="skip"``)
    a too-small image are found when the dataset is built (``verify="header"`` opens each image's
    header; ``"full"`` decodes it) and never returned; ``len()`` counts only good items and
    ``index`` is the row in the source table. A file that only fails when fully decoded is
    skipped at that moment and its slot takes the next good item (``index`` says which), so a run
    never stops; a warning names both, once per run: what workers find is shared, so the item is
    logged and counted once (``.skipped`` in the main process too) and not decoded again.

    With ``linker`` (an ``EntityLinker``) items carry ``"entities"`` — (start, end, entity_id)
    character spans — and with ``tokenizer`` (a fast HF tokenizer) ``input_ids``,
    ``attention_mask`` and ``token_entity_ids`` [max_length]; both computed once, up front.
    ``jpeg_draft`` decodes large JPEGs at a reduced scale that still covers ``image_size``.
    ``prepared`` is a folder written by ``rapiddiff data prepare``: its checked rows (no scan)
    and, when it has them and no ``linker`` is given, its entity spans are used. Such a folder is
    also a ``source``: the table it was prepared from, with its rows.
    """

    def __init__(
        self,
        source: str | os.PathLike[str],
        *,
        image_size: int = 256,
        image_column: str = "image",
        text_column: str = "text",
        column_names: Sequence[str] | None = None,
        crop: Literal["center", "random"] = "center",
        hflip: bool = False,
        small_images: Literal["upscale", "skip"] = "upscale",
        t2s: bool = False,
        verify: Verify = "header",
        skip_log: str | os.PathLike[str] | None = None,
        linker: Any = None,
        tokenizer: Any = None,
        max_length: int = 77,
        transform: Callable[[Any], torch.Tensor] | None = None,
        jpeg_draft: bool = True,
        prepared: str | os.PathLike[str] | None = None,
        progress: bool = False,
    ) -> None:
        if small_images not in ("upscale", "skip"):
            raise ValueError(f"small_images must be 'upscale' or 'skip', got {small_images!r}")
        if verify not in ("none", "header", "full"):
            raise ValueError(f"verify must be 'none', 'header' or 'full', got {verify!r}")
        if prepared is None and (table := _prepared_source(source)) is not None:
            source, prepared = table, source
        self.table, self.base_dir = resolve_table(source)
        self.image_size = image_size
        self.small_images = small_images
        self.jpeg_draft = jpeg_draft
        self.transform = transform or build_image_transform(image_size, crop=crop, hflip=hflip)
        self._log = SkipLog(skip_log)
        self._column_names = list(column_names) if column_names else None
        self._rows = read_table_lenient(self.table, column_names=column_names)
        columns = [c for c in self._rows.column_names if c not in _INTERNAL]
        # Read line by line (the table had malformed lines): each record's line, and the bad ones.
        self._errors: list[str | None] | None = None
        self._lines: list[int] | None = None
        if ERROR_COLUMN in self._rows.column_names:
            self._errors = self._rows.data.column(ERROR_COLUMN).to_pylist()
            self._lines = self._rows.data.column(LINE_COLUMN).to_pylist()
        self.image_column = _pick_image_column(columns, image_column, self.table)
        _check_text_column(columns, text_column, self.table)
        self.text_column = text_column
        texts = [clean_caption(t, t2s=t2s) for t in self._rows.data.column(text_column).to_pylist()]
        self.image_sizes: dict[int, tuple[int, int]] = {}  # row → (width, height), from the scan
        spans = None
        if prepared is not None:
            settings = {"t2s": t2s, "small_images": small_images, "image_size": image_size}
            keep, skipped, spans = load_prepared(prepared, self.table, texts, settings)
            for item, reason in skipped:
                self._log.items.append((item, reason))
        else:
            keep = self._scan(texts, verify, progress)
        self.indices: list[int] = keep
        self.texts: list[str] = [texts[i] for i in keep]
        self.annotations = _Annotations(self.texts, linker, tokenizer, max_length, spans=spans)
        # Items found undecodable after the scan. In shared memory, so DataLoader workers (forked or
        # spawned, and started again every epoch) see each other's finds: each bad item is
        # decoded, logged and counted once per run, not once per worker and epoch.
        self._failed = torch.zeros(len(keep), dtype=torch.bool).share_memory_()
        self._seen_failed: set[int] = set()  # those whose reason this process recorded
        # False: items carry no pixels (a trainer that cached every image's latents sets this,
        # so its loader workers stop decoding images it never reads).
        self.decode_images = True
        if self._log.items:
            counts = ", ".join(f"{n} {k}" for k, n in self._log.counts().most_common())
            where = f"; listed in {self._log.path}" if self._log.path else ""
            log.warning(
                "%s: skipped %d of %d items (%s)%s",
                self.table,
                len(self._log.items),
                len(texts),
                counts,
                where,
            )

    @property
    def skipped(self) -> list[tuple[dict[str, Any], str]]:
        """(item, reason) for every item skipped so far, including those DataLoader workers found."""
        found_elsewhere = [
            (self._item_info(self.indices[j], self.texts[j]), "failed to decode in a DataLoader worker")
            for j in self._failed.nonzero().flatten().tolist()
            if j not in self._seen_failed
        ]
        return self._log.items + found_elsewhere

    def image_cell(self, row: int) -> Any:
        """The image cell of table row ``row`` as stored: a path, base64 text, bytes or a struct."""
        # Straight from the Arrow column: datasets' row access builds a whole formatted row.
        return self._rows.data.column(self.image_column)[row].as_py()

    def line(self, row: int) -> int | None:
        """The 1-based line of the table where record ``row`` starts (None for parquet/JSON arrays)."""
        if self._lines is None:
            # Found lazily, the first time a skipped item needs it: the fast path has no line column.
            self._lines = record_lines(self.table, self._column_names) or []
        return self._lines[row] if row < len(self._lines) else None

    def _item_info(self, row: int, text: str) -> dict[str, Any]:
        info: dict[str, Any] = {"source": str(self.table)}
        line = self.line(row)
        if line is not None:
            info["line"] = line
        info["row"] = row
        if self._errors is not None and self._errors[row]:
            info["content"] = self._rows.data.column(CONTENT_COLUMN)[row].as_py()
            return info
        return info | {"image": describe(self.image_cell(row)), "text": text}

    def _scan(self, texts: list[str], verify: Verify, progress: bool) -> list[int]:
        from tqdm.auto import tqdm

        images = self._rows.data.column(self.image_column) if verify != "none" else None
        keep = []
        for row in tqdm(
            range(len(texts)),
            desc=f"checking {self.table.parent.name if self.table.name in METADATA_NAMES else self.table.name}",
            disable=not progress,
            unit="item",
        ):
            if self._errors is not None and self._errors[row]:
                self._log.add(self._item_info(row, ""), self._errors[row])
                continue
            if not texts[row]:
                self._log.add(self._item_info(row, texts[row]), "empty caption")
                continue
            if images is not None:
                reason = self._check_image(row, images[row].as_py(), verify)
                if reason:
                    self._log.add(self._item_info(row, texts[row]), reason)
                    continue
            keep.append(row)
        return keep

    def _check_image(self, row: int, value: Any, verify: Verify) -> str | None:
        try:
            image = open_image(image_source(value, self.base_dir))
            with image:
                # The shorter side does not depend on EXIF orientation; reading the orientation
                # would make Pillow decode a whole PNG (its eXIf chunk may follow the pixels).
                width, height = image.size
                if verify == "full":
                    width, height = to_rgb(image).size  # oriented
        except BadImageError as err:
            return str(err)
        self.image_sizes[row] = (width, height)
        if self.small_images == "skip" and min(width, height) < self.image_size:
            return f"image too small ({width}x{height} < {self.image_size})"
        return None

    def __len__(self) -> int:
        return len(self.indices)

    def mark_failed(self, positions: Iterable[int]) -> None:
        """Skip these items from now on (e.g. found undecodable by another process)."""
        marked = list(positions)
        if marked:
            self._failed[marked] = True

    def load_image(self, i: int) -> Any:
        """The decoded RGB PIL image of item ``i`` (raises ``BadImageError``)."""
        row = self.indices[i]
        source = image_source(self.image_cell(row), self.base_dir)
        image = to_rgb(open_image(source, self.image_size if self.jpeg_draft else None))
        if self.small_images == "skip" and min(image.size) < self.image_size:
            raise BadImageError(f"image too small ({image.size[0]}x{image.size[1]} < {self.image_size})")
        return image

    def item(self, j: int) -> dict[str, Any]:
        """Item ``j``'s fields, its image decoded (unless ``decode_images`` is off); raises
        ``BadImageError``. A subclass adds fields here (ControlNet's conditioning image)."""
        item: dict[str, Any] = {"text": self.texts[j], "index": self.indices[j]}
        if self.decode_images:
            item = {"pixel_values": self.transform(self.load_image(j)), **item}
        item.update(self.annotations.item(j))
        return item

    def __getitem__(self, i: int) -> dict[str, Any]:
        """Item ``i``; if its image fails to decode (found only now: e.g. a file truncated after a
        valid header), the next good item instead — with a warning, once per run, that names the
        bad item's line and the row that takes its place."""
        n = len(self.indices)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for {n} items")
        i %= n
        failures: list[tuple[int, str]] = []
        for step in range(n):
            j = (i + step) % n
            if self._failed[j]:
                continue  # known bad: logged when it was found
            try:
                item = self.item(j)
            except BadImageError as err:
                failures.append((j, str(err)))
                continue
            self._record_failures(failures, replacement=j)
            return item
        self._record_failures(failures, replacement=None)
        raise RuntimeError(f"{self.table}: every item failed to decode; see the skip log")

    def _record_failures(self, failures: list[tuple[int, str]], replacement: int | None) -> None:
        for j, reason in failures:
            if self._failed[j]:  # another worker found it first
                continue
            self._failed[j] = True
            self._seen_failed.add(j)
            info = self._item_info(self.indices[j], self.texts[j])
            self._log.add(info, reason)
            where = f"line {info['line']}" if "line" in info else f"row {info['row']}"
            instead = (
                f"; row {self.indices[replacement]} takes its place in this batch"
                if replacement is not None
                else ""
            )
            log.warning("%s %s skipped from now on: %s%s", self.table, where, reason, instead)


class StreamingImageTextDataset(IterableDataset):
    """Iterate rows of shards through ``datasets`` streaming; bad rows are skipped and logged.

    ``source``: a table file, a glob (``shards/*.parquet``), a folder of shards, or webdataset
    ``.tar`` shards (image column ``jpg``/``png``/``webp``, text column ``txt``). With several
    DataLoader workers, ``datasets`` gives each worker its own shards. ``index`` counts rows in
    the stream (unique per worker: ``k * num_workers + worker_id``).
    """

    def __init__(
        self,
        source: str | os.PathLike[str],
        *,
        image_size: int = 256,
        image_column: str = "image",
        text_column: str = "text",
        column_names: Sequence[str] | None = None,
        crop: Literal["center", "random"] = "center",
        hflip: bool = False,
        small_images: Literal["upscale", "skip"] = "upscale",
        t2s: bool = False,
        skip_log: str | os.PathLike[str] | None = None,
        transform: Callable[[Any], torch.Tensor] | None = None,
        jpeg_draft: bool = True,
    ) -> None:
        super().__init__()
        self.jpeg_draft = jpeg_draft
        self.files, self.base_dir = _shard_files(source)
        first = Path(self.files[0])
        self.webdataset = first.suffix == ".tar"
        self.image_size, self.small_images, self.t2s = image_size, small_images, t2s
        self.transform = transform or build_image_transform(image_size, crop=crop, hflip=hflip)
        self._log = SkipLog(skip_log)
        self.source = str(source)
        self._column_names = list(column_names) if column_names else None
        self._image_column, self.text_column = image_column, text_column
        self.text_column = "txt" if self.webdataset and text_column == "text" else text_column

    @property
    def skipped(self) -> list[tuple[dict[str, Any], str]]:
        return self._log.items

    def _rows(self) -> Any:
        import datasets

        if self.webdataset:
            rows = datasets.load_dataset("webdataset", data_files=self.files, split="train", streaming=True)
        else:
            rows = read_table(
                Path(self.files[0]), column_names=self._column_names, streaming=True, data_files=self.files
            )
        # datasets would decode Image features itself and raise on the first corrupt one, ending
        # the stream; we take the bytes and decode them here, one bad image costing one sample.
        for name, feature in (rows.features or {}).items():
            if isinstance(feature, datasets.Image) and feature.decode:
                rows = rows.cast_column(name, datasets.Image(decode=False))
        return rows

    def _line_rows(self, worker: int, workers: int) -> Iterator[dict[str, Any]]:
        """JSONL/CSV/TSV shards read line by line (a malformed line costs one row, not the
        stream); each worker takes every ``workers``-th shard, as ``datasets`` would."""
        for file in self.files[worker::workers]:
            for record in parse_lines(Path(file), self._column_names):
                yield {**record, _FILE_KEY: file}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        by_line = not self.webdataset and Path(self.files[0]).suffix.lower() in (".jsonl", ".csv", ".tsv")
        rows = self._line_rows(worker, workers) if by_line else self._rows()
        image_column = None
        for k, row in enumerate(rows):
            where: dict[str, Any] = {"source": row.get(_FILE_KEY, self.source)}
            if LINE_COLUMN in row:
                where["line"] = row[LINE_COLUMN]
            if row.get(ERROR_COLUMN):
                self._log.add(where | {"content": row.get(CONTENT_COLUMN)}, row[ERROR_COLUMN])
                log.warning("%s line %s skipped: %s", where["source"], where.get("line"), row[ERROR_COLUMN])
                continue
            if image_column is None:
                columns = [c for c in row if c not in (*_INTERNAL, _FILE_KEY)]
                image_column = _pick_image_column(columns, self._image_column, Path(self.files[0]))
                _check_text_column(columns, self.text_column, Path(self.files[0]))
            text = clean_caption(row.get(self.text_column), t2s=self.t2s)
            item_info = where | {"row": k, "image": describe(row.get(image_column)), "text": text}
            if not text:
                self._log.add(item_info, "empty caption")
                continue
            try:
                source = image_source(row[image_column], self.base_dir)
                image = to_rgb(open_image(source, self.image_size if self.jpeg_draft else None))
                if self.small_images == "skip" and min(image.size) < self.image_size:
                    raise BadImageError(
                        f"image too small ({image.size[0]}x{image.size[1]} < {self.image_size})"
                    )
            except BadImageError as err:
                self._log.add(item_info, str(err))
                continue
            yield {"pixel_values": self.transform(image), "text": text, "index": k * workers + worker}


def _shard_files(source: str | os.PathLike[str]) -> tuple[list[str], Path]:
    text = str(source)
    path = Path(text).expanduser()
    if path.is_dir():
        table, base = (
            resolve_table(path) if any((path / n).is_file() for n in METADATA_NAMES) else (None, path)
        )
        if table is not None:
            return [str(table)], base
        files = sorted(
            str(p) for p in path.iterdir() if p.suffix.lower() in {*TABLE_SUFFIXES, ".tar"} and p.is_file()
        )
    elif path.is_file():
        files = [str(path)]
    else:
        files = sorted(glob.glob(os.path.expanduser(text)))
    if not files:
        raise FileNotFoundError(f"no shards found at {source} (a file, a folder of shards, or a glob)")
    suffixes = {Path(f).suffix.lower() for f in files}
    if len(suffixes) > 1:
        raise ValueError(f"{source}: shards must share one format, found {', '.join(sorted(suffixes))}")
    return files, Path(files[0]).parent


def load_image_text_dataset(
    source: str | os.PathLike[str] | ImageTextDataConfig, *, streaming: bool | None = None, **kwargs: Any
) -> ImageTextDataset | StreamingImageTextDataset:
    """Build the dataset for ``source`` (a path, or an :class:`ImageTextDataConfig`).

    Keyword arguments are those of :class:`ImageTextDataset` (``linker``, ``tokenizer`` ...);
    with ``streaming=True`` a :class:`StreamingImageTextDataset`.
    """
    if isinstance(source, ImageTextDataConfig):
        cfg = source
        options = {
            "image_size": cfg.image_size,
            "image_column": cfg.image_column,
            "text_column": cfg.text_column,
            "column_names": cfg.column_names,
            "crop": cfg.crop,
            "hflip": cfg.hflip,
            "small_images": cfg.small_images,
            "t2s": cfg.t2s,
            "skip_log": cfg.skip_log,
            "jpeg_draft": cfg.jpeg_draft,
        }
        if not cfg.streaming:
            options["verify"] = cfg.verify
        streaming = cfg.streaming if streaming is None else streaming
        kwargs = {**options, **kwargs}
        source = cfg.source
        if not source:
            raise ValueError("the data config has no 'source' (an image folder or a table file)")
    if streaming:
        kwargs.pop("verify", None)
        return StreamingImageTextDataset(source, **kwargs)
    return ImageTextDataset(source, **kwargs)


def collate_image_text(batch: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack tensors, keep texts and entity span lists as lists (they are ragged)."""
    out: dict[str, Any] = {}
    for key in batch[0]:
        values = [item[key] for item in batch]
        if isinstance(values[0], torch.Tensor):
            out[key] = torch.stack(values)
        elif key == "index":
            out[key] = torch.tensor(values)
        else:
            out[key] = values
    return out


__all__ = [
    "ImageTextDataConfig",
    "ImageTextDataset",
    "StreamingImageTextDataset",
    "collate_image_text",
    "load_image_text_dataset",
    "tokenize_with_entities",
]
