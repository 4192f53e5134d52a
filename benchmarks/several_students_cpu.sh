#!/usr/bin/env bash
# Many students from one teacher, three ways, on the CPU (docs/benchmarks.md, the README's "Many
# students from one teacher"): kd demo's digits, a resnet18 teacher trained by kd demo, three
# timm:resnet10t students (kd, dkd, lskd at their defaults) on 20 digits per class, 60 epochs:
#   separate: three kd train runs, each with the teacher's forward;
#   together: one kd train --kd-loss kd,dkd,lskd (one teacher forward per batch for the three);
#   store:    kd teach once (every logit: 10 classes), then three kd train --soft-labels runs.
# Each command's wall time (set-up included) and each student's best and last top-1.
# Usage: bash benchmarks/several_students_cpu.sh   (OUT=/tmp/kd-ways; about 8 minutes on 2 cores)
set -euo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/kd-ways}
KD="python -m cli"
mkdir -p "$OUT"
[ -f "$OUT/demo/teacher/checkpoints/best.pt" ] || $KD demo --out "$OUT/demo" --overwrite > "$OUT/demo.log" 2>&1
COMMON="--data $OUT/demo/data_20_per_class --image-size 32 --val-resize 32 --min-crop-scale 0.8 -b 32 --lr 0.1
  --lr-schedule cosine --warmup-epochs 1 --weight-decay 5e-4 --device cpu -j 1 --seed 0 --epochs 60 --no-progress"
TEACHER="--teacher resnet18 --teacher-weights $OUT/demo/teacher/checkpoints/best.pt"
STUDENT="--student timm:resnet10t"
timed() {  # timed LABEL CMD...: runs CMD, its log in $OUT/LABEL.log, prints LABEL and its seconds
  local label=$1; shift
  local start; start=$(date +%s.%N)
  "$@" > "$OUT/$label.log" 2>&1
  printf '%s: %.1f s\n' "$label" "$(echo "$(date +%s.%N) - $start" | bc)"
}
rm -rf "$OUT/separate" "$OUT/together" "$OUT/store" "$OUT/from_store"
for m in kd dkd lskd; do
  timed "separate_$m" $KD train $COMMON $TEACHER $STUDENT --kd-loss $m --out "$OUT/separate/$m"
done
timed together $KD train $COMMON $TEACHER $STUDENT --kd-loss kd,dkd,lskd --out "$OUT/together"
timed teach $KD teach $COMMON $TEACHER --out "$OUT/store"
du -sh "$OUT/store"
for m in kd dkd lskd; do
  timed "from_store_$m" $KD train $COMMON --soft-labels "$OUT/store" $STUDENT --kd-loss $m --out "$OUT/from_store/$m"
done
$KD report "$OUT/separate"/* "$OUT/together"/*/ "$OUT/from_store"/*
