#!/usr/bin/env bash
# The OpenKG-sized graph through `rapiddiff kg train` in ONE device call of < 10 minutes (issue 13):
# generate it on the device, train TransE 1 epoch, filtered evaluation of a 1,000-triple sample (batches
# of 4: pykeen scores a batch as one [batch, 16 M, dim] tensor, 16 GB at 4, 65 GB at 16), save
# the store; then, if time is left, open the saved store (lookups, fusion's relation table).
#   bash benchmarks/kg_scale_device.sh                      # 16 M entities, 140 M triples, cuda
#   ENTITIES=20000 TRIPLES=175000 DEVICE=cpu OUT=/tmp/o bash benchmarks/kg_scale_device.sh   # a dry run
# Writes to $OUT: log.txt (every step's output, one line per finished phase), kg_scale_{generate,train,
# store}.json, gpu_mem.txt (nvidia-smi MiB used, 1 s samples) and host_mem.txt (free's used MiB, 2 s).
set -u
ENTITIES=${ENTITIES:-16000000}; TRIPLES=${TRIPLES:-140000000}; DEVICE=${DEVICE:-cuda}
LIMIT=${LIMIT:-570}   # seconds from this script's start by which everything must have ended (the prelude runs before)
KG=${KG:-/tmp/kg}; PY=${PY:-python3}
log=$OUT/log.txt
pids=()
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -l 1 > "$OUT/gpu_mem.txt" & pids+=($!)
fi
(while sleep 2; do free -m | awk '/Mem:/{print $3}'; done) > "$OUT/host_mem.txt" & pids+=($!)
stamp() { echo "[kg_scale_device] $(date -u +%H:%M:%S) t=${SECONDS}s $*" | tee -a "$log"; }
stamp "generate $ENTITIES entities, $TRIPLES triples"
$PY benchmarks/kg_scale.py generate --out "$KG" --entities "$ENTITIES" --triples "$TRIPLES" 2>&1 | tee -a "$log"
stamp "train (1 epoch, 1,000 sampled test triples, save)"
timeout $((LIMIT - SECONDS)) $PY benchmarks/kg_scale.py train --kg "$KG" --device "$DEVICE" --epochs 1 \
  --eval-triples 1000 --eval-batch-size 4 2>&1 | tee -a "$log"
stamp "train ended"
ls -la "$KG/store" 2>&1 | tee -a "$log"
if [ -f "$KG/store/config.json" ] && [ $((LIMIT - SECONDS)) -gt 30 ]; then
  stamp "store: open, look up, relation table"
  timeout $((LIMIT - SECONDS)) $PY benchmarks/kg_scale.py store --store "$KG/store" 2>&1 | tee -a "$log"
fi
stamp "done"
kill "${pids[@]}" 2> /dev/null
exit 0
