#!/usr/bin/env bash
# The NCCL backend on a GPU machine, in one device call: build, tests/test_nccl.py, bench/bench_nccl.py,
# tests/test_nccl_faults.py.
# Run from the repository root (the device tool's working directory), carrying .whl (the DeepSpeed
# wheel and its pure-Python dependencies) when DeepSpeed should be compared:
#     bash bench/run_nccl_gpu.sh
# Logs and results go to $OUT (default: ./out/nccl); results also to bench/results/.
set -u -o pipefail
OUT=${OUT:-$PWD/out/nccl}
mkdir -p "$OUT" bench/results
PY=${PYTHON:-python3}
# Never use NVLink multicast on these machines (KINDS.md); keep it off for every child process too.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PATH=$PATH:/usr/local/cuda/bin
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/run.log"; }
status=0

log "start; python: $($PY -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)')"
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || true
GPUS=$($PY -c 'import torch; print(torch.cuda.device_count())')
log "GPUs: $GPUS"

# DeepSpeed 0.19.6 and its missing pure-Python dependencies, as wheels in .whl (or ../.whl), go to
# /tmp/site (not the image's site-packages); cupy, which its NcclBackend needs, is in the image.
WHL=""
for d in .whl ../.whl; do ls $d/deepspeed-*.whl >/dev/null 2>&1 && WHL=$d && break; done
if [ -n "$WHL" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHL"/*.whl >"$OUT/pip_deepspeed.log" 2>&1 \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} && log "deepspeed wheels from $WHL in /tmp/site" \
    || log "deepspeed install failed (see pip_deepspeed.log)"
else
  log "no .whl/deepspeed-*.whl: the deepspeed series will be skipped"
fi
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1

# nccl.h from the nvidia-nccl wheel torch uses (cpp/nccl/CMakeLists.txt also finds it by itself).
NCCL_INCLUDE_DIR=$($PY -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "include"))' 2>/dev/null)
export NCCL_INCLUDE_DIR
log "NCCL_INCLUDE_DIR=$NCCL_INCLUDE_DIR"
t0=$(date +%s)
if ! $PY -m pip install --no-build-isolation --no-deps -v . >"$OUT/build.log" 2>&1; then
  log "BUILD FAILED"; tail -60 "$OUT/build.log"; exit 1
fi
log "built in $(( $(date +%s) - t0 )) s; $(grep -m3 'compcomm:' "$OUT/build.log" | tr '\n' ' ')"
(cd /tmp && $PY -c 'import compcomm, json; print(json.dumps(compcomm.build_info()))') | tee "$OUT/build_info.json"
SO=$(cd /tmp && $PY -c 'import compcomm._C as C; print(C.__file__)')
ldd "$SO" >"$OUT/ldd.txt" 2>&1
grep -q libnccl "$OUT/ldd.txt" && { log "ERROR: _C links libnccl"; status=1; } || log "_C does not link libnccl"

log "tests/test_nccl.py"
timeout 150 $PY -m pytest tests/test_nccl.py -v -rs -p no:cacheprovider --timeout 120 \
  --junitxml "$OUT/test_nccl.xml" >"$OUT/test_nccl.log" 2>&1
rc=$?; log "pytest rc=$rc: $(tail -1 "$OUT/test_nccl.log")"; [ $rc -eq 0 ] || status=1
grep -E "PASSED|FAILED|SKIPPED|ERROR" "$OUT/test_nccl.log" | head -60

log "bench/bench_nccl.py, world size 1"
timeout 180 $PY bench/bench_nccl.py --out bench/results/nccl_h200 >"$OUT/bench_nccl.log" 2>&1
rc=$?; log "bench rc=$rc"; [ $rc -eq 0 ] || status=1
tail -45 "$OUT/bench_nccl.log"
if [ "$GPUS" -gt 1 ]; then
  log "bench/bench_nccl.py, world size $GPUS"
  timeout 150 $PY -m torch.distributed.run --standalone --nproc_per_node="$GPUS" bench/bench_nccl.py \
    --out "bench/results/nccl_h200x$GPUS" >"$OUT/bench_nccl_x$GPUS.log" 2>&1
  rc=$?; log "bench x$GPUS rc=$rc"; [ $rc -eq 0 ] || status=1
  tail -30 "$OUT/bench_nccl_x$GPUS.log"
fi
# Last, so the benches above are never cut short by it (~4-5 min; FAULTS=0 skips; alone:
# bench/run_faults_gpu.sh).
if [ "${FAULTS:-1}" = 1 ]; then
  log "tests/test_nccl_faults.py (dead/hung peer, W=2..4 ranks sharing the GPU as emulated hosts)"
  timeout 420 $PY -m pytest tests/test_nccl_faults.py -v -rs -p no:cacheprovider --timeout 300 >"$OUT/test_nccl_faults.log" 2>&1
  rc=$?; log "pytest rc=$rc: $(tail -1 "$OUT/test_nccl_faults.log")"; [ $rc -eq 0 ] || status=1
fi
cp bench/results/nccl_h200* "$OUT/" 2>/dev/null || true
log "done, status $status"
exit $status
