#!/usr/bin/env bash
# The mission's own command, as a user runs it on one GPU (the checks behind docs/benchmarks.md):
# a learnable 100-class JPEG folder, a resnet101 teacher trained by kd itself, then
# 'kd train --teacher resnet101 --teacher-weights best.pt --student resnet18 --opt O1' in float16
# under each backend, a teacher made to overflow float16, and stops (a non-finite loss, SIGTERM)
# with apex where it is installed. Every run reports its exit code, wall time, first-step time,
# teacher precision, losses and skipped steps.
# Usage: bash benchmarks/user_path_gpu.sh PART...  (PART: data | teacher | backends | together | overflow | stops | ctrlc | field |
#        apex | fast | resolution | store | integrity | teacher34 | taps | table | newer | methods | latest | inception |
#        shapes | learn | runfolder | vit)
# fast: the command as typed (kd's defaults) beside the best flags known and prepared copies, each as a share of
#       the synthetic step, and the first step's breakdown; resolution: a short run on the folder and on a copy.
# teacher34, table: a resnet34 teacher trained by kd (TEACHER_EPOCHS, TEACHER_LR), then the six rows of the papers' R34 -> R18 table as one command.
# newer: kd, dkd, nkd, ctkd and ctdkd from one teacher forward, then kd, dkd, ctkd, ctdkd with --logit-standardisation.
# methods: OFD, CRD and ReviewKD under each backend and opt level, CRD over two ranks, and kd bench --methods.
# data, shapes: a learnable JPEG folder at $DATA (benchmarks/learnable_folders.py): 100 classes of stripes and
#         colours, or 20 of shapes, whose classes survive MLKD's strong view.
# learn: on $DATA, the student alone (ce), KD, DKD and MLKD from one teacher forward (teacher34's), top-1 after
#        TABLE_EPOCHS epochs; LEARN_VARIANTS "name:methods:lr ...".
# inception: an inception_v3 teacher (299 px) trained by kd, beside a resnet18 student (224 px).
# latest: MLKD and DOT beside KD, DKD, NKD and CTKD from one teacher forward; mlkd with --dot under each backend.
#         LATEST_LR (0.2), LATEST_DTYPE (float16) for the students of one run; LATEST_VARIANTS, LATEST_COMBOS.
# together: four students (kd, dkd, dist, lskd) from one teacher forward, under each of TOGETHER_BACKENDS.
# integrity: unreadable val images counted under both loaders, a second writer, kill -9, checksums, a float32 store.
# store: kd bench --vs-store (synthetic, then the folder), then three students three ways: separate runs, together,
#        from a store taught once (WAYS_EPOCHS epochs each, 4 by default).
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/kd-mission}; mkdir -p "$OUT"
PY=python3
DATA=${DATA:-/tmp/jpegs100}
RUNS=${RUNS:-/tmp/mission}
TEACHER=${TEACHER:-$RUNS/teacher/checkpoints/best.pt}  # TEACHER=none: a random teacher where none was trained
T="timeout -s ABRT"  # with -X faulthandler a hang prints every thread's stack before the kill
KD="$PY -X faulthandler -m cli"
COMMON="--data $DATA --loader gpu -j 15 -b 256 --no-progress --overwrite"

report() {  # NAME RC SECONDS: one line from the run's log and metrics.jsonl
  local name=$1 rc=$2 secs=$3 out=$RUNS/$1
  $PY - "$name" "$rc" "$secs" "$out" <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys
from pathlib import Path
name, rc, secs, out = sys.argv[1], sys.argv[2], float(sys.argv[3]), Path(sys.argv[4])
recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()] if (out / "metrics.jsonl").exists() else []
cfg = (out / "config.yaml").read_text() if (out / "config.yaml").exists() else ""
tp = next((l.split(":", 1)[1].strip() for l in cfg.splitlines() if l.startswith("teacher_precision:")), "-")
first = recs[0].get("startup_s") if recs else None
rows = "; ".join(f"e{r['epoch']} loss {r.get('train_loss', float('nan')):.3f} kd {r.get('train_kd', float('nan')):.3f} "
                 f"skipped {r.get('train_skipped_steps', 0):.0f} val {r.get('val_top1', float('nan')):.2f} "
                 f"{r.get('img_per_s', 0):.0f} img/s" for r in recs)
print(f"{name}: exit {rc}, {secs:.1f} s, first step {first if first is None else round(first, 1)} s, "
      f"teacher {tp}; {rows or 'no epoch'}")
