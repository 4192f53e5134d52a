#!/usr/bin/env bash
# End to end against the step alone, on an ImageNet-like JPEG folder (the checks behind the
# "End to end" section of docs/benchmarks.md): `kd bench` on synthetic tensors and on the folder
# with the same settings, side by side, and a few epochs of `kd train` for the per-epoch costs.
# Usage: bash benchmarks/folder_vs_synthetic.sh PART...
#   data      50,000 train + 5,000 val JPEGs in 1,000 classes ($DATA): ImageNet-like sizes (most 500 px
#             on the long side, 20 % portrait, 10 % between 200 and 1,600 px), 2 % grayscale,
#             0.5 % CMYK, 5 % progressive, quality 70-95
#   eager     r101 -> r18, O1 float16, batch 256 and 128 (the b128 part): synthetic vs folder (--loader gpu -j 15)
#   apex      the same at batch 256 with --amp-impl apex (needs apex installed)
#   compiled  --compile --set compile_mode=reduce-overhead, batch 256 and 128: synthetic vs folder
#   decoders  the folder at batch 256 with each GPU decoder forced (KD_GPU_DECODER), against eager's synthetic
#   shares    the folder at batch 256 with each --cpu-decode-share of $SHARES (default "0 0.25 0.4 0.55")
#   b128      batch 128 alone
#   epochs    kd train, 3 epochs over the folder: per-epoch validation, checkpoint and loader start
#   beside    batch 256 and 128 ($BESIDE_BATCHES): the step on synthetic tensors alone, on the folder, and with the loader
#             running beside it, its batches dropped (kd's auto share and share 0 taken at most at 95 % of the
#             step's rate, share 1 as fast as it goes), with 15 busy processes and with Python bursts in a
#             thread (benchmarks/step_beside_loader.py)
# The folder runs of eager, b128 and compiled use --cpu-decode-share $SHARE where set (else kd's auto share).
# Every ratio goes to $OUT/summary.txt. Timed steps: $ITERS (120) after $WARMUP (30) at batch 256, twice
# as many at 128; they must fit in one epoch (a smaller folder needs fewer).
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kd-e2e}; mkdir -p "$OUT"
PY=python3
DATA=${DATA:-/tmp/in1k}
J=${WORKERS:-15}
IT=${ITERS:-120} WU=${WARMUP:-30}
BENCH="$PY -m cli bench --teacher resnet101 --student resnet18 --backends single --opt O1 --amp-dtype float16"

pair() {  # NAME BASE ARGS...: kd bench on the folder and (once per BASE) on synthetic tensors; prints the ratio
  local name=$1 base=$2; shift 2
  [ -f "/tmp/e2e/$base/synthetic/bench.json" ] || \
    $BENCH "$@" --out "/tmp/e2e/$base/synthetic" > "$OUT/$base.synthetic.log" 2>&1
  ${DECODER:+env KD_GPU_DECODER=$DECODER} $BENCH "$@" --data "$DATA" --loader gpu -j "$J" \
    --out "/tmp/e2e/$name/folder" > "$OUT/$name.folder.log" 2>&1
  $PY - "$name" "/tmp/e2e/$name/folder" "/tmp/e2e/$base/synthetic" <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys
from pathlib import Path
name, folder, synthetic = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
def rate(path):
    try:
        row = json.loads((path / "bench.json").read_text())["rows"][0]
    except (OSError, ValueError, IndexError):
        return None, "no result"
    return row.get("img_per_s") if isinstance(row.get("img_per_s"), (int, float)) else None, row.get("note") or row.get("impl")
(s, s_note), (f, f_note) = rate(synthetic), rate(folder)
ratio = f"{100 * f / s:.1f} %" if s and f else "-"
print(f"{name}: synthetic {s} img/s, folder {f} img/s, folder/synthetic {ratio}  [{f_note}]")
EOF
}

SHARE_SET=${SHARE:+--set cpu_decode_share=$SHARE}
batch() {  # B ITERS WARMUP ARGS...: the pair at batch B (ARGS: more kd bench options; NAME: the run's name)
  local b=$1 it=$2 wu=$3; shift 3
  pair "${NAME:-eager}_b$b${SHARE:+_share_$SHARE}" "${NAME:-eager}_b$b" -b "$b" --iters "$it" --warmup "$wu" \
    $SHARE_SET "$@"
}
b256() { batch 256 "$IT" "$WU" "$@"; }
b128() { batch 128 $((2 * IT)) $((2 * WU)) "$@"; }

