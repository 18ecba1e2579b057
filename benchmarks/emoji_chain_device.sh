#!/usr/bin/env bash
# The emoji-zh chain on one H200 in device calls of < 10 minutes (benchmarks/emoji_chain.py).
#   bash benchmarks/emoji_chain_device.sh all $OUT PKGS             # call 1: the whole chain, as a session of
#                                                                   #   its own; returns after WAIT s with prep.tgz
#   bash benchmarks/emoji_chain_device.sh wait $OUT PKGS            # calls 2, 3: collect what runs on
#   bash benchmarks/emoji_chain_device.sh unet $OUT PKGS PREP.tgz   # a machine found cold: U-Nets on from prep.tgz
#   bash benchmarks/emoji_chain_device.sh prep $OUT PKGS            # the prep alone → $OUT/prep.tgz
# Here, once: bash benchmarks/device/make_wheels.sh && bash benchmarks/emoji_chain_device.sh wheels .whl .wt/lean
#             bash benchmarks/device/slim_emoji_packages.sh TGZ_DIR .wt/emoji_pkgs   # TGZ_DIR: `npm pack` of the six
# Carry WHEELS (default .wt/lean: benchmarks/device/make_wheels.sh's set without the serving stack,
# sqlalchemy/optuna, pydantic and lmdb: 17 MB) and PKGS, emoji-zh's npm tarballs slimmed to what the
# builder reads (package.json, LICENSE, emoji.json, img/<style>/64 of the catalogue's emoji,
# annotations*/zh*: 11 MB; the full tarballs are 150 MB), and for `unet` the folder holding prep.tgz.
# The working tree travels too, and the built-in model's 24 MB does not fit beside them: keep
# rapiddiff/assets out of what travels for the first call (untracked and ignored for its duration).
# SVG=FOLDER (the two @iconify-json tarballs, 4.7 MB) with `all`: the upscaler trains beside the chain
# (benchmarks/device/emoji_upscaler_job.sh) → $OUT/upscaler.tgz.
# A `wait` call carries nothing: the warm machine keeps the installed wheels and the data.
# The chain runs as a session of its own (setsid): it outlives the call while the machine is held,
# and a `wait` call within the machine's 30 s warm window collects it. A machine found cold has lost
# it: then `unet` with the prep.tgz the first call brought back (the data is rebuilt from PKGS).
# Measured 2026-12-02 (H200, WORK=/tmp/ec): data 17–22 s, TransE 143–206 s (3 seeds side by side, 300
# epochs, pykeen's per-batch overhead), CLIP 210 s, VAEs 268 s (4 minutes' budget).
set -u
# torch_fidelity stays: `eval emoji`'s Fréchet distance imports it (2026-12-02 every evaluation failed
# without it); resvg-py stays: the upscaler's hr/ slice.
if [ "$1" = wheels ]; then  # kshapes' slim set without what the chain never imports (serving stays out too)
  bash benchmarks/kshapes_chain_device.sh wheels "$2" "$3.slim" > /dev/null || exit 1
  rm -rf "$3"; mkdir -p "$3"
  for w in "$3.slim"/*; do
    case $(basename "$w") in
      sqlalchemy-*|alembic-*|mako-*|optuna-*|colorlog-*|pydantic*|annotated_types-*|typing_inspection-*|lmdb-*) ;;
      opentelemetry*|dataclasses_json-*|marshmallow-*|typing_extensions-*|click-*|prelude.sh) ;;
      *) cp "$w" "$3/" ;;
    esac
  done
  rm -rf "$3.slim"; du -sh "$3"; exit 0
fi
part=$1; out=$2; pkgs=$3; work=${WORK:-/tmp/ec}; wait_s=${WAIT:-560}
export WHEELS=${WHEELS:-.wt/lean}
source benchmarks/device/install_wheels.sh || exit 1
mkdir -p "$work" "$out"
read -ra sets <<< "${SET:-}"
collect() {
  cp "$work/chain.log" "$work/summary.md" "$work/summary.json" "$out/" 2>/dev/null
  tar czf "$out/results.tgz" --exclude='*.ckpt' --exclude='images' --exclude='*.safetensors' -C "$work" \
    logs results $(cd "$work" && ls -d seed-*/eval_* seed-*/guidance seed-*/kg/config.json seed-*/run_*/csv 2>/dev/null) 2>/dev/null
  if [ -f "$work/upscaler/model/upscaler.safetensors" ] && [ ! -f "$work/upscaler_sent" ]; then
    tar czf "$out/upscaler.tgz" -C "$work/upscaler" model run/csv upscaler.log 2>/dev/null && touch "$work/upscaler_sent"
  fi
  tail -n 3 "$work/upscaler/upscaler.log" 2>/dev/null
  if [ -f "$work/prep.tgz" ] && [ ! -f "$work/prep_sent" ]; then cp "$work/prep.tgz" "$out/" && touch "$work/prep_sent"; fi
  if [ -d "$work/builtin" ] && [ ! -f "$work/builtin_sent" ]; then  # two parts under the 16 MiB a file may be
    tar czf - -C "$work" builtin | split -b 15m - "$out/builtin.tgz." && touch "$work/builtin_sent"
  fi
  tail -n 25 "$work/chain.log"; ls -la "$out"
}
if [ "$part" = prep ]; then
  timeout 570 python3 benchmarks/emoji_chain.py --out "$work" --packages "$pkgs" --part prep --pack "$out/prep.tgz" \
    "${sets[@]/#/--set=}" > "$out/chain_prep.log" 2>&1
  tar czf "$out/prep_logs.tgz" -C "$work" logs results 2>/dev/null; ls -la "$out"; exit 0
fi
if [ "$part" = unet ] || [ "$part" = all ]; then
  pkill -f emoji_chain.py; rm -f "$work/chain.log"
  if [ "$part" = all ]; then args=(--part all --pack "$work/prep.tgz"); else args=(--part unet --unpack "$4"); fi
  setsid nohup python3 benchmarks/emoji_chain.py --out "$work" --packages "$pkgs" "${args[@]}" \
    "${sets[@]/#/--set=}" > "$work/chain.log" 2>&1 < /dev/null &
  echo $! > "$work/pid"
  if [ "$part" = all ] && [ -n "${SVG:-}" ]; then  # the upscaler beside the chain: its own data slice with hr/
    setsid nohup bash benchmarks/device/emoji_upscaler_job.sh "$work/upscaler" "$pkgs" "$SVG" > /dev/null 2>&1 < /dev/null &
  fi
fi
until grep -qE "\[emoji-chain\] (unet|all) done" "$work/chain.log" 2>/dev/null || ! kill -0 "$(cat "$work/pid")" 2>/dev/null \
  || [ $SECONDS -ge "$wait_s" ]; do sleep 5; done
collect
