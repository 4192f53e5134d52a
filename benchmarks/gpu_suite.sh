#!/usr/bin/env bash
# The GPU checks and benchmarks behind docs/benchmarks.md, as run on one H200.
# Usage: bash benchmarks/gpu_suite.sh PART...   (PART: env | tests | profile | step | compile | graphs | host |
#        backends | apex | jpegs | data | decoders | loader | stages); logs go to $OUT.
# nvImageCodec rows need its wheels installed first (nvidia-nvimgcodec-cu13, nvidia-nvjpeg).
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/kd-h200}; mkdir -p "$OUT"
PY=python3
B="$PY -m cli bench --teacher resnet101 --student resnet18 -b 256 --iters 60 --warmup 15"
JPEGS=/tmp/jpegs
T="timeout -s ABRT"  # with -X faulthandler a hang prints every thread's stack before the kill
for part in "$@"; do case "$part" in
  env) { nvidia-smi -L; nproc; free -g | head -2; df -h /dev/shm /tmp; ulimit -n; $PY -c "import torch, torchvision; print(torch.__version__, torchvision.__version__)"; } 2>&1 | tee "$OUT/env.log" ;;
  tests) $PY -m pytest -m gpu -q -rs 2>&1 | tee "$OUT/gpu_tests.log" ;;
  profile) for D in bfloat16 float16; do
             $PY benchmarks/profile_step.py --opt O1 --amp-dtype $D --variant fuse_teacher=false 2>&1 \
               | grep -v Warning | tee -a "$OUT/profile.log"
           done ;;
  step) $B --backends single --opt O0,O1,O2,O3 --amp-dtype float16 --out "/tmp/kdb/step_fp16" 2>&1 | tee "$OUT/step_fp16.log"
        $B --backends single --opt O1,O2,O3 --amp-dtype bfloat16 --out "/tmp/kdb/step_bf16" 2>&1 | tee "$OUT/step_bf16.log" ;;
  compile) for D in bfloat16 float16; do
             $B --backends single --opt O1 --amp-dtype $D --compile --out "/tmp/kdb/compile_$D" 2>&1 | tee -a "$OUT/compile.log"
           done ;;
  backends) $B --backends dp,torch_ddp,apex_ddp --opt O0,O1 --gpus 0 --out "/tmp/kdb/backends" 2>&1 | tee "$OUT/backends.log" ;;
  apex) (cd .apex && $PY -m pip install -q --no-build-isolation --no-deps --no-index . 2>&1 | tail -3) | tee "$OUT/apex.log"
        $PY -m cli backends 2>&1 | tee -a "$OUT/apex.log"
        $B --backends apex_ddp --opt O1,O2 --gpus 0 --out "/tmp/kdb/apex" 2>&1 | tee -a "$OUT/apex.log"
        $PY -m pytest -m gpu -q -rs -k apex tests 2>&1 | tail -5 | tee -a "$OUT/apex.log" ;;
  jpegs) $PY benchmarks/loader_stages.py --data $JPEGS --images 5000 --no-pil --decoders "" 2>&1 | head -3 | tee "$OUT/jpegs.log" ;;
  data) for args in "--loader pil -j 15" "--loader pil -j 4" "--loader pil -j 15 --mp-context fork" "--loader gpu -j 8"; do
          echo "== kd bench data $args" | tee -a "$OUT/data.log"
          $T 90 $PY -X faulthandler -m cli bench data --data $JPEGS --epochs 2 $args 2>&1 | tail -25 | tee -a "$OUT/data.log"
        done ;;
  stages) $T 300 $PY -X faulthandler benchmarks/loader_stages.py --data $JPEGS --images 5000 --e2e 2>&1 | tee "$OUT/stages.log" ;;
  decoders) $T 120 $PY benchmarks/gpu_decoders.py --data $JPEGS 2>&1 | grep -v Warn | tee "$OUT/decoders.log" ;;
  loader) for L in "pil auto bfloat16" "gpu nvjpeg bfloat16" "gpu nvimgcodec bfloat16" "gpu nvjpeg float16 --compile"; do
            set -- $L
            KD_GPU_DECODER=$2 $T 150 $PY -X faulthandler -m cli train --data $JPEGS --teacher resnet101 --teacher-weights none \
              --student resnet18 --opt O1 --amp-dtype $3 ${4:-} -b 256 --epochs 4 --limit-val-batches 1 --loader $1 -j 15 \
              --log-every 19 --timed-after 19 --out "/tmp/kdb/e2e_$1$2$3" --overwrite --no-progress 2>&1 \
              | grep "^epoch\|error" | tee -a "$OUT/e2e.log"
            echo "== $L" >> "$OUT/e2e.log"; tail -1 "/tmp/kdb/e2e_$1$2$3/metrics.jsonl" | tee -a "$OUT/e2e.log"
          done ;;
  graphs) $PY -m cli bench --teacher resnet101 --student resnet18 -b 256 --iters 40 --warmup 15 --backends single --opt O1 \
            --amp-dtype float16 --compile --set compile_mode=reduce-overhead --out /tmp/kdb/graphs 2>&1 | tee "$OUT/graphs.log" ;;
  host) $T 200 $PY benchmarks/host_overhead.py 2>&1 | grep -v Warn | tee "$OUT/host.log" ;;
  *) echo "unknown part $part"; exit 2 ;;
esac; done
