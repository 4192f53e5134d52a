#!/usr/bin/env bash
# Students from a soft-label store against the live teacher, on the CPU (docs/benchmarks.md):
# kd demo's digits (a resnet18 teacher on every labelled digit, timm:resnet10t students on 20 per
# class, 60 epochs, Hinton KD T 4, 0.5/0.5), then the same student from stores of every logit and
# of the top 3 and top 1 (FKD's marginal smoothing for the rest), each taught once.
# Usage: bash benchmarks/soft_label_topk_cpu.sh   (OUT=/tmp/kd-soft; about 5 minutes on 2 cores)
set -euo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/kd-soft}
KD="python -m cli"
$KD demo --out "$OUT/demo" --overwrite > "$OUT.demo.log" 2>&1
COMMON="--data $OUT/demo/data_20_per_class --image-size 32 --val-resize 32 --min-crop-scale 0.8 -b 32 --lr 0.1
  --lr-schedule cosine --warmup-epochs 1 --weight-decay 5e-4 --device cpu -j 1 --seed 0 --epochs 60 --no-progress"
TEACHER="--teacher resnet18 --teacher-weights $OUT/demo/teacher/checkpoints/best.pt"
for k in all 3 1; do
  rm -rf "$OUT/store_$k" "$OUT/student_store_$k"
  start=$(date +%s.%N)
  $KD teach $COMMON $TEACHER --top-k $k --out "$OUT/store_$k" 2>&1 | grep "kd teach: [0-9]"
  echo "teach top-k $k: $(echo "$(date +%s.%N) - $start" | bc) s, $(du -sh "$OUT/store_$k" | cut -f1)"
  start=$(date +%s.%N)
  $KD train $COMMON --soft-labels "$OUT/store_$k" --student timm:resnet10t --kd-loss kd --ce-weight 0.5 \
    --temperature 4 --loss-arg kd_weight=0.5 --out "$OUT/student_store_$k" > "$OUT.student_store_$k.log" 2>&1
  echo "student from store top-k $k: $(echo "$(date +%s.%N) - $start" | bc) s"
done
$KD report "$OUT/demo/student" "$OUT/demo/student_kd" "$OUT"/student_store_*
