#!/usr/bin/env bash
# Per-bucket overhead of the 1-bit optimizers' compressed step on one GPU (issues 12, 13), in one
# device call: about 35 s of build (SKIP_BUILD=1 skips it when this checkout is installed), then
# about 70 s:
#   tests  tests/test_bucket_overhead.py (list forms, staging, W=2 gloo bit-equality on the CPU,
#          and on CUDA: per-parameter buckets staged at once = per bucket, peers mirrored)
#   bench  bench/bench_bucket_overhead.py --device cuda --mirror: OneBitAdam's compressed step at
#          W=2 (peers mirrored, no network) with one bucket / 16k-element buckets / one per
#          parameter, 208 x 4096 fp32; then the same on the host CPU over gloo (W=2)
# From the repository root:  OUT=... bash bench/run_bucketovh_gpu.sh
set -u -o pipefail
OUT=${OUT:-$PWD/out/bucketovh}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PATH=$PATH:/usr/local/cuda/bin
status=0
t0=$(date +%s)
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  NCCL_INCLUDE_DIR=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "include"))' 2>/dev/null)
  export NCCL_INCLUDE_DIR
  timeout 200 python3 -m pip install --no-build-isolation --no-deps . >"$OUT/build.log" 2>&1 || status=1
  echo "[build $(( $(date +%s) - t0 )) s] status $status"
fi
timeout 60 python3 -m pytest -q -rs -p no:cacheprovider tests/test_bucket_overhead.py \
  >"$OUT/tests.log" 2>&1 || status=1
echo "[tests $(( $(date +%s) - t0 )) s]"; tail -2 "$OUT/tests.log"
B="python3 bench/bench_bucket_overhead.py --steps 30"
: >"$OUT/bench.log"
for args in "--rounds 2 --device cuda --mirror --world 2 --tensors 208 --numel 4096" \
            "--rounds 1 --device cpu --world 2 --tensors 208 --numel 4096"; do
  timeout 45 $B $args >>"$OUT/bench.log" 2>&1 || { status=1; echo "FAILED: $args" >>"$OUT/bench.log"; }
done
grep -E "^compcomm|best of|FAILED|Error" "$OUT/bench.log"
echo "[total $(( $(date +%s) - t0 )) s] status $status" | tee "$OUT/summary.txt"
exit $status