beside() {  # NAME B LOAD... -- TRAIN_ARGS...: one step_beside_loader.py run; its JSON line to the summary, the
  # step's images/s to stdout (nothing where the run failed)
  local name=$1 b=$2 it=$((IT * 256 / $2)) wu=$((WU * 256 / $2)); shift 2
  # to a file, not a pipe: a pipe would wait for every child that inherited it (the loader's workers)
  $PY benchmarks/step_beside_loader.py "$@" --teacher resnet101 --student resnet18 --teacher-weights none \
    --student-weights none --opt O1 --amp-dtype float16 --backend single --epochs 1 --no-progress --overwrite -b "$b" \
    --limit-train-batches $((it + wu)) --timed-after "$wu" --out "/tmp/e2e/beside/$name" \
    > "$OUT/beside_$name.json" 2> "$OUT/beside_$name.log"
  local line
  line=$(tail -1 "$OUT/beside_$name.json")
  echo "beside $name: ${line:-no result (see $OUT/beside_$name.log)}" >> "$OUT/summary.txt"
  echo "beside $name: ${line:-no result}" >&2
  echo "$line" | $PY -c "import json, sys; r = json.loads(sys.stdin.read())['step_img_per_s']; print(r or '')" \
    2>/dev/null
}

for part in "$@"; do case "$part" in
  data) $PY - "$DATA" <<'EOF' 2>&1 | tee "$OUT/data.log"
import os, sys, time
from multiprocessing import Pool
from pathlib import Path
import numpy as np
from PIL import Image

root = Path(sys.argv[1])
CLASSES, TRAIN, VAL = int(os.environ.get("E2E_CLASSES", 1000)), 50, 5

def size(rng):
    u = rng.random()
    if u < 0.1:  # the odd ones: small thumbnails to large photos
        w, h = int(rng.integers(200, 1600)), int(rng.integers(200, 1200))
    else:
        w, h = 500, int(rng.choice([333, 375, 375, 375, 281, 400]))
        if u > 0.8:
            w, h = h, w
    return w, h

