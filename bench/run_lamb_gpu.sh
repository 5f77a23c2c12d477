#!/usr/bin/env bash
# The GPU machine's side of the OneBitLamb work (issue 12, the 1-bit optimizers' step): on the lent
# H200 host,
#   tests   the LAMB CPU passes on the host's AVX-512 CPU (bits against the torch ops, the rsqrt14
#           sqrt), the CUDA passes against the CPU passes, OneBitLamb on CUDA against the CPU, and
#           the CPU-kernel tests the passes share cpp/kernels/cpu_vec.h with, and the 1-bit Adam
#           CUDA kernels' tests (tests/test_fused_optim.py: the one-rank step among them)
#   cpu     bench/bench_cpu_adam.py --skip flat on one pinned core of that CPU
#   gpu     bench/bench_fused_optim.py (OneBitAdam's update; OneBitLamb's step under the table),
#           bench/profile_optim_gpu.py (each step's kernels against its wall time)
# From the repository root:  OUT=... bash bench/run_lamb_gpu.sh
set -u -o pipefail
OUT=${OUT:-$PWD/out/lamb}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PATH=$PATH:/usr/local/cuda/bin
status=0
NCCL_INCLUDE_DIR=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "include"))' 2>/dev/null)
export NCCL_INCLUDE_DIR
timeout 300 python3 -m pip install --no-build-isolation --no-deps . >"$OUT/build.log" 2>&1 || status=1
{ lscpu | grep -E 'Model name|^CPU\(s\)|L3'; uptime; } >"$OUT/cpu.md"
timeout 240 python3 -m pytest -q -rs -p no:cacheprovider tests/test_lamb_cpu_kernel.py \
  tests/test_cpu_adam.py tests/test_zero_one_cpu_kernel.py tests/test_frozen_denominators.py \
  tests/test_cuda_lamb.py tests/test_fused_optim.py \
  "tests/test_cuda.py::test_optimizers_on_cuda_match_cpu" \
  >"$OUT/tests.log" 2>&1 || status=1
for i in 1 2; do
  timeout 120 taskset -c 3 python3 bench/bench_cpu_adam.py --repeats 11 --skip flat \
    --json "$OUT/cpu_adam_$i.json" >>"$OUT/cpu.md" 2>&1 || status=1
done
timeout 150 python3 bench/bench_fused_optim.py --out "$OUT/fused_optim.md" >"$OUT/gpu.log" 2>&1 || status=1
timeout 120 python3 bench/profile_optim_gpu.py >"$OUT/profile.md" 2>&1 || status=1
tail -3 "$OUT/tests.log"; grep -i "lamb\|foreach=True |" "$OUT/cpu.md"; cat "$OUT/fused_optim.md"
cat "$OUT/profile.md"
echo "status $status" | tee "$OUT/summary.txt"
exit $status
