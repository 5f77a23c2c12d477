#!/usr/bin/env bash
# Issue 19's GPU side in one short command (~30-60 s once compcomm is built with CUDA, e.g. by
# bench/run_gpu.sh): the packed-momentum torch-op path on CUDA tensors against numpy, then
# tests/mpi/check_packed_gpu.py under mpirun with 2 and 3 ranks sharing the GPU (batched exchange,
# packed_average, ZeRO-2 + OneBitAdam exact / no_allgather vs the CPU run). Logs in $OUT.
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
python3 -c "import compcomm, torch; print(compcomm.build_info()); assert torch.cuda.is_available()" || exit 1
rc=0
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_zero_packed_momentum.py \
  -k "cuda and (unpack or pack_matches)" > "$OUT/packed_gpu_pytest.log" 2>&1 || rc=1
tail -3 "$OUT/packed_gpu_pytest.log"
for np in 2 3; do
  timeout 90 python3 -c "
import subprocess, sys
from compcomm.testing import mpirun_command
sys.exit(subprocess.call(mpirun_command($np, 'tests/mpi/check_packed_gpu.py')))" \
    > "$OUT/packed_gpu_mpi_np$np.log" 2>&1 || rc=1
  grep -E "^RANK 0|Error" "$OUT/packed_gpu_mpi_np$np.log" | head -8
  echo "np=$np: $(grep -c ' OK$' "$OUT/packed_gpu_mpi_np$np.log") of $np ranks OK"
done
echo "rc=$rc"
exit $rc
