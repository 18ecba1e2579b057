#!/usr/bin/env bash
# Issue 49 in one device call (≈ 8 min on an H200 shared with other training; modest GPU memory).
# Measured 2026-12-02 beside the emoji chain's four U-Nets (GPU at 99 %): data 7 s, train 280 s, and
# the measure's 200 s drew 120 held-out and 40 seen cases (complete: false); the speed step had 53 s
# left and timed nothing. On a GPU of its own, or with KSC_MEASURE_S / KSC_SPEED_S raised, it finishes.
#   1. data:    kshapes with object masks (the `mask` column), no hr/ copies, into $KSC/data;
#   2. train:   `rapiddiff train controlnet --config configs/controlnet/kshapes.yaml` on the built-in
#               kshapes model, paths in $KSC, bf16-mixed, stopped by --trainer.max_time (the config's
#               1500 steps are an estimate, not yet timed), a CSV log beside TensorBoard's;
#   3. measure: benchmarks/controlnet_mask_iou.py, with and without control on the same seeds: mask
#               IoU and the kshapes knowledge read (seen entities: the first $KSC_LIMIT test items
#               naming one; held-out entities: eval knowledge's held-out prompts), knowledge on;
#   4. speed:   the same script's --speed: batch 1 on the fast path, with vs without the ControlNet.
# OUT gets iou.json (the figures, the speed, issue 49's targets met or not, per case rows), grid.png
# (control | with | without) and cn_kshapes.tgz (speed.json, timings.txt: seconds per step,
# train_metrics.csv, train_log_tail.txt, every step's log). One line per step on stdout:
# `[cn-kshapes] step NAME done in N s`, a summary of the figures, and `[cn-kshapes] done` at the end.
# Usage (device tool, the slim wheels carried as the other device scripts carry them):
#   bash benchmarks/device/controlnet_kshapes_call.sh $OUT
# Smaller runs (a CPU smoke check of the commands) through the environment: KSC (work folder,
# default /tmp/ksc), KSC_TRAIN / KSC_VAL / KSC_TEST (images per split: 10000 / 200 / 1000),
# KSC_WORKERS (drawing processes, 8), KSC_TRAIN_TIME (00:00:04:00), KSC_MAX_STEPS (the config's),
# KSC_BATCH (the config's), KSC_PRECISION (bf16-mixed), KSC_LIMIT (200), KSC_HELDOUT_PROMPTS (all),
# KSC_IMAGES_PER_PROMPT (4), KSC_SAMPLE_STEPS (the model's), KSC_SPEED_RUNS (10), KSC_DTYPE
# (bfloat16), KSC_DEVICE (auto: cuda), KSC_BUDGET (seconds after which no step starts, 540),
# KSC_MEASURE_S / KSC_SPEED_S (those steps' time limits, 200 s each), KSC_TRAIN_ARGS (more `train controlnet` overrides, e.g. --samples.at_end=false), KSC_NO_INSTALL=1
# (PYTHONPATH already set: skip install_wheels.sh), PY (python3).
set -u
out=$1
work=${KSC:-/tmp/ksc}
py=${PY:-python3}
if [ "${KSC_NO_INSTALL:-0}" != 1 ]; then
  source benchmarks/device/install_wheels.sh || exit 1
fi
rm -rf "$work"  # a warm machine keeps the last call's folder
logs=$work/logs
mkdir -p "$out" "$logs"
timings=$work/timings.txt
budget=${KSC_BUDGET:-540}
device=()
[ -n "${KSC_DEVICE:-}" ] && device=(--device "$KSC_DEVICE")
sample=()
[ -n "${KSC_SAMPLE_STEPS:-}" ] && sample=(--steps "$KSC_SAMPLE_STEPS")

# Three files leave in OUT (the device tool returns 8 a call, and this call shares one): iou.json,
# grid.png, and cn_kshapes.tgz with the rest (speed.json, timings.txt, train_metrics.csv,
# train_log_tail.txt, every step's log).
finish() {
  tail -n 60 "$logs/train.log" > "$logs/train_log_tail.txt" 2>/dev/null
  csv=$(ls "$work"/run/csv/version_*/metrics.csv 2>/dev/null | tail -n 1)
  [ -n "$csv" ] && cp "$csv" "$logs/train_metrics.csv"
  [ -f "$out/speed.json" ] && mv "$out/speed.json" "$logs/"
  cp "$timings" "$logs/" 2>/dev/null
  tar czf "$out/cn_kshapes.tgz" -C "$work" logs 2>/dev/null
}

