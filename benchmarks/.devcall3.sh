set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
S=$OUT/summary.txt
git log --oneline -1 > $S
python3 -m pip install -q --no-deps --no-index .wheels/*.whl > /dev/null 2>&1
E2E_CLASSES=200 DATA=/tmp/in200 OUT=$OUT/e2e bash benchmarks/e2e.sh data >> $S 2>&1
timeout 70 python3 benchmarks/bench_loader.py --data /tmp/in200 --no-pil --gpu-workers 15 --decoders nvjpeg,nvimgcodec --stage-batches 8 2>&1 | grep "^| gpu" >> $S
B="python3 -m cli bench --teacher resnet101 --student resnet18 --backends single --opt O1 --amp-dtype float16 -b 256 --iters 24 --warmup 10"
$B --data /tmp/in200 --loader gpu -j 15 --out /tmp/bf > $OUT/bf.log 2>&1
echo "bench folder -j 15: $(grep '^| single' /tmp/bf/bench.md | cut -d'|' -f5)" >> $S
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_loader.py 2>&1 | tail -2 >> $S
