"""SD 1.5 inference benchmark: stock diffusers vs the torch.compile recipe vs rapiddiff (one process).

Same as ``rapiddiff bench``; with ``OUT`` set, results go to $OUT. On the H200 through the device tool:

    python benchmarks/bench_sd15.py --batch 1 8 --variants eager recipe rapiddiff \
        --switches all --second-process --profile
"""

from __future__ import annotations

import os
import sys

from rapiddiff.infer.bench_cli import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    if os.environ.get("OUT") and "--out" not in argv:
        argv += ["--out", os.environ["OUT"]]
    sys.exit(main(argv))
