"""The MPI communicator under real mpirun (the launcher flags live in compcomm.testing.mpirun_command).

The collectives themselves are checked on MPI (and every other backend) by tests/conformance.
Here: what only MPI has. Rank bodies run through tests/mpi/runner.py (they raise on failure; the
failing rank's traceback is in the test's output); the older scripts tests/mpi/check_*.py print
"RANK r OK" and are checked for it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import pytest

import compcomm
from _backends import RUNNER, mpirun, no_mpi, no_mpi_gpu, skip_unless, skipif
from compcomm.testing import mpirun_command

HERE = Path(__file__).parent / "mpi"

pytestmark = [pytest.mark.mpi, skipif(no_mpi())]


def launch(np: int, script: str, timeout: float, *args: str, ranks_ok: Optional[int] = None,
           **kw) -> str:
    """Run ``script`` on ``np`` ranks; check it exited 0 and ranks 0..ranks_ok-1 (default: all)
    printed ``RANK r OK``; return its output."""
    text = mpirun(np, HERE / script, *args, timeout=timeout, **kw)
    for r in range(np if ranks_ok is None else ranks_ok):
        assert f"RANK {r} OK" in text, text
    return text


def run_body(np: int, ref: str, *args, timeout: float) -> str:
    """Run rank body ``ref`` ("module:function", from tests/) on ``np`` MPI ranks via runner.py."""
    return mpirun(np, RUNNER, ref, json.dumps(list(args)), timeout=timeout)


@pytest.mark.parametrize("np", [1, 2, 3, 4])
def test_interop(np: int) -> None:
    """compressed_allreduce over MPI == over gloo bit for bit, mpi4py sub-communicators, the
    cuda_aware=True refusal, init's type errors."""
    run_body(np, "mpi.interop:run", timeout=150)


@pytest.mark.parametrize("np", [2, 3])
def test_overlap_backward(np: int) -> None:
    """OneBitAdam(overlap_backward=True) on the MPI communicator: the bits of the run without
    overlap (tests/test_overlap.py checks the same over gloo, with every safety case)."""
    run_body(np, "mpi.overlap:run", timeout=200)


@pytest.mark.parametrize("np", [1, 2, 3])
def test_exchange_pieces(np: int) -> None:
    """all_to_all/all_gather as piecewise point-to-point exchanges: odd sizes, tiny and MiB pieces,
    in place; a compressed allreduce spanning several pieces is equal on every rank."""
    run_body(np, "mpi.exchange:run", timeout=200)


def test_backoff_never_sleeps_while_data_may_move() -> None:
    """The wait loops' policy (cpp/mpi/backoff.h), replayed on a made-up clock: spin right after
    progress, yield (never sleep) while the bytes in flight may still be moving, then sleeps that
    grow to a small bound, and progress starts the schedule over."""
    sched = compcomm._C._mpi_backoff_schedule
    ms = 1e-3
    # Nothing in flight: spin, then yield for 20 ms, then 20, 40, ... capped at 200 us.
    times = [0.05, 0.15, 1, 10, 20.1] + [30 + i for i in range(8)]
    got = sched([(t * ms, False) for t in times])
    assert got[:2] == ["spin", "spin"] and got[2:5] == ["yield"] * 3, got
    assert got[5:] == [20, 40, 80, 160, 200, 200, 200, 200], got
    # 64 MiB in flight: no sleep within its time at 0.25 GB/s (268 ms) on top of the 20 ms.
    polls = [(i * ms, False) for i in range(0, 289)]
    assert all(isinstance(a, str) for a in sched(polls, 64 << 20)), "slept while 64 MiB may be moving"
    assert isinstance(sched([(0.29, False)], 64 << 20)[0], int)
    # Progress (a message or a copy finished) restarts the schedule, sleeps from the shortest again.
    got = sched([(0.05, False), (0.06, False), (0.061, True), (0.0611, False), (0.1, False)])
    assert got == [20, 40, "progress", "spin", 20], got
    # A dead peer: 10 s of polls every 10 us -- sleeping is reached, and no sleep exceeds 200 us.
    got = sched([(i * 1e-5, False) for i in range(0, 1_000_000, 97)])
    sleeps = [a for a in got if isinstance(a, int)]
    assert sleeps and max(sleeps) == 200 and got.index(sleeps[0]) * 97e-5 < 0.021, got[:5]
    # More ranks than cores: the peer needs our core, so sleeping starts early whatever the size.
    got = sched([(0.01e-3, False), (0.1e-3, False), (0.2e-3, False)], 64 << 20, oversubscribed=True)
    assert got == ["spin", "yield", 20], got


def test_absent_and_dead_peer_time_out() -> None:
    """A rank that skips a collective, then one that exits early: the others get
    CommTimeoutError within the 3 s timeout (not a hang), and a broken communicator refuses."""
    text = launch(3, "check_timeout.py", timeout=90, ranks_ok=2, allow_early_exit=True)
    for r in range(2):
        assert f"RANK {r} absent peer -> CommTimeoutError" in text, text
        assert f"RANK {r} absent peer in all_gather -> CommTimeoutError" in text, text
        assert f"RANK {r} dead peer -> CommTimeoutError" in text, text


@pytest.mark.parametrize("np", [2, 3])
def test_mismatched_exchange_raises(np: int) -> None:
    """Ranks that disagree on an exchange's message sizes (their buffers, or pipeline_chunk_bytes)
    get RankMismatchError naming the peer, on every rank, not stale bytes; a new communicator
    works."""
    mpirun(np, RUNNER, "mpi.faults:mismatched_exchange", "[]", timeout=120, allow_early_exit=True)


