#!/usr/bin/env bash
# A short device call: the SD 1.5 AOTInductor packages built in the machine's own environment
# ($CXX as it comes: rapiddiff picks a compiler that links Python's libstdc++) and loaded by fresh
# processes. Usage: bash benchmarks/device/aoti_rows_call.sh $OUT   (carrying .wt/slim)
set -u
out=$1
source benchmarks/device/install_wheels.sh || exit 1
echo "CXX=${CXX:-unset}"
left=$((345 - SECONDS))
timeout $left python3 benchmarks/aoti_cold_start.py --preset sd15 --steps 50 --variants aoti --rounds 3 \
  --budget-s $((left - 25)) --timeout-s 300 --out "$out/cold" 2>&1 | tail -c 2500
grep -h "C++ compiler" "$out"/cold/export.log | cut -c1-400
cd "$out" && tar czf logs.tgz cold/*.log 2>/dev/null; rm -f cold/*.log
