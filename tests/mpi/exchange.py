"""Run under mpirun (1-4 ranks): all_to_all and all_gather -- point-to-point exchanges cut into pieces
of pipeline_chunk_bytes -- on CPU buffers whose per-rank sizes do not divide into whole pieces, from
a few bytes to several MiB (many pieces in flight, messages larger than the eager limit), in place
and not, against the expected bytes; then a large compressed_allreduce equal on every rank. The
same piece plan runs for host-staged device buffers (tests/mpi/check_gpu.py). A rank body for
tests/mpi/runner.py (``mpi.exchange:run``)."""

from __future__ import annotations

import torch

import compcomm
from compcomm._buffers import buffer_of

T = 120.0  # generous: an oversubscribed 2-core machine
MIB = 1 << 20


def data(r: int, nbytes: int, seed: int) -> torch.Tensor:
    """Rank r's bytes, reproducible on every rank."""
    g = torch.Generator().manual_seed(seed * 7919 + r)
    return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)


def check(comm, rank: int, world: int, chunk: int, block: int, seed: int) -> None:
    what = f"[rank {rank}] chunk={chunk} block={block}"
    # all_to_all: block j of my send goes to rank j
    send = data(rank, world * block, seed)
    recv = torch.zeros(world * block, dtype=torch.uint8)
    comm.all_to_all(buffer_of(send), buffer_of(recv), timeout_s=T)
    want = torch.cat([data(r, world * block, seed)[rank * block:(rank + 1) * block] for r in range(world)])
    assert torch.equal(recv, want), f"{what} all_to_all"
    # all_gather, out of place and in place
    mine = data(rank, block, seed + 1)
    out = torch.zeros(world * block, dtype=torch.uint8)
    comm.all_gather(buffer_of(mine), buffer_of(out), timeout_s=T)
    want = torch.cat([data(r, block, seed + 1) for r in range(world)])
    assert torch.equal(out, want), f"{what} all_gather"
    out.zero_()
    out[rank * block:(rank + 1) * block] = mine
    comm.all_gather(buffer_of(out[rank * block:(rank + 1) * block]), buffer_of(out), timeout_s=T)
    assert torch.equal(out, want), f"{what} all_gather in place"


def run(ctx) -> None:
    """Every piece plan, then the large compressed allreduce, on the runner's communicator."""
    comm = ctx.comm
    rank, world = comm.rank(), comm.size()
    seed = 0
    # (piece size, per-rank block sizes): tiny pieces with many messages per peer; the default
    # (1 MiB) with blocks of several pieces and a tail; 0 = one message per peer.
    for chunk, blocks in ((7, [0, 1, 6, 7, 8, 50]), (MIB, [MIB - 1, MIB, 3 * MIB + 4099]),
                          (0, [5, 2 * MIB + 13])):
        comm.pipeline_chunk_bytes = chunk
        for block in blocks:
            seed += 1
            check(comm, rank, world, chunk, block, seed)
    comm.pipeline_chunk_bytes = MIB

    # A compressed allreduce large enough that its all_to_all and all_gather span several pieces.
    n = 30_000_001  # P/8 > 3 MiB; not a multiple of the padding unit
    m = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    we, se = compcomm.error_buffers(n, comm)
    compcomm.compressed_allreduce(m, we, se, comm, timeout=T)
    assert torch.isfinite(m).all(), f"[rank {rank}] compressed output not finite"
    first = m.clone()
    comm.broadcast(buffer_of(first), 0, timeout_s=T)
    assert torch.equal(m, first), f"[rank {rank}] compressed output differs from rank 0's"