EOF
}

run() {  # NAME LIMIT ARGS...: one kd train, timed
  local name=$1 limit=$2; shift 2
  local start=$(date +%s%N)
  $T "$limit" $KD train "$@" --out "$RUNS/$name" > "$OUT/$name.log" 2>&1
  local rc=$?
  report "$name" $rc "$(( ($(date +%s%N) - start) / 1000000 ))e-3"
  grep -h "teacher\|first step\|^kd:\|error\|Thread\|File " "$OUT/$name.log" | head -12 | sed "s/^/    /" | tee -a "$OUT/summary.txt"
}

students() {  # NAME METHODS ARGS...: one kd train of several students (--kd-loss METHODS), a line for each
  local name=$1 methods=$2; shift 2
  local start=$(date +%s%N)
  $T 420 $KD train "$@" --kd-loss $methods --out "$RUNS/$name" > "$OUT/$name.log" 2>&1
  local rc=$? secs="$(( ($(date +%s%N) - start) / 1000000 ))e-3"
  for m in ${methods//,/ }; do report "$name/$m" $rc "$secs"; done
  grep -h "first step\|^kd:\|error\|Traceback\|view\|DOT\|dot" "$OUT/$name.log" | head -8 | sed "s/^/    /" | tee -a "$OUT/summary.txt"
}

for part in "$@"; do case "$part" in
  data) $PY benchmarks/learnable_folders.py stripes "$DATA" 2>&1 | tee "$OUT/data.log" ;;
  shapes) $PY benchmarks/learnable_folders.py shapes "$DATA" 2>&1 | tee "$OUT/shapes.log" ;;
  learn) T34=$RUNS/teacher34/checkpoints/best.pt E=${TABLE_EPOCHS:-8}
         for variant in ${LEARN_VARIANTS:-"learn:ce,kd,dkd,mlkd:0.05"}; do
           IFS=: read -r name methods lr <<< "$variant"
           students "$name" "$methods" $COMMON --teacher resnet34 --teacher-weights "$T34" --student resnet18 \
             --opt O1 --amp-dtype bfloat16 --epochs $E --lr $lr
         done ;;
  teacher) run teacher 300 $COMMON --no-teacher --student resnet101 --opt O1 --amp-dtype bfloat16 --epochs ${TEACHER_EPOCHS:-5} --lr ${TEACHER_LR:-0.2} \
             --lr-schedule cosine --warmup-epochs 1 --limit-val-batches 2 ;;
  backends) for b in single torch_ddp apex_ddp; do
              run "kd_$b" 240 $COMMON --teacher resnet101 --teacher-weights "$TEACHER" --student resnet18 --backend $b \
                --opt O1 --amp-dtype float16 --gpus 0 --epochs 2 --lr 0.2
            done ;;
  together) for b in ${TOGETHER_BACKENDS:-single torch_ddp}; do
              nproc=""; [ "$b" = single ] || nproc="--nproc ${TOGETHER_NPROC:-2}"  # ranks sharing GPU 0 over gloo
              start=$(date +%s%N)
              $T 300 $KD train $COMMON --teacher resnet101 --teacher-weights "$TEACHER" --student resnet18 --backend $b \
                --kd-loss kd,dkd,dist,lskd --opt O1 --amp-dtype float16 --gpus 0 $nproc --epochs 2 --lr 0.2 \
                --out "$RUNS/together_$b" > "$OUT/together_$b.log" 2>&1
              rc=$? secs="$(( ($(date +%s%N) - start) / 1000000 ))e-3"
              for m in kd dkd dist lskd; do report "together_$b/$m" $rc "$secs"; done
              grep -h "first step\|^kd:\|error\|stopped" "$OUT/together_$b.log" | head -8 | sed "s/^/    /" | tee -a "$OUT/summary.txt"
            done ;;
  overflow) $PY - "$TEACHER" "$RUNS/overflow.pt" <<'EOF'
