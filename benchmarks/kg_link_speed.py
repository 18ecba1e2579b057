"""EntityLinker speed on a 100k-entity lexicon, one core, against jieba's own speed on the same text.

Lexicon: 100,000 noun-like words (tags n/nr/ns/nt/nz/nrt, 2+ characters) sampled from jieba's
own dictionary, which makes a dense, hard case: nearly every clause holds a candidate match.
Text: by default sentences sampled word by word from jieba's dictionary by frequency (a unigram
model of Chinese, reproducible anywhere jieba is installed), with punctuation; or any UTF-8
file with --text (one document a line, e.g. real prose).

    python benchmarks/kg_link_speed.py                        # synthetic text, 100k entities
    python benchmarks/kg_link_speed.py --text corpus.txt --entities 100000
    OUT=dir python benchmarks/kg_link_speed.py                # also writes dir/kg_link_speed.json

Reported: characters per CPU-second (one core; process CPU time, so other jobs on a shared
machine do not count) of (a) jieba.cut(HMM=False) with its default dictionary — the baseline the
issue quotes; (b) jieba.cut with the entity lexicon loaded; (c) EntityLinker.link, and the
trie-only part of it (word_check=False).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

NOUN_TAGS = {"n", "nr", "ns", "nt", "nz", "nrt"}
PUNCT = "，。、；！？"


def _dictionary() -> list[tuple[str, int, str]]:
    import jieba

    path = Path(jieba.__file__).with_name("dict.txt")
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        parts = line.split()
        if len(parts) == 3:
            rows.append((parts[0], int(parts[1]), parts[2]))
    return rows


def lexicon(n: int, seed: int) -> dict[str, int]:
    nouns = sorted(w for w, _, tag in _dictionary() if tag in NOUN_TAGS and len(w) >= 2)
    rng = random.Random(seed)
    chosen = rng.sample(nouns, min(n, len(nouns)))
    return {w: i for i, w in enumerate(chosen)}


def synthetic_text(n_chars: int, seed: int) -> list[str]:
    """Sentences of 20-80 characters, words drawn by jieba dictionary frequency."""
    rows = _dictionary()
    words = [w for w, _, _ in rows]
    weights = [f for _, f, _ in rows]
    rng = random.Random(seed)
    sample = rng.choices(words, weights=weights, k=n_chars)  # more than enough words
    docs, i, total = [], 0, 0
    while total < n_chars:
        target = rng.randint(20, 80)
        parts, length = [], 0
        while length < target:
            parts.append(sample[i])
            length += len(sample[i])
            i += 1
            if rng.random() < 0.12:
                parts.append(rng.choice(PUNCT))
                length += 1
        doc = "".join(parts) + "。"
        docs.append(doc)
        total += len(doc)
    return docs


def _rate(fn, docs: list[str], repeat: int) -> float:
    """Characters per CPU-second of this process (best of ``repeat`` passes).

    CPU time, not wall time: on a machine shared with other jobs the wall clock measures the
    neighbours; the process's CPU time is what one core spends on the work.
    """
    chars = sum(map(len, docs))
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        for d in docs:
            fn(d)
        best = min(best, time.process_time() - start)
    return chars / best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--entities", type=int, default=100_000)
    parser.add_argument("--chars", type=int, default=200_000, help="characters of synthetic text")
    parser.add_argument(
        "--text", type=Path, help="a UTF-8 file, one document a line, instead of synthetic text"
    )
    parser.add_argument("--repeat", type=int, default=3, help="timed passes; the best is reported")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import jieba

    from rapiddiff.kg.linker import EntityLinker

    jieba.setLogLevel(60)
    lex = lexicon(args.entities, args.seed)
    if args.text:
        docs = [line.strip() for line in args.text.read_text(encoding="utf-8").splitlines() if line.strip()]
        source = str(args.text)
    else:
        docs = synthetic_text(args.chars, args.seed)
        source = f"synthetic (jieba unigram, seed {args.seed})"
    n_chars = sum(map(len, docs))

    t0 = time.perf_counter()
    linker = EntityLinker(lex)
    linker.link(docs[0])  # loads jieba's dictionary, so its cost is not timed as linking
    build_s = time.perf_counter() - t0
    plain = jieba.Tokenizer()
    plain.initialize()
    tok = jieba.Tokenizer()  # the baseline: jieba with every name added as a user word
    tok.FREQ, tok.total, tok.initialized = dict(plain.FREQ), plain.total, True
    for word in lex:
        tok.add_word(word)

    results = {
        "jieba_default_dict": _rate(lambda d: list(plain.cut(d, HMM=False)), docs, args.repeat),
        "jieba_with_lexicon": _rate(lambda d: list(tok.cut(d, HMM=False)), docs, args.repeat),
        "linker_trie_only": _rate(lambda d: linker.link(d, word_check=False), docs, args.repeat),
        "linker": _rate(linker.link, docs, args.repeat),
    }
    spans = sum(len(linker.link(d)) for d in docs)
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": f"CPU {platform.processor() or platform.machine()}, one core (single-threaded Python), os.cpu_count()={os.cpu_count()}",
        "command": "python "
        + " ".join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]),
        "entities": len(lex),
        "text": source,
        "documents": len(docs),
        "characters": n_chars,
        "spans_found": spans,
        "build_seconds": round(build_s, 2),
        "chars_per_second": {k: round(v) for k, v in results.items()},
    }
    print(json.dumps(report, ensure_ascii=False, indent=2))
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "kg_link_speed.json").write_text(json.dumps(report, ensure_ascii=False, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