# step NAME TIMEOUT_S COMMAND...: run it (its output in $logs/NAME.log) under the smaller of its
# timeout and the budget left, print the marker, record the seconds; returns the command's status.
step() {
  local name=$1 limit=$2 left started rc
  shift 2
  left=$((budget - SECONDS))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 0 ]; then
    echo "[cn-kshapes] step $name skipped: the budget of $budget s is spent" | tee -a "$timings"
    return 1
  fi
  started=$SECONDS
  timeout "$limit" "$@" > "$logs/$name.log" 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then
    echo "[cn-kshapes] step $name done in $((SECONDS - started)) s" | tee -a "$timings"
  else
    echo "[cn-kshapes] step $name FAILED (exit $rc, timeout $limit s) after $((SECONDS - started)) s" \
      | tee -a "$timings"
    tail -n 25 "$logs/$name.log"
  fi
  return $rc
}

step data 150 "$py" -m rapiddiff data kshapes --out "$work/data" --masks --no-hr-copies \
  --train "${KSC_TRAIN:-10000}" --val "${KSC_VAL:-200}" --test "${KSC_TEST:-1000}" --workers "${KSC_WORKERS:-8}" \
  || { finish; exit 1; }

train=(--trainer.default_root_dir="$work/run" --output="$work/run/model"
  --data.train="$work/data/train" --data.val="$work/data/val"
  --trainer.precision="${KSC_PRECISION:-bf16-mixed}" --trainer.max_time="${KSC_TRAIN_TIME:-00:00:04:00}"
  --trainer.enable_progress_bar=false
  "--trainer.logger+={\"class_path\": \"CSVLogger\", \"init_args\": {\"save_dir\": \"$work/run\", \"name\": \"csv\"}}")
[ -n "${KSC_MAX_STEPS:-}" ] && train+=(--trainer.max_steps="$KSC_MAX_STEPS")
[ -n "${KSC_BATCH:-}" ] && train+=(--data.batch_size="$KSC_BATCH")
[ "${KSC_DEVICE:-}" = cpu ] && train+=(--trainer.accelerator=cpu)
# shellcheck disable=SC2206  # KSC_TRAIN_ARGS: more overrides, one word each
[ -n "${KSC_TRAIN_ARGS:-}" ] && train+=(${KSC_TRAIN_ARGS})
# max_time stops the fit, not the latent caching before it or the export after: 330 s in all
step train 330 "$py" -m rapiddiff train controlnet --config configs/controlnet/kshapes.yaml "${train[@]}" \
  || { finish; exit 1; }

iou=(--model builtin:kshapes --controlnet "$work/run/model" --data "$work/data/test" --kshapes "$work/data"
  --captions seen --out "$out" --dtype "${KSC_DTYPE:-bfloat16}" "${device[@]}" "${sample[@]}")
heldout=()
[ -n "${KSC_HELDOUT_PROMPTS:-}" ] && heldout=(--heldout-prompts "$KSC_HELDOUT_PROMPTS")
step measure "${KSC_MEASURE_S:-200}" "$py" benchmarks/controlnet_mask_iou.py "${iou[@]}" --limit "${KSC_LIMIT:-200}" \
  --images-per-prompt "${KSC_IMAGES_PER_PROMPT:-4}" "${heldout[@]}" --batch-size 32
# a speed run on its own joins iou.json (when the measure wrote one) and writes speed.json
step speed "${KSC_SPEED_S:-200}" "$py" benchmarks/controlnet_mask_iou.py "${iou[@]}" --no-measure --speed \
  --speed-runs "${KSC_SPEED_RUNS:-10}"
finish
[ -f "$out/iou.json" ] && "$py" -c "
import json, sys
r = json.load(open(sys.argv[1], encoding='utf-8'))
print('[cn-kshapes] measure complete:', r.get('complete'), '| mean IoU with/without', r.get('mean_iou_with'), r.get('mean_iou_without'))
for k, v in r.get('knowledge', {}).items():
    print(f\"[cn-kshapes] {k}: n={v['n']} both with {v['both_with']} without {v['both_without']} ({v['both_diff_points']:+} points)\")
s = r.get('speed') or {}
print('[cn-kshapes] speed with/without', s.get('median_s_with'), s.get('median_s_without'), 'ratio', s.get('ratio'))
print('[cn-kshapes] targets', json.dumps(r.get('targets'), ensure_ascii=False))
" "$out/iou.json"
echo "[cn-kshapes] done"
