#!/usr/bin/env bash
# One device call for the shipped kshapes model (issue 18), without retraining it:
#  - its ×4 upscaler retrained with configs/upscaler/kshapes.yaml (bicubic base, MSE) on the model's
#    own data seed, scored against the shipped upscaler, bicubic and nearest
#    (benchmarks/kshapes_upscaler_eval.py) and exported (OUT/upscaler.safetensors);
#  - beside it, `rapiddiff eval knowledge` of the shipped model on the GPU: seen / held-out /
#    validation entities and attribute captions, knowledge on / off / both, at guidance 7.5 (its
#    default) and 4, 4 images a prompt.
#   bash benchmarks/kshapes_builtin_refresh_device.sh OUT [UPSCALER_MINUTES] [SEED]
# SEED is the kshapes seed the shipped model was trained on (its knowledge/kg_only_entities.json
# names the data; the chain's seed 0 since 2026-11-24).
set -u
out=$1; minutes=${2:-4}; seed=${3:-0}; work=/tmp/ksr; model=rapiddiff/assets/model
mkdir -p "$out" $work
python -m rapiddiff data kshapes --out $work/data --seed "$seed" --workers 16 > "$out/data.log" 2>&1 || exit 1
secs=$((minutes * 60))
python -m rapiddiff train upscaler --config configs/upscaler/kshapes.yaml \
  --trainer.max_time="00:00:$(printf %02d $((secs / 60))):$(printf %02d $((secs % 60)))" \
  --trainer.precision=bf16-mixed --trainer.enable_progress_bar=false \
  --seed_everything="$seed" --data.seed="$seed" --model.seed="$seed" --data.num_workers=6 \
  --data.train_lr=$work/data/train --data.train_hr=$work/data/hr/train \
  --data.val_lr=$work/data/val --data.val_hr=$work/data/hr/val \
  --trainer.default_root_dir=$work/upscaler_runs --output=$work/upscaler > "$out/upscaler.log" 2>&1 &
up=$!
# An attribute caption names no entity: its "both" is "on" and its "text" is "off", so on/off only.
for g in 7.5 4; do
  for run in "entities seen,heldout,val on,off,both" "attribute attribute on,off"; do
    set -- $run
    python -m rapiddiff eval knowledge --model $model --kshapes $work/data --out $work/eval_g${g}_$1 \
      --splits "$2" --modes "$3" --images-per-prompt 4 --guidance $g --workers 4 > "$out/eval_g${g}_$1.log" 2>&1
    cat $work/eval_g${g}_$1/knowledge.md >> "$out/knowledge_g$g.md"
  done
done
wait $up
cp $work/upscaler/upscaler.safetensors "$out/" 2>/dev/null
python benchmarks/kshapes_upscaler_eval.py --data $work/data --n 200 --out "$out" \
  --upscalers shipped=$model/upscaler new=$work/upscaler > "$out/upscaler_eval.log" 2>&1
tar czf "$out/eval.tgz" $(find $work -path "*eval_g*" \( -name "*.json" -o -name "*grid*.png" \) | grep -v /images/) 2>/dev/null
ls -la "$out"
