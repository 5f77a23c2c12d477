#!/usr/bin/env bash
# Issue 12's small-call latency on one GPU, in one device call (<= 100 s on the H200; compcomm must
# already be installed from this checkout):
#   tests  tests/test_cuda.py, tests/test_nccl.py and tests/test_small_calls_gpu.py (kernels vs CPU
#          twins, the compressed allreduce on device, native NCCL at world size 1, the fused kernels
#          and the world-of-one path: its header posted to mapped host memory, the commit queued
#          after the verdict, a busy stream and the timeout)
#   bench  bench/bench_latency.py: 2^20 and 2^28 fp32 through the default path (torch nccl group,
#          W=1, eager, check=True), check=False, the local communicator, a CUDA graph, plain NCCL
#          allreduce; per-call us and the profiler's kernel/API list of one default call
# From the repository root:  OUT=... bash bench/run_latency_gpu.sh  -> $OUT/summary.txt,
# $OUT/latency.md, $OUT/latency.json, $OUT/tests.log, $OUT/bench.log
set -u -o pipefail
OUT=${OUT:-$PWD/out/latency}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
START=$(date +%s)
status=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$OUT/summary.txt" 2>&1
(cd /tmp && python3 -c 'import compcomm; print(compcomm.__file__, compcomm.build_info())') >>"$OUT/summary.txt" 2>&1
timeout 68 python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py tests/test_nccl.py \
  tests/test_small_calls_gpu.py >"$OUT/tests.log" 2>&1
rc=$?; [ $rc -eq 0 ] || status=1
echo "tests: rc=$rc, $(tail -1 "$OUT/tests.log") ($(( $(date +%s) - START )) s)" | tee -a "$OUT/summary.txt"
t0=$(date +%s)
timeout 28 python3 bench/bench_latency.py --sizes 20,28 --out "$OUT" >"$OUT/bench.log" 2>&1
rc=$?; [ $rc -eq 0 ] || status=1
echo "bench: rc=$rc in $(( $(date +%s) - t0 )) s: $(grep -E 'Target' "$OUT/bench.log" | tail -1)" \
  | tee -a "$OUT/summary.txt"
echo "total $(( $(date +%s) - START )) s, status $status" | tee -a "$OUT/summary.txt"
exit $status
