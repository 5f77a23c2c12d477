#!/usr/bin/env bash
# Build compcomm with its CUDA kernels, run the GPU tests and the GPU benchmark: one command for one
# device session. Run from the repository root on a machine with a CUDA GPU, nvcc, torch and cupy:
#
#   bash bench/run_gpu.sh [WHEEL_DIR]      # results in $OUT (default bench/results)
#
# WHEEL_DIR (default ../.whl, then .whl) may hold wheels to install first into /tmp/site: DeepSpeed
# 0.19.6 (pure Python, `pip wheel --no-deps --no-build-isolation deepspeed==0.19.6`) and its missing
# dependencies (pydantic, pydantic-core, annotated-types, typing-inspection, typing-extensions, hjson).
set -o pipefail
WHL=${1:-}
if [ -z "$WHL" ]; then for d in ../.whl .whl; do ls $d/*.whl >/dev/null 2>&1 && WHL=$d && break; done; fi
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
if [ -n "$WHL" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || exit 1
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
command -v nvcc || ls /usr/local/cuda/bin/nvcc
env | grep -E "FLAGS|^CC=|^CXX=" ; ldd_check() { ldd "$(python3 -c 'import compcomm._C as c; print(c.__file__)')" | grep -E "stdc|cudart" || echo "(libstdc++ and cudart linked statically)"; }
t0=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -q -v . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
grep -E "compcomm:|CUDA" "$OUT/build.log" | head -5
echo "build: $(( $(date +%s) - t0 )) s"
python3 -c "import compcomm; print(compcomm.build_info())" || exit 1
ldd_check
timeout ${TEST_TIMEOUT:-240} python3 -m pytest tests/test_cuda.py -q -p no:cacheprovider 2>&1 | tee "$OUT/test_cuda.log" | tail -25
echo "tests: $(( $(date +%s) - t0 )) s"
timeout ${BENCH_TIMEOUT:-280} python3 bench/gpu_bench.py --out "$OUT" 2>&1 | tee "$OUT/bench.log"
echo "total: $(( $(date +%s) - t0 )) s"
