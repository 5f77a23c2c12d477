#!/usr/bin/env bash
# The 1-bit optimizers' GPU step on the lent GPU machine (issue 12: within 1.5x of the memory
# floor), the Python layer's host time included: build, the GPU tests of the optimizers, then
# bench/profile_optim_gpu.py (each step's wall time against its kernels' time) alternated between
# this tree's Python layer and an earlier one (OLD_PY: a folder holding the earlier
# python/compcomm files, same C++ build), so both columns come from one machine in one call.
# OLD_PY may name several folders (space-separated): each is profiled in turn after this tree's.
# HOST_PROFILE=N: then one more run of this tree's layer with the N functions of most host time.
# From the repository root:  OUT=... [OLD_PY=out/old_py] [ROUNDS=3] bash bench/run_step_gpu.sh
set -u -o pipefail
OUT=${OUT:-$PWD/out/step}
ROUNDS=${ROUNDS:-3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PATH=$PATH:/usr/local/cuda/bin
status=0
NCCL_INCLUDE_DIR=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "include"))' 2>/dev/null)
export NCCL_INCLUDE_DIR
timeout 300 python3 -m pip install --no-build-isolation --no-deps . >"$OUT/build.log" 2>&1 || status=1
PKG=$(cd /tmp && python3 -c 'import compcomm, os; print(os.path.dirname(compcomm.__file__))')
{ nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep -E 'Model name'; } >"$OUT/machine.txt"
timeout 300 python3 -m pytest -q -rs -p no:cacheprovider tests/test_finite_gate.py \
  tests/test_fused_optim.py tests/test_cuda_lamb.py \
  "tests/test_cuda.py::test_optimizers_on_cuda_match_cpu" >"$OUT/tests.log" 2>&1 || status=1
tail -3 "$OUT/tests.log"
NEW_PY=$(mktemp -d)
cp -r "$PKG"/*.py "$PKG"/optim "$NEW_PY"/
for r in $(seq 1 "$ROUNDS"); do
  for src in "$NEW_PY" ${OLD_PY:-}; do
    cp -r "$src"/* "$PKG"/
    which=new
    [ "$src" = "$NEW_PY" ] || which="old ($src)"
    echo "## round $r, $which Python layer" >>"$OUT/profile.md"
    timeout 120 python3 bench/profile_optim_gpu.py --iters 50 >>"$OUT/profile.md" 2>&1 || status=1
  done
done
cp -r "$NEW_PY"/* "$PKG"/
if [ -n "${HOST_PROFILE:-}" ]; then
  timeout 120 python3 bench/profile_optim_gpu.py --iters 50 --host-profile "$HOST_PROFILE" \
    >"$OUT/host_profile.md" 2>&1 || status=1
fi
grep -E "^## |\.step:" "$OUT/profile.md"
# the W=2 tests (two processes sharing the GPU as emulated hosts) last: the slowest part
timeout 300 python3 -m pytest -q -rs -p no:cacheprovider tests/test_optim_gpu_ranks.py \
  >>"$OUT/tests.log" 2>&1 || status=1
tail -2 "$OUT/tests.log"
echo "status $status" | tee "$OUT/summary.txt"
exit $status
