#!/usr/bin/env bash
# The batched exchange and commit on one GPU (issues 12, 13: tensor-aligned buckets cheap on the GPU),
# in one device call of about 120 s: the build (~45 s; SKIP_BUILD=1 skips it when this checkout is
# installed), then
#   tests  tests/test_batched_kernels_gpu.py (batch_copy; exchange_many + commit_many = per-call GPU
#          calls bit for bit, W=1..4 mirrored, several argument packs), tests/test_cuda.py (every CUDA
#          kernel against its CPU twin), and the CUDA case of tests/test_bucket_overhead.py
#   bench  bench/bench_bucket_overhead.py --device cuda --mirror --profile at W=2 and W=4: OneBitAdam's
#          compressed step, 208 x 4096 fp32, one bucket / 16k-element buckets (52) / one per tensor
#          (208): ms per step, the ratio to one bucket, and launches / copies / syncs per step
# From the repository root:  OUT=... bash bench/run_gpubatch_gpu.sh
set -u -o pipefail
OUT=${OUT:-$PWD/out/gpubatch}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PATH=$PATH:/usr/local/cuda/bin
status=0
t0=$(date +%s)
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  NCCL_INCLUDE_DIR=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "include"))' 2>/dev/null)
  export NCCL_INCLUDE_DIR CMAKE_BUILD_PARALLEL_LEVEL=16
  timeout 200 python3 -m pip install --no-build-isolation --no-deps . >"$OUT/build.log" 2>&1 || status=1
  echo "[build $(( $(date +%s) - t0 )) s] status $status"
fi
timeout 75 python3 -m pytest -q -rs -p no:cacheprovider tests/test_batched_kernels_gpu.py tests/test_cuda.py \
  "tests/test_bucket_overhead.py::test_staged_at_once_equals_per_bucket_with_mirrored_peers" \
  >"$OUT/tests.log" 2>&1 || status=1
echo "[tests $(( $(date +%s) - t0 )) s]"; tail -3 "$OUT/tests.log"
B="python3 bench/bench_bucket_overhead.py --steps 20 --rounds 1 --device cuda --mirror --profile --tensors 208 --numel 4096"
: >"$OUT/bench.log"
for w in 2 4; do
  timeout 45 $B --world $w >>"$OUT/bench.log" 2>&1 || { status=1; echo "FAILED: --world $w" >>"$OUT/bench.log"; }
done
grep -E "^compcomm|^round|per step|FAILED|Error" "$OUT/bench.log"
echo "[total $(( $(date +%s) - t0 )) s] status $status" | tee "$OUT/summary.txt"
exit $status
