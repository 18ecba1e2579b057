#!/usr/bin/env bash
# Issue 16's kernel switches (fuse_norm, fuse_geglu, conv_1x1_as_mm) on an H100, in two calls of
# about 9 minutes each, most important first. A step that fails does not stop the next; every step
# writes under OUT as it goes, so a call cut short keeps what it measured.
#
#   bash benchmarks/device/fast_kernels_call.sh wheels           # here, once: 3 wheels into .wt/kw
#   bash benchmarks/device/fast_kernels_call.sh first $OUT       # on the device, carrying .wt/kw:
#       the GPU tests of the fused modules (eager and torch.compile'd, where the first run gave NaN),
#       benchmarks/fast_kernels_check.py (each GroupNorm/GEGLU shape of SD 1.5 against Inductor's),
#       the bench of rapiddiff against both kernel switches, a profile of each
#   bash benchmarks/device/fast_kernels_call.sh second $OUT      # fuse_norm and conv_1x1_as_mm alone,
#       and a kernel-by-kernel profile of fuse_norm and of rapiddiff
#   bash benchmarks/device/fast_kernels_call.sh third $OUT       # rapiddiff and fuse_norm again, stacks
#       dumped on a hang, and the attention-timing GPU tests
#   bash benchmarks/device/fast_kernels_call.sh fourth $OUT      # batch_time_proj against rapiddiff (twice,
#       first and last, for drift) and the recipe; the GPU tests of the attention timing through Triton's
#       do_bench_cudagraph and of the packed time projections
set -u
part=${1:?usage: fast_kernels_call.sh wheels | first OUT | second OUT | third OUT | fourth OUT}
if [ "$part" = wheels ]; then
  mkdir -p .wt/kw
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .wt/kw diffusers==0.42.1 importlib_metadata zipp
  ls -la .wt/kw
  exit 0
fi
out=${2:?usage: fast_kernels_call.sh first|second OUT}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .wt/kw/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p "$out/k" "$out/b"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader
both="rapiddiff+fuse_norm=true,fuse_geglu=true"

bench() {  # bench OUT_LOG BUDGET ARGS...
  local log=$1 budget=$2
  shift 2
  timeout $((budget + 40)) python3 benchmarks/bench_sd15.py --preset sd15 --steps 50 --batch 1 \
    --budget-s "$budget" --min-run-time 1.5 --out "$out/b" "$@" > "$log" 2>&1
  echo "bench rc=$?"; grep -E " b1:|skipped|FAILED" "$log" | cut -c1-400
  grep -A12 "GPU time of one image" "$log" | head -40
}

if [ "$part" = first ]; then
  timeout 200 python3 -m pytest tests/infer/test_fast_kernels.py -q -m gpu > "$out/k/tests.log" 2>&1
  echo "gpu tests rc=$?"; tail -4 "$out/k/tests.log"
  timeout 200 python3 benchmarks/fast_kernels_check.py --out "$out/k" > "$out/k/check.log" 2>&1
  echo "kernel check rc=$?"; cat "$out/k/kernels.md" 2>/dev/null || tail -20 "$out/k/check.log"
  bench "$out/b/bench.log" 280 --variants rapiddiff "$both" --profile rapiddiff "$both"
elif [ "$part" = fourth ]; then
  timeout 240 python3 -m pytest tests/infer/test_fast_attention_timing.py tests/infer/test_fast_time.py -q -m gpu \
    > "$out/k/tests.log" 2>&1
  echo "gpu tests rc=$?"; tail -4 "$out/k/tests.log"
  timeout -s ABRT 480 python3 -X faulthandler benchmarks/bench_sd15.py --preset sd15 --steps 50 --batch 1 \
    --budget-s 400 --min-run-time 2 --out "$out/b" --variants rapiddiff rapiddiff+batch_time_proj=true recipe \
    rapiddiff+batch_time_proj=false > "$out/b/bench.log" 2>&1
  echo "bench rc=$?"; grep -E " b1:|skipped|FAILED|Fatal|File " "$out/b/bench.log" | cut -c1-300 | head -60
elif [ "$part" = third ]; then
  # The second call's fuse_norm row never finished warming up (400 s, no output): this time with every
  # thread's stack dumped if it hangs, the GPU's clocks and load logged, and the attention backends
  # timed through CUDA graphs (the first call's both-switches row lost its 8 % to a noisy pick).
  timeout 150 python3 -m pytest tests/infer/test_fast_attention_timing.py -q -m gpu > "$out/k/tests.log" 2>&1
  echo "attention timing tests rc=$?"; tail -3 "$out/k/tests.log"
  nvidia-smi --query-gpu=timestamp,clocks.sm,utilization.gpu,power.draw --format=csv -l 10 > "$out/k/smi.csv" &
  timeout -s ABRT 370 python3 -X faulthandler benchmarks/bench_sd15.py --preset sd15 --steps 50 --batch 1 \
    --budget-s 290 --min-run-time 1.5 --out "$out/b" --variants rapiddiff rapiddiff+fuse_norm=true \
    --profile rapiddiff+fuse_norm=true > "$out/b/bench.log" 2>&1
  echo "bench rc=$?"; grep -E " b1:|skipped|FAILED|Fatal|File " "$out/b/bench.log" | cut -c1-300 | head -60
  grep -A12 "GPU time of one image" "$out/b/bench.log" | head -20
  kill %1
else
  # The first call (2026-11-28) found both switches slower in the graph (0.92x) though fast_kernels_check
  # timed fuse_norm's kernels 513 us/eval faster than Inductor's alone: profile fuse_norm in the graph.
  # fuse_geglu alone is left out: the check already timed it 14 us/eval slower than Inductor's.
  bench "$out/b/bench.log" 470 --variants rapiddiff rapiddiff+fuse_norm=true rapiddiff+conv_1x1_as_mm=true \
    --profile rapiddiff+fuse_norm=true rapiddiff
fi
# 8 files come back: keep the logs, tables and profile; the image grid and the kernels table repeat.
rm -f "$out/b/first_images.png" "$out/b/first_images.txt" "$out/k/kernels.md"