def test_mpi_error_in_a_collective_raises() -> None:
    """An MPI error in a non-blocking collective (a message truncated: the ranks' sizes differ)
    raises a typed error on the rank that sees it, instead of aborting the job through
    MPI_COMM_WORLD's fatal error handler."""
    text = mpirun(2, RUNNER, "mpi.faults:mismatched_all_reduce", "[]", timeout=120,
                  allow_early_exit=True)
    assert "all_reduce -> BackendError" in text or "all_reduce -> RankMismatchError" in text, text
    assert "MPI_ERRORS_ARE_FATAL" not in text, text


def test_rank_that_gave_up_exits(tmp_path) -> None:
    """A rank whose collective timed out leaves at once through the normal exit path: MPI_Finalize
    (which would wait for the absent peer) is skipped."""
    mpirun(2, RUNNER, "mpi.faults:gave_up_exits", json.dumps([str(tmp_path)]), timeout=120,
           allow_early_exit=True)


def test_timed_out_buffers_are_kept() -> None:
    """A call that timed out leaves its MPI request running on its buffers: the tensor (and the
    communicator with its workspaces) stays alive after the caller dropped it."""
    mpirun(2, RUNNER, "mpi.faults:timed_out_buffers_kept", "[]", timeout=120, allow_early_exit=True)


@pytest.mark.parametrize("np,level", [(2, "funneled"), (3, "serialized"), (2, "multiple")])
def test_thread_level_below_multiple(np: int, level: str) -> None:
    """MPI initialized by mpi4py below MPI_THREAD_MULTIPLE: other threads get UnsupportedError
    naming the level (not undefined behaviour), and ZeRO-2 (overlap on and off) and the bucketed
    OneBitAdam, whose exchanges then run in the calling thread, still train correctly."""
    pytest.importorskip("mpi4py")
    launch(np, "check_thread_level.py", 180, level)


@pytest.mark.gpu
@pytest.mark.parametrize("np", [2, 4])
def test_gpu_buffers(np: int) -> None:
    """Device buffers: host-staged (always) and CUDA-aware (where the MPI reports support), with
    several ranks sharing one GPU."""
    skip_unless(no_mpi_gpu())
    launch(np, "check_gpu.py", timeout=200)


@pytest.mark.gpu
@pytest.mark.parametrize("np", [1, 2, 3])
def test_zero_on_gpu(np: int, tmp_path) -> None:
    """ZeroOptimizer with CUDA parameters (stages 1-3, AdamW fp32/bf16, OneBitAdam, ZeroOneAdam's
    local phase) over host-staged MPI, ranks sharing the GPU, equals the CPU run; a GPU checkpoint
    resumes on the CPU."""
    skip_unless(no_mpi_gpu())
    launch(np, "check_zero_gpu.py", 240, str(tmp_path))


@pytest.mark.gpu
@pytest.mark.parametrize("np", [2, 3])
def test_optim_on_gpu(np: int) -> None:
    """OneBitAdam/ZeroOneAdam with CUDA parameters (several buckets exchanged on the communication
    thread) over host-staged MPI equal the CPU run; a NaN on one rank skips everywhere."""
    skip_unless(no_mpi_gpu())
    launch(np, "check_optim_gpu.py", 200)


@pytest.mark.gpu
@pytest.mark.parametrize("np", [2, 3])
def test_packed_momentum_on_gpu(np: int) -> None:
    """Issue 19 on CUDA tensors over host-staged MPI: the batched exchange equals per-bucket calls
    bit for bit, packed_average's signs and scales are exact, ZeRO-2 + OneBitAdam exact and
    no_allgather equal the CPU run with the momentum packed on the GPU."""
    skip_unless(no_mpi_gpu())
    launch(np, "check_packed_gpu.py", 200)


def test_mpirun_command_flags() -> None:
    """The launcher command ends with the interpreter, script and arguments; np < 1 is refused."""
    cmd = mpirun_command(2, "x.py", "a", python="py")
    assert cmd[-3:] == ["py", "x.py", "a"] and ("-np" in cmd or "-n" in cmd)
    with pytest.raises(ValueError, match="np"):
        mpirun_command(0, "x.py")
    cmd = mpirun_command(2, "x.py", mca={"btl": "self,tcp"})  # (Open MPI: CI's launcher)
    i = cmd.index("btl")
    assert cmd[i - 1:i + 2] == ["--mca", "btl", "self,tcp"] and cmd[-1] == "x.py"


def test_init_errors_in_process() -> None:
    """An unknown backend is a ValueError; nccl without a native NCCL build is UnsupportedError."""
    with pytest.raises(ValueError, match="backend"):
        compcomm.init("bogus")
    with pytest.raises(compcomm.errors.UnsupportedError, match="nccl"):
        if compcomm.build_info()["nccl"]:
            pytest.skip("native NCCL is built")
        compcomm.init("nccl")


def test_optimizers_over_mpi_equal_over_gloo() -> None:
    """OneBitAdam, ZeroOneAdam and OneBitLamb with comm_backend_name="mpi" give the parameters of
    the same optimizers over a gloo group bit for bit (2 ranks, warm-up and compressed phases)."""
    from compcomm.bench import runner

    lines = runner.run_on_profile("loopback", 2, [str(HERE / "optim_vs_gloo.py")], timeout=150,
                                  launcher="mpirun")
    assert lines == [f"{name} mpi == gloo: True"
                     for name in ("OneBitAdam", "ZeroOneAdam", "OneBitLamb")], lines
