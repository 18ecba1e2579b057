#!/usr/bin/env bash
# Issue 18: U-Net training recipes compared like for like, on the shipped model's own encoders (its
# knowledge text encoder, fusion, KnowledgeStore and VAE, rapiddiff/assets/kshapes) and its data seed,
# so only the U-Net recipe differs. Two device calls (carrying the slim wheels, .wt/slim):
#   bash benchmarks/kshapes_unet_arms_device.sh train OUT           # the arms side by side, packed
#   bash benchmarks/kshapes_unet_arms_device.sh eval OUT CARRIED    # each arm and the shipped model
#   bash benchmarks/kshapes_unet_arms_device.sh all OUT             # both in one call (arms only)
# ARMS: "name:override override;name:..." (default: eps = the shipped recipe, zsnr = zero terminal
# SNR + v-prediction); STEPS (default 10000, the cosine schedule's length); SEED (0, the shipped
# model's data seed); ENCODERS (default the shipped folder): the model folder whose encoders the arms
# train on — the shipped model of 2026-11-24 16:00 UTC came from the folder of commit 54a3692
# (`git archive 54a3692 rapiddiff/assets/model | tar x -C DIR`, then ENCODERS=DIR/rapiddiff/assets/model
# SEED=1 STEPS=5000 ARMS="eps:"), its U-Net's second round. The shipped text encoder samples in
# knowledge mode "both" but its U-Net trained on the fused vectors alone ("embed"): the arms train
# that way too (a copy of the folder set to "embed"), and the evaluation asks for embed, both and off
# explicitly. SHIPPED=0 (eval) or 1 (all): evaluate the arms alone, or beside the model in the tree.
# DEADLINE: seconds after the start at which unfinished evaluations stop (default none).
# TRAIN_TIME: each arm's time limit (default 00:00:07:20); ENTITY_SPLITS / ENTITY_MODES: the entity
# evaluation (default seen,heldout,val / embed,both,off) — fewer fit an `all` call of three arms in 600 s.
# ATTRIBUTE_SPLITS: the attribute evaluation (default attribute,attribute_val: the test captions and the
# validation ones a model is chosen on). KEEP: the arms whose models leave in $OUT (default all; the tool
# returns 8 files, two a model).
# EXTRA_DATA: "NAME:ARGS", a second kshapes folder /tmp/ka/NAME of the same seed with ARGS added (e.g.
# "data60:--train 60000": the same entities, prompts and held-out splits, more training images), for
# arms that set --data.train=/tmp/ka/NAME/train.
# An arm may replace the VAE or the U-Net's architecture too (--model.vae=$PWD/.wt/vae_f4
# --model.unet=$PWD/benchmarks/kshapes_unet_latent32.json: carry the VAE folder; BENCHMARKS.md, issue 18,
# "finer latent resolution"). Its model leaves without the VAE's weights, like every arm's, and the
# eval part would put the shipped 8× VAE back: copy the arm's own VAE into it before an eval call.
# PREP: bash run after the data, before training (see the loop below). POST: bash run after the arms are
# assembled; POST_MODELS: the folders it makes ($work/NAME/builtin), evaluated and kept as arms are.
# An arm with --ckpt_path=FILE (another arm's checkpoint: a fork) starts when FILE appears.
# WHEELS: the wheel folder (an eval call with two arms fits the 64 MiB carry only with a slimmer set than .wt/slim: without pykeen and its
# dependencies, pydantic, datasets, torch-fidelity and lmdb, which `eval knowledge` and `data kshapes`
# do not import).
set -u
part=$1; out=$2; work=/tmp/ka; seed=${SEED:-0}; steps=${STEPS:-10000}; shipped=rapiddiff/assets/kshapes
encoders=${ENCODERS:-$shipped}
arms=${ARMS:-"eps:;zsnr:--model.loss.prediction_type=v_prediction --model.loss.zero_terminal_snr=true"}
source benchmarks/device/install_wheels.sh || exit 1
# Logs go to $logs and leave as one archive: the device tool returns at most 8 files, and the two
# models take 2 each.
rm -rf $work  # a warm machine keeps the last call's folder
logs=$work/logs; mkdir -p "$out" $logs
python -m rapiddiff data kshapes --out $work/data --seed "$seed" --workers 16 > $logs/data_"$part".log 2>&1 || { tail -20 $logs/data_"$part".log; exit 1; }
if [ -n "${EXTRA_DATA:-}" ] && [ "$part" != eval ]; then
  # shellcheck disable=SC2086  # the folder's extra arguments, one word each
  python -m rapiddiff data kshapes --out $work/"${EXTRA_DATA%%:*}" --seed "$seed" --workers 16 ${EXTRA_DATA#*:} \
    > $logs/data_extra.log 2>&1 || { tail -20 $logs/data_extra.log; exit 1; }
fi
if [ "$part" != eval ]; then
  cp -r "$encoders" $work/encoders
  sed -i 's/"knowledge_mode": "both"/"knowledge_mode": "embed"/' $work/encoders/text_encoder/rapiddiff_encoder.json
  # the same encoders without knowledge: an arm with --model.text_encoder=/tmp/ka/encoders_nokg
  # --model.trainable=[unet] trains a U-Net on the base tower's states alone (no fused vectors)
  cp -r $work/encoders $work/encoders_nokg && rm -rf $work/encoders_nokg/knowledge
  # and both with the tower in fp32 (the shipped folder is fp16): for arms that train it
  # (--model.trainable=[...,text_encoder] with --model.text_encoder=/tmp/ka/encoders32 or encoders_nokg32)
  for e in encoders encoders_nokg; do
    cp -r $work/$e $work/${e}32
    python -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; from kshapes_chain import cast_safetensors; cast_safetensors(Path(sys.argv[1]), 'float32')" \
      $work/${e}32/text_encoder
    sed -i 's/"dtype": "float16"/"dtype": "float32"/' $work/${e}32/text_encoder/config.json  # transformers loads the config's dtype
  done
  # PREP: bash run once the data and encoders exist, before the arms train (the weak-cell tables and
  # carried draws of benchmarks/kshapes_weak_cells_device.sh)
  if [ -n "${PREP:-}" ]; then ( eval "$PREP" ) > $logs/prep.log 2>&1 || { tail -20 $logs/prep.log; exit 1; }; fi
  IFS=';' read -ra specs <<< "$arms"
  for spec in "${specs[@]}"; do
    name=${spec%%:*}; extra=${spec#*:}
    # an arm that resumes another arm's checkpoint (a fork: --ckpt_path=/tmp/ka/runs/NAME/checkpoints/
    # step=0001000.ckpt) starts when that file appears (written atomically: a present file is whole)
    start=""; [[ "$extra" =~ --ckpt_path=([^ ]+) ]] && start=${BASH_REMATCH[1]}
    (
      if [ -n "$start" ]; then
        until [ -f "$start" ]; do sleep 1; [ $SECONDS -gt "${DEADLINE:-100000}" ] && exit 1; done
      fi
      # shellcheck disable=SC2086  # $extra: the arm's overrides, one word each
      python -m rapiddiff train unet --config configs/unet/kshapes.yaml --trainer.max_steps="$steps" \
        --trainer.max_time="${TRAIN_TIME:-00:00:07:20}" --trainer.precision=bf16-mixed --trainer.enable_progress_bar=false \
        --trainer.default_root_dir=$work/runs/"$name" --output=$work/"$name"/model \
        --data.train=$work/data/train --data.val=$work/data/val --data.num_workers=3 \
        --seed_everything="$seed" --data.seed="$seed" --model.seed="$seed" \
        --model.vae=$work/encoders/vae --model.text_encoder=$work/encoders \
        --model.speed.gpu_data=true --model.speed.foreach_ema=true --model.speed.cuda_graph=true \
        --model.optim.fused=true --model.speed.sync_every=10 $extra > $logs/train_"$name".log 2>&1
    ) &
  done
  wait
  # each arm assembled in its own process, side by side (about 20 s each, CPU-bound)
  for spec in "${specs[@]}"; do
    name=${spec%%:*}
    python - "$work/$name" "$work/data" "$shipped" <<'PY' > $logs/assemble_"$name".log 2>&1 &
import sys
from pathlib import Path

sys.path.insert(0, "benchmarks")
from kshapes_chain import assemble_builtin_model, record_kg_only_entities

run, data, shipped = map(Path, sys.argv[1:])
assemble_builtin_model(run / "model", shipped / "upscaler" / "upscaler.safetensors", data, run / "builtin", 25)
if (run / "builtin" / "knowledge").exists():  # a no-knowledge arm has no store to link with
    record_kg_only_entities(data, run / "builtin")
print(run.name, "assembled")
PY
  done
  wait
  # POST: bash run once the arms are assembled (kshapes_soup_device.sh averages them); the folders it
  # names in POST_MODELS ($work/NAME/builtin) are evaluated and kept like arms
  if [ -n "${POST:-}" ]; then ( eval "$POST" ) > $logs/post.log 2>&1 || tail -20 $logs/post.log; fi
  names=(); for spec in "${specs[@]}"; do names+=("${spec%%:*}"); done
  read -ra post_models <<< "${POST_MODELS:-}"; names+=("${post_models[@]}")  # the arms, then POST's folders
  for name in "${names[@]}"; do
    # without the files every arm shares with the shipped model (the frozen VAE, its upscaler): the
    # eval call puts them back, so three arms and the wheels fit the 64 MiB carry
    [[ "${KEEP:-all}" == all || ",$KEEP," == *",$name,"* ]] || continue
    [ -d $work/"$name"/builtin ] && tar czf - -C $work/"$name" --exclude=vae/diffusion_pytorch_model.safetensors \
      --exclude=upscaler/upscaler.safetensors builtin | split -b 15m - "$out/$name.tgz."
  done
  grep -h "step $steps/$steps\|stopped" $logs/train_*.log
  cat $logs/assemble_*.log >> $logs/assemble.log
  # (an `all` call's logs leave in eval.tgz: three arms' 6 pieces + knowledge.md + eval.tgz = the 8 files)
  [ "$part" = train ] && tar czf "$out/logs.tgz" $logs $(find $work/runs -name "metrics.csv" -o -name "*.png") 2>/dev/null
fi
if [ "$part" = all ]; then
  models=(); [ "${SHIPPED:-0}" = 1 ] && models=("shipped=$shipped")  # SHIPPED=1: the model in the tree beside the arms
  for name in "${names[@]}"; do
    [ -d $work/"$name"/builtin ] && models+=("$name=$work/$name/builtin")
  done
elif [ "$part" = eval ]; then
  carried=$3
  models=(); [ "${SHIPPED:-1}" = 1 ] && models=("shipped=$shipped")  # SHIPPED=0: the arms alone
  for first in "$carried"/*.tgz.aa; do
    name=$(basename "$first" .tgz.aa); mkdir -p $work/"$name"
    cat "$carried/$name".tgz.* | tar xzf - -C $work/"$name" || continue
    for f in vae/diffusion_pytorch_model.safetensors upscaler/upscaler.safetensors; do
      [ -f $work/"$name"/builtin/$f ] || cp $shipped/$f $work/"$name"/builtin/$f
    done
    models+=("$name=$work/$name/builtin")
  done
  if [ -d $work/zsnr/builtin ]; then  # the zero-SNR arm again with CFG rescale 0.7 (Lin et al. 2024 §3.4)
    mkdir -p $work/zsnr_r07 && cp -r $work/zsnr/builtin $work/zsnr_r07/ && models+=("zsnr_r07=$work/zsnr_r07/builtin")
    python -c "import json, sys; p = sys.argv[1]; d = json.load(open(p)); d['sampling']['guidance_rescale'] = 0.7; json.dump(d, open(p, 'w'), indent=2)" \
      $work/zsnr_r07/builtin/rapiddiff.json
  fi
fi
if [ "$part" != train ]; then
  for entry in "${models[@]}"; do
    name=${entry%%=*}; model=${entry#*=}
    entity_modes=${ENTITY_MODES:-embed,both,off}; attribute_modes=embed
    [ -d "$model/knowledge" ] || { entity_modes=off; attribute_modes=off; }  # a no-knowledge arm
    # the two evaluations of a model side by side too: the GPU has room, the call's 600 s has not.
    # DEADLINE (seconds since the script began): evaluations still running then stop, so the tables of
    # those that finished still leave before the call's limit.
    left=$(( ${DEADLINE:-100000} - SECONDS )); [ $left -lt 10 ] && left=10
    timeout $left python -m rapiddiff eval knowledge --model "$model" --kshapes $work/data --out $work/eval_"$name"_attribute \
      --splits "${ATTRIBUTE_SPLITS:-attribute,attribute_val}" --modes $attribute_modes --images-per-prompt 4 --workers 2 > $logs/eval_"$name"_attribute.log 2>&1 &
    timeout $left python -m rapiddiff eval knowledge --model "$model" --kshapes $work/data --out $work/eval_"$name"_entities \
      --splits "${ENTITY_SPLITS:-seen,heldout,val}" --modes $entity_modes --images-per-prompt 4 --workers 2 \
      > $logs/eval_"$name"_entities.log 2>&1 &
  done
  wait
  for entry in "${models[@]}"; do
    name=${entry%%=*}
    for kind in attribute entities; do
      { echo "## $name, $kind"; cat $work/eval_"$name"_$kind/knowledge.md; } >> "$out/knowledge.md" 2>/dev/null
    done
  done
  # with the training metrics; the grids only from an eval call (an `all` call's 64 MiB go to the models)
  kept=(-name "*.json"); [ "$part" = eval ] && kept+=(-o -name "*.png")
  tar czf "$out/eval.tgz" $logs $(find $work/runs -name "metrics.csv" 2>/dev/null) \
    $(find $work -path "*eval_*" \( "${kept[@]}" \) | grep -v /images/) 2>/dev/null
fi
ls -la "$out"
