#!/usr/bin/env bash
# One device call for issue 16's cold start (H100), ≈ 9.5 minutes:
#   1. bytecode as an installed environment has it: the device image sets PYTHONDONTWRITEBYTECODE=1
#      and ships torch without __pycache__ (and our wheels go in with --no-compile), so without this
#      step every process compiles every module it imports from source; compileall's time is logged;
#   2. benchmarks/aoti_cold_start.py: the SD 1.5 packages (U-Net + decoder) in fresh processes,
#      3 rounds, then one package process that reads no bytecode (the same run's control), then
#      torch.compile with its cache (cold, then cached rounds) while the budget lasts.
# Usage (device tool, carrying the slim wheels of kshapes_chain_device.sh in .wt/slim):
#   bash benchmarks/device/cold_start_call.sh $OUT
set -u
out=$1
source benchmarks/device/install_wheels.sh || exit 1
mkdir -p "$out"
site=$(python3 -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")
s=$EPOCHREALTIME
python3 -m compileall -q -j 16 "$site" /tmp/site /usr/lib/python3.12 rapiddiff benchmarks > /dev/null 2>&1
awk -v s="$s" -v e="$EPOCHREALTIME" -v d="$site" 'BEGIN {printf "compileall %s, /tmp/site, stdlib, the tree: %.1f s\n", d, e - s}' \
  | tee "$out/bytecode.txt"
imports="import torch
from rapiddiff.infer.pipeline import RapidDiffusionPipeline
from rapiddiff.models.bundle import diffusers_class
diffusers_class('UNet2DConditionModel'); diffusers_class('AutoencoderKL')"
for run in 1 2; do
  s=$EPOCHREALTIME; python3 -c "$imports"
  awk -v s="$s" -v e="$EPOCHREALTIME" 'BEGIN {printf "imports of a generating process, with bytecode: %.2f s\n", e - s}' | tee -a "$out/bytecode.txt"
done
left=$((585 - SECONDS))
PYTHONFAULTHANDLER=1 timeout $left python3 benchmarks/aoti_cold_start.py --preset sd15 --steps 50 --grouped \
  --variants aoti compile --rounds 3 --no-bytecode-round --budget-s $((left - 75)) --timeout-s 330 \
  --out "$out/cold" 2>&1 | tail -c 3000
cd "$out" && tar czf logs.tgz cold/*.log 2>/dev/null; rm -f cold/*.log
