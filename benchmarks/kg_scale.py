"""An OpenKG-sized knowledge graph through the KG stage: generate it, train TransE, open, link.

Rapid Diffusion's KG (OpenKG / CN-DBpedia) had 16 M entities and 140 M triples. This script makes
a graph of that shape and measures each step on it:

    python benchmarks/kg_scale.py generate --out DIR [--entities 16000000 --triples 140000000]
    python benchmarks/kg_scale.py train --kg DIR --device cuda [--epochs 2 --batch-size 1048576]
    python benchmarks/kg_scale.py save --kg DIR                    # a store as kg train writes one (untrained vectors; needs generate --ids)
    python benchmarks/kg_scale.py store --store DIR/store [--cold]  # open, look up, relation table, names
    python benchmarks/kg_scale.py link --kg DIR                    # EntityLinker over every name
    python benchmarks/kg_scale.py reltable [--pairs 140000000] [--from-store DIR]   # relation table

``benchmarks/kg_scale_device.sh`` runs generate, train (1 epoch, a sampled filtered evaluation, the
save) and store in one device call. Each subcommand prints one JSON report (and writes it to $OUT/kg_scale_<step>.json when OUT is
set) with the command, device, date, wall seconds, peak host memory (max RSS of the process)
and, for training, peak GPU memory.

The graph: entity names are Chinese noun phrases — jieba's dictionary nouns (2+ characters) and
concatenations of two of them drawn by word frequency (北京 + 大学, 番茄 + 酱料, ...) — deduplicated
until there are ``--entities`` of them; ``--relations`` relation names. Every entity is the head
of about triples/entities facts (a shuffled round-robin), tails follow a power law (a few
entities such as 中国 are the tail of very many facts, as in CN-DBpedia), relations are skewed
the same way. The TSV is written with numpy through ``rapiddiff.kg.triples.write_triples_array``
(140 M lines, ~5 GB, in about a minute), in the exact format ``rapiddiff kg train`` reads.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

NOUN_TAGS = {"n", "nr", "ns", "nt", "nz", "nrt"}


def _nouns() -> tuple[list[str], Any]:
    """jieba's dictionary nouns of 2+ characters and their frequencies."""
    import jieba
    import numpy as np

    words, freqs = [], []
    for line in Path(jieba.__file__).with_name("dict.txt").read_text(encoding="utf-8").splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2] in NOUN_TAGS and len(parts[0]) >= 2:
            words.append(parts[0])
            freqs.append(int(parts[1]))
    return words, np.asarray(freqs, dtype=np.float64)


def entity_names(n: int, seed: int) -> list[str]:
    """``n`` distinct Chinese noun phrases: dictionary nouns first, then noun + noun pairs."""
    import numpy as np

    words, freqs = _nouns()
    rng = np.random.default_rng(seed)
    names: dict[str, None] = dict.fromkeys(words[:n])
    p = np.sqrt(freqs)  # flatter than raw frequency, so pairs are varied but common words lead
    p /= p.sum()
    while len(names) < n:
        need = n - len(names)
        a = rng.choice(len(words), size=int(need * 1.3) + 1000, p=p)
        b = rng.choice(len(words), size=len(a), p=p)
        for i, j in zip(a.tolist(), b.tolist(), strict=True):
            names[words[i] + words[j]] = None
    return list(names)[:n]


