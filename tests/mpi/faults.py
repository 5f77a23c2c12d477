"""Rank bodies for tests/mpi/runner.py: what goes wrong between ranks of an MPI communicator.

``mismatched_exchange``: all_gather/all_to_all where the ranks disagree on the message sizes (buffer
sizes, or pipeline_chunk_bytes on one rank only) raise RankMismatchError on every rank, naming the
peer, instead of returning with stale bytes. ``gave_up_exits``: a rank whose barrier timed out
exits at once through the normal exit path (MPI_Finalize skipped), while its peer is still away.
``timed_out_buffers_kept``: the tensor of a call that timed out is kept alive (MPI may still write
it when the peer shows up), and so is its communicator.
"""

from __future__ import annotations

import gc
import os
import time
import weakref

import pytest
import torch

import compcomm
from compcomm._buffers import buffer_of
from compcomm.errors import CommTimeoutError, RankMismatchError

MIB = 1 << 20


def _expect_mismatch(comm, call: str, send: torch.Tensor, recv: torch.Tensor) -> None:
    with pytest.raises(RankMismatchError, match=rf"\[rank {comm.rank()}\] mpi {call}: a message "
                       r"from rank \d+ held .* where \d+ were expected"):
        getattr(comm, call)(buffer_of(send), buffer_of(recv), timeout_s=60)


def mismatched_exchange(ctx) -> None:
    rank, world = ctx.rank, ctx.world
    # 1. sizes: rank 0 gathers 80 bytes a rank, the others 100
    comm = compcomm.make_communicator("mpi", cuda_aware=False, timeout=60)
    n = 80 if rank == 0 else 100
    _expect_mismatch(comm, "all_gather", torch.ones(n, dtype=torch.uint8),
                     torch.zeros(world * n, dtype=torch.uint8))
    # 2. the same sizes, cut differently: rank 0 sends 2 MiB messages, the others 1 MiB pieces
    comm = compcomm.make_communicator("mpi", cuda_aware=False, timeout=60)
    if rank == 0:
        comm.pipeline_chunk_bytes = 0
    _expect_mismatch(comm, "all_to_all", torch.ones(world * 2 * MIB, dtype=torch.uint8),
                     torch.zeros(world * 2 * MIB, dtype=torch.uint8))
    # a new communicator works
    comm = compcomm.make_communicator("mpi", cuda_aware=False, timeout=60)
    x = torch.ones(1000)
    comm.all_reduce(buffer_of(x), timeout_s=60)
    assert torch.all(x == world)


def gave_up_exits(ctx, pid_dir: str) -> None:
    """Rank 0 times out in a barrier that rank 1 never calls, then returns (the runner exits
    normally); rank 1 sees rank 0's process gone within 15 s, then leaves without MPI_Finalize."""
    rank = ctx.rank
    comm = compcomm.make_communicator("mpi", cuda_aware=False, timeout=60)
    path = os.path.join(pid_dir, "rank0.pid")
    if rank == 0:
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(path + ".tmp", path)
        with pytest.raises(CommTimeoutError):
            comm.barrier(timeout_s=1.0)
        return  # the runner exits 0; MPI_Finalize, which would wait for rank 1, is skipped
    if rank == 1:
        while not os.path.exists(path):
            time.sleep(0.05)
        pid = int(open(path).read())
        end = time.monotonic() + 15
        while time.monotonic() < end and _alive(pid):
            time.sleep(0.1)
        assert not _alive(pid), "rank 0 is still in its exit path (MPI_Finalize waits for this rank)"
    os._exit(0)  # this rank never joined the barrier: MPI_Finalize is not for it either


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def timed_out_buffers_kept(ctx) -> None:
    rank = ctx.rank
    comm = compcomm.make_communicator("mpi", cuda_aware=False, timeout=60)
    if rank == 0:
        x = torch.ones(1000)
        tensor, communicator = weakref.ref(x), weakref.ref(comm)
        with pytest.raises(CommTimeoutError):
            comm.all_reduce(buffer_of(x), timeout_s=1.0)
        del x, comm
        gc.collect()
        assert tensor() is not None, "the timed-out all_reduce's tensor was freed"
        assert communicator() is not None, "the communicator of the timed-out call was freed"
    fresh = compcomm.make_communicator("mpi", cuda_aware=False, timeout=60)
    fresh.barrier(timeout_s=60)
    if rank != 0:
        os._exit(0)  # never joined rank 0's all_reduce: no MPI_Finalize for it


def mismatched_all_reduce(ctx) -> None:
    """Ranks all-reducing different sizes: MPI reports the truncation through MPI_COMM_WORLD's
    error handler (a failed request of a non-blocking collective), which used to abort the job;
    now every rank raises a typed error that names the call."""
    comm = compcomm.make_communicator("mpi", cuda_aware=False, timeout=30)
    x = torch.ones(100 if ctx.rank == 0 else 200)
    try:
        comm.all_reduce(buffer_of(x), timeout_s=10.0)
    except compcomm.errors.CommError as e:
        print(f"RANK {ctx.rank} all_reduce -> {type(e).__name__}", flush=True)
    else:
        print(f"RANK {ctx.rank} all_reduce -> returned", flush=True)
    os._exit(0)  # the failed collective may leave requests behind: no MPI_Finalize
