#!/usr/bin/env bash
# kshapes retrieval recall, knowledge on vs off, seen vs held-out entities.
#
#   OUT=out/ benchmarks/clip_kshapes_recall.sh KSHAPES_DIR STORE_DIR [LightningCLI overrides...]
#
# KSHAPES_DIR: `rapiddiff data kshapes --out DIR` output; STORE_DIR: `rapiddiff kg train` output on
# DIR/kg. Trains two KnowledgeCLIPs from configs/clip/kshapes.yaml (knowledge on; knowledge off =
# the same recipe without a store), then scores text→image / image→text recall on DIR/test for
# captions of seen and of held-out entities — plus the knowledge-on model with fusion switched off
# at test time. Ground truth both ways: "pairs" (Chinese-CLIP's protocol: a caption's own image) and
# "attributes" (every test image matching what the caption states: colour and shape, plus background
# and position where named). Writes recall_*.json and recall_table.md to $OUT (models go to $WORK).
set -euo pipefail
if [ $# -lt 2 ]; then sed -n 2,14p "$0"; exit 2; fi
KS=$1
STORE=$2
shift 2
OUT=${OUT:-runs/clip_kshapes_recall}
WORK=${WORK:-runs/clip_kshapes_recall_work}
PY=${PYTHON:-python}
mkdir -p "$OUT" "$WORK"

"$PY" - "$KS" "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
ks, out = Path(sys.argv[1]), Path(sys.argv[2])
held = [l.strip() for l in (ks / "heldout_entities.txt").read_text("utf-8").splitlines() if l.strip()]
seen = [n for n in json.loads((ks / "entities.json").read_text("utf-8")) if n not in set(held)]
(out / "heldout.txt").write_text("".join(f"{n}\n" for n in held), "utf-8")
(out / "seen.txt").write_text("".join(f"{n}\n" for n in seen), "utf-8")
PYEOF

for mode in on off; do
  knowledge=true; [ "$mode" = off ] && knowledge=false
  start=$(date +%s)
  "$PY" -m rapiddiff train clip --config configs/clip/kshapes.yaml \
    --model.knowledge=$knowledge --model.knowledge_store="$STORE" \
    --data.train="$KS/train" --data.val="$KS/val" \
    --output="$WORK/$mode/model" --trainer.default_root_dir="$WORK/$mode" "$@"
  echo "{\"train_seconds\": $(( $(date +%s) - start ))}" > "$OUT/train_${mode}.json"
  evals=on; [ "$mode" = on ] && evals=on,off
  # one process a ground truth: the test images are encoded once for every (knowledge, entities) pair
  for gt in pairs attributes; do
    "$PY" -m rapiddiff eval recall --model "$WORK/$mode/model" --data "$KS/test" --knowledge "$evals" \
      --filter-entities "$OUT/seen.txt" "$OUT/heldout.txt" --ground-truth "$gt" \
      --out "$OUT/recall_train-${mode}_eval-{knowledge}_{entities}_${gt}.json"
  done
done

"$PY" - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = ["| model | knowledge at test | entities | ground truth | t→i R@1 | t→i R@5 | t→i R@10 | i→t R@1 | text queries |",
        "|---|---|---|---|---|---|---|---|---|"]
for f in sorted(out.glob("recall_train-*.json")):
    r = json.loads(f.read_text("utf-8"))
    _, train, ev, split, gt = f.stem.split("_")
    t, i = r["text_to_image"], r["image_to_text"]
    rows.append(f"| trained knowledge {train.split('-')[1]} | {ev.split('-')[1] if train == 'train-on' else '—'} | {split} | {gt} | {t['R@1']:.1f} | "
                f"{t['R@5']:.1f} | {t['R@10']:.1f} | {i['R@1']:.1f} | {r['num_text_queries']} |")
(out / "recall_table.md").write_text("\n".join(rows) + "\n", "utf-8")
print("\n".join(rows))
PYEOF
