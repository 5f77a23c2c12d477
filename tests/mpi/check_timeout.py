"""Run under mpirun with 3 ranks: a peer that never calls (absent) and a peer that exits early
must give the others CommTimeoutError within the timeout, never a hang."""

from __future__ import annotations

import os
import sys
import time

import torch

import compcomm
from compcomm._buffers import buffer_of
from compcomm.errors import BackendError, CommTimeoutError

TIMEOUT = 3.0

if __name__ == "__main__":
    comm = compcomm.init("mpi")
    rank, world = comm.rank(), comm.size()
    last = world - 1
    x = torch.ones(1000)

    # 1. An absent peer: the last rank skips the all_reduce.
    if rank != last:
        t0 = time.monotonic()
        try:
            comm.all_reduce(buffer_of(x), timeout_s=TIMEOUT)
        except CommTimeoutError as e:
            took = time.monotonic() - t0
            assert TIMEOUT <= took < TIMEOUT + 5, took
            assert e.rank == rank and e.call == "all_reduce" and e.backend == "mpi", vars(e)
            print(f"RANK {rank} absent peer -> CommTimeoutError after {took:.1f} s", flush=True)
        else:
            raise AssertionError("all_reduce with an absent peer returned")
        try:  # the timed-out collective cannot be cancelled: the communicator refuses further calls
            comm.barrier(timeout_s=TIMEOUT)
        except BackendError as e:
            assert "unusable" in str(e), e
        else:
            raise AssertionError("a broken communicator was used again")

    # 2. A fresh communicator works again for everyone.
    comm = compcomm.init("mpi", timeout=60)
    comm.barrier(timeout_s=60)

    # 2b. An absent peer in a large all_gather (point-to-point pieces: the ranks present finish their
    #     messages to each other, the ones with the absent rank never complete).
    if rank != last:
        big = torch.ones(3 << 20, dtype=torch.uint8)
        out = torch.empty(world * big.numel(), dtype=torch.uint8)
        t0 = time.monotonic()
        try:
            comm.all_gather(buffer_of(big), buffer_of(out), timeout_s=TIMEOUT)
        except CommTimeoutError as e:
            took = time.monotonic() - t0
            assert TIMEOUT <= took < TIMEOUT + 5, took
            assert e.call == "all_gather", vars(e)
            print(f"RANK {rank} absent peer in all_gather -> CommTimeoutError after {took:.1f} s", flush=True)
        else:
            raise AssertionError("all_gather with an absent peer returned")
    comm = compcomm.init("mpi", timeout=60)
    comm.barrier(timeout_s=60)

    # 3. A peer that exits early (without MPI_Finalize).
    if rank == last:
        print(f"RANK {rank} exiting early", flush=True)
        os._exit(0)
    t0 = time.monotonic()
    try:
        comm.all_reduce(buffer_of(x), timeout_s=TIMEOUT)
    except CommTimeoutError:
        took = time.monotonic() - t0
        assert took < TIMEOUT + 5, took
        print(f"RANK {rank} dead peer -> CommTimeoutError after {took:.1f} s", flush=True)
    else:
        raise AssertionError("all_reduce with a dead peer returned")
    print(f"RANK {rank} OK", flush=True)
    sys.stdout.flush()
    os._exit(0)  # MPI_Finalize with a dead peer is not worth waiting for
