#!/usr/bin/env bash
# The GPU machine's side of the CPU optimizer-step work (issue 12, CPU step): on the lent H200 host,
#   cpu     bench/bench_cpu_adam.py --skip flat on that host's CPU (a second CPU model for the
#           1-bit step's ratio against torch's AdamW; one thread, 8.4M parameters)
#   tests   the OneBitAdam W=1 / step_on paths, ZeroOneAdam's CPU local step, the frozen denominators with CUDA present (CUDA parameters must take the
#           general path, not the CPU kernels) and the fused CUDA optimizer tests
# Expects this checkout installed (SKIP_BUILD=1, e.g. after run_verify_gpu.sh's build part), else
# builds it first. From the repository root:  OUT=... bash bench/run_cpustep_gpu.sh
set -u -o pipefail
OUT=${OUT:-$PWD/out/cpustep}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PATH=$PATH:/usr/local/cuda/bin
status=0
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  NCCL_INCLUDE_DIR=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "include"))' 2>/dev/null)
  export NCCL_INCLUDE_DIR
  timeout 300 python3 -m pip install --no-build-isolation --no-deps . >"$OUT/build.log" 2>&1 || status=1
fi
{ lscpu | grep -E 'Model name|^CPU\(s\)|L3'; uptime; } >"$OUT/cpu.md"
timeout 120 python3 bench/bench_cpu_adam.py --repeats 7 --skip flat --json "$OUT/cpu_adam.json" \
  >>"$OUT/cpu.md" 2>&1 || status=1
timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/test_onebit_local.py \
  tests/test_step_on.py tests/test_fused_optim.py tests/test_zero_one_cpu_kernel.py \
  tests/test_frozen_denominators.py >"$OUT/tests.log" 2>&1 || status=1
tail -3 "$OUT/tests.log"; tail -8 "$OUT/cpu.md"
echo "status $status" | tee "$OUT/summary.txt"
exit $status
