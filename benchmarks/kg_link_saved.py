"""EntityLinker before and after on a SAVED 16 M-name index, in one process (issue 13).

Building the 16 M-name index takes ~150 CPU-s and ~5 GB per linker (``kg_link_compare.py`` builds it
twice); this saves the built index once and then compares linkers on it in seconds:

    python benchmarks/kg_link_saved.py save --names 16000000 --prefix /tmp/n16
    python benchmarks/kg_link_saved.py compare --prefix /tmp/n16 --old /work/main/rapiddiff/kg/linker.py

``save`` builds this tree's ``EntityLinker`` over ``kg_scale.entity_names(N, 0)`` and writes the
combined trie (forms and jieba's words, ``PREFIX.marisa``), the entity id per trie key
(``PREFIX_ids.npy``) and the rest of the index (``PREFIX_meta.pkl``: first two characters of each
form, longest form). ``compare`` loads that index into this tree's linker and the one in ``--old``
(each derives its own per-key tables from the trie, as its ``__init__`` does; both read the same
private attribute names, so this script follows ``linker.py``), links the same synthetic text
(``kg_link_speed.synthetic_text``) with both, interleaving the timed passes, and prints one JSON
line: characters per CPU-second with and without the word check (each pass), the first pass's CPU
seconds, span counts, whether the spans are identical, the date and the load average.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import pickle
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

_META = ("_heads", "longest", "_forms", "_scan_longest", "_singles")


def save(names: int, prefix: str) -> None:
    from kg_scale import entity_names

    from rapiddiff.kg.linker import EntityLinker

    linker = EntityLinker((name, i) for i, name in enumerate(entity_names(names, 0)))
    linker.trie.save(f"{prefix}.marisa")
    np.save(f"{prefix}_ids.npy", linker.entity_ids)
    with open(f"{prefix}_meta.pkl", "wb") as f:
        pickle.dump({k: getattr(linker, k) for k in _META}, f)


def load(module: ModuleType, prefix: str) -> Any:
    """``module.EntityLinker`` over the saved index, its per-key tables derived as ``__init__`` does."""
    import marisa_trie

    linker = object.__new__(module.EntityLinker)
    with open(f"{prefix}_meta.pkl", "rb") as f:
        linker.__dict__.update(pickle.load(f))
    linker.trie = marisa_trie.Trie()
    linker.trie.mmap(f"{prefix}.marisa")
    linker.entity_ids = np.load(f"{prefix}_ids.npy")
    linker._ids = memoryview(linker.entity_ids)
    linker.word_check = True
    linker._frequencies = {}
    jieba_words = module._jieba()
    weights = np.full(len(linker.trie), np.nan)
    for word, i in jieba_words.trie.iteritems():
        weights[linker.trie.key_id(word)] = jieba_words.weights[i]
    if hasattr(module, "_head_set"):  # the compiled word check (this branch)
        weights[linker.entity_ids >= 0] = np.nan
        linker._weights = weights
        linker._head_set = module._head_set(linker._heads)
    else:  # main before it: jieba's weights per key, forms' weights memoised in a dict
        linker._word_weights = memoryview(weights)
        linker._form_weights = {}
    return linker


def compare(prefix: str, old_path: Path, chars: int, repeat: int) -> dict[str, Any]:
    from kg_link_speed import _rate, synthetic_text

    from rapiddiff.kg import linker as new

    spec = importlib.util.spec_from_file_location("old_linker", old_path)
    assert spec is not None and spec.loader is not None
    old = importlib.util.module_from_spec(spec)
    sys.modules["old_linker"] = old  # dataclasses look their module up
    spec.loader.exec_module(old)
    docs = synthetic_text(chars, 0)
    linkers = {"new": load(new, prefix), "old": load(old, prefix)}
    report: dict[str, Any] = {"forms": linkers["new"]._forms, "characters": sum(map(len, docs))}
    spans = {}
    for label, linker in linkers.items():
        t = time.process_time()
        spans[label] = [[(s.start, s.end, s.entity_id) for s in linker.link(d)] for d in docs]
        report[f"{label}_first_pass_cpu_s"] = round(time.process_time() - t, 2)
        report[f"{label}_spans"] = sum(map(len, spans[label]))
    for label in linkers:
        report[f"{label}_chars_per_cpu_s"] = []
        report[f"{label}_chars_per_cpu_s_no_check"] = []
    for _ in range(repeat):  # interleaved, so both see the same neighbours on a shared machine
        for label, linker in linkers.items():
            report[f"{label}_chars_per_cpu_s"].append(round(_rate(linker.link, docs, 1)))
            no_check = _rate(lambda d, linker=linker: linker.link(d, word_check=False), docs, 1)
            report[f"{label}_chars_per_cpu_s_no_check"].append(round(no_check))
    report["identical_spans"] = spans["new"] == spans["old"]
    report["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    report["load_average"] = [round(x, 1) for x in os.getloadavg()]
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("save", help="build this tree's linker and save its index")
    p.add_argument("--names", type=int, default=16_000_000)
    p.add_argument("--prefix", required=True)
    p = sub.add_parser("compare", help="this tree's linker against --old on a saved index")
    p.add_argument("--prefix", required=True)
    p.add_argument("--old", type=Path, required=True, help="the linker.py to compare against")
    p.add_argument("--chars", type=int, default=100_000)
    p.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    if args.command == "save":
        save(args.names, args.prefix)
    else:
        print(json.dumps(compare(args.prefix, args.old, args.chars, args.repeat)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
