"""Rank bodies for tests/test_nccl.py (module-level so run_ranks can pickle them).

Each body runs on one rank with one GPU (cuda:rank), joined to the others by a gloo process group
that only bootstraps the NCCL communicator (its unique id travels over it).
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Sequence, Tuple

import torch

OP_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.float64)


def _comm(rank: int, **kw: Any) -> Any:
    from compcomm._nccl import make_nccl_communicator

    torch.cuda.set_device(rank % torch.cuda.device_count())
    return make_nccl_communicator(device=torch.cuda.current_device(), **kw)


def run_ops(comm: Any, counts: Sequence[int], stream: "torch.cuda.Stream") -> List[str]:
    """Runs every collective on `comm` for each count and dtype; returns the failures (empty: all good).

    Inputs depend on the rank so that each result has one right answer: all_reduce of
    (i % 5) + rank + 1 is W*(i % 5) + W(W+1)/2 (sum), (i % 5) + W (max), (i % 5) + 1 (min); all_gather
    and all_to_all chunks are tagged with their source rank; broadcast from the last rank.
    """
    from compcomm import _C
    from compcomm._buffers import buffer_of

    rank, world = comm.rank(), comm.size()
    dev = torch.device("cuda", comm.device)
    st = stream.cuda_stream
    fails: List[str] = []
    checks: List[Tuple[str, torch.Tensor, torch.Tensor]] = []
    with torch.cuda.stream(stream):
        for n in counts:
            base = torch.arange(n, device=dev) % 5
            for dtype in OP_DTYPES:
                for op, want in (
                    (_C.ReduceOp.sum, base * world + world * (world + 1) // 2),
                    (_C.ReduceOp.max, base + world),
                    (_C.ReduceOp.min, base + 1),
                ):
                    x = (base + rank + 1).to(dtype)
                    comm.all_reduce(buffer_of(x), op, stream=st)
                    checks.append((f"all_reduce {op} {dtype} n={n}", x, want.to(dtype)))
                send = (base + 10 * rank).to(dtype)
                recv = torch.full((world * n,), -1, dtype=dtype, device=dev)
                comm.all_gather(buffer_of(send), buffer_of(recv), stream=st)
                want = torch.cat([(base + 10 * r).to(dtype) for r in range(world)])
                checks.append((f"all_gather {dtype} n={n}", recv, want))

                big = torch.arange(world * n, device=dev) % 7
                send = (big + rank).to(dtype)
                recv = torch.full((n,), -1, dtype=dtype, device=dev)
                comm.reduce_scatter(buffer_of(send), buffer_of(recv), _C.ReduceOp.sum, stream=st)
                want = (big[rank * n : (rank + 1) * n] * world + world * (world - 1) // 2).to(dtype)
                checks.append((f"reduce_scatter {dtype} n={n}", recv, want))

                chunk = torch.arange(n, device=dev) % 3
                send = torch.cat([chunk + 100 * rank + j for j in range(world)]).to(dtype)
                recv = torch.full((world * n,), -1, dtype=dtype, device=dev)
                comm.all_to_all(buffer_of(send), buffer_of(recv), stream=st)
                want = torch.cat([chunk + 100 * j + rank for j in range(world)]).to(dtype)
                checks.append((f"all_to_all {dtype} n={n}", recv, want))

                buf = (base + rank).to(dtype)
                comm.broadcast(buffer_of(buf), world - 1, stream=st)
                checks.append((f"broadcast {dtype} n={n}", buf, (base + world - 1).to(dtype)))
        comm.barrier_on(st, 120.0)
    stream.synchronize()
    for name, got, want in checks:
        if not torch.equal(got, want):
            bad = (got != want).nonzero()
            fails.append(f"rank {rank}: {name}: {bad.numel()} wrong, first at {bad[:1].tolist()}")
    return fails


def ops_case(rank: int, world: int, counts: Sequence[int]) -> List[str]:
    from compcomm._nccl import shutdown_nccl

    comm = _comm(rank, timeout=120)
    assert (comm.rank(), comm.size()) == (rank, world), (comm.rank(), comm.size())
    fails = run_ops(comm, counts, torch.cuda.Stream())
    shutdown_nccl()
    return fails


def compressed_pairs(
    comm: Any, cpu_group: Any, n: int, steps: int, seed: int
) -> List[Tuple[Any, Any]]:
    """`steps` compressed allreduces of the same inputs on the GPU (through `comm`) and on the CPU
    (through `cpu_group`: a gloo group or a LocalCommunicator); returns (gpu, cpu) result pairs."""
    import compcomm

    g = torch.Generator().manual_seed(seed + comm.rank())
    dev = torch.device("cuda", comm.device)
    we_c, se_c = compcomm.error_buffers(n, group=cpu_group)
    we_g, se_g = we_c.to(dev), se_c.to(dev)
    out = []
    for _ in range(steps):
        m = torch.randn(n, generator=g)
        a = m.clone()
        compcomm.compressed_allreduce(a, we_c, se_c, group=cpu_group)
        b = m.to(dev)
        compcomm.compressed_allreduce(b, we_g, se_g, group=comm)
        out.append((b.cpu(), a))
    out.append((we_g.cpu(), we_c))
    out.append((se_g.cpu(), se_c))
    return out


def compressed_case(rank: int, world: int, n: int, steps: int) -> List[Tuple[Any, Any]]:
    import torch.distributed as dist
    from compcomm._nccl import shutdown_nccl

    comm = _comm(rank, timeout=120)
    out = compressed_pairs(comm, dist.group.WORLD, n, steps, seed=77)
    shutdown_nccl()
    return out


def timeout_case(rank: int, world: int, warm: bool, blocking: bool) -> Dict[str, Any]:
    """Rank 0 calls all_reduce; the others never do (after one collective together if `warm`).
    Rank 0 must get CommTimeoutError, then find the communicator closed; nobody may hang."""
    import torch.distributed as dist
    from compcomm._buffers import buffer_of
    from compcomm._nccl import shutdown_nccl
    from compcomm.errors import CommTimeoutError

    comm = _comm(rank, timeout=120, blocking=blocking)
    res: Dict[str, Any] = {"rank": rank}
    buf = torch.ones(1 << 16, device=torch.device("cuda", comm.device))
    st = torch.cuda.current_stream().cuda_stream
    if warm:
        comm.all_reduce(buffer_of(buf), timeout_s=60.0, stream=st)
        comm.synchronize(timeout_s=60.0)
        res["warm_sum"] = float(buf[0].item())
    if rank == 0:
        t0 = time.monotonic()
        try:
            comm.all_reduce(buffer_of(buf), timeout_s=3.0, stream=st)
            comm.synchronize(timeout_s=30.0)
            res["first"] = "returned"
        except CommTimeoutError as e:
            res["first"] = "timeout"
            res["first_msg"] = str(e)
        res["seconds"] = time.monotonic() - t0
        res["closed"] = comm.closed
        try:
            comm.all_reduce(buffer_of(buf), timeout_s=3.0, stream=st)
            res["after"] = "returned"
        except CommTimeoutError as e:
            res["after"] = "timeout"
            res["after_msg"] = str(e)
    dist.barrier()  # gloo: the silent ranks wait here until rank 0 is done
    t0 = time.monotonic()
    shutdown_nccl(timeout=10.0)
    res["shutdown_seconds"] = time.monotonic() - t0
    return res
