#!/usr/bin/env bash
# Issue 18: the weak cells of benchmarks/kshapes_weak_cells.py in training, on the shipped encoders. One
# device call each, carrying .wt/ft (the slim wheels without pykeen's stack, pydantic, lmdb and
# torch-fidelity, which training and evaluation do not import):
#   DRAWS="u0 u1" WHEELS=.wt/ft bash benchmarks/kshapes_weak_cells_device.sh continue $OUT   # + carry .wt/draws/u1
#   WHEELS=.wt/ft bash benchmarks/kshapes_weak_cells_device.sh scratch $OUT
# continue: the 2-head U-Net draws of BENCHMARKS.md "the 2-head preset U-Net on the shipped encoders" (u0
#   ships; u1 and u2 come from .wt/draws, their folders without the VAE's and upscaler's weights, which
#   are the shipped model's) continued for STEPS (1,500) steps at rate LR (5e-5), twice each from one
#   seed: on the training data as it is (arms c0, c1, c2: the control) and on the table that repeats the
#   lines of the cells the draw misses on the validation captions FACTOR (3) times (w0, w1, w2). The
#   carry's 64 MiB (with the tree) holds one carried draw a call.
# scratch: fresh U-Nets of the preset, seeds SEEDS (101 102), STEPS (4,000) steps, each twice: on the
#   training data as it is (b101, b102: the baselines of "three U-Net-stage levers") and from the start on
#   the table of the cells the three draws miss together ("pooled": p101, p102).
set -u
mode=$1; out=$2; factor=${FACTOR:-3}; draws=${DRAWS:-u0 u1 u2}
arms=""
if [ "$mode" = continue ]; then
  for draw in $draws; do
    i=${draw#u}; folder=/tmp/ka/draw_$draw; [ "$draw" = u0 ] && folder=/tmp/ka/encoders  # u0 = the shipped folder
    start="--seed_everything=20$i --model.seed=20$i --data.seed=20$i --model.pretrained=$folder"
    start+=" --model.optim.lr=${LR:-5e-5} --model.optim.warmup_steps=100"
    arms+="c$i:$start;w$i:$start --data.train=/tmp/ka/data/train/weak_$draw.jsonl;"
  done
  tables=$draws; steps=${STEPS:-1500}; keep=${KEEP:-w0,w1,w2}
else
  for seed in ${SEEDS:-101 102}; do
    start="--seed_everything=$seed --model.seed=$seed --data.seed=$seed"
    arms+="b$seed:$start;p$seed:$start --data.train=/tmp/ka/data/train/weak_pooled.jsonl;"
  done
  draws=""; tables=pooled; steps=${STEPS:-4000}; keep=${KEEP:-p101,p102}
fi
# the carried draws completed with the shipped VAE and upscaler (the same files), and the tables
PREP="for d in $draws; do
  [ \$d = u0 ] && continue
  cp -r .wt/draws/\$d /tmp/ka/draw_\$d && cp -r rapiddiff/assets/kshapes/upscaler /tmp/ka/draw_\$d/ &&
    cp rapiddiff/assets/kshapes/vae/diffusion_pytorch_model.safetensors /tmp/ka/draw_\$d/vae/ || exit 1
done
for t in $tables; do
  python benchmarks/kshapes_weak_cells.py write --train /tmp/ka/data/train --weak benchmarks/kshapes_weak_cells.json \
    --name \$t --factor $factor --out /tmp/ka/data/train/weak_\$t.jsonl || exit 1
done"
export PREP ARMS=${arms%;} SEED=1 STEPS=$steps TRAIN_TIME=${TRAIN_TIME:-00:00:05:40} DEADLINE=${DEADLINE:-560}
export ENTITY_SPLITS=${ENTITY_SPLITS:-heldout} ENTITY_MODES=${ENTITY_MODES:-both} KEEP=$keep SHIPPED=0
bash benchmarks/kshapes_unet_arms_device.sh all "$out"
