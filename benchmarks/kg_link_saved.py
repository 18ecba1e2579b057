"""EntityLinker before and after on a SAVED 16 M-name index, in one process (issue 13).

Building the 16 M-name index takes ~150 CPU-s and ~5 GB per linker (``kg_link_compare.py`` builds it
twice); this saves the built index once and then compares linkers on it in seconds:

    python benchmarks/kg_link_saved.py save --names 16000000 --prefix /tmp/n16
    python benchmarks/kg_link_saved.py compare --prefix /tmp/n16 --old OLD/rapiddiff/kg/linker.py

``save`` builds this tree's ``EntityLinker`` over ``kg_scale.entity_names(N, 0)`` and writes the
combined trie (forms and jieba's words, ``PREFIX.marisa``), the entity id per trie key
(``PREFIX_ids.npy``) and the rest of the index (``PREFIX_meta.pkl``: first two characters of each
form, longest form). ``compare`` loads that index into this tree's linker and the one in ``--old``
(each derives its own per-key tables from the trie, as its ``__init__`` does; both read the same
private attribute names, so this script follows ``linker.py``), links the same synthetic text
(``kg_link_speed.synthetic_text``) with both, interleaving the timed passes, and prints one JSON
line: characters per CPU-second with and without the word check (each pass), the first pass's CPU
seconds, span counts, whether the spans are identical, the date and the load average.

``store`` measures what a KnowledgeStore that carries its linker's index (``linker/``, written by
``KnowledgeStore.save``) saves a fresh process:

    python benchmarks/kg_link_saved.py store --names 2000000 --dir /tmp/ls2m

It writes a store of ``entity_names(N, 0)`` (dim 4, no facts) twice — ``save(linker=False)``,
then ``save(linker=True)``, whose added part (``write_store_index``) is timed on its own (the
per-user cache empty, so the index is built; the second save reuses the name index the first
built, so the two saves' difference is not the added time) — and then, each in a fresh interpreter: ``EntityLinker.from_store`` on the
store with the index (a); on the store without it, per-user cache cold (b: read the names, build
the index) and warm (b': read the names, hash them, map the cached index); (a) runs first with an
empty per-user cache (jieba's own tables built too: a machine's first use) and last with jieba's
tables cached. Each step: wall and CPU seconds and peak RSS (VmHWM, reset before the step), plus
each process's peak RSS; every process links the same synthetic text, and the spans must be
identical. Prints one JSON report.
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
    from rapiddiff.kg import linker_index  # where the index code lives since linker.py was split

    jieba_words = getattr(module, "_jieba", linker_index.jieba_words)()
    weights = np.full(len(linker.trie), np.nan)
    for word, i in jieba_words.trie.iteritems():
        weights[linker.trie.key_id(word)] = jieba_words.weights[i]
    if hasattr(module, "_head_set") or hasattr(module, "jieba_words"):  # the compiled word check
        weights[linker.entity_ids >= 0] = np.nan
        linker._weights = weights
        linker._head_set = getattr(module, "_head_set", linker_index.head_set)(linker._heads)
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


def _store_save(names: int, folder: Path) -> dict[str, Any]:
    """The two saves of the same store (run in its own process: ``store`` starts it)."""
    import torch
    from kg_scale import _phase, entity_names

    from rapiddiff.kg import store as store_module
    from rapiddiff.kg.store import KnowledgeStore

    report: dict[str, Any] = {}
    write_store_index = store_module.write_store_index

    def timed(*args: Any) -> Any:  # the linker's part of save(linker=True)
        t0, c0 = time.perf_counter(), time.process_time()
        result = write_store_index(*args)
        report["· write_store_index (linker/)"] = {
            "seconds": round(time.perf_counter() - t0, 2),
            "cpu_seconds": round(time.process_time() - c0, 2),
        }
        return result

    store_module.write_store_index = timed  # the name save() calls
    with _phase(report, "entity_names + KnowledgeStore.from_arrays"):
        all_names = entity_names(names, 0)
        store = KnowledgeStore.from_arrays(
            all_names, ["关系"], torch.zeros(len(all_names), 4), torch.zeros(1, 4)
        )
        del all_names
    with _phase(report, "save(linker=False)"):
        store.save(folder / "plain", linker=False)
    with _phase(report, "save(linker=True)"):
        store.save(folder / "indexed", linker=True)
    report["linker_folder_bytes"] = {
        f.name: f.stat().st_size for f in sorted((folder / "indexed/linker").iterdir())
    }
    report["entities_tsv_bytes"] = (folder / "indexed/entities.tsv").stat().st_size
    return report


def _store_link(folder: Path, chars: int) -> dict[str, Any]:
    """A fresh process: import, load, ``EntityLinker.from_store``, link (``store`` starts it)."""
    import hashlib
    import resource

    from kg_scale import _phase

    report: dict[str, Any] = {}
    with _phase(report, "import rapiddiff.kg (store, linker)"):
        from rapiddiff.kg.linker import EntityLinker
        from rapiddiff.kg.store import KnowledgeStore
    with _phase(report, "KnowledgeStore.load"):
        store = KnowledgeStore.load(folder)
    with _phase(report, "EntityLinker.from_store") as entry:
        linker = EntityLinker.from_store(store)
        entry["read_the_names"] = store._entity_names is not None
        entry["surface_forms"] = len(linker)
    from kg_link_speed import synthetic_text

    docs = synthetic_text(chars, 0)
    with _phase(report, f"first link of {sum(map(len, docs))} characters"):
        spans = [[(s.start, s.end, s.entity_id) for s in linker.link(d)] for d in docs]
    report["spans"] = sum(map(len, spans))
    report["spans_sha256"] = hashlib.sha256(json.dumps(spans).encode()).hexdigest()[:16]
    report["process_peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    return report


def store(names: int, folder: Path, chars: int) -> dict[str, Any]:
    import shutil
    import subprocess
    import tempfile

    def child(cache: str, *args: str) -> dict[str, Any]:
        env = {**os.environ, "RAPIDDIFF_CACHE_DIR": cache}
        t0 = time.perf_counter()
        done = subprocess.run(
            [sys.executable, __file__, *args], env=env, check=True, capture_output=True, text=True
        )
        result = json.loads(done.stdout.splitlines()[-1])
        result["process_wall_seconds"] = round(time.perf_counter() - t0, 2)
        return result

    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "cpus": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
        "names": names,
    }
    folder.mkdir(parents=True, exist_ok=True)
    cold = tempfile.mkdtemp(prefix="cache-cold-", dir=folder)
    report["save"] = child(cold, "_store_save", "--names", str(names), "--dir", str(folder))
    cache_b = tempfile.mkdtemp(prefix="cache-b-", dir=folder)
    for label, store_folder, cache in (
        ("a_with_index_cache_empty", "indexed", tempfile.mkdtemp(prefix="cache-a-", dir=folder)),
        ("b_without_index_cache_cold", "plain", cache_b),
        ("b_without_index_cache_warm", "plain", cache_b),  # the cache (b) just filled
        # jieba's tables cached (any earlier use of rapiddiff's linker on this machine); the
        # store's index in that cache is not looked at: a store with linker/ never hashes its names
        ("a_with_index", "indexed", cache_b),
    ):
        args = ("_store_link", "--dir", str(folder / store_folder), "--chars", str(chars))
        report[label] = child(cache, *args)
    report["identical_spans"] = len({report[k]["spans_sha256"] for k in report if k[:2] in ("a_", "b_")}) == 1
    report["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    for cache_folder in folder.glob("cache-*"):
        shutil.rmtree(cache_folder)
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
    p = sub.add_parser("store", help="EntityLinker.from_store with and without the store's linker/ index")
    p.add_argument("--names", type=int, default=2_000_000)
    p.add_argument("--dir", type=Path, required=True, help="where the two stores are written")
    p.add_argument("--chars", type=int, default=20_000, help="characters each process links")
    p = sub.add_parser("_store_save")  # the steps `store` runs, each in its own process
    p.add_argument("--names", type=int, required=True)
    p.add_argument("--dir", type=Path, required=True)
    p = sub.add_parser("_store_link")
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--chars", type=int, required=True)
    args = parser.parse_args(argv)
    if args.command == "save":
        save(args.names, args.prefix)
    elif args.command == "store":
        print(json.dumps(store(args.names, args.dir, args.chars), ensure_ascii=False, indent=1))
    elif args.command == "_store_save":
        print(json.dumps(_store_save(args.names, args.dir), ensure_ascii=False))
    elif args.command == "_store_link":
        print(json.dumps(_store_link(args.dir, args.chars), ensure_ascii=False))
    else:
        print(json.dumps(compare(args.prefix, args.old, args.chars, args.repeat)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
