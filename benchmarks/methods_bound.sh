#!/usr/bin/env bash
# Each KD method's step against KD's on one GPU (ResNet-34 -> ResNet-18, O1 float16, batch 256, synthetic
# input): where the time goes, eager and compiled, and the six-row table run against the sum of its parts.
# Usage: bash benchmarks/methods_bound.sh PART...   (PART: env | tests | profile | profile_compiled | six | six_compiled |
#        rest | parts | parts_compiled); logs go to $OUT (default /tmp/kd-methods).
#   tests             the GPU tests of the methods' steps: compiled against eager, AT's and OFD's reduced-dtype paths
#   profile           benchmarks/profile_step.py per method, eager: teacher forward, student fwd+loss+bwd, optimizer
#                     step and the engine's whole step (ms), GPU kernel time by kind per method, top kernels
#   profile_compiled  the same with --compile for KD and the feature methods of the six-row table ($CMETHODS)
#   six               kd bench --methods kd,at,ofd,crd,reviewkd,dkd: the six students in one run and each alone
#   six_compiled      the same with --compile
#   rest              kd bench --methods for the other methods of the goals (FitNet, NKD, MLKD, DIST, CTKD, LS),
#                     KD among them
#   parts             after six (parts_compiled: after six_compiled): the six-row run against the teacher's
#                     forward (from the profile part's log where it ran, else profiled) plus each student's own
#                     step, and its 100 ImageNet epochs (benchmarks/table_vs_parts.py); TEACHER_MS=ms takes the
#                     teacher's forward from an earlier profile
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kd-methods}; mkdir -p "$OUT"
PY=python3
PAIR="--teacher resnet34 --student resnet18"
B="$PY -m cli bench $PAIR --backends single --opt O1 --amp-dtype float16 -b 256 --iters 40 --warmup 10"
P="$PY benchmarks/profile_step.py $PAIR --opt O1 --amp-dtype float16 --iters 20 --warmup 5 --profile-steps 4"
SIX=kd,at,ofd,crd,reviewkd,dkd
for part in "$@"; do case "$part" in
  env) { git log --oneline -1 2>/dev/null; nvidia-smi -L; nproc
         $PY -c "import torch, torchvision, timm; print('torch', torch.__version__, 'torchvision', torchvision.__version__, 'timm', timm.__version__)"
       } 2>&1 | tee "$OUT/env.log" ;;
  tests) timeout 300 $PY -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_compile.py tests/test_losses.py \
           tests/test_ofd.py 2>&1 | tail -15 | tee "$OUT/tests.log" ;;
  profile) timeout 420 $P --methods ${PMETHODS:-kd,at,fitnet,ofd,crd,reviewkd,nkd,mlkd,dkd,dist,ctkd,lskd} 2>&1 | grep -v Warn | tee "$OUT/profile.log" ;;
  profile_compiled) timeout 420 $P --compile --methods "${CMETHODS:-kd,at,ofd,crd,reviewkd}" 2>&1 | grep -v Warn \
                      | tee "$OUT/profile_compiled.log" ;;
  six) timeout 560 $B --methods $SIX --out /tmp/kdb/six 2>&1 | tee "$OUT/six.log" ;;
  six_compiled) timeout 580 $B --methods $SIX --compile --out /tmp/kdb/six_compiled 2>&1 | tee "$OUT/six_compiled.log" ;;
  rest) timeout 560 $B --methods kd,fitnet,nkd,mlkd,dist,ctkd,lskd --out /tmp/kdb/rest 2>&1 | tee "$OUT/rest.log" ;;
  parts|parts_compiled)
         C=; [ "$part" = parts ] || C=--compile
         NAME=six${C:+_compiled}
         [ -f /tmp/kdb/$NAME/bench.json ] || { echo "== $NAME: run $NAME first" | tee -a "$OUT/$part.log"; continue; }
         LOG=$OUT/profile${C:+_compiled}.log  # the teacher's forward from the profile part where it ran kd, else profiled now
         forward() { sed -n 's/.*profiled kd default: teacher forward \([0-9.]*\) ms.*/\1/p' "$1" 2>/dev/null | tail -1; }
         T=${TEACHER_MS:-$(forward "$LOG")}  # TEACHER_MS: a forward measured by an earlier call
         [ -n "$T" ] || { timeout 300 $P $C --methods kd > "$OUT/teacher_forward${C:+_compiled}.log" 2>&1
                          T=$(forward "$OUT/teacher_forward${C:+_compiled}.log"); }
         [ -n "$T" ] || { echo "== $NAME: no teacher forward measured" | tee -a "$OUT/$part.log"; continue; }
         echo "== $NAME (teacher forward $T ms)" | tee -a "$OUT/$part.log"
         $PY benchmarks/table_vs_parts.py /tmp/kdb/$NAME/bench.json --teacher-ms "$T" 2>&1 | tee -a "$OUT/$part.log" ;;
  *) echo "unknown part $part"; exit 2 ;;
esac; done
