#!/usr/bin/env bash
# The multi-tensor CUDA kernels of OneBitAdam's update, in one device call (< 4 minutes): build this
# checkout, run tests/test_fused_optim.py (kernels bit-exact against a float32 numpy oracle, fused
# vs foreach vs CPU trajectories) and tests/test_optim.py, then the micro-benchmark (121M parameters
# in 148 tensors: foreach vs fused, CUDA events). From the repository root:
#     bash bench/run_fused_gpu.sh        # output in $OUT (default ./out/fused): build.log,
#                                        # tests.log, fused_optim.md (the table), bench.log
set -u -o pipefail
OUT=${OUT:-$PWD/out/fused}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PATH=$PATH:/usr/local/cuda/bin
t0=$(date +%s)
NCCL_INCLUDE_DIR=$($PY -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "include"))' 2>/dev/null)
export NCCL_INCLUDE_DIR
$PY -m pip install --no-build-isolation --no-deps -v . >"$OUT/build.log" 2>&1 \
  || { echo "BUILD FAILED"; tail -40 "$OUT/build.log"; exit 1; }
grep -E "compcomm: CUDA|cuda_optim" "$OUT/build.log" | head -3
echo "[build $(( $(date +%s) - t0 )) s] $(cd /tmp && $PY -c 'import torch, compcomm; print(torch.__version__, torch.cuda.get_device_name(0), compcomm.build_info()["cuda"])' 2>&1)"
timeout ${TEST_TIMEOUT:-170} $PY -m pytest -q -p no:cacheprovider -rs --durations 8 \
  tests/test_fused_optim.py tests/test_optim.py >"$OUT/tests.log" 2>&1
rc=$?
echo "[tests $(( $(date +%s) - t0 )) s] pytest rc=$rc"
grep -E "passed|failed|error" "$OUT/tests.log" | tail -3
[ $rc -ne 0 ] && grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
timeout ${BENCH_TIMEOUT:-90} $PY bench/bench_fused_optim.py --out "$OUT/fused_optim.md" >"$OUT/bench.log" 2>&1
brc=$?
cat "$OUT/bench.log" | tail -20
echo "[total $(( $(date +%s) - t0 )) s] bench rc=$brc"
[ $rc -eq 0 ] && [ $brc -eq 0 ]
