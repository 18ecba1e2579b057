#!/usr/bin/env bash
# One device call: the GPU tests, then the SD 1.5 benchmark (recipe vs rapiddiff, batch 1 and 8) for
# this tree and for a reference tree, one after the other on the same machine, so a refactor of the
# fast path can be shown to keep its speed. Carry .wt/slim (wheels) and, for the reference, a copy of
# the reference commit's rapiddiff/ and benchmarks/ in REF (default .wt/old):
#   git archive REV rapiddiff benchmarks | tar x -C .wt/old && rm -rf .wt/old/rapiddiff/assets
#   bash benchmarks/device/fastpath_check.sh $OUT      # WHICH='new ref' (default), SKIP_TESTS=1, BENCH_BUDGET_S
set -u
out=$1; ref=${REF:-.wt/old}; budget=${BENCH_BUDGET_S:-170}
source benchmarks/device/install_wheels.sh || exit 1
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
python3 -c "import torch, diffusers; print('torch', torch.__version__, 'diffusers', diffusers.__version__)" | tee -a "$out/device.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 200 python3 -m pytest -m gpu tests/infer tests/train -q -p no:cacheprovider 2>&1 | tail -n 25 | tee "$out/gpu_tests.txt"
fi
bench() {  # $1: label, $2: PYTHONPATH tree
  PYTHONPATH=/tmp/site:$2 timeout $((budget + 90)) python3 "$2/benchmarks/bench_sd15.py" --preset sd15 --steps 50 \
    --batch 1 8 --variants recipe rapiddiff --min-run-time 1.5 --budget-s "$budget" --out "$out/$1" 2>&1 | tail -n 30
}
for w in ${WHICH:-new ref}; do
  if [ "$w" = new ]; then bench new "$PWD"; else bench ref "$PWD/$ref"; fi
done
for d in ${WHICH:-new ref}; do echo "== $d"; cat "$out/$d/bench.md" 2>/dev/null | head -30; done
