#!/usr/bin/env bash
# Everything the GPU machine checks, in one device call per stage:
#   bash bench/run_device.sh tests    build, then tests/test_cuda.py, tests/test_nccl.py, GPU MPI tests
#   bash bench/run_device.sh bench    build, then bench/gpu_bench.py and bench/bench_nccl.py
#   bash bench/run_device.sh mpi      build, then the GPU MPI tests only (device buffers, ZeRO on GPU)
#   bash bench/run_device.sh links    build, then host-staged MPI on emulated GPU hosts over shaped
#                                     links: the mpirun-launcher tests (SKIP_TESTS=1 skips them) and
#                                     bench/bench_mpi.py --compare --device cuda (compcomm against
#                                     DeepSpeed's MpiBackend) for each "profile:W" of CONFIGS, with
#                                     SIZES and ITERS; needs root and .tools (bench/collect_tools.sh)
# Run from the repository root, carrying .whl (DeepSpeed 0.19.6 + pure-Python deps, for the benches).
# Logs go to $OUT (default out/device), results to bench/results/.
set -u -o pipefail
STAGE=${1:-tests}
OUT=${OUT:-$PWD/out/device}
mkdir -p "$OUT" bench/results
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PATH=$PATH:/usr/local/cuda/bin PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
[ -d .tools/bin ] && export PATH="$PWD/.tools/bin:$PATH"  # ip and tc, for the links stage
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/run.log"; }
status=0
if ls .whl/deepspeed-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || log "deepspeed wheels failed to install"
fi
NCCL_INCLUDE_DIR=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "include"))' 2>/dev/null)
export NCCL_INCLUDE_DIR
t0=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -v . >"$OUT/build.log" 2>&1 || { log "BUILD FAILED"; tail -60 "$OUT/build.log"; exit 1; }
log "built in $(( $(date +%s) - t0 )) s"
(cd /tmp && python3 -c 'import compcomm, json; print(json.dumps(compcomm.build_info()))') | tee "$OUT/build_info.json"
run() {  # name timeout command...
  local name=$1 limit=$2; shift 2
  log "$name"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; local rc=$?
  log "$name rc=$rc: $(grep -E 'passed|failed|error' "$OUT/$name.log" | tail -1)"
  [ $rc -eq 0 ] || status=1
}
if [ "$STAGE" = tests ]; then
  (ompi_info --parsable --all 2>/dev/null | grep -i "mpi_built_with_cuda_support\|opal_cuda" ; ompi_info | head -3) >"$OUT/ompi_info.txt" 2>&1
  run test_cuda 200 python3 -m pytest tests/test_cuda.py -q -rs -p no:cacheprovider
  run test_nccl 150 python3 -m pytest tests/test_nccl.py -q -rs -p no:cacheprovider --timeout 120
  run test_mpi_gpu 400 python3 -m pytest tests/test_mpi.py -q -rs -p no:cacheprovider -k "gpu or cuda"
  grep -hE "FAILED|Error" "$OUT"/test_*.log | head -40
elif [ "$STAGE" = links ]; then
  (lscpu | grep -E "Model name|^CPU\(s\)"; mpirun --version | head -1) >"$OUT/machine.txt" 2>&1
  [ "${SKIP_TESTS:-0}" = 1 ] || run test_launcher 240 python3 -m pytest tests/test_bench_harness.py -q -rs \
    -p no:cacheprovider -k "mpirun or mpi_methods"
  for cfg in ${CONFIGS:-eth1g:2 eth1g:4 eth10g:2 eth10g:4 unshaped:4}; do
    run "mpi_${cfg%:*}_w${cfg#*:}" 300 python3 bench/bench_mpi.py --compare --device cuda \
      --profile "${cfg%:*}" --world-size "${cfg#*:}" --sizes "${SIZES:-256K,1M,4M,16M,64M,256M}" \
      --iters "${ITERS:-8}" --timeout 280
    cat "$OUT/mpi_${cfg%:*}_w${cfg#*:}.log"
  done
elif [ "$STAGE" = mpi ]; then
  run test_mpi_gpu 450 python3 -m pytest tests/test_mpi.py -q -rs -p no:cacheprovider -k "gpu or cuda"
  grep -hE "FAILED|Error|RANK|assert" "$OUT"/test_mpi_gpu.log | head -60
else
  run gpu_bench 280 python3 bench/gpu_bench.py --out "$OUT"
  run bench_nccl 200 python3 bench/bench_nccl.py --out bench/results/nccl_h200
  cp bench/results/nccl_h200* "$OUT/" 2>/dev/null
  tail -30 "$OUT/gpu_bench.log"; tail -30 "$OUT/bench_nccl.log"
fi
log "done, status $status"
exit $status