import sys, torch
state = torch.load(sys.argv[1], weights_only=True)
state["student"]["fc.weight"] *= 2000.0  # logits far past float16's 65504, fine in bfloat16 and float32
torch.save(state, sys.argv[2])
EOF
            run overflow_auto 240 $COMMON --teacher resnet101 --teacher-weights "$RUNS/overflow.pt" --student resnet18 \
              --opt O1 --amp-dtype float16 --epochs 1
            [ -n "${OVERFLOW_EXPLICIT:-1}" ] && run overflow_fp16 240 $COMMON --teacher resnet101 --teacher-weights "$RUNS/overflow.pt" --student resnet18 \
              --opt O1 --amp-dtype float16 --teacher-precision float16 --epochs 1 ;;
  stops) for b in ${STOP_BACKENDS:-single apex_ddp}; do  # a non-finite stop, then SIGTERM mid-epoch
           run "nan_$b" 240 $COMMON --teacher resnet101 --teacher-weights "$TEACHER" --student resnet18 --backend $b \
             --opt O1 --amp-dtype float16 --gpus 0 --epochs 2 --lr 1e6 --max-nonfinite-steps 3 --log-every 1
           $KD train $COMMON --teacher resnet101 --teacher-weights "$TEACHER" --student resnet18 --backend $b --opt O1 \
             --gpus 0 --epochs 3 --out "$RUNS/term_$b" > "$OUT/term_$b.log" 2>&1 &
           pid=$!
           for _ in $(seq 120); do grep -q "first step" "$OUT/term_$b.log" && break; sleep 0.5; done
           sleep 2; kill -TERM $pid; t0=$(date +%s%N)
           for _ in $(seq 120); do kill -0 $pid 2>/dev/null || break; sleep 0.5; done
           if kill -0 $pid 2>/dev/null; then pkill -ABRT -f "term_$b"; sleep 2; echo "term_$b: STILL ALIVE 60 s after SIGTERM" | tee -a "$OUT/summary.txt"; fi
           wait $pid; rc=$?
           echo "term_$b: exit $rc, $(( ($(date +%s%N) - t0) / 1000000 )) ms after SIGTERM; left: $(pgrep -fc "term_$b" || true) processes" | tee -a "$OUT/summary.txt"
           tail -2 "$OUT/term_$b.log" | sed "s/^/    /" | tee -a "$OUT/summary.txt"
         done ;;
  ctrlc) for b in ${CTRLC_BACKENDS:-torch_ddp}; do  # a terminal's Ctrl-C in set-up and mid-epoch, two ranks on GPU 0
           for moment in "backend:0" "first step done:3"; do
             rm -rf "$RUNS/ctrlc_$b"
             printf "ctrlc_%s at '%s': " "$b" "$moment" | tee -a "$OUT/summary.txt"
             $T 200 $PY benchmarks/ctrl_c_stop.py "${moment%%:*}" "${moment##*:}" -- train $COMMON --teacher resnet101 \
               --teacher-weights "$TEACHER" --student resnet18 --backend $b --nproc 2 --gpus 0 --opt O1 --epochs 3 \
               --out "$RUNS/ctrlc_$b" 2>&1 | tail -1 | tee -a "$OUT/summary.txt"
           done
           $T 200 $KD train --out "$RUNS/ctrlc_$b" --resume --no-progress > "$OUT/ctrlc_resume_$b.log" 2>&1
           report "ctrlc_$b" $? 0
         done ;;
  field) # a timm teacher with its own data config ((0.5, 0.5, 0.5), bicubic, crop_pct 0.95) beside a
         # torchvision student, on the GPU loader; then the student exported and loaded by timm and torchvision
         run field_timm_teacher 300 $COMMON --teacher timm:resnetv2_50 --teacher-weights none --student resnet18 \
           --opt O1 --amp-dtype float16 --epochs 1
         grep -h "mean (\|own crops\|loader" "$OUT/field_timm_teacher.log" | sed "s/^/    /" | tee -a "$OUT/summary.txt"
         $KD export "$RUNS/field_timm_teacher" -o /tmp/field_student.pt 2>&1 | tee -a "$OUT/summary.txt"
         $PY -c "import timm, torch, torchvision; m = torchvision.models.resnet18(num_classes=100); m.load_state_dict(torch.load('/tmp/field_student.pt')); t = timm.create_model('resnet18', num_classes=100, checkpoint_path='$RUNS/field_timm_teacher/checkpoints/last.pt'); print('loaded by torchvision (strict) and timm')" 2>&1 | tail -1 | tee -a "$OUT/summary.txt" ;;
  fast) B="$PY -m cli bench --teacher resnet101 --student resnet18 --backends single --opt O1 --amp-dtype float16 -b 256"
        B="$B --iters ${FAST_ITERS:-60} --warmup 15"
        $T 300 $B --data "$DATA" --vs-synthetic --out /tmp/kdb/typed 2>&1 | tail -4 | tee -a "$OUT/summary.txt"
        $T 200 $B --data "$DATA" --loader gpu -j 15 --out /tmp/kdb/best 2>&1 | tail -4 | tee -a "$OUT/summary.txt"
        for prep in ${FAST_COPIES:-raw:256 jpeg:256 raw:192}; do
          copy=/tmp/prep_${prep/:/_}; t0=$(date +%s%N)
          $KD prepare "$DATA" "$copy" --format "${prep%%:*}" --max-side "${prep##*:}" --no-progress 2>&1 | tee -a "$OUT/summary.txt"
          echo "prepare $prep: $(( ($(date +%s%N) - t0) / 1000000 )) ms, $(du -sh "$copy" | cut -f1)" | tee -a "$OUT/summary.txt"
          for L in gpu pil; do
            echo "== copy $prep, --loader $L -j 15" | tee -a "$OUT/summary.txt"
            $T 200 $B --data "$copy" --loader $L -j 15 --out "/tmp/kdb/copy_${prep/:/_}_$L" 2>&1 | tail -3 | tee -a "$OUT/summary.txt"
          done
        done
        run typed_first_step 240 --data "$DATA" --teacher resnet101 --teacher-weights "$TEACHER" --student resnet18 --opt O1 \
          --epochs 1 --limit-train-batches 30 --no-progress --overwrite
        grep -h "loader\|first step" "$OUT/typed_first_step.log" | sed "s/^/    /" | tee -a "$OUT/summary.txt" ;;
  resolution) # the accuracy cost of a copy capped at 256: the same short training on the folder and on the copy
        for data in "$DATA" /tmp/prep_raw_256; do
          name=res_$(basename "$data")
          run "$name" 400 --data "$data" --no-teacher --student resnet18 --opt O1 --amp-dtype bfloat16 -b 256 \
            --epochs ${RES_EPOCHS:-16} --lr 0.4 --lr-schedule cosine --warmup-epochs 1 --no-progress --overwrite
        done ;;
  store) # a soft-label store (kd teach) against the live teacher and the student alone: the kd bench table on
         # synthetic tensors and on the folder; then the three ways for three students (kd, dkd, lskd) on the
         # learnable folder with kd's own teacher: separate runs, one run together, a store taught once
         B="$PY -m cli bench --teacher resnet101 --student resnet18 --backends single --opt O1 --amp-dtype float16 -b 256"
         B="$B --iters ${FAST_ITERS:-60} --warmup 15 --vs-store"
         $T 400 $B --out /tmp/kdb/store_synthetic 2>&1 | tail -7 | tee -a "$OUT/summary.txt"
         $T 400 $B --data "$DATA" --out /tmp/kdb/store_folder 2>&1 | tail -7 | tee -a "$OUT/summary.txt"
         W="$COMMON --student resnet18 --opt O1 --amp-dtype float16 --epochs ${WAYS_EPOCHS:-4} --lr 0.2"
         for m in kd dkd lskd; do run "separate_$m" 300 $W --teacher resnet101 --teacher-weights "$TEACHER" --kd-loss $m; done
         start=$(date +%s%N)
         $T 400 $KD train $W --teacher resnet101 --teacher-weights "$TEACHER" --kd-loss kd,dkd,lskd \
           --out "$RUNS/together" > "$OUT/together.log" 2>&1
         rc=$? secs="$(( ($(date +%s%N) - start) / 1000000 ))e-3"
         for m in kd dkd lskd; do report "together/$m" $rc "$secs"; done
         rm -rf "$RUNS/store"  # a store left by an earlier call would be continued (not timed) or be another teacher's
         start=$(date +%s%N)
         $T 300 $KD teach --data "$DATA" --loader gpu -j 15 -b 256 --no-progress --teacher resnet101 --teacher-weights "$TEACHER" \
           --opt O1 --amp-dtype float16 --epochs ${WAYS_EPOCHS:-4} --out "$RUNS/store" > "$OUT/teach.log" 2>&1
         echo "teach: exit $?, $(( ($(date +%s%N) - start) / 1000000 )) ms, $(du -sh "$RUNS/store" | cut -f1)" | tee -a "$OUT/summary.txt"
         grep -h "kd teach:\|teacher" "$OUT/teach.log" | sed "s/^/    /" | tee -a "$OUT/summary.txt"
         for m in kd dkd lskd; do run "from_store_$m" 300 $W --soft-labels "$RUNS/store" --kd-loss $m; done ;;
  integrity) # nothing silently wrong, on the user's path: two unreadable val images counted (both loaders), a
             # second writer refused, a kill -9 leaving no process, checksums checked and verified, a store of a
             # teacher past float16's range stored in float32 and trained from
         DMG=${DATA}_damaged
         if [ ! -d "$DMG" ]; then
           cp -al "$DATA" "$DMG" && rm "$DMG/val/c000/0000.jpg" "$DMG/val/c001/0000.jpg"
           head -c 3000 "$DATA/val/c000/0000.jpg" > "$DMG/val/c000/0000.jpg"; : > "$DMG/val/c001/0000.jpg"
         fi
         D="--data $DMG -j 15 -b 256 --no-progress --overwrite --teacher resnet101 --teacher-weights $TEACHER --teacher-precision float32"
         for L in gpu pil; do
           run "damaged_$L" 240 $D --loader $L --student resnet18 --opt O1 --amp-dtype float16 --epochs 1
           $PY -c "import json,sys; r=json.loads(open(sys.argv[1]).readlines()[-1]); print('    val_images', r.get('val_images'), 'val_unreadable', r.get('val_unreadable'), 'val_top1', round(r.get('val_top1', -1), 2))" \
             "$RUNS/damaged_$L/metrics.jsonl" 2>&1 | tee -a "$OUT/summary.txt"
           grep -h "unreadable" "$OUT/damaged_$L.log" | head -4 | sed "s/^/    /" | tee -a "$OUT/summary.txt"
         done
         $KD verify "$RUNS/damaged_gpu" 2>&1 | tail -2 | sed "s/^/    verify: /" | tee -a "$OUT/summary.txt"
         cp "$RUNS/damaged_gpu/checkpoints/best.pt" /tmp/flipped.pt; cp "$RUNS/damaged_gpu/checkpoints/best.pt.sha256" /tmp/flipped.pt.sha256
         sed -i "s/best.pt/flipped.pt/" /tmp/flipped.pt.sha256
         printf '\x5a' | dd of=/tmp/flipped.pt bs=1 seek=4000000 conv=notrunc 2>/dev/null
         $KD eval --weights /tmp/flipped.pt --data "$DMG" 2>&1 | tail -1 | sed "s/^/    flipped eval: /" | tee -a "$OUT/summary.txt"
         KD_MARK=integrity_lock $KD train $D --loader gpu --student resnet18 --opt O1 --epochs 3 --out "$RUNS/lock" \
           --save-every-steps 5 \
           > "$OUT/lock.log" 2>&1 &
         pid=$!
         for _ in $(seq 240); do [ -f "$RUNS/lock/checkpoints/last.pt.sha256" ] && break; sleep 0.5; done
         $T 120 $KD train $D --loader gpu --student resnet18 --opt O1 --epochs 3 --out "$RUNS/lock" 2>&1 | tail -1 \
           | sed "s/^/    second writer: /" | tee -a "$OUT/summary.txt"
         before=$(grep -l "KD_MARK=integrity_lock" /proc/[0-9]*/environ 2>/dev/null | wc -l)
         kill -9 $pid; sleep 8
         left=$(grep -l "KD_MARK=integrity_lock" /proc/[0-9]*/environ 2>/dev/null | wc -l)
         echo "    kill -9 with --loader gpu -j 15: $before processes before, $left left 8 s after" | tee -a "$OUT/summary.txt"
         $T 200 $KD train --out "$RUNS/lock" --resume --no-progress > "$OUT/lock_resume.log" 2>&1
         echo "    resumed after kill -9: exit $?; $(grep -h "taken over\|^done" "$OUT/lock_resume.log" | tr '\n' ' ')" | tee -a "$OUT/summary.txt"
         $PY - "$TEACHER" "$RUNS/overflow.pt" <<'PYEOF'
