"""Issue 18: a U-Net draw's weak cells, found on the validation attribute captions, oversampled in the
U-Net's training data.

Each 2-head U-Net draw misses the attribute captions in its own one or two cells (BENCHMARKS.md,
issue 18, "where the three draws miss": ellipses on dark green, ellipses anywhere, centred
positions), and the cells a draw misses on the validation captions are mostly the ones it misses
on the test captions. This script picks those cells from a draw's evaluation of ``attribute_val`` alone
(the test captions stay unread) and writes a training table in which the training lines of those
cells come ``factor`` times, for ``rapiddiff train unet --data.train=TABLE``. Measured (BENCHMARKS.md,
issue 18, "weak cells"): a draw continued on its own cells loses; the cells three draws share
("pooled": ellipse, dark green) from the start lift the attribute captions, and the chain trains its
U-Net that way (``configs/kshapes/chain.yaml``: ``unet_weak_cells``, through :func:`oversample`).

    python benchmarks/kshapes_weak_cells.py select --detections EVAL/knowledge_on/detections.jsonl \
        --name u1 --into benchmarks/kshapes_weak_cells.json
    python benchmarks/kshapes_weak_cells.py write --train data/train --weak benchmarks/kshapes_weak_cells.json \
        --name u1 --factor 3 --out data/train/weak_u1.jsonl

("pooled" is ``select`` on the three draws' detections.jsonl files concatenated.)

A value is weak when the validation images that ask for it miss (not all four right) at least
``ratio`` times as often as all the validation images do, and at least ``min_misses`` times: the
second keeps one unlucky image of a rare value from counting. A training line belongs to a weak
cell when its object has the weak colour or shape (an entity caption names its object by the
entity, which implies both), or when its caption *names* the weak background or position (a caption
that does not name them teaches nothing about their words).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rapiddiff.data.loader import ERROR_COLUMN, LINE_COLUMN, parse_json_lines
from rapiddiff.eval.knowledge import SCORED

NAMED_IN_TEXT = ("background", "position")  # only lines whose caption names them count


def weak_values(
    detections: Iterable[dict[str, Any]],
    split: str = "attribute_val",
    ratio: float = 2.0,
    min_misses: int = 3,
) -> dict[str, list[str]]:
    """{attribute: [weak values, most missed first]} of one evaluation's ``split`` images."""
    rows = [row for row in detections if row.get("split") == split]
    if not rows:
        raise ValueError(f"no detections of split {split!r}")
    overall = sum(not row["all_ok"] for row in rows) / len(rows)
    weak: dict[str, list[str]] = {}
    for attribute in SCORED:
        asked, missed = Counter(), Counter()
        for row in rows:
            asked[row[attribute]] += 1
            missed[row[attribute]] += not row["all_ok"]
        rates = {value: missed[value] / asked[value] for value in asked}
        chosen = [
            value
            for value in sorted(rates, key=lambda v: (-rates[v], v))
            if missed[value] >= min_misses and rates[value] >= ratio * overall > 0
        ]
        if chosen:
            weak[attribute] = chosen
    return weak


def in_weak_cell(line: dict[str, Any], weak: dict[str, list[str]]) -> bool:
    """Whether a training line's object or caption falls in one of the weak cells."""
    for attribute, values in weak.items():
        value = line.get(attribute)
        if value in values and (attribute not in NAMED_IN_TEXT or value in line.get("text", "")):
            return True
    return False


def check_weak(weak: dict[str, list[str]], factor: int) -> None:
    """Raises ValueError naming the attributes when ``weak`` has another key, or ``factor`` < 1."""
    unknown = sorted(set(weak) - set(SCORED))
    if unknown:
        raise ValueError(f"{', '.join(unknown)}? the attributes are {', '.join(SCORED)}")
    if factor < 1:
        raise ValueError(f"factor must be >= 1, got {factor}")


def oversample(train: Path, weak: dict[str, list[str]], factor: int, out: Path) -> dict[str, int]:
    """Write ``train``'s metadata.jsonl to ``out`` with the weak cells' lines ``factor`` times, atomically.
    A line that is not a JSON object is left out and named on stderr (file and line), as the loader would."""
    check_weak(weak, factor)
    if out.parent.resolve() != train.resolve():
        raise ValueError(f"{out}: write the table into {train}, where its file_name paths point")
    counts = {"lines": 0, "in_weak_cells": 0, "written": 0}
    skipped: list[str] = []
    present: dict[str, set[str]] = {attribute: set() for attribute in weak}  # to name a mistyped value
    partial = out.with_name(out.name + ".partial")  # a table cut short is never trained on
    with partial.open("w", encoding="utf-8") as table:
        for record in parse_json_lines(train / "metadata.jsonl"):
            line = record.pop(LINE_COLUMN)
            if ERROR_COLUMN in record:
                skipped.append(f"{train / 'metadata.jsonl'}:{line}: {record[ERROR_COLUMN]}")
                continue
            for attribute, values in present.items():
                values.add(record.get(attribute))
            times = factor if in_weak_cell(record, weak) else 1
            table.write((json.dumps(record, ensure_ascii=False) + "\n") * times)
            counts["lines"] += 1
            counts["in_weak_cells"] += times > 1
            counts["written"] += times
    missing = {a: sorted(set(v) - present[a]) for a, v in weak.items() if set(v) - present[a]}
    if missing:
        partial.unlink()
        raise ValueError(
            "; ".join(
                f"{a} {', '.join(v)} is in no line (it has {', '.join(sorted(map(str, present[a])))})"
                for a, v in missing.items()
            )
        )
    partial.replace(out)
    if skipped:
        print(f"oversample: {len(skipped)} unreadable lines left out:", *skipped, sep="\n  ", file=sys.stderr)
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    select = commands.add_parser("select", help="a draw's weak values from its validation detections")
    select.add_argument("--detections", type=Path, required=True, help="an eval knowledge detections.jsonl")
    select.add_argument("--name", required=True, help="the draw's name in the JSON file")
    select.add_argument("--into", type=Path, required=True, help="JSON file of {name: weak values}; updated")
    select.add_argument("--ratio", type=float, default=2.0)
    select.add_argument("--min-misses", type=int, default=3)
    write = commands.add_parser("write", help="a training table with a draw's weak cells oversampled")
    write.add_argument("--train", type=Path, required=True, help="the kshapes train folder")
    write.add_argument("--weak", type=Path, required=True, help="the JSON file select writes")
    write.add_argument("--name", required=True)
    write.add_argument("--factor", type=int, default=3)
    write.add_argument("--out", type=Path, required=True, help="a .jsonl inside --train")
    args = parser.parse_args(argv)
    try:
        if args.command == "select":
            with args.detections.open(encoding="utf-8") as file:
                weak = weak_values(map(json.loads, file), ratio=args.ratio, min_misses=args.min_misses)
            table = json.loads(args.into.read_text(encoding="utf-8")) if args.into.exists() else {}
            table[args.name] = weak
            args.into.write_text(json.dumps(table, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
            print(args.name, json.dumps(weak, ensure_ascii=False))
        else:
            tables = json.loads(args.weak.read_text(encoding="utf-8"))
            if args.name not in tables:
                raise ValueError(f"{args.weak}: no cells named {args.name!r}; it has {', '.join(tables)}")
            weak = tables[args.name]
            print(args.name, json.dumps(oversample(args.train, weak, args.factor, args.out)))
    except (ValueError, OSError) as err:  # a typo or a missing file: one line, no traceback
        parser.error(str(err))


if __name__ == "__main__":
    main()
