#!/usr/bin/env bash
# Issue 14's dead/hung peer target on native NCCL, on a machine with ONE (or more) GPU(s), in one
# device call: tests/test_nccl_faults.py (W = 2, 3, 4 ranks sharing the GPU as emulated hosts) and
# the fault test of tests/test_nccl.py (one GPU per rank; skips on one GPU). Builds nothing: run it
# where compcomm is already installed with NCCL (e.g. after bench/run_nccl_gpu.sh in the same warm
# session), or set BUILD=1 to pip-install this checkout first. From the repository root:
#     bash bench/run_faults_gpu.sh            # output in $OUT/faults.log (default ./out/faults)
# About 4-5 minutes (15 GPU tests); each launch has a 240 s limit inside, pytest-timeout 300 s
# per test, 570 s in all (the log keeps what ran).
# PART=abort runs only the GPU tests of tests/test_nccl_abort.py (a peer dying after its header,
# W = 2, 3, and the same without the commit gate: 5 tests, about 1 minute; 150 s in all by
# default), e.g.  BUILD=1 PART=abort bash bench/run_faults_gpu.sh
set -u -o pipefail
OUT=${OUT:-$PWD/out/faults}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
# Never use NVLink multicast on these machines (KINDS.md); keep it off for every child process too.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
if [ "${BUILD:-0}" = 1 ]; then
  NCCL_INCLUDE_DIR=$($PY -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "include"))' 2>/dev/null)
  export NCCL_INCLUDE_DIR PATH=$PATH:/usr/local/cuda/bin
  $PY -m pip install --no-build-isolation --no-deps . >"$OUT/build.log" 2>&1 || { echo "BUILD FAILED"; tail -40 "$OUT/build.log"; exit 1; }
fi
{
  echo "[$(date +%T)] $(cd /tmp && $PY -c 'import sys, torch, compcomm; print(sys.version.split()[0], torch.__version__, torch.cuda.device_count(), "GPU(s);", compcomm.build_info())' 2>&1)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
} | tee "$OUT/faults.log"
PT_TIMEOUT=; $PY -c 'import pytest_timeout' 2>/dev/null && PT_TIMEOUT="--timeout 300"
if [ "${PART:-all}" = abort ]; then
  TESTS=(tests/test_nccl_abort.py -m gpu)
  DEFAULT_LIMIT=150
else
  TESTS=(tests/test_nccl_faults.py tests/test_nccl.py::test_silent_peer_gives_timeout_then_closed)
  DEFAULT_LIMIT=570
fi
timeout ${LIMIT:-$DEFAULT_LIMIT} $PY -m pytest "${TESTS[@]}" \
  -v -rs -p no:cacheprovider $PT_TIMEOUT --durations 0 >>"$OUT/faults.log" 2>&1
rc=$?
echo "[$(date +%T)] pytest rc=$rc" | tee -a "$OUT/faults.log"
grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed" "$OUT/faults.log" | tail -40
exit $rc
