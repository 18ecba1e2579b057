#!/usr/bin/env bash
# Issue 16's own-kernel switches (fuse_norm, fuse_geglu) in one H100 call, most important first:
#   1. their GPU tests (fused U-Net and VAE decoder against stock, eager and torch.compile'd),
#   2. benchmarks/fast_kernels_check.py: each GroupNorm/GEGLU shape of SD 1.5 against Inductor,
#   3. the SD 1.5 bench: rapiddiff, each switch alone, both; a profile of rapiddiff and of both.
# A step that fails does not stop the next; every step writes under OUT as it goes, so a call cut
# short keeps what it measured. About 9 minutes from a cold machine.
#
#   bash benchmarks/device/fast_kernels_call.sh wheels        # here, once: the 3 wheels into .wt/kw
#   bash benchmarks/device/fast_kernels_call.sh run $OUT      # on the device, carrying .wt/kw
set -u
part=${1:?usage: fast_kernels_call.sh wheels | run OUT}
if [ "$part" = wheels ]; then
  mkdir -p .wt/kw
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .wt/kw diffusers==0.42.1 importlib_metadata zipp
  ls -la .wt/kw
  exit 0
fi
out=${2:?usage: fast_kernels_call.sh run OUT}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .wt/kw/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p "$out/k" "$out/b"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader

timeout 200 python3 -m pytest tests/infer/test_fast_kernels.py -q -m gpu > "$out/k/tests.log" 2>&1
echo "gpu tests rc=$?"; tail -4 "$out/k/tests.log"

timeout 200 python3 benchmarks/fast_kernels_check.py --out "$out/k" > "$out/k/check.log" 2>&1
echo "kernel check rc=$?"; cat "$out/k/kernels.md" 2>/dev/null || tail -20 "$out/k/check.log"

both="rapiddiff+fuse_norm=true,fuse_geglu=true"
timeout 420 python3 benchmarks/bench_sd15.py --preset sd15 --steps 50 --batch 1 \
  --variants rapiddiff rapiddiff+fuse_norm=true rapiddiff+fuse_geglu=true "$both" \
  --profile rapiddiff "$both" --budget-s 380 --min-run-time 1.5 --out "$out/b" > "$out/b/bench.log" 2>&1
echo "bench rc=$?"; grep -E " b1:|skipped|FAILED" "$out/b/bench.log" | cut -c1-400
grep -A12 "GPU time of one image" "$out/b/bench.log" | head -40
# 8 files come back: keep the logs, tables and profile; the image grid and the kernels table repeat.
rm -f "$out/b/first_images.png" "$out/b/first_images.txt" "$out/k/kernels.md"
