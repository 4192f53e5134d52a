#!/usr/bin/env bash
# The GPU checks and benchmarks behind the README's tables, as run on one H200 (device tool).
# Usage: bash benchmarks/h200.sh PART   (PART: tests | step | compile | backends | apex | loader); logs go to $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/kd-h200}; mkdir -p "$OUT"
B="python -m cli bench --teacher resnet101 --student resnet18 -b 256 --iters 60 --warmup 15"
case "$1" in
  tests) python -m pytest -m gpu -q -rs 2>&1 | tee "$OUT/gpu_tests.log" ;;
  step) $B --backends single --opt O0,O1,O2,O3 --amp-dtype float16 --out "/tmp/kdb/step_fp16" 2>&1 | tee "$OUT/step_fp16.log"
        $B --backends single --opt O1,O2,O3 --amp-dtype bfloat16 --out "/tmp/kdb/step_bf16" 2>&1 | tee "$OUT/step_bf16.log" ;;
  compile) $B --backends single --opt O1 --amp-dtype bfloat16 --compile --out "/tmp/kdb/compile" 2>&1 | tee "$OUT/compile.log" ;;
  backends) $B --backends dp,torch_ddp,apex_ddp --opt O0,O1 --gpus 0 --out "/tmp/kdb/backends" 2>&1 | tee "$OUT/backends.log" ;;
  apex) (cd .apex && pip install -q --no-build-isolation --no-deps --no-index .) && python -m cli backends
        $B --backends apex_ddp --opt O1,O2 --gpus 0 --out "/tmp/kdb/apex" 2>&1 | tee "$OUT/apex.log" ;;
  loader) python benchmarks/bench_loader.py --data /tmp/jpegs --images 5000 --e2e 2>&1 | tee "$OUT/loader.log"
        for L in gpu pil; do
          python -m cli train --data /tmp/jpegs --teacher resnet101 --teacher-weights none --student resnet18 \
            --opt O1 --amp-dtype bfloat16 -b 256 --epochs 1 --limit-train-batches 19 --limit-val-batches 2 --loader $L \
            -j 15 --log-every 5 --set timing_warmup=4 --out "/tmp/kdb/e2e_$L" --overwrite --no-progress 2>&1 | tail -3 | tee -a "$OUT/e2e.log"
          tail -1 "/tmp/kdb/e2e_$L/metrics.jsonl" | tee -a "$OUT/e2e.log"
        done ;;
esac
