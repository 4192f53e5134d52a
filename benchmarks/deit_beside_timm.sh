#!/usr/bin/env bash
# A distilled DeiT recipe as a user types it, beside the synthetic step and beside timm's own train.py with
# DeiT's flags and --kd-model-name, on one GPU, same folder, student, teacher (a resnet34 kd trained) and
# precision (the recipe's float16, AMP). Needs: $DATA (benchmarks/learnable_folders.py), the teacher34 run of
# benchmarks/user_path_gpu.sh, and timm's train.py of the installed release in .timm/train.py.
# Usage: OUT=/tmp/o bash benchmarks/deit_beside_timm.sh   (RECIPE, EPOCHS, DATA, RUNS as below; PARTS: kd bench timm)
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kd-deit}; mkdir -p "$OUT"
PY=python3
DATA=${DATA:-/tmp/jpegs100}
RUNS=${RUNS:-/tmp/mission}
RECIPE=${RECIPE:-imagenet/deit_s_distilled}
STUDENT=${STUDENT:-deit_small_distilled_patch16_224}
EPOCHS=${EPOCHS:-3}
B=${B:-256}
PARTS=${PARTS:-kd bench timm}
AMP=${AMP:-float16}  # the recipe's own (DeiT's float16 autocast)
T34=$RUNS/teacher34/checkpoints/best.pt
T="timeout -s ABRT"
$PY -c "import torch, torchvision, timm; print('torch', torch.__version__, 'torchvision', torchvision.__version__, 'timm', timm.__version__)" | tee -a "$OUT/summary.txt"

kd_run() {  # NAME EXTRA...: the recipe with the teacher and the run's length changed, and EXTRA
  local name=$1; shift
  local start=$(date +%s)
  $T 400 $PY -X faulthandler -m cli train --recipe "$RECIPE" --data "$DATA" --teacher resnet34 --teacher-weights "$T34" \
    --epochs "$EPOCHS" --warmup-epochs 1 -b "$B" --no-progress --overwrite --out "$RUNS/$name" "$@" > "$OUT/$name.log" 2>&1
  echo "kd train --recipe $RECIPE $*: exit $?, $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
  grep -h "epoch \|skipped\|loader\|error" "$OUT/$name.log" | head -12 | sed "s/^/    /" | tee -a "$OUT/summary.txt"
}
# kd as typed (its loader: auto, which takes the CPU workers for RandAugment and random erasing); then without
# repeated augmentation, as timm's train.py runs on one GPU (it takes --aug-repeats only over several processes)
if [[ " $PARTS " == *" kd "* ]]; then
  kd_run deit_kd
  kd_run deit_kd_norepeat --repeated-aug 0
fi

# the synthetic step of the same recipe, student, teacher and precision
[[ " $PARTS " == *" bench "* ]] && $T 400 $PY -m cli bench --teacher resnet34 --student "timm:$STUDENT" --backends single --opt O1 --amp-dtype "$AMP" \
  -b "$B" --iters 40 --warmup 10 --methods deit --set "recipe=$RECIPE" --out /tmp/kdb/deit 2>&1 | tail -4 | tee -a "$OUT/summary.txt"

# timm's train.py with DeiT's flags (facebookresearch/deit README / main.py), hard token distillation, under
# torchrun; its --aug-repeats (DeiT's repeated augmentation) asserts several processes, so none here
[[ " $PARTS " == *" timm "* ]] || exit 0
$PY -m cli export "$RUNS/teacher34" -o /tmp/teacher34.pth > /dev/null 2>&1
lr=$($PY -c "print(5e-4 * $B / 512)")
start=$(date +%s)
KD_TIMM_TEACHER=/tmp/teacher34.pth $T 400 $PY -m torch.distributed.run --standalone --nproc_per_node 1 \
  benchmarks/timm_train_offline.py .timm/train.py --data-dir "$DATA" \
  --train-split train --val-split val --model "$STUDENT" --num-classes 100 --kd-model-name resnet34 \
  --kd-distill-type token --kd-token-distill-type hard -b "$B" --opt adamw --lr "$lr" --weight-decay 0.05 \
  --sched cosine --warmup-epochs 1 --warmup-lr 1e-6 --min-lr 1e-5 --epochs "$EPOCHS" --aa rand-m9-mstd0.5-inc1 \
  --mixup 0.8 --cutmix 1.0 --smoothing 0.1 --reprob 0.25 --color-jitter 0.3 --train-interpolation bicubic \
  --drop-path 0.1 --model-ema --model-ema-decay 0.99996 --amp --amp-dtype "$AMP" -j 15 \
  --pin-mem --log-interval 5 --output /tmp/timm_out > "$OUT/deit_timm.log" 2>&1
echo "timm train.py: exit $?, $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
grep -h "Train: \|Test: \[ *[0-9]*/[0-9]*\]\|Error\|error" "$OUT/deit_timm.log" | tail -8 | sed "s/^/    /" | tee -a "$OUT/summary.txt"
