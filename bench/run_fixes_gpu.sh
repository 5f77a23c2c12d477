#!/usr/bin/env bash
# The GPU side of the review fixes (branch fixes), one device call of at most 120 s (about 90) once compcomm is
# built (BUILD=1, or an installed compcomm without these fixes, builds first: +1-3 minutes):
#   packed  bench/run_packed_gpu.sh: compressed_allreduce_exchange_many on CUDA buffers over MPI
#           (np 2, 3): one host copy of all headers, the call-count all-gather, count-mismatch errors
#   cuda    tests/test_cuda.py's compressed allreduce / reduce-scatter / guard tests: the commit now
#           guarded by the server scales on every backend (bit-equal to the CPU when finite)
#   abort   tests/test_nccl_abort.py -m gpu: commit_gate on CUDA, NCCL peer death (world 2) with and
#           without the gate (the no_commit_gate fault keeps a checked call unguarded)
# From the repository root:  OUT=... bash bench/run_fixes_gpu.sh   -> $OUT/summary.txt and logs.
set -u -o pipefail
OUT=${OUT:-$PWD/out/fixes}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PATH=$PATH:/usr/local/cuda/bin
PY=${PYTHON:-python3}
status=0
if [ "${BUILD:-0}" = 1 ] || ! (cd /tmp && $PY -c 'from compcomm import _C
assert _C.zero.compressed_allreduce_batch_bytes([], 2) > 0' 2>/dev/null); then
  NCCL_INCLUDE_DIR=$($PY -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "include"))' 2>/dev/null)
  export NCCL_INCLUDE_DIR
  t0=$(date +%s)
  $PY -m pip install --no-build-isolation --no-deps . >"$OUT/build.log" 2>&1 \
    || { echo "BUILD FAILED" | tee "$OUT/summary.txt"; tail -40 "$OUT/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s" | tee "$OUT/summary.txt"
fi
part() {  # name limit command...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; local rc=$?
  echo "$name: rc=$rc in $(( $(date +%s) - t0 )) s: $(grep -E 'passed|failed|rc=' "$OUT/$name.log" | tail -1)" \
    | tee -a "$OUT/summary.txt"
  [ $rc -eq 0 ] || status=1
}
part packed 55 env OUT="$OUT/packed" bash bench/run_packed_gpu.sh
part cuda 30 $PY -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py \
  -k "compressed or guard or unchecked or decompress or graph"
part abort 35 $PY -m pytest -q -rs -p no:cacheprovider tests/test_nccl_abort.py -m gpu \
  --deselect "tests/test_nccl_abort.py::test_nccl_peer_dies_after_header_changes_nothing[3]"
exit $status
