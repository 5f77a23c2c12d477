#!/usr/bin/env bash
# Host-staged MPI on emulated GPU hosts over Ethernet-like links, in one device call: build, the
# mpirun-launcher tests, then bench/bench_mpi.py --compare --device cuda (compcomm against DeepSpeed
# 0.19.6's MpiBackend(cuda_aware=False), same tensors, interleaved) on eth1g, eth10g and unshaped
# links, W=2 and 4 ranks sharing the local GPU, MPI over TCP on the ranks' veths only.
# Run from the repository root as root, carrying .tools (ip and tc: bench/collect_tools.sh) and .whl
# (DeepSpeed and its pure-Python dependencies):
#     OUT=$OUT bash bench/run_mpi_links_gpu.sh
# CONFIGS overrides the "profile:W" list; SIZES and ITERS the bench_mpi.py arguments; SKIP_TESTS=1
# skips the tests.
set -u -o pipefail
OUT=${OUT:-$PWD/out/mpi_links}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PATH=$PATH:/usr/local/cuda/bin PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
[ -d .tools/bin ] && export PATH="$PWD/.tools/bin:$PATH"
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/run.log"; }
status=0
if ls .whl/deepspeed-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || log "deepspeed wheels failed to install"
fi
(nvidia-smi --query-gpu=name,driver_version --format=csv; lscpu | grep -E "Model name|^CPU\(s\)"; mpirun --version | head -1) >"$OUT/machine.txt" 2>&1
NCCL_INCLUDE_DIR=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "include"))' 2>/dev/null)
export NCCL_INCLUDE_DIR
t0=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -v . >"$OUT/build.log" 2>&1 || { log "BUILD FAILED"; tail -60 "$OUT/build.log"; exit 1; }
log "built in $(( $(date +%s) - t0 )) s"
(cd /tmp && python3 -c 'import compcomm, json; print(json.dumps(compcomm.build_info()))') | tee "$OUT/build_info.json"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  log "tests: the mpirun launcher"
  timeout 240 python3 -m pytest tests/test_bench_harness.py -q -rs -p no:cacheprovider -k "mpirun or mpi_methods" >"$OUT/test_launcher.log" 2>&1
  rc=$?; log "pytest rc=$rc: $(tail -1 "$OUT/test_launcher.log")"; [ $rc -eq 0 ] || status=1
fi
for cfg in ${CONFIGS:-eth1g:2 eth1g:4 eth10g:2 eth10g:4 unshaped:4}; do
  prof=${cfg%:*} w=${cfg#*:}
  log "bench_mpi --compare --device cuda --profile $prof --world-size $w"
  timeout 300 python3 bench/bench_mpi.py --compare --device cuda --profile "$prof" --world-size "$w" \
    --sizes "${SIZES:-256K,1M,4M,16M,64M,256M}" --iters "${ITERS:-8}" --timeout 280 >"$OUT/mpi_${prof}_w$w.log" 2>&1
  rc=$?; log "rc=$rc"; [ $rc -eq 0 ] || status=1
  cat "$OUT/mpi_${prof}_w$w.log"
done
log "done, status $status"
exit $status
