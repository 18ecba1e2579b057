"""EntityLinker before and after, in one process, over OpenKG-sized lexicons (issue 13).

Builds this tree's ``EntityLinker`` and the one in ``--old`` (another checkout's
``rapiddiff/kg/linker.py``) over the same ``--names`` generated names (``kg_scale.entity_names``),
links the same synthetic text with both (``kg_link_speed.synthetic_text``), and prints one JSON line:
per linker, build CPU seconds, index size, the first pass over the text in CPU seconds (it loads
jieba's dictionary and, for a compiled word check, the compiled code, and weighs each form the first
time it is met), characters per CPU-second (best of 3) with and without the word check; whether the
spans are identical; the date and the load average.

    python benchmarks/kg_link_compare.py --old OLD/rapiddiff/kg/linker.py --names 16000000
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def main(argv: list[str] | None = None) -> int:
    from kg_link_speed import _rate, synthetic_text
    from kg_scale import entity_names

    from rapiddiff.kg.linker import EntityLinker

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, required=True, help="the linker.py to compare against")
    parser.add_argument("--names", type=int, default=16_000_000)
    parser.add_argument("--chars", type=int, default=100_000)
    args = parser.parse_args(argv)
    spec = importlib.util.spec_from_file_location("old_linker", args.old)
    assert spec is not None and spec.loader is not None
    old = importlib.util.module_from_spec(spec)
    sys.modules["old_linker"] = old  # dataclasses look their module up
    spec.loader.exec_module(old)

    def rss() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

    t = time.process_time()
    names = entity_names(args.names, 0)
    docs = synthetic_text(args.chars, 0)
    report = {
        "names": args.names,
        "characters": sum(map(len, docs)),
        "names_cpu_s": round(time.process_time() - t, 1),
    }
    spans_of: dict[str, list[list[tuple[int, int, int]]]] = {}
    for label, cls in (("new", EntityLinker), ("old", old.EntityLinker)):
        t = time.process_time()
        linker = cls((name, i) for i, name in enumerate(names))
        report[f"{label}_build_cpu_s"] = round(time.process_time() - t, 1)
        report[f"{label}_index_mb"] = round(
            (len(linker.trie.tobytes()) + linker.entity_ids.nbytes) / 2**20, 1
        )
        t = time.process_time()
        spans = [[(s.start, s.end, s.entity_id) for s in linker.link(d)] for d in docs]  # warms jieba
        report[f"{label}_first_pass_cpu_s"] = round(time.process_time() - t, 2)
        spans_of[label] = spans
        report[f"{label}_spans"] = sum(map(len, spans))
        report[f"{label}_chars_per_cpu_s"] = round(_rate(linker.link, docs, 3))
        report[f"{label}_chars_per_cpu_s_no_check"] = round(
            _rate(lambda d, linker=linker: linker.link(d, word_check=False), docs, 3)
        )
        report[f"{label}_peak_rss_gb"] = round(rss(), 2)
        del linker
    report["identical_spans"] = spans_of["new"] == spans_of["old"]
    report["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    report["load_average"] = [round(x, 1) for x in os.getloadavg()]
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
