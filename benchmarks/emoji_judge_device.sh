#!/usr/bin/env bash
# The emoji-zh judge on one GPU: the full judge (every style) and one leave-one-style-out judge per
# style, each tested on renders from a seed training never draws; figures under $OUT.
#
#   EMOJI_DATA=/path/to/emoji-data OUT=/tmp/out bash benchmarks/emoji_judge_device.sh
#
# EMOJI_DATA: a folder from `rapiddiff data emoji` (entities.jsonl, glyphs/<style>/<id>.png, ...).
# Sized for about 6 minutes on one H200: 3 minutes for the full judge, 1 minute per left-out style
# (two styles), plus tests. JUDGE_MINUTES / LOSO_MINUTES / ARCH / INPUT_SIZE / BATCH override.
set -euo pipefail
: "${EMOJI_DATA:?set EMOJI_DATA to a folder written by rapiddiff data emoji}"
OUT=${OUT:-/tmp/emoji-judge-out}
JUDGE_MINUTES=${JUDGE_MINUTES:-3}
LOSO_MINUTES=${LOSO_MINUTES:-1}
ARCH=${ARCH:-resnet18}
INPUT_SIZE=${INPUT_SIZE:-96}
BATCH=${BATCH:-512}
PY=${PYTHON:-python}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt" || true

common=(--data "$EMOJI_DATA" --device cuda --arch "$ARCH" --input-size "$INPUT_SIZE" --batch-size "$BATCH")
$PY -m rapiddiff eval judge-train "${common[@]}" --minutes "$JUDGE_MINUTES" --out "$OUT/judge" \
  2>&1 | tee "$OUT/judge.log"
for style in $(ls "$EMOJI_DATA/glyphs"); do
  $PY -m rapiddiff eval judge-train "${common[@]}" --minutes "$LOSO_MINUTES" --leave-out-style "$style" \
    --out "$OUT/judge_without_$style" 2>&1 | tee "$OUT/judge_without_$style.log"
  rm -f "$OUT/judge_without_$style/model.safetensors"  # its figures are what is wanted; the weights stay here
done

$PY - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
summary = {}
for figures in sorted(out.glob("judge*/figures.json")):
    f = json.loads(figures.read_text())
    row = {"test": f["test"]["all"], "by_style": f["test"]["by_style"], "training": {k: f["training"][k] for k in ("steps", "images", "seconds", "images_per_second")}}
    if "test_left_out" in f:
        row["left_out_style"], row["test_left_out"] = f["left_out_style"], f["test_left_out"]["all"]
    summary[figures.parent.name] = row
(out / "emoji_judge_summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
print(json.dumps(summary, indent=2, ensure_ascii=False))
PY
