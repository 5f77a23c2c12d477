"""The MPI communicator under real mpirun: each test launches tests/mpi/<script>.py on N ranks
(the launcher flags live in compcomm.testing.mpirun_command) and checks every rank reported OK."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional

import pytest

import compcomm
from compcomm.testing import mpirun_command

HERE = Path(__file__).parent / "mpi"

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(
        shutil.which("mpirun") is None and shutil.which("mpiexec") is None,
        reason="no mpirun on PATH (install Open MPI)",
    ),
    pytest.mark.skipif(not compcomm.build_info()["mpi"], reason="compcomm was built without MPI"),
]


def launch(np: int, script: str, timeout: float, *args: str, ranks_ok: Optional[int] = None,
           **kw) -> str:
    """Run ``script`` on ``np`` ranks; check it exited 0 and ranks 0..ranks_ok-1 (default: all)
    printed ``RANK r OK``; return its output."""
    cmd = mpirun_command(np, str(HERE / script), *args, **kw)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} hung for {timeout} s:\n{e.stdout}\n{e.stderr}")
    text = out.stdout + out.stderr
    assert out.returncode == 0, f"{' '.join(cmd)} exited with {out.returncode}:\n{text}"
    for r in range(np if ranks_ok is None else ranks_ok):
        assert f"RANK {r} OK" in text, text
    return text


def _skip_without_gpu() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if not compcomm._C.mpi_cuda_built():
        pytest.skip("compcomm's MPI backend was built without the CUDA runtime")


@pytest.mark.parametrize("np", [1, 2, 3, 4])
def test_collectives_compressed_interop(np: int) -> None:
    """All collectives vs numpy, compressed_allreduce MPI == gloo, typed errors, mpi4py, refusal."""
    launch(np, "check_collectives.py", timeout=150)


def test_absent_and_dead_peer_time_out() -> None:
    """A rank that skips a collective, then one that exits early: the others get
    CommTimeoutError within the 3 s timeout (not a hang), and a broken communicator refuses."""
    text = launch(3, "check_timeout.py", timeout=90, ranks_ok=2, allow_early_exit=True)
    for r in range(2):
        assert f"RANK {r} absent peer -> CommTimeoutError" in text, text
        assert f"RANK {r} dead peer -> CommTimeoutError" in text, text


@pytest.mark.gpu
@pytest.mark.parametrize("np", [2, 4])
def test_gpu_buffers(np: int) -> None:
    """Device buffers: host-staged (always) and CUDA-aware (where the MPI reports support), with
    several ranks sharing one GPU."""
    _skip_without_gpu()
    launch(np, "check_gpu.py", timeout=200)


@pytest.mark.gpu
@pytest.mark.parametrize("np", [1, 2, 3])
def test_zero_on_gpu(np: int, tmp_path) -> None:
    """ZeroOptimizer with CUDA parameters (stages 1-3, AdamW fp32/bf16, OneBitAdam, ZeroOneAdam's
    local phase) over host-staged MPI, ranks sharing the GPU, equals the CPU run; a GPU checkpoint
    resumes on the CPU."""
    _skip_without_gpu()
    launch(np, "check_zero_gpu.py", 240, str(tmp_path))


@pytest.mark.gpu
@pytest.mark.parametrize("np", [2, 3])
def test_optim_on_gpu(np: int) -> None:
    """OneBitAdam/ZeroOneAdam with CUDA parameters (several buckets exchanged on the communication
    thread) over host-staged MPI equal the CPU run; a NaN on one rank skips everywhere."""
    _skip_without_gpu()
    launch(np, "check_optim_gpu.py", 200)


def test_mpirun_command_flags() -> None:
    cmd = mpirun_command(2, "x.py", "a", python="py")
    assert cmd[-3:] == ["py", "x.py", "a"] and ("-np" in cmd or "-n" in cmd)
    with pytest.raises(ValueError, match="np"):
        mpirun_command(0, "x.py")


def test_init_errors_in_process() -> None:
    with pytest.raises(ValueError, match="backend"):
        compcomm.init("bogus")
    with pytest.raises(compcomm.errors.UnsupportedError, match="nccl"):
        if compcomm.build_info()["nccl"]:
            pytest.skip("native NCCL is built")
        compcomm.init("nccl")