def write(job):
    path, c, seed = job
    rng = np.random.default_rng(seed)
    w, h = size(rng)
    # a smooth random field (a photo's low frequencies), class-tinted, with edges and sensor-like noise
    coarse = rng.normal(0, 1, (max(2, h // 48), max(2, w // 48), 3)).astype(np.float32)
    base = np.asarray(Image.fromarray(np.uint8(np.clip(128 + 50 * coarse, 0, 255))).resize((w, h), Image.BICUBIC),
                      dtype=np.float32)
    tint = np.array([np.cos(2 * np.pi * c / CLASSES + k * 2.1) for k in range(3)], dtype=np.float32)
    edges = (rng.random((h, 1)) < 0.02).cumsum(0) % 2 * 30
    img = base + 40 * tint + edges[..., None] + rng.normal(0, 10, (h, w, 1)).astype(np.float32) \
        + rng.normal(0, 6, (h, w, 3)).astype(np.float32)
    u = rng.random()
    mode = "L" if u < 0.02 else ("CMYK" if u < 0.025 else "RGB")
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).convert(mode).save(
        path, quality=int(rng.integers(70, 96)), progressive=bool(rng.random() < 0.05))

start = time.time()
if not (root / "val").is_dir():
    jobs = []
    for split, n, off in (("train", TRAIN, 0), ("val", VAL, 10**7)):
        for c in range(CLASSES):
            (root / split / f"n{c:08d}").mkdir(parents=True, exist_ok=True)
            jobs += [(root / split / f"n{c:08d}" / f"{i:04d}.JPEG", c, off + c * 1000 + i) for i in range(n)]
    with Pool(os.cpu_count()) as pool:
        pool.map(write, jobs, chunksize=64)
files = list(root.rglob("*.JPEG"))
mb = sum(f.stat().st_size for f in files) / 2**20
print(f"{len(files)} JPEGs in {root}, {mb:.0f} MiB (mean {1024 * mb / len(files):.0f} KiB), {time.time() - start:.0f} s")
EOF
  ;;
  beside) for b in ${BESIDE_BATCHES:-256 128}; do
            alone=$(beside "alone_b$b" "$b" --beside none -- --data synthetic)
            beside "folder_b$b" "$b" --beside none -- --data "$DATA" --loader gpu -j "$J" > /dev/null
            if [ -n "$alone" ]; then  # the loader's batches taken at most at 95 % of the step alone
              pace=$($PY -c "print(round(0.95 * $alone))")
              beside "loader_b$b" "$b" --beside loader --data "$DATA" -j "$J" --rate "$pace" -- --data synthetic > /dev/null
              beside "loader_share0_b$b" "$b" --beside loader --data "$DATA" -j "$J" --share 0 --rate "$pace" -- \
                --data synthetic > /dev/null
            else
              echo "beside: no rate for the step alone at batch $b, so no paced loader rows" | tee -a "$OUT/summary.txt"
            fi
            beside "loader_share1_b$b" "$b" --beside loader --data "$DATA" -j "$J" --share 1 -- --data synthetic > /dev/null
            beside "burn15_b$b" "$b" --beside burn:15 -- --data synthetic > /dev/null
            beside "gil_b$b" "$b" --beside gil:0.2:0.5 -- --data synthetic > /dev/null
          done ;;
  b128) b128 ;;
  eager) b256
         b128 ;;
  apex) pair apex_b256 apex_b256 -b 256 --iters "$IT" --warmup "$WU" --set amp_impl=apex ;;
  compiled) NAME=graphs b256 --compile --set compile_mode=reduce-overhead
            NAME=graphs b128 --compile --set compile_mode=reduce-overhead ;;
  decoders) for d in nvimgcodec nvjpeg cpu; do
              DECODER=$d pair "decoder_${d}_b256" eager_b256 -b 256 --iters "$IT" --warmup "$WU"; done ;;
  shares) for s in ${SHARES:-0 0.25 0.4 0.55}; do
            pair "share_${s}_b256" eager_b256 -b 256 --iters "$IT" --warmup "$WU" --set cpu_decode_share="$s"; done ;;
  epochs) $PY -m cli train --data "$DATA" --teacher resnet101 --teacher-weights none --student resnet18 --opt O1 \
            --amp-dtype float16 -b 256 --epochs 3 --loader gpu -j "$J" --no-progress --overwrite \
            --out /tmp/e2e/epochs ${EPOCH_ARGS:-} > "$OUT/epochs.log" 2>&1
          echo "epochs: exit $?" | tee -a "$OUT/summary.txt"
          $PY - /tmp/e2e/epochs/metrics.jsonl "$DATA" <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys
from pathlib import Path
recs = [json.loads(l) for l in Path(sys.argv[1]).read_text().splitlines() if l.strip()]
val_images = sum(1 for _ in Path(sys.argv[2], "val").rglob("*.JPEG"))
for r in recs:
    print(f"  epoch {r['epoch']}: train {r['seconds']:.2f} s ({r['img_per_s']:.0f} img/s, first batch "
          f"{r.get('train_first_batch_s', float('nan')):.2f} s, waiting for data {r.get('train_data_wait_s', float('nan')):.2f} s), "
          f"val {r.get('val_s', float('nan')):.2f} s for {val_images} images, before the epoch "
          f"{r.get('between_epochs_s', float('nan')):.2f} s (checkpoint, logging, loader start)")
# ImageNet: 1,281,167 train images (5,005 steps of 256), 50,000 val images
last = recs[-1]
step_s = last["seconds"] / max(last["train_images"], 1) * 256
epoch_in = 5005 * step_s
val_in = last.get("val_s", 0) / max(val_images, 1) * 50000
fixed = last.get("between_epochs_s", 0) + last.get("train_first_batch_s", 0)
print(f"  extrapolated to ImageNet: epoch {epoch_in:.0f} s of steps, validation {val_in:.1f} s "
      f"({100 * val_in / epoch_in:.2f} %), checkpoint + loader start {fixed:.2f} s ({100 * fixed / epoch_in:.2f} %)")
EOF
  ;;
  *) echo "unknown part $part"; exit 2 ;;
esac; done
