"""``rapiddiff kg train|link|info``: train TransE into a KnowledgeStore, link text, describe a store.

Imports nothing heavy at import time (torch, pykeen and jieba load inside the commands).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rapiddiff.kg.store import KnowledgeStore


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="kg_command", metavar="<kg command>")
    sub.required = True

    train = sub.add_parser(
        "train",
        help="train TransE (pykeen) on a triples TSV or a pykeen dataset; write a KnowledgeStore",
        description=(
            "Train TransE through pykeen's pipeline on --triples FILE, or as the YAML --config says "
            "(configs/kg/*.yaml; --triples and the other flags override it), log filtered "
            "MRR and Hits@1/3/10 on held-out triples, and write a KnowledgeStore folder (entities.tsv, "
            "relations.tsv, *_embeddings.safetensors, triples.tsv, config.json with the metrics). "
            "Triples TSV: head<TAB>relation<TAB>tail, '#' comments, UTF-8. Aliases TSV: entity<TAB>a1|a2. "
            "A malformed line is skipped and listed in OUT/skipped_lines.tsv (config bad_lines: error "
            "stops at the first instead)."
        ),
    )
    files = {
        "--config": "YAML file of TransEConfig keys (configs/kg/*.yaml)",
        "--triples": "triples TSV: train on it without a YAML of its own",
        "--aliases": "aliases TSV of --triples' entities",
        "--out": "store folder (overrides the config's 'out')",
    }
    for flag, help_text in files.items():
        train.add_argument(flag, type=Path, help=help_text)
    train.add_argument("--device", help="auto, cpu, cuda or cuda:N (overrides the config)")
    train.add_argument("--epochs", type=int, help="maximum epochs (overrides the config)")
    train.add_argument("--seed", type=int, help="random seed (overrides the config)")
    train.set_defaults(func=_train)

    link = sub.add_parser(
        "link",
        help="print the entity spans the linker finds in a text",
        description="Link entities of a KnowledgeStore in Chinese text: one line per span, start<TAB>end<TAB>surface<TAB>entity.",
    )
    link.add_argument("text", nargs="+", help="text(s) to link")
    link.add_argument("--store", required=True, type=Path, help="KnowledgeStore folder")
    link.add_argument("--json", action="store_true", help="print JSON lines instead of TSV")
    link.add_argument("--no-word-check", action="store_true", help="skip jieba's word-boundary check")
    link.set_defaults(func=_link)

    info = sub.add_parser(
        "info",
        help="describe a KnowledgeStore folder",
        description="Sizes, metrics and a few facts of a KnowledgeStore.",
    )
    info.add_argument("store", type=Path, help="KnowledgeStore folder")
    info.set_defaults(func=_info)


def _train(args: argparse.Namespace) -> int:
    from rapiddiff.kg.transe import TransEConfig, load_transe_config, train_transe

    if args.config is None and args.triples is None:
        raise SystemExit("kg train: give --triples FILE (a triples TSV) or --config FILE (a YAML)")
    flags = {"out": args.out, "device": args.device, "epochs": args.epochs, "seed": args.seed}
    flags |= {"triples": args.triples, "aliases": args.aliases}
    if args.config is None:
        cfg = TransEConfig(**{k: v for k, v in flags.items() if v is not None})
    else:  # the flags that are given override the YAML's keys
        cfg = load_transe_config(args.config, **flags)
    _, metrics = train_transe(cfg)
    print(json.dumps({"store": str(cfg.out), **metrics}, ensure_ascii=False))
    return 0


def _link(args: argparse.Namespace) -> int:
    from rapiddiff.kg.linker import EntityLinker
    from rapiddiff.kg.store import KnowledgeStore

    store = KnowledgeStore.load(args.store)
    linker = EntityLinker.from_store(store, word_check=not args.no_word_check)
    for text in args.text:
        for span in linker.link(text):
            name = store.entity_names[span.entity_id]
            if args.json:
                row = {
                    "start": span.start,
                    "end": span.end,
                    "surface": span.surface,
                    "entity": name,
                    "entity_id": span.entity_id,
                }
                print(json.dumps(row, ensure_ascii=False))
            else:
                print(f"{span.start}\t{span.end}\t{span.surface}\t{name}")
    return 0


def _info(args: argparse.Namespace) -> int:
    from rapiddiff.kg.store import KnowledgeStore

    store = KnowledgeStore.load(args.store)
    cfg = store.config
    print(f"store:      {args.store}")
    print(f"entities:   {len(store)}  (with aliases: {sum(1 for a in store.aliases if a)})")
    print(f"relations:  {len(store.relation_names)}")
    print(f"triples:    {len(store.triples)}")
    print(f"dim:        {store.dim}")
    print(f"model:      {cfg.get('model', '?')}  source: {cfg.get('source', '?')}")
    metrics = cfg.get("metrics")
    if metrics:
        print("metrics:    " + "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    print(f"linker:     {_linker_index_status(store)}")
    skipped = cfg.get("training", {}).get("skipped_lines")
    if skipped:  # kg train's bad_lines: skip left these out of the source files
        print(f"skipped:    {skipped} malformed source line(s), listed in skipped_lines.tsv")
    for i in range(min(3, len(store))):
        facts = store.facts(i)[:3]
        shown = ", ".join(f"{store.relation_names[r]} → {store.entity_names[t]}" for r, t in facts)
        print(f"  {store.entity_names[i]}: {shown or '(no facts as head)'}")
    return 0


def _linker_index_status(store: KnowledgeStore) -> str:
    """Whether the store carries its EntityLinker's index (``linker/``) and whether it is usable."""
    from rapiddiff.kg.linker_index import STORE_INDEX, read_store_index

    index, why = read_store_index(store)
    if index is not None:
        return f"index saved in {STORE_INDEX}/ ({len(index.trie)} keys): linking reads no names"
    if store.path is not None and (store.path / STORE_INDEX).exists():
        return f"{STORE_INDEX}/ not used ({why}): the index is built from the names"
    return "no saved index: built from the names on first use (then cached per user)"
