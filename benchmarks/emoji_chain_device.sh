#!/usr/bin/env bash
# The emoji-zh chain on one H200 across device calls of < 10 minutes: the first call starts it as a
# session of its own (setsid: it outlives the call while the machine stays held), every call then
# waits up to WAIT seconds and brings back the summary, the logs and (once assembled) the model.
#   WHEELS=.wt/lean bash benchmarks/emoji_chain_device.sh $OUT PKGS     # carry .wt/lean and PKGS
# PKGS: emoji-zh's npm tarballs (`npm pack` of the six packages, or slimmed copies holding only what
# the builder reads: package.json, LICENSE, emoji.json, img/<style>/64, annotations*/zh*); the next
# call within the machine's 30 s warm window finds the chain running (or done) and waits on it.
set -u
out=$1; pkgs=$2; work=${WORK:-/tmp/ec}; wait_s=${WAIT:-560}
source benchmarks/device/install_wheels.sh || exit 1
mkdir -p "$work"
# not running and not done (the first call, or a chain stopped by a failure fixed since): (re)start
# it; finished stages are skipped, so a restart resumes
if ! grep -q "\[emoji-chain\] all done" "$work/chain.log" 2>/dev/null && ! kill -0 "$(cat "$work/pid" 2>/dev/null)" 2>/dev/null; then
  [ -f "$work/chain.log" ] && mv "$work/chain.log" "$work/chain.$(date +%s).log"
  setsid nohup python3 benchmarks/emoji_chain.py --out "$work" --packages "$pkgs" ${SET:+$(printf -- '--set=%s ' $SET)} \
    > "$work/chain.log" 2>&1 < /dev/null &
  echo $! > "$work/pid"
fi
until grep -q "\[emoji-chain\] all done" "$work/chain.log" 2>/dev/null || ! kill -0 "$(cat "$work/pid")" 2>/dev/null \
  || [ $SECONDS -ge "$wait_s" ]; do sleep 5; done
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv > "$out/gpu.txt" 2>&1
cp "$work/chain.log" "$out/" 2>/dev/null
cp "$work/summary.md" "$work/summary.json" "$out/" 2>/dev/null
tar czf "$out/results.tgz" --exclude='*.ckpt' --exclude='images' --exclude='*.safetensors' -C "$work" \
  logs results $(cd "$work" && ls -d seed-*/eval_* seed-*/guidance seed-*/kg/config.json seed-*/run_*/csv 2>/dev/null) 2>/dev/null
if [ -d "$work/builtin" ] && [ ! -f "$work/builtin_sent" ]; then
  tar czf - -C "$work" builtin | split -b 15m - "$out/builtin.tgz." && touch "$work/builtin_sent"
fi
ls -la "$out"
