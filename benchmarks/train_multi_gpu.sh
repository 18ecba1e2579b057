#!/usr/bin/env bash
# One nvidia-h200-x2 call (issue 13): the kshapes step with the captured step on 1 vs 2 GPUs (DDP),
# the chain's U-Net stage with the fusion training (old code from the main checkout vs this tree, same
# machine), one FSDP run of the U-Net stage (train, checkpoint, resume, export, load), the gpu-marked
# captured-step test, and DDP at SD 1.5 size if time is left.
#   bash benchmarks/train_multi_gpu.sh OUT_DIR [OLD_TREE]
# OLD_TREE: a checkout of the code before (default: ../.. , the main checkout on the device tool).
set -u
OUT_DIR=${1:-${OUT:-.}}
OLD=${2:-$(cd ../.. && pwd)}
mkdir -p "$OUT_DIR"
DATA=/tmp/ksd
say() { rm -f "$OUT_DIR"/*/*.md; echo "== $(date -u +%H:%M:%S) $*"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
say "data"
python3 -m rapiddiff data kshapes --out $DATA --train 1024 --val 16 --test 16 --hr-scale 0 >/dev/null 2>&1
STEP=(--data $DATA --steps 30 --warmup 6 --workers 4)

say "kshapes DDP with the captured step: 1 vs 2 GPUs (chain_off, all; all+sync10 = host syncs every 10 steps)"
for n in 1 2; do
    timeout 140 torchrun --standalone --nproc_per_node $n benchmarks/train_kshapes_step.py "${STEP[@]}" \
        --out "$OUT_DIR/k$n" --scenes chain_off --variants all,all+sync10 --devices $n 2>&1 | grep -E "^\||rror"
done

COMMON=(--config configs/unet/kshapes.yaml --model.pretrained=rapiddiff/assets/kshapes --data.train=$DATA/train
    --data.val=null --data.num_workers=2 --trainer.val_check_interval=null --trainer.logger=false
    --trainer.enable_progress_bar=false --samples.every_n_steps=100000 --samples.at_end=false
    --checkpoint.every_n_train_steps=5 --model.ema=null --trainer.strategy=fsdp --trainer.devices=2)
say "FSDP (U-Net + fusion train): 10 steps on 2 GPUs, checkpoint, resume to 15, export, load"
F=/tmp/fsdp
timeout 75 python3 -m rapiddiff train unet "${COMMON[@]}" --trainer.max_steps=10 --trainer.default_root_dir=$F \
    --output=$F/model 2>&1 | grep -E "rror|Trace" | head -5
timeout 75 python3 -m rapiddiff train unet "${COMMON[@]}" --trainer.max_steps=15 --trainer.default_root_dir=$F \
    --output=$F/model --ckpt_path=last 2>&1 | grep -E "rror|Trace|resuming" | head -5
ls $F/checkpoints $F/model
timeout 40 python3 - <<'PY'
import torch
from safetensors.torch import load_file
from rapiddiff.models.bundle import load_model_folder
ckpt = torch.load("/tmp/fsdp/checkpoints/last.ckpt", map_location="cpu", weights_only=False)
state = ckpt["state_dict"]
unet = load_file("/tmp/fsdp/model/unet/diffusion_pytorch_model.safetensors")
same = sum(torch.equal(v, state["unet." + k]) for k, v in unet.items())
bundle = load_model_folder("/tmp/fsdp/model", load_upscaler=False)
fusion = bundle.text_encoder.fusion
gates = None if fusion is None else fusion.gates.tolist()
print(f"FSDP checkpoint step {ckpt['global_step']}, {len(state)} trained tensors; exported U-Net = checkpoint "
      f"{same}/{len(unet)}; fusion gates {gates} (checkpoint {state.get('text_encoder.fusion.gates')})")
PY

say "chain_on (fusion trains), 1 GPU: old code (the fusion syncs; text outside the graph) vs this tree"
(cd "$OLD" && CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/tmp/site:$OLD timeout 75 python3 benchmarks/train_kshapes_step.py \
    "${STEP[@]}" --out "$OUT_DIR/old" --scenes chain_on --variants plain,all 2>&1 | grep -E "^\||rror")
CUDA_VISIBLE_DEVICES=0 timeout 75 python3 benchmarks/train_kshapes_step.py "${STEP[@]}" --out "$OUT_DIR/new" \
    --scenes chain_on --variants plain,all 2>&1 | grep -E "^\||rror"

say "gpu-marked test: captured step (fusion inside the graph) vs plain"
CUDA_VISIBLE_DEVICES=0 timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/train/test_train_speed.py 2>&1 | tail -3

say "SD 1.5 DDP, 2 GPUs vs 1 (eager), if time is left"
CUDA_VISIBLE_DEVICES=0 timeout 70 python3 benchmarks/train_unet_throughput.py --out "$OUT_DIR/sd1" --variants eager \
    --steps 6 --warmup 2 2>&1 | grep -E "^\||rror"
timeout 90 torchrun --standalone --nproc_per_node 2 benchmarks/train_unet_throughput.py --out "$OUT_DIR/sd2" \
    --variants eager --steps 6 --warmup 2 --devices 2 2>&1 | grep -E "^\||rror"
say "done"
