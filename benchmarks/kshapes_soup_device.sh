#!/usr/bin/env bash
# Issue 18: a soup of U-Net draws that share a warm start (benchmarks/kshapes_soup.py), on the shipped
# encoders with the chain's weak-cell table (ellipse and dark green ×3, configs/kshapes/chain.yaml). One
# device call, carrying .wt/ft:
#   WHEELS=.wt/ft bash benchmarks/kshapes_soup_device.sh $OUT
# A trunk (seed TRUNK, default 104) trains the preset for STEPS (4,000) steps; when it writes its step
# FORK_AT (1,000) checkpoint, FORKS (3) more runs resume from it with seeds TRUNK+1, TRUNK+2, ... (their
# own data order and noise; the same learning-rate schedule) to the same end. Then every member is
# evaluated, and two soups: s2 = the mean of the trunk and the first fork, sN = the mean of all of them.
set -u
out=$1; trunk=${TRUNK:-104}; forks=${FORKS:-3}; fork_at=${FORK_AT:-1000}; factor=${FACTOR:-3}
table=/tmp/ka/data/train/weak_pooled.jsonl
ckpt=$(printf "/tmp/ka/runs/t%s/checkpoints/step=%07d.ckpt" "$trunk" "$fork_at")
arms="t$trunk:--seed_everything=$trunk --model.seed=$trunk --data.seed=$trunk --data.train=$table"
members="/tmp/ka/t$trunk/builtin"
for i in $(seq 1 "$forks"); do
  s=$((trunk + i))
  arms+=";f$s:--seed_everything=$s --model.seed=$s --data.seed=$s --data.train=$table --ckpt_path=$ckpt"
  members+=" /tmp/ka/f$s/builtin"
done
first_two=$(echo "$members" | cut -d' ' -f1-2)
PREP="python benchmarks/kshapes_weak_cells.py write --train /tmp/ka/data/train --weak benchmarks/kshapes_weak_cells.json \
  --name pooled --factor $factor --out $table"
POST="mkdir -p /tmp/ka/s2 /tmp/ka/s$((forks + 1)) &&
  python benchmarks/kshapes_soup.py --out /tmp/ka/s2/builtin $first_two &&
  python benchmarks/kshapes_soup.py --out /tmp/ka/s$((forks + 1))/builtin $members"
export PREP POST POST_MODELS="s2 s$((forks + 1))" ARMS=$arms SEED=1 STEPS=${STEPS:-4000}
export TRAIN_TIME=${TRAIN_TIME:-00:00:06:20} DEADLINE=${DEADLINE:-565} SHIPPED=0
export ENTITY_SPLITS=${ENTITY_SPLITS:-heldout} ENTITY_MODES=${ENTITY_MODES:-both} KEEP=${KEEP:-s$((forks + 1))}
bash benchmarks/kshapes_unet_arms_device.sh all "$out"