def generate(
    out: Path, n_entities: int, n_triples: int, n_relations: int, seed: int, save_ids: bool = False
) -> dict[str, Any]:
    import numpy as np

    from rapiddiff.kg.triples import write_triples_array

    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    names = entity_names(n_entities, seed)
    t_names = time.perf_counter() - t0
    relations = [f"关系{i:03d}" for i in range(n_relations)]
    rng = np.random.default_rng(seed + 1)
    # Heads: every entity in turn (shuffled), so each has about n_triples / n_entities facts.
    heads = np.resize(rng.permutation(n_entities), n_triples)
    rng.shuffle(heads)
    # Tails and relations: power laws (u**3 piles mass near 0), through a permutation so the
    # popular entities are spread over the id range.
    tail_rank = (n_entities * rng.random(n_triples) ** 3).astype(np.int64)
    tails = rng.permutation(n_entities)[tail_rank]
    rels = (n_relations * rng.random(n_triples) ** 2).astype(np.int64)
    ids = np.stack([heads, rels, tails], axis=1)
    del heads, tails, rels, tail_rank
    if save_ids:  # for `save`: the same ids without parsing the 6 GB TSV (ids index entities.txt)
        np.save(out / "triples.ids.npy", ids, allow_pickle=False)
    t1 = time.perf_counter()
    file = out / "triples.tsv"
    write_triples_array(file, ids, names, relations, header="head\trelation\ttail (benchmarks/kg_scale.py)")
    t_write = time.perf_counter() - t1
    (out / "entities.txt").write_text("\n".join(names) + "\n", encoding="utf-8")  # for `link`
    return {
        "entities": n_entities,
        "relations": n_relations,
        "triples_written": n_triples,
        "file": str(file),
        "file_gb": round(file.stat().st_size / 1e9, 2),
        "names_seconds": round(t_names, 1),
        "write_seconds": round(t_write, 1),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def train(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import yaml

    from rapiddiff.cli import main as cli

    kg = Path(args.kg)
    config = {
        "triples": str(kg / "triples.tsv"),
        "out": str(kg / "store"),
        "split": [0.98, 0.01, 0.01],
        "embedding_dim": args.dim,
        "scoring_norm": 1,
        "training_loop": "slcwa",
        "loss": "marginranking",
        "margin": 1.0,
        "negatives_per_positive": args.negatives,
        "optimizer": "adam",
        "lr": args.lr,
        "batch_size": args.batch_size,
        "epochs": args.epochs,
        "early_stopping": False,
        "eval_max_triples": args.eval_triples,
        "eval_batch_size": args.eval_batch_size,
        "progress": False,
        "seed": 42,
    }
    cfg_file = kg / "kg_scale.yaml"
    cfg_file.write_text(yaml.safe_dump(config, allow_unicode=True), encoding="utf-8")
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    phases: dict[str, dict[str, float]] = {}
    t0 = time.perf_counter()
    with _timed_phases(phases):
        code = cli(["kg", "train", "--config", str(cfg_file), "--device", args.device])
    seconds = time.perf_counter() - t0
    store = kg / "store"
    metrics = json.loads((store / "config.json").read_text(encoding="utf-8")).get("training", {})
    report: dict[str, Any] = {"exit_code": code, "config": config, "seconds": round(seconds, 1)}
    report["phases"] = phases
    report["training"] = {k: v for k, v in metrics.items() if k != "config"}
    if torch.cuda.is_available():
        report["gpu_peak_allocated_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        report["gpu_peak_reserved_gb"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
        report["gpu"] = torch.cuda.get_device_name()
    return report


@contextlib.contextmanager
def _timed_phases(phases: dict[str, dict[str, float]]) -> Iterator[None]:
    """Time the steps of ``rapiddiff kg train`` run in this process (wrapping its functions): wall
    seconds, the process's resident memory after the step and its peak so far, and the GPU's peak
    allocation during the step. Each step is printed as it ends, so a run cut off by a time limit
    still shows the steps it finished."""
    import torch

    from rapiddiff.kg import transe
    from rapiddiff.kg.store import KnowledgeStore

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            cuda = torch.cuda.is_available()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            result = fn(*a, **k)
            if cuda:
                torch.cuda.synchronize()
            phase = {"seconds": round(time.perf_counter() - t0, 1), "rss_gb": round(_current_rss_gb(), 2)}
            phase["peak_rss_gb"] = round(_rss_gb(), 2)
            if cuda:
                phase["gpu_peak_allocated_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
                phase["gpu_peak_reserved_gb"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
            phases[name] = phase
            print(f"[kg_scale] {name}: {json.dumps(phase)}", flush=True)
            return result

        return wrapper

    targets = [
        (transe, "_load_data", "load: read + distinct + TriplesFactory + split"),
        (transe, "_train_loop", "train"),
        (transe, "_filtered_evaluation", "evaluate (filtered, sampled)"),
        (transe, "_to_store", "to_store"),
        (KnowledgeStore, "save", "save"),
    ]
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in targets]
    for owner, attr, name in targets:
        setattr(owner, attr, timed(name, getattr(owner, attr)))
    try:
        yield
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


def _current_rss_gb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def store_step(args: argparse.Namespace) -> dict[str, Any]:
    """Open a saved store in this fresh process and touch each part once, in the order a user
    meets them: open, look names up, read vectors, the triples and fusion's relation table (what
    a CLIP or U-Net training with this store does at setup), one entity's facts (prompt
    expansion), all names. Each step: wall and CPU seconds, RSS after and peak during it. With
    ``--cold`` the store's files are first dropped from the page cache (posix_fadvise on our own
    files), so the open and first reads come from disk."""
    import statistics

    folder = Path(args.store)
    report: dict[str, Any] = {"store": str(folder)}
    report["store_files"] = {f.name: f.stat().st_size for f in sorted(folder.iterdir())}
    if args.cold:
        _drop_from_page_cache(folder)
    report["fresh_interpreter"] = _fresh_open_seconds(folder)
    if args.cold:
        _drop_from_page_cache(folder)
    with _phase(report, "import torch + rapiddiff.kg.store"):
        import numpy as np
        import torch

        from rapiddiff.kg.store import KnowledgeStore
    with _phase(report, "KnowledgeStore.load"):
        store = KnowledgeStore.load(folder)
    report["entities"], report["dim"] = len(store), store.dim
    with _phase(report, "first id_of (maps the name index)"):
        trie, index_ids = store._name_index()
        first_name = trie.restore_key(0)
        first = store.id_of(first_name)
    assert first == int(index_ids[0])
    rng = np.random.default_rng(0)
    keys = rng.integers(0, len(trie), args.lookups).tolist()
    queries = [trie.restore_key(k) for k in keys]  # random names, without reading entities.tsv
    expected = [int(index_ids[k]) for k in keys]

    def each_ms(fn: Any) -> tuple[list[Any], dict[str, float]]:
        results, times = [], []
        for q in queries:
            t0 = time.perf_counter()
            results.append(fn(q))
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        return results, {
            "mean_ms": round(statistics.fmean(times), 4),
            "median_ms": round(times[len(times) // 2], 4),
            "p99_ms": round(times[int(len(times) * 0.99)], 4),
            "max_ms": round(times[-1], 4),
        }

    with _phase(report, f"{args.lookups} id_of (name -> id)") as entry:
        found, entry["each"] = each_ms(store.id_of)
    assert found == expected, "id_of disagrees with the saved index"
    with _phase(report, "first vector read (one row of the memory-mapped table)") as entry:
        row = store.entity_vectors[expected[0]].clone()
    with _phase(report, f"{args.lookups} vector (name -> vector, copied out)") as entry:
        vectors, entry["each"] = each_ms(lambda q: store.vector(q).clone())
    assert torch.equal(vectors[0], row)
    del vectors
    with _phase(report, f"the same {args.lookups} vector lookups again (their pages now cached)") as entry:
        _, entry["each"] = each_ms(lambda q: store.vector(q).clone())
    if not args.skip_triples:
        from rapiddiff.models.fusion import FusionConfig, KnowledgeFusion, relation_table

        with _phase(report, "triples (first access)") as entry:
            triples = store.triples
            entry["triples"] = len(triples)
        with _phase(report, "triples grouped check") as entry:
            keys64 = triples[:, 0] * len(store.relation_vectors) + triples[:, 1]
            entry["grouped_by_head_relation"] = bool((keys64[1:] >= keys64[:-1]).all())
            del keys64
        with _phase(report, "relation_table (fusion, max 8 relations)") as entry:
            table = relation_table(triples, len(store), 8)
            entry["shape"] = list(table.shape)
            entry["heads_with_relations"] = int((table[:, 0] >= 0).sum())
        del table
        with _phase(report, "KnowledgeFusion.set_knowledge (CPU: table + buffers, as set_store does)"):
            fusion = KnowledgeFusion(FusionConfig(kg_dim=store.dim, hidden_size=64, num_layers=1))
            fusion.set_knowledge(store.entity_vectors, store.relation_vectors, triples)
        del fusion
        with _phase(report, "first facts(id) (prompt expansion)") as entry:
            entry["facts"] = len(store.facts(expected[0]))
        with _phase(report, f"{args.lookups} facts(id)") as entry:
            _, entry["each"] = each_ms(lambda q: store.facts(store.id_of(q)))
        del triples
    with _phase(report, "entity_names (all names and aliases)"):
        names = store.entity_names
    assert all(names[i] == q for i, q in zip(expected, queries, strict=True))
    del names
    if args.linker:
        from rapiddiff.kg.linker import EntityLinker

        with _phase(report, "EntityLinker.from_store (what set_store builds)") as entry:
            linker = EntityLinker.from_store(store)
            entry["surface_forms"] = len(linker)
    return report


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return -1


@contextlib.contextmanager
def _phase(report: dict[str, Any], name: str) -> Iterator[dict[str, Any]]:
    """Wall and CPU seconds of a step, the process's RSS after it and its peak during it (the
    kernel's high-water mark VmHWM, reset at the start through /proc/self/clear_refs)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    entry: dict[str, Any] = {}
    t0, c0 = time.perf_counter(), time.process_time()
    yield entry
    entry["seconds"] = round(time.perf_counter() - t0, 4)
    entry["cpu_seconds"] = round(time.process_time() - c0, 3)
    entry["rss_gb"] = round(_status_kb("VmRSS") / 2**20, 2)
    entry["peak_rss_gb"] = round(_status_kb("VmHWM") / 2**20, 2)
    report[name] = entry
    print(f"[kg_scale] {name}: {json.dumps(entry)}", flush=True)


def save_step(args: argparse.Namespace) -> dict[str, Any]:
    """Write a KnowledgeStore of the generated graph as ``rapiddiff kg train`` writes one, without
    training: names labelled as pykeen labels them (sorted by code point), the triples distinct
    and in (head, relation, tail) id order (what ``_to_store`` hands over), dim-``--dim`` float32
    vectors drawn at random — untrained: the format's save/open/lookup timings do not depend on
    the values — then ``KnowledgeStore.from_arrays(...).save(DIR)``, the two calls ``_to_store``
    and ``train_transe`` make. Needs ``generate --ids`` (the ids, without parsing the TSV). Since
    2026-11-23 that save also writes the linker's index (``linker/``, stores of ≥ 100 k entities):
    the figures in BENCHMARKS.md's 16 M save table were taken before, without it."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import torch

    from rapiddiff.kg import store as store_module
    from rapiddiff.kg.store import KnowledgeStore
    from rapiddiff.kg.triples import group_triples

    kg, out = Path(args.kg), Path(args.store or Path(args.kg) / "store")
    report: dict[str, Any] = {
        "dim": args.dim,
        "vectors": "untrained (random) vectors: the format's timings do not depend on the values",
    }
    with _phase(report, "read names + ids"):
        names = (kg / "entities.txt").read_text(encoding="utf-8").split("\n")[:-1]
        ids = np.load(kg / "triples.ids.npy", mmap_mode="r")
        n_relations = int(ids[:, 1].max()) + 1
    with _phase(report, "label as pykeen (sorted names) + group triples"):
        order = pc.sort_indices(pa.array(names, pa.large_string())).to_numpy()  # code-point order
        rank = np.empty(len(order), dtype=np.int64)
        rank[order] = np.arange(len(order))
        names = [names[i] for i in order.tolist()]
        del order
        labelled = np.empty(ids.shape, dtype=np.int64)
        for begin in range(0, len(ids), 1 << 24):
            block = ids[begin : begin + (1 << 24)]
            labelled[begin : begin + len(block), 0] = rank[block[:, 0]]
            labelled[begin : begin + len(block), 1] = block[:, 1]
            labelled[begin : begin + len(block), 2] = rank[block[:, 2]]
        del rank, ids, block  # block: the last slice keeps the ids file mapped (3.4 GB resident)
        triples = group_triples(labelled, len(names), n_relations)
        del labelled
    report["entities"], report["relations"], report["triples"] = len(names), n_relations, len(triples)
    with _phase(report, "random vectors"):
        rng = np.random.default_rng(0)
        entity_vectors = torch.from_numpy(rng.standard_normal((len(names), args.dim), dtype=np.float32))
        relation_vectors = torch.from_numpy(rng.standard_normal((n_relations, args.dim), dtype=np.float32))
    relation_names = [f"关系{i:03d}" for i in range(n_relations)]  # as `generate` names them
    with _phase(report, "from_arrays"):
        store = KnowledgeStore.from_arrays(
            names, relation_names, entity_vectors, relation_vectors, triples=torch.from_numpy(triples)
        )
    del names, triples, entity_vectors, relation_vectors
    # The save's parts: its compute steps timed by wrapping them, each file's completion by its
    # modification time (every file is written atomically, in this order).
    parts: dict[str, Any] = {}
    wrapped = [
        (store_module, "group_triples"),
        (store_module, "write_triples_array"),
        (KnowledgeStore, "_name_index"),
    ]
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr in wrapped]

    def timing(attr: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t0, c0 = time.perf_counter(), time.process_time()
            result = fn(*a, **k)
            parts[attr] = {
                "seconds": round(time.perf_counter() - t0, 2),
                "cpu_seconds": round(time.process_time() - c0, 2),
            }
            return result

        return wrapper

    for owner, attr, fn in saved:
        setattr(owner, attr, timing(attr, fn))
    started = time.time()
    try:
        with _phase(report, "save"):
            store.save(out)
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)
    files = sorted(out.iterdir(), key=lambda f: f.stat().st_mtime)
    previous = started
    report["save_files"] = {}
    for f in files:
        mtime = f.stat().st_mtime
        report["save_files"][f.name] = {
            "bytes": f.stat().st_size,
            "wall_seconds_since_previous_file": round(mtime - previous, 2),
        }
        previous = mtime
    report["save_parts"] = parts
    report["store_bytes"] = sum(f.stat().st_size for f in files)
    report["store"] = str(out)
    return report


def _drop_from_page_cache(folder: Path) -> None:
    """Ask the kernel to forget the cached pages of this store's files (our files only), so an
    open and first reads are measured as from disk."""
    for f in folder.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _fresh_open_seconds(folder: Path) -> dict[str, float]:
    """A new interpreter: from its start to ``KnowledgeStore.load`` done, torch's import included."""
    import subprocess

    code = (
        "import sys, time; t0 = time.perf_counter()\n"
        "from rapiddiff.kg.store import KnowledgeStore\n"
        "t1 = time.perf_counter(); s = KnowledgeStore.load(sys.argv[1]); t2 = time.perf_counter()\n"
        "i = s.id_of(s._name_index()[0].restore_key(0)); t3 = time.perf_counter()\n"
        "print(t1 - t0, t2 - t1, t3 - t2)"
    )
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", code, str(folder)], check=True, capture_output=True, text=True
    ).stdout
    whole = time.perf_counter() - t0
    imp, load, first = map(float, out.split())
    return {
        "process_seconds": round(whole, 3),
        "import_seconds": round(imp, 3),
        "load_seconds_incl_torch_import": round(load, 4),
        "first_id_of_seconds": round(first, 4),
    }


def link_step(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).parent))
    from kg_link_speed import _rate, synthetic_text

    from rapiddiff.kg.linker import EntityLinker

    names = Path(args.kg, "entities.txt").read_text(encoding="utf-8").split("\n")[:-1]
    if args.entities:
        names = names[: args.entities]
    rss0 = _rss_gb()
    t0 = time.perf_counter()
    linker = EntityLinker((name, i) for i, name in enumerate(names))  # pairs: no dict of 16 M names
    del names
    build = time.perf_counter() - t0
    rss_built = _rss_gb()
    docs = synthetic_text(args.chars, 0)
    t0 = time.perf_counter()
    spans = sum(len(linker.link(d)) for d in docs)  # the first pass warms jieba's dictionary
    first_pass = time.perf_counter() - t0
    return {
        "surface_forms": len(linker),
        "build_seconds": round(build, 1),
        "rss_before_build_gb": round(rss0, 2),
        "peak_rss_after_build_gb": round(rss_built, 2),
        "index_mb": round((len(linker.trie.tobytes()) + linker.entity_ids.nbytes) / 2**20, 1),
        "characters": sum(map(len, docs)),
        "spans_found": spans,
        "first_pass_seconds": round(first_pass, 2),
        "chars_per_cpu_second": round(_rate(linker.link, docs, 3)),
        "chars_per_cpu_second_no_word_check": round(
            _rate(lambda d: linker.link(d, word_check=False), docs, 3)
        ),
    }


def _unique_relation_table(triples: Any, num_entities: int, max_relations: int) -> Any:
    """The relation table as it was built before (one ``torch.unique`` over int64 keys): the baseline."""
    import torch

    table = torch.full((num_entities, max_relations), -1, dtype=torch.long)
    heads, rels = triples[:, 0].long(), triples[:, 1].long()
    num_rel = int(rels.max()) + 1
    keys = torch.unique(heads * num_rel + rels)
    heads, rels = keys // num_rel, keys % num_rel
    counts = torch.bincount(heads, minlength=num_entities)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(len(keys)) - starts[heads]
    keep = rank < max_relations
    table[heads[keep], rank[keep]] = rels[keep]
    return table


def reltable_step(args: argparse.Namespace) -> dict[str, Any]:
    """Fusion's relation table on random triples, CPU seconds of this process: the previous build
    and ``relation_table`` on the triples shuffled, then ``group_triples`` (the sort a
    KnowledgeStore's save now does) and the table on its output, as every saved store gives it.
    With ``--from-store DIR`` the triples also go through ``KnowledgeStore.save`` and ``load``."""
    import numpy as np
    import torch

    from rapiddiff.kg.triples import group_triples
    from rapiddiff.models.fusion import relation_table

    rng = np.random.default_rng(args.seed)
    triples = np.empty((args.pairs, 3), dtype=np.int64)
    triples[:, 0] = rng.integers(0, args.entities, args.pairs)
    triples[:, 1] = rng.integers(0, args.relations, args.pairs)
    triples[:, 2] = rng.integers(0, args.entities, args.pairs)
    shuffled = torch.from_numpy(triples)
    report: dict[str, Any] = {"pairs": args.pairs, "entities": args.entities, "relations": args.relations}
    t0 = time.process_time()
    new = relation_table(shuffled, args.entities, 8)
    report["cpu_seconds_new_shuffled"] = round(time.process_time() - t0, 2)
    if not args.skip_old:
        t0 = time.process_time()
        old = _unique_relation_table(shuffled, args.entities, 8)
        report["cpu_seconds_old_unique"] = round(time.process_time() - t0, 2)
        report["identical"] = bool(torch.equal(new, old))
        del old
    if args.from_store:
        report.update(_reltable_through_store(args, shuffled, new))
    t0 = time.process_time()
    grouped = group_triples(triples, args.entities, args.relations)  # what KnowledgeStore.save writes
    report["cpu_seconds_group_triples"] = round(time.process_time() - t0, 2)
    report["distinct_triples"] = len(grouped)
    del triples, shuffled
    t0 = time.process_time()
    again = relation_table(torch.from_numpy(grouped), args.entities, 8)
    report["cpu_seconds_new_store_order"] = round(time.process_time() - t0, 2)
    report["identical_store_order"] = bool(torch.equal(new, again))
    report["heads_with_relations"] = int((new[:, 0] >= 0).sum())
    return report


def _reltable_through_store(args: argparse.Namespace, shuffled: Any, expected: Any) -> dict[str, Any]:
    """Save a store of the shuffled triples (names e00000000..., dim 1), load it, build the table."""
    import shutil

    import torch

    from rapiddiff.kg.store import KnowledgeStore
    from rapiddiff.models.fusion import relation_table

    folder = Path(args.from_store)
    store = KnowledgeStore.from_arrays(
        [f"e{i:08d}" for i in range(args.entities)],
        [f"r{i:03d}" for i in range(args.relations)],
        torch.zeros(args.entities, 1),
        torch.zeros(args.relations, 1),
        triples=shuffled.clone(),
    )
    t0, c0 = time.perf_counter(), time.process_time()
    store.save(folder)
    out = {"store_save_seconds": round(time.perf_counter() - t0, 1)}
    out["store_save_cpu_seconds"] = round(time.process_time() - c0, 1)
    del store
    t0 = time.perf_counter()
    loaded = KnowledgeStore.load(folder)
    triples = loaded.triples
    out["store_load_and_read_triples_seconds"] = round(time.perf_counter() - t0, 1)
    keys = triples[:, 0] * args.relations + triples[:, 1]
    out["store_triples_grouped"] = bool((keys[1:] >= keys[:-1]).all())
    del keys
    t0 = time.process_time()
    table = relation_table(triples, args.entities, 8)
    out["cpu_seconds_new_from_saved_store"] = round(time.process_time() - t0, 2)
    out["identical_from_saved_store"] = bool(torch.equal(table, expected))
    del loaded, triples, table
    if not args.keep_store:
        shutil.rmtree(folder)
    return out


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="step", required=True)
    g = sub.add_parser("generate", help="write DIR/triples.tsv and DIR/entities.txt")
    g.add_argument("--out", type=Path, required=True)
    g.add_argument("--entities", type=int, default=16_000_000)
    g.add_argument("--triples", type=int, default=140_000_000)
    g.add_argument("--relations", type=int, default=200)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--ids", action="store_true", help="also DIR/triples.ids.npy (int64, for `save`)")
    t = sub.add_parser("train", help="rapiddiff kg train on DIR/triples.tsv → DIR/store")
    t.add_argument("--kg", type=Path, required=True)
    t.add_argument("--device", default="auto")
    t.add_argument("--epochs", type=int, default=2)
    t.add_argument("--dim", type=int, default=64)
    t.add_argument("--batch-size", type=int, default=1 << 20)
    t.add_argument("--negatives", type=int, default=1)
    t.add_argument("--lr", type=float, default=0.01)
    t.add_argument("--eval-triples", type=int, default=10_000)
    t.add_argument("--eval-batch-size", type=int, default=16)
    s = sub.add_parser("store", help="open a store, look names up, build fusion's relation table")
    s.add_argument("--store", type=Path, required=True)
    s.add_argument("--skip-triples", action="store_true")
    s.add_argument("--lookups", type=int, default=1000)
    s.add_argument("--cold", action="store_true", help="drop the store's files from the page cache first")
    s.add_argument("--linker", action="store_true", help="also build the EntityLinker over every name")
    v = sub.add_parser("save", help="a store of DIR's graph as `kg train` writes one, untrained vectors")
    v.add_argument("--kg", type=Path, required=True)
    v.add_argument("--store", type=Path, help="where (default DIR/store)")
    v.add_argument("--dim", type=int, default=64)
    k = sub.add_parser("link", help="EntityLinker over DIR/entities.txt: build memory and speed")
    k.add_argument("--kg", type=Path, required=True)
    k.add_argument("--entities", type=int, help="only the first N names")
    k.add_argument("--chars", type=int, default=200_000)
    r = sub.add_parser("reltable", help="fusion's relation table on random pairs: old vs new")
    r.add_argument("--pairs", type=int, default=140_000_000)
    r.add_argument("--entities", type=int, default=16_000_000)
    r.add_argument("--relations", type=int, default=200)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--skip-old", action="store_true", help="time only the new build")
    r.add_argument("--from-store", type=Path, help="also save the triples as a store here, load it, build")
    r.add_argument("--keep-store", action="store_true", help="keep the --from-store folder")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    if args.step == "generate":
        report = generate(args.out, args.entities, args.triples, args.relations, args.seed, args.ids)
    elif args.step == "train":
        report = train(args)
    elif args.step == "store":
        report = store_step(args)
    elif args.step == "save":
        report = save_step(args)
    elif args.step == "reltable":
        report = reltable_step(args)
    else:
        report = link_step(args)
    report = {
        "step": args.step,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *(argv or sys.argv[1:])]),
        "host": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "wall_seconds": round(time.perf_counter() - started, 1),
        "peak_host_rss_gb": round(_rss_gb(), 2),
        **report,
    }
    print(json.dumps(report, ensure_ascii=False, indent=2))
    out = os.environ.get("OUT")
    if out:
        Path(out, f"kg_scale_{args.step}.json").write_text(json.dumps(report, ensure_ascii=False, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
