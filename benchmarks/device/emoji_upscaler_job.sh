#!/usr/bin/env bash
# emoji-zh's upscaler (128² → 512², configs/upscaler/emoji.yaml) on the device, beside the chain
# (benchmarks/emoji_chain_device.sh): a data slice with hr/ copies drawn from the SVG packages, then
# the upscaler stage for MINUTES (default 4) in bf16. Started as a session of its own by the chain's
# first call; its own data folder (the chain's data has no hr/: its 13,596 SVG renders would cost
# minutes of one core), so a failure here costs the chain nothing.
#   bash benchmarks/device/emoji_upscaler_job.sh WORK PKGS SVG_PKGS   → WORK/model, WORK/upscaler.log
# EXTRA: more stage flags (a CPU check: EXTRA="--trainer.max_steps=3 --trainer.precision=32-true").
# The caller has sourced benchmarks/device/install_wheels.sh (resvg-py is in the lean set).
set -u
work=$1; pkgs=$2; svg=$3; minutes=${MINUTES:-4}
mkdir -p "$work"
log="$work/upscaler.log"
{
  s=$SECONDS
  python3 -m rapiddiff data emoji --config configs/data/emoji.yaml --out "$work/data" --package "$pkgs" \
    --package "$svg" --limit "${LIMIT:-400}" || { echo "[emoji-upscaler] data failed"; exit 1; }
  echo "[emoji-upscaler] data done in $((SECONDS - s)) s"; s=$SECONDS
  python3 -m rapiddiff train upscaler --config configs/upscaler/emoji.yaml --output "$work/model" \
    --trainer.default_root_dir "$work/run" --trainer.precision bf16-mixed \
    --trainer.max_time "00:00:$(printf %02d "$minutes"):00" \
    --data.train_lr "$work/data/train" --data.train_hr "$work/data/hr/train" \
    --data.val_lr "$work/data/val" --data.val_hr "$work/data/hr/val" ${EXTRA:-} || { echo "[emoji-upscaler] training failed"; exit 1; }
  echo "[emoji-upscaler] training done in $((SECONDS - s)) s"
  echo "[emoji-upscaler] done"
} > "$log" 2>&1
