"""Rank bodies for tests/test_nccl.py (module-level so run_ranks can pickle them).

Each body runs on one rank with one GPU (cuda:rank), joined to the others by a gloo process group
that only bootstraps the NCCL communicator (its unique id travels over it). The collectives
themselves are checked by tests/conformance (backend "nccl").
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Tuple

import torch

def _comm(rank: int, **kw: Any) -> Any:
    from compcomm._nccl import make_nccl_communicator

    torch.cuda.set_device(rank % torch.cuda.device_count())
    return make_nccl_communicator(device=torch.cuda.current_device(), **kw)


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
