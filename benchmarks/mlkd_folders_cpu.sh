#!/usr/bin/env bash
# MLKD beside KD and the student alone on two small folders, on the CPU: the stripes folder, whose
# classes are colours and stripe geometry that MLKD's strong view (RandAugment) changes, and the
# shapes folder, whose classes survive it (benchmarks/learnable_folders.py). A resnet18 teacher
# trained by kd on each, then '--kd-loss ce,kd,mlkd' from one teacher forward; each student's top-1.
# Usage: bash benchmarks/mlkd_folders_cpu.sh [OUT]   (EPOCHS, TEACHER_EPOCHS, PER_CLASS, SIZE)
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${1:-/tmp/kd-mlkd-folders}; mkdir -p "$OUT"
E=${EPOCHS:-10} TE=${TEACHER_EPOCHS:-15} N=${PER_CLASS:-100} S=${SIZE:-48}
COMMON="--image-size $S -b 64 -j 2 --device cpu --no-progress --overwrite --lr 0.1 --lr-schedule cosine --warmup-epochs 1"
for kind in stripes shapes; do
  data=$OUT/data_$kind
  python benchmarks/learnable_folders.py $kind "$data" --classes 20 --train $N --val $((N / 4)) --size 64 100
  python -m cli train --data "$data" $COMMON --no-teacher --student resnet18 --epochs $TE --out "$OUT/teacher_$kind" \
    > "$OUT/teacher_$kind.log" 2>&1
  python -m cli train --data "$data" $COMMON --teacher resnet18 --teacher-weights "$OUT/teacher_$kind/checkpoints/best.pt" \
    --student resnet18 --kd-loss ce,kd,mlkd --epochs $E --out "$OUT/students_$kind" > "$OUT/students_$kind.log" 2>&1
  echo "$kind: exit $?; teacher: $(tail -1 "$OUT/teacher_$kind.log" | cut -c1-80)"
  python -m cli report "$OUT/students_$kind" 2>&1 | tail -5
done | tee "$OUT/summary.txt"
