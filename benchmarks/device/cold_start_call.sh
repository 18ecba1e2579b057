#!/usr/bin/env bash
# One device call for issue 16's cold start (H100), ≈ 9 minutes:
#   1. bytecode: does the image's torch have compiled bytecode beside it, and what the imports of a
#      generating process cost without a bytecode cache (and, at the end, with a warm one);
#   2. benchmarks/aoti_cold_start.py: the SD 1.5 packages (U-Net + decoder) against torch.compile
#      with its cache, fresh processes, packages' rounds first, with that bytecode cache (what an
#      installed environment has).
# Usage (device tool, carrying the slim wheels of kshapes_chain_device.sh in .wt/slim):
#   bash benchmarks/device/cold_start_call.sh $OUT
set -u
out=$1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .wt/slim/*.whl \
  && tar xzf .wt/slim/jieba_slim.tgz -C /tmp/site || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p "$out"
python3 - <<'PY' | tee "$out/bytecode.txt"
import os, sysconfig, torch, sympy
for mod in (torch, sympy):
    d = os.path.dirname(mod.__file__)
    print(mod.__name__, d, "has __pycache__:", os.path.isdir(os.path.join(d, "__pycache__")), "writable:", os.access(d, os.W_OK))
PY
imports="import torch
from rapiddiff.infer.pipeline import RapidDiffusionPipeline
from rapiddiff.models.bundle import diffusers_class
diffusers_class('UNet2DConditionModel'); diffusers_class('AutoencoderKL')"
timed_imports() {
  local s e; s=$EPOCHREALTIME; python3 -c "$imports"; e=$EPOCHREALTIME
  awk -v s="$s" -v e="$e" -v r="$1" 'BEGIN {printf "imports, %s: %.2f s\n", r, e - s}' | tee -a "$out/bytecode.txt"
}
timed_imports "no bytecode cache for read-only folders"
export PYTHONPYCACHEPREFIX=/tmp/pyc  # written by the model's and the export's processes, read by the rest
left=$((575 - SECONDS))
PYTHONFAULTHANDLER=1 timeout $left python3 benchmarks/aoti_cold_start.py --preset sd15 --steps 50 --grouped \
  --variants aoti compile --rounds 3 --budget-s $((left - 70)) --timeout-s 330 --out "$out/cold" 2>&1 | tail -c 3000
[ $SECONDS -lt 570 ] && timed_imports "bytecode cache (PYTHONPYCACHEPREFIX) warm"
cd "$out" && tar czf logs.tgz cold/*.log 2>/dev/null; rm -f cold/*.log
