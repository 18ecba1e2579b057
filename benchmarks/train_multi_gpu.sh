#!/usr/bin/env bash
# Two GPUs in one call (nvidia-h200-x2): DDP scaling at kshapes and SD 1.5 size, one FSDP run of the
# U-Net stage (train, checkpoint, resume, export, load), and a DDP checkpoint resumed on one GPU.
# Also the SD 1.5 single-GPU comparison with diffusers' loop (same machine, same run).
#   bash benchmarks/train_multi_gpu.sh OUT_DIR
set -u
OUT_DIR=${1:-${OUT:-.}}
mkdir -p "$OUT_DIR"
DATA=/tmp/ksd
python3 -m rapiddiff data kshapes --out $DATA --train 2048 --val 16 --test 16 --hr-scale 0 >/dev/null 2>&1
say() { echo "== $*"; }

say "SD 1.5 one GPU: diffusers loop vs rapiddiff eager (+ profile)"
timeout 150 python3 benchmarks/train_unet_throughput.py --out "$OUT_DIR/sd1" --variants reference,eager \
    --steps 8 --warmup 2 --profile 2 2>&1 | grep -E "^\||rror|GPU kernel"

say "kshapes DDP: 1 vs 2 GPUs (chain U-Net stage, knowledge off, the multi-GPU fast path no_graph)"
for n in 1 2; do
    timeout 100 torchrun --standalone --nproc_per_node $n benchmarks/train_kshapes_step.py --data $DATA \
        --out "$OUT_DIR/k$n" --scenes chain_off --variants no_graph --steps 30 --warmup 5 --devices $n \
        2>&1 | grep -E "^\||rror"
done

say "SD 1.5 DDP: 2 GPUs (the 1-GPU eager figure is above)"
timeout 120 torchrun --standalone --nproc_per_node 2 benchmarks/train_unet_throughput.py --out "$OUT_DIR/sd2" \
    --variants eager --steps 8 --warmup 2 --devices 2 2>&1 | grep -E "^\||rror"

COMMON=(--config configs/unet/kshapes.yaml --model.pretrained=rapiddiff/assets/model --data.train=$DATA/train
    --data.val=null --data.num_workers=2 --trainer.val_check_interval=null --trainer.logger=false
    --trainer.enable_progress_bar=false --samples.every_n_steps=100000 --samples.at_end=false
    --checkpoint.every_n_train_steps=5)

say "FSDP: train 10 steps on 2 GPUs, checkpoint, resume to 15, export, load"
F=/tmp/fsdp
timeout 120 python3 -m rapiddiff train unet "${COMMON[@]}" --model.ema=null --trainer.strategy=fsdp \
    --trainer.devices=2 --trainer.max_steps=10 --trainer.default_root_dir=$F --output=$F/model 2>&1 | grep -E "rror|Trace" | head -5
ls $F/checkpoints
timeout 120 python3 -m rapiddiff train unet "${COMMON[@]}" --model.ema=null --trainer.strategy=fsdp \
    --trainer.devices=2 --trainer.max_steps=15 --trainer.default_root_dir=$F --output=$F/model --ckpt_path=last \
    2>&1 | grep -E "rror|Trace" | head -5
ls $F/checkpoints $F/model
timeout 60 python3 - <<'EOF'
import torch
from rapiddiff.models.bundle import load_model_folder
ckpt = torch.load("/tmp/fsdp/checkpoints/last.ckpt", map_location="cpu", weights_only=False)
state = ckpt["state_dict"]
print("checkpoint global_step", ckpt.get("global_step"), "keys", len(state))
bundle = load_model_folder("/tmp/fsdp/model", load_upscaler=False)
unet = bundle.unet.state_dict()
same = [torch.equal(unet[k].float(), state["unet." + k].float()) for k in unet if "unet." + k in state]
print(f"exported U-Net loads: {len(unet)} tensors; equal to the checkpoint's: {sum(same)}/{len(same)}")
EOF

say "DDP on 2 GPUs for 10 steps, then resume that checkpoint on 1 GPU to 15"
D=/tmp/ddp2
timeout 100 python3 -m rapiddiff train unet "${COMMON[@]}" --trainer.strategy=ddp --trainer.devices=2 \
    --trainer.max_steps=10 --trainer.default_root_dir=$D --output=$D/model 2>&1 | grep -E "rror|Trace" | head -5
timeout 100 python3 -m rapiddiff train unet "${COMMON[@]}" --trainer.strategy=auto --trainer.devices=1 \
    --trainer.max_steps=15 --trainer.default_root_dir=$D --output=$D/model --ckpt_path=last 2>&1 | grep -E "rror|Trace" | head -5
ls $D/checkpoints $D/model
rm -f "$OUT_DIR"/*/*.md