import sys, torch
state = torch.load(sys.argv[1], weights_only=True)
state["student"]["fc.weight"] *= 2000.0  # logits far past float16's 65504
torch.save(state, sys.argv[2])
PYEOF
         rm -rf "$RUNS/store_over"
         $T 300 $KD teach --data "$DATA" --loader gpu -j 15 -b 256 --no-progress --teacher resnet101 \
           --teacher-weights "$RUNS/overflow.pt" --opt O1 --amp-dtype float16 --epochs 1 --out "$RUNS/store_over" > "$OUT/teach_over.log" 2>&1
         echo "    teach (overflowing teacher): exit $?; $(grep -h "stored in" "$OUT/teach_over.log")" | tee -a "$OUT/summary.txt"
         $KD verify "$RUNS/store_over" 2>&1 | tail -1 | sed "s/^/    verify: /" | tee -a "$OUT/summary.txt"
         run from_store_over 240 --data "$DATA" --loader gpu -j 15 -b 256 --no-progress --overwrite --soft-labels "$RUNS/store_over" \
           --student resnet18 --opt O1 --amp-dtype float16 --epochs 1 ;;
  runfolder) # the run folder on the user's path: a several-students run (teacher34's teacher) stopped by SIGTERM
             # mid-epoch and resumed, a copy of it moved and resumed for one more epoch, a resume asking another lr
             # (refused, exit 2), and kd verify of both
         T34=$RUNS/teacher34/checkpoints/best.pt
         F="--data $DATA --loader gpu -j 15 -b 256 --no-progress --teacher resnet34 --teacher-weights $T34 --student resnet18"
         F="$F --opt O1 --amp-dtype bfloat16 --lr 0.05 --lr-schedule cosine --epochs 2 --save-every-steps 20"
         rm -rf "$RUNS/folder" "$RUNS/folder_moved"
         $KD train $F --kd-loss kd,dkd --out "$RUNS/folder" > "$OUT/folder.log" 2>&1 &
         pid=$!
         for _ in $(seq 600); do [ -f "$RUNS/folder/dkd/checkpoints/last.pt" ] && break; sleep 0.5; done
         sleep 3; kill -TERM $pid; wait $pid
         echo "runfolder: SIGTERM mid-epoch: exit $?; $(tail -1 "$OUT/folder.log")" | tee -a "$OUT/summary.txt"
         ls "$RUNS/folder" | tr '\n' ' ' | sed "s/^/    folder holds: /" | tee -a "$OUT/summary.txt"; echo | tee -a "$OUT/summary.txt"
         $T 400 $KD train --out "$RUNS/folder" --resume > "$OUT/folder_resume.log" 2>&1
         echo "    resumed: exit $?; $(grep -h "resumed from\|^done\|error" "$OUT/folder_resume.log" | head -4 | tr '\n' ' ')" | tee -a "$OUT/summary.txt"
         cp -a "$RUNS/folder" "$RUNS/folder_copy" && mv "$RUNS/folder_copy" "$RUNS/folder_moved"
         $T 60 $KD train --out "$RUNS/folder_moved" --resume --epochs 3 --lr 0.5 2>&1 | tail -1 | sed "s/^/    --lr 0.5 on resume: /" | tee -a "$OUT/summary.txt"
         $T 400 $KD train --out "$RUNS/folder_moved" --resume --epochs 3 > "$OUT/folder_moved.log" 2>&1
         echo "    moved copy, --epochs 3: exit $?; $(grep -c "$RUNS/folder/" "$OUT/folder_moved.log") lines name the first folder" | tee -a "$OUT/summary.txt"
         for m in kd dkd; do report "folder_moved/$m" 0 0; done
         for f in folder folder_moved; do $KD verify "$RUNS/$f" 2>&1 | tail -1 | sed "s/^/    verify $f: /" | tee -a "$OUT/summary.txt"; done ;;
  vit) # today's recipe on a ViT student: a distilled DeiT-Ti from teacher34's resnet34 with DeiT's loss (hard), AdamW,
       # timm's per-update cosine with a warm-up, drop path, an EMA of the weights, bfloat16; then a ConvNeXt with KD
       T34=$RUNS/teacher34/checkpoints/best.pt E=${VIT_EPOCHS:-3}
       V="$COMMON --teacher resnet34 --teacher-weights $T34 --opt O1 --amp-dtype bfloat16 --epochs $E --optimizer adamw"
       V="$V --lr 1e-3 --weight-decay 0.05 --lr-schedule timm-cosine --warmup-epochs 1 --drop-path 0.1 --model-ema"
       run deit_ti 300 $V --student timm:deit_tiny_distilled_patch16_224 --kd-loss deit --model-ema-decay 0.99
       run convnext_kd 300 $V --student timm:convnext_atto --kd-loss kd --model-ema-decay 0.99
       grep -h "ema\|EMA\|drop" "$OUT/deit_ti.log" | head -4 | sed "s/^/    /" | tee -a "$OUT/summary.txt" ;;
  apex) for opt in O1; do
          run "apexamp_single" 240 $COMMON --teacher resnet101 --teacher-weights "$TEACHER" --student resnet18 \
            --amp-impl apex --opt $opt --gpus 0 --epochs 2 --lr 0.2
        done ;;
  teacher34) run teacher34 300 $COMMON --no-teacher --student resnet34 --opt O1 --amp-dtype bfloat16 \
               --epochs ${TEACHER_EPOCHS:-5} --lr ${TEACHER_LR:-0.2} --lr-schedule cosine --warmup-epochs 1 ;;
  table) # the six rows of the 2022-24 papers' ImageNet tables (KD, AT, OFD, CRD, ReviewKD, DKD) for R34 -> R18, from one
         # teacher forward, with the student alone beside them; then kd report's paper table
         T34=$RUNS/teacher34/checkpoints/best.pt E=${TABLE_EPOCHS:-8}
         start=$(date +%s%N)
         $T 420 $KD train $COMMON --teacher resnet34 --teacher-weights "$T34" --student resnet18 \
           --kd-loss kd,at,ofd,crd,reviewkd,dkd --opt O1 --amp-dtype float16 --epochs $E --lr 0.2 \
           --out "$RUNS/table" > "$OUT/table.log" 2>&1
         rc=$? secs="$(( ($(date +%s%N) - start) / 1000000 ))e-3"
         for m in kd at ofd crd reviewkd dkd; do report "table/$m" $rc "$secs"; done
         grep -h "first step\|^kd:\|error\|stopped\|^done\|\] done" "$OUT/table.log" | head -12 | sed "s/^/    /" | tee -a "$OUT/summary.txt"
         run table_alone 240 $COMMON --no-teacher --student resnet18 --opt O1 --amp-dtype float16 --epochs $E --lr 0.2
         $KD report "$RUNS/table" "$RUNS/table_alone" --format markdown 2>&1 | tee -a "$OUT/summary.txt"
         $KD report "$RUNS/table" "$RUNS/table_alone" --format latex > "$OUT/table.tex" 2>&1 ;;
  newer) # the 2023-24 logit methods beside KD and DKD from one teacher forward, then with logit standardisation
         T34=$RUNS/teacher34/checkpoints/best.pt E=${TABLE_EPOCHS:-8}
         for variant in "newer:" "newer_ls:--logit-standardisation"; do
           name=${variant%%:*} flag=${variant#*:} methods=kd,dkd,nkd,ctkd,ctdkd
           [ -n "$flag" ] && methods=kd,dkd,ctkd,ctdkd
           start=$(date +%s%N)
           $T 420 $KD train $COMMON --teacher resnet34 --teacher-weights "$T34" --student resnet18 --kd-loss $methods $flag \
             --opt O1 --amp-dtype float16 --epochs $E --lr 0.2 --out "$RUNS/$name" > "$OUT/$name.log" 2>&1
           rc=$? secs="$(( ($(date +%s%N) - start) / 1000000 ))e-3"
           for m in ${methods//,/ }; do report "$name/$m" $rc "$secs"; done
         done
         $KD report "$RUNS/table" "$RUNS/table_alone" "$RUNS/newer" "$RUNS/newer_ls" --format markdown 2>&1 | tee -a "$OUT/summary.txt"
         $T 300 $PY -m cli bench --teacher resnet34 --student resnet18 --backends single --opt O1 --amp-dtype float16 -b 256 \
           --methods kd,nkd,ctkd,ctdkd --iters 40 --warmup 10 2>&1 | tail -8 | tee -a "$OUT/summary.txt" ;;
  taps) # the feature methods' taps read from the fused teacher's graph, on the folder: a resnet34 teacher trained by kd
        # (teacher34), then AT, FitNet, OFD, CRD, ReviewKD and SD-NKD from one teacher forward at O1 float16
        # (fuse_teacher auto: on for CUDA), then AT and OFD with --compile
        T34=$RUNS/teacher34/checkpoints/best.pt
        students taps at,fitnet,ofd,crd,reviewkd,sdnkd $COMMON --teacher resnet34 --teacher-weights "$T34" \
          --student resnet18 --opt O1 --amp-dtype float16 --epochs ${TAPS_EPOCHS:-2} --lr 0.2
        students taps_compiled at,ofd $COMMON --teacher resnet34 --teacher-weights "$T34" --student resnet18 \
          --opt O1 --amp-dtype float16 --epochs 1 --lr 0.2 --compile ;;
  methods) # the feature methods under each backend and opt level (one epoch each), two ranks on GPU 0, and their steps timed
         T34=$RUNS/teacher34/checkpoints/best.pt
         for combo in "single O1" "dp O1" "torch_ddp O1" "apex_ddp O1" "apex_ddp O2" "single O3"; do
           set -- $combo
           run "methods_$1_$2" 240 $COMMON --teacher resnet34 --teacher-weights "$T34" --student resnet18 --backend $1 \
             --kd-loss ofd,crd,reviewkd --opt $2 --amp-dtype float16 --gpus 0 --epochs 1 --lr 0.2
           for m in ofd crd reviewkd; do report "methods_$1_$2/$m" - 0; done
         done
         run methods_ddp2 300 $COMMON --teacher resnet34 --teacher-weights "$T34" --student resnet18 --backend torch_ddp \
           --nproc 2 --kd-loss crd --opt O1 --gpus 0 --epochs 1 --lr 0.2
         $T 400 $PY -m cli bench --teacher resnet34 --student resnet18 --backends single --opt O1 --amp-dtype float16 -b 256 \
           --methods kd,at,ofd,crd,reviewkd,dkd 2>&1 | tail -14 | tee -a "$OUT/summary.txt" ;;
  latest) # MLKD and DOT: kd, dkd, mlkd, nkd, ctkd, ctdkd from one teacher forward (MLKD's strong view through the
         # teacher once), then kd, dkd, nkd and mlkd with --dot; mlkd and DOT under each backend and opt level; the steps timed
         T34=$RUNS/teacher34/checkpoints/best.pt E=${TABLE_EPOCHS:-8}
         for variant in ${LATEST_VARIANTS:-"latest:kd,dkd,mlkd,nkd,ctkd,ctdkd:" "latest_dot:kd,dkd,nkd,mlkd:--dot"}; do
           IFS=: read -r name methods flag <<< "$variant"
           students "$name" "$methods" $COMMON --teacher resnet34 --teacher-weights "$T34" --student resnet18 $flag \
             --opt O1 --amp-dtype ${LATEST_DTYPE:-float16} --epochs $E --lr ${LATEST_LR:-0.2}
         done
         for combo in ${LATEST_COMBOS:-single:O1 dp:O1 torch_ddp:O1 apex_ddp:O1 apex_ddp:O2 single:O3}; do
           set -- ${combo/:/ }
           run "latest_$1_$2" 240 $COMMON --teacher resnet34 --teacher-weights "$T34" --student resnet18 --backend $1 \
             --kd-loss mlkd,kd --dot --opt $2 --amp-dtype float16 --gpus 0 --epochs 1 --lr ${LATEST_LR:-0.2}
           for m in mlkd kd; do report "latest_$1_$2/$m" - 0; done
         done
         run latest_ddp2 300 $COMMON --teacher resnet34 --teacher-weights "$T34" --student resnet18 --backend torch_ddp \
           --nproc 2 --kd-loss mlkd --dot --opt O1 --gpus 0 --epochs 1 --lr ${LATEST_LR:-0.2}
         $KD report "$RUNS/latest" "$RUNS/latest_dot" --format markdown 2>&1 | tee -a "$OUT/summary.txt"
         $T 300 $PY -m cli bench --teacher resnet34 --student resnet18 --backends single --opt O1 --amp-dtype float16 -b 256 \
           --methods ${LATEST_BENCH:-kd,mlkd} --iters 40 --warmup 10 2>&1 | tail -9 | tee -a "$OUT/summary.txt" ;;
  inception) # a teacher of another resolution: inception_v3 trained by kd at 299 px, then beside a resnet18 student
         # at 224 (the teacher fed the student's crop resized to 299 on the device, validated on its own 342/299 crops)
         run inception_teacher 300 $COMMON --no-teacher --student inception_v3 --image-size 299 --opt O1 --amp-dtype bfloat16 \
           --epochs ${TEACHER_EPOCHS:-5} --lr 0.2 --lr-schedule cosine --warmup-epochs 1
         run inception_kd 300 $COMMON --teacher inception_v3 --teacher-weights "$RUNS/inception_teacher/checkpoints/best.pt" \
           --student resnet18 --opt O1 --amp-dtype float16 --epochs ${TABLE_EPOCHS:-3} --lr 0.2
         grep -h "train [0-9]\|validated on\|eval:" "$OUT/inception_kd.log" | head -6 | sed "s/^/    /" | tee -a "$OUT/summary.txt" ;;
  *) echo "unknown part $part"; exit 2 ;;
esac; done
