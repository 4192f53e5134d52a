set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
S=$OUT/summary.txt
git log --oneline -1 > $S
(cd .apex && python3 -m pip install -q --no-build-isolation --no-deps --no-index . 2>&1 | tail -1)
python3 -m pip install -q --no-deps --no-index .wheels/*.whl 2>&1 | grep -v "^$" | tail -1
E2E_CLASSES=400 DATA=/tmp/in400 OUT=$OUT/e2e bash benchmarks/e2e.sh data >> $S 2>&1
B="python3 -m cli bench --teacher resnet101 --student resnet18 --backends single --opt O1 --amp-dtype float16 -b 256 --iters 50 --warmup 20"
for j in 6 10; do
  $B --data /tmp/in400 --loader gpu -j $j --out /tmp/bj$j > $OUT/bench_j$j.log 2>&1
  echo "bench folder -j $j: $(grep '^| single' /tmp/bj$j/bench.md | cut -d'|' -f5)" >> $S
done
echo "== profile_e2e nvimgcodec -j 15" >> $S
timeout 120 python3 benchmarks/profile_e2e.py --data /tmp/in400 --steps 40 2>&1 | grep -v "nvjpeg2k\|nvtiff\|Note:\|Failed to load" | head -50 >> $S
echo "== bench_loader" >> $S
timeout 150 python3 benchmarks/bench_loader.py --data /tmp/in400 --no-pil --gpu-workers 15 --decoders nvjpeg,nvimgcodec 2>&1 | grep -v "nvjpeg2k\|nvtiff\|Note:\|Failed to load" | tail -15 >> $S
(TEACHER_EPOCHS=2 OUT=$OUT/mission timeout 240 bash benchmarks/mission.sh data teacher backends > $OUT/mission.log 2>&1)
cat $OUT/mission/summary.txt >> $S
