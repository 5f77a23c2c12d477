#!/usr/bin/env bash
# One device call that checks every GPU path a CPU machine cannot run, on one GPU (the H200), in
# order of importance, within one time budget (BUDGET seconds, default 560):
#   build   pip install this checkout (CUDA kernels, native NCCL)
#   cuda    tests/test_cuda.py, tests/test_fused_optim.py, tests/test_nccl.py (GPU kernels vs CPU twins,
#           the compressed allreduce on device, native NCCL at world size 1)
#   abort   bench/run_faults_gpu.sh PART=abort (a peer dying mid-exchange on native NCCL: buffers unchanged)
#   packed  bench/run_packed_gpu.sh (packed momentum and batched exchange on CUDA, ZeRO-2 under mpirun)
#   stepon  tests/test_step_on.py on CUDA, ZeRO with the 1-bit optimizers on GPU over 2 MPI ranks
#   offload bench/run_offload_gpu.sh (offload tests on CUDA, CPU Adam at 2^26, memory vs estimate, cap)
# PARTS picks some of them (default: all, in this order).
# From the repository root:  OUT=... bash bench/run_verify_gpu.sh   -> $OUT/summary.txt and logs.
set -u -o pipefail
OUT=${OUT:-$PWD/out/verify}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PATH=$PATH:/usr/local/cuda/bin
START=$(date +%s)
BUDGET=${BUDGET:-560}
status=0
PARTS=${PARTS:-"build cuda abort packed stepon offload"}
part() {  # name limit command...: runs with min(limit, budget left) seconds, logs $OUT/name.log
  local name=$1 limit=$2; shift 2
  case " $PARTS " in *" $name "*) ;; *) return ;; esac
  local left=$(( BUDGET - ($(date +%s) - START) ))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 15 ]; then echo "$name: not run (budget spent)" | tee -a "$OUT/summary.txt"; status=1; return; fi
  local t0=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; local rc=$?
  echo "$name: rc=$rc in $(( $(date +%s) - t0 )) s (limit $limit): $(grep -E 'passed|failed|rc=|OK' "$OUT/$name.log" | tail -1)" \
    | tee -a "$OUT/summary.txt"
  [ $rc -eq 0 ] || status=1
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$OUT/summary.txt" 2>&1
NCCL_INCLUDE_DIR=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "include"))' 2>/dev/null)
export NCCL_INCLUDE_DIR
part build 200 python3 -m pip install --no-build-isolation --no-deps -v .
(cd /tmp && python3 -c 'import compcomm; print(compcomm.build_info())') >>"$OUT/summary.txt" 2>&1
part cuda 100 python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py tests/test_fused_optim.py tests/test_nccl.py
part abort 130 env PART=abort OUT="$OUT/abort" bash bench/run_faults_gpu.sh
part packed 110 env OUT="$OUT/packed" bash bench/run_packed_gpu.sh
part stepon 90 python3 -m pytest -q -rs -p no:cacheprovider tests/test_step_on.py tests/test_mpi.py \
  -k "cuda or (zero_on_gpu and 2)"
part offload 170 env OUT="$OUT/offload" BENCH_LIMIT=80 TEST_TIMEOUT=45 bash bench/run_offload_gpu.sh
echo "total $(( $(date +%s) - START )) s, status $status" | tee -a "$OUT/summary.txt"
exit $status
