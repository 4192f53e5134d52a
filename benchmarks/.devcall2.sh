set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
S=$OUT/summary.txt
git log --oneline -1 > $S
(cd .apex && python3 -m pip install -q --no-build-isolation --no-deps --no-index . 2>&1 | tail -1)
python3 -m pip install -q --no-deps --no-index .wheels/*.whl 2>&1 | grep -v "^$" | tail -1
E2E_CLASSES=200 DATA=/tmp/in200 OUT=$OUT/e2e bash benchmarks/e2e.sh data >> $S 2>&1
echo "== profile_e2e nvimgcodec" >> $S
timeout 120 python3 benchmarks/profile_e2e.py --data /tmp/in200 --steps 30 2>&1 | grep -v "nvjpeg2k\|nvtiff\|Note:\|Failed to load" | head -45 >> $S
echo "== profile_e2e nvjpeg" >> $S
KD_GPU_DECODER=nvjpeg timeout 100 python3 benchmarks/profile_e2e.py --data /tmp/in200 --steps 30 2>&1 | grep "^epoch\|^loader" >> $S
echo "== bench_loader" >> $S
timeout 150 python3 benchmarks/bench_loader.py --data /tmp/in200 --no-pil --gpu-workers 15 --decoders nvjpeg,nvimgcodec 2>&1 | grep -v "nvjpeg2k\|nvtiff\|Note:\|Failed to load" | tail -15 >> $S
(TEACHER_EPOCHS=2 OUT=$OUT/mission timeout 300 bash benchmarks/mission.sh data teacher backends > $OUT/mission.log 2>&1)
cat $OUT/mission/summary.txt >> $S
