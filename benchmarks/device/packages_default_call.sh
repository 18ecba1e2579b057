#!/usr/bin/env bash
# One device call (≈ 6–8 minutes on an H200): AOTInductor packages by default (issue 47).
#   1. bytecode compiled as an installed environment has it (see cold_start_call.sh);
#   2. an SD 1.5 folder of random weights (benchmarks/aoti_cold_start.py's make_model);
#   3. process A: `rapiddiff generate --fast` with no packages and empty Inductor/Triton caches: it
#      runs torch.compile and starts the packages' export in the background (its log line says so);
#   4. the background build's end is awaited (build.lock gone), its record and log tail shown;
#   5. process B: the same command, two images, new empty caches: it should load the packages
#      ("aoti_unet → loaded") and end — imports, weights, both images, PNGs — in ≤ 15 s.
# Usage (device tool, carrying the slim wheels of kshapes_chain_device.sh in .wt/slim):
#   bash benchmarks/device/packages_default_call.sh $OUT
set -u
out=$1
source benchmarks/device/install_wheels.sh || exit 1
mkdir -p "$out"
site=$(python3 -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 16 "$site" /tmp/site /usr/lib/python3.12 rapiddiff benchmarks > /dev/null 2>&1
root=$(mktemp -d)
python3 - "$root" <<'PY'
import argparse, sys
sys.path.insert(0, "benchmarks")
from pathlib import Path
from aoti_cold_start import make_model
folder, took = make_model(argparse.Namespace(preset="sd15", device="cuda", dtype="float16"), Path(sys.argv[1]))
print(f"model {folder} in {took:.1f} s")
PY
model="$root/model-sd15"
gen() {  # $1: name, $2: images; fresh compile caches, as on a new machine
  local caches; caches=$(mktemp -d)
  local s=$EPOCHREALTIME
  TORCHINDUCTOR_CACHE_DIR=$caches/inductor TRITON_CACHE_DIR=$caches/triton \
    python3 -m rapiddiff generate "一只熊猫" --model "$model" --fast --steps 50 --seed 0 --no-upscale \
    --no-progress --num-images "$2" --batch-size 1 --no-grid --out "$out/$1" > "$out/$1.log" 2>&1
  local rc=$?
  awk -v s="$s" -v e="$EPOCHREALTIME" -v n="$1" -v rc="$rc" 'BEGIN {printf "%s: exit %s, %.1f s from start to its last PNG\n", n, rc, e - s}' \
    | tee -a "$out/summary.txt"
  grep -E "aoti|background|compile_unet|loop →" "$out/$1.log" | cut -c1-400 | tee -a "$out/summary.txt"
}
gen A-first-use 1
waited=0
while [ -f "$model/accelerated/build.lock" ] && [ $waited -lt 420 ]; do sleep 5; waited=$((waited + 5)); done
echo "background build: waited $waited s after process A" | tee -a "$out/summary.txt"
cat "$model/accelerated/build-last.json" 2>/dev/null | tee -a "$out/summary.txt"
tail -c 2000 "$model/accelerated/build.log" > "$out/build-log-tail.txt" 2>/dev/null
grep -h "built\|compile_s\|export_s" "$model"/accelerated/*.json 2>/dev/null | head -8 | tee -a "$out/summary.txt"
gen B-next-process 2
gen C-again 2
