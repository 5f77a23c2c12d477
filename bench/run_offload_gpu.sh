#!/usr/bin/env bash
# ZeRO-Offload on the GPU (issue 17), one device call: (a) C++ CPU Adam vs torch AdamW foreach on
# 2^26 fp32 parameters at all cores, (b) a 0.5B-parameter GPT-like model at W=1, ZeRO stage 2
# AdamW with and without offload_optimizer (step time, device memory vs estimate_memory, parameter
# difference), (c) a memory cap, below the model's fp32 Adam state, under which only the offload
# run trains, (d) OneBitAdam's 1-bit work per bucket on the device vs on the host
# (onebit_placement). From the repository root:
#     bash bench/run_offload_gpu.sh      # $OUT/offload_gpu.md (the tables), $OUT/offload_gpu.log,
#                                        # $OUT/offload_gpu_tests.log (the CUDA tests, first)
# Builds this checkout first only if the installed compcomm lacks compcomm.zero.offload (or BUILD=1).
# About 2 minutes: the GPU tests (-k cuda) of tests/test_zero_offload.py (offload vs not, stages
# 1-3), test_zero_staging.py (bounded staging: pieces equal the whole bucket, memory held) and
# test_zero_offload_placement.py (OneBitAdam placements agree), timeout 60 s, then the benchmark,
# which stops itself after BENCH_LIMIT seconds (default 75).
set -u -o pipefail
OUT=${OUT:-$PWD/out/offload}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 NCCL_NVLS_ENABLE=0 PATH=$PATH:/usr/local/cuda/bin
t0=$(date +%s)
if [ "${BUILD:-0}" = 1 ] || ! (cd /tmp && $PY -c 'import compcomm.zero.offload' 2>/dev/null); then
  NCCL_INCLUDE_DIR=$($PY -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "include"))' 2>/dev/null)
  export NCCL_INCLUDE_DIR
  $PY -m pip install --no-build-isolation --no-deps . >"$OUT/build.log" 2>&1 \
    || { echo "BUILD FAILED"; tail -40 "$OUT/build.log"; exit 1; }
  echo "[build $(( $(date +%s) - t0 )) s]"
fi
timeout ${TEST_TIMEOUT:-60} $PY -m pytest -q -p no:cacheprovider -rs tests/test_zero_offload.py \
  tests/test_zero_staging.py tests/test_zero_offload_placement.py -k cuda \
  >"$OUT/offload_gpu_tests.log" 2>&1
trc=$?
echo "[tests $(( $(date +%s) - t0 )) s] pytest -k cuda rc=$trc: $(tail -1 "$OUT/offload_gpu_tests.log")"
[ $trc -ne 0 ] && grep -E "^(FAILED|ERROR)|Error" "$OUT/offload_gpu_tests.log" | head -20
BL=${BENCH_LIMIT:-75}
timeout $(( BL + 30 )) $PY bench/bench_offload.py --device cuda --time-limit "$BL" \
  --out "$OUT/offload_gpu.md" >"$OUT/offload_gpu.log" 2>&1
rc=$?
tail -40 "$OUT/offload_gpu.log"
echo "[total $(( $(date +%s) - t0 )) s] bench rc=$rc"
[ $rc -eq 0 ] && [ $trc -eq 0 ]
