"""Run under mpirun with 2-4 ranks sharing the GPU(s): every collective on CUDA buffers, host-staged
(chunked pipeline and single chunk) and CUDA-aware where the MPI reports support, against the same
collective on CPU buffers. Prints "RANK r OK"."""

from __future__ import annotations

import sys

import torch

import compcomm
from compcomm import _C
from compcomm._buffers import buffer_of

T = 120.0


def data(r: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 131 + r)
    return torch.randint(-8, 9, (n,), generator=g).to(dtype)


def check(comm, dev: torch.device, rank: int, world: int, label: str) -> None:
    stream = torch.cuda.Stream(dev)  # the caller's stream, not the default one
    sid = stream.cuda_stream
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for n in (0, 7, 4099, 300_001):
            seed = n + len(str(dtype))
            with torch.cuda.stream(stream):
                x = data(rank, n, dtype, seed).to(dev, non_blocking=False) * 1  # produced on stream
                comm.all_reduce(buffer_of(x), _C.ReduceOp.sum, timeout_s=T, stream=sid)
            stream.synchronize()
            want = sum(data(r, n, dtype, seed).double() for r in range(world))
            assert torch.equal(x.cpu().double(), want), f"[rank {rank}] {label} all_reduce {dtype} n={n}"
            y = data(rank, n, dtype, seed).to(dev)
            torch.cuda.synchronize(dev)
            comm.broadcast(buffer_of(y), world - 1, timeout_s=T, stream=sid)
            stream.synchronize()
            assert torch.equal(y.cpu(), data(world - 1, n, dtype, seed)), f"[rank {rank}] {label} broadcast"
            k = n // world
            s = data(rank, world * k, dtype, seed).to(dev)
            o = torch.empty(k, dtype=dtype, device=dev)
            g = torch.empty(world * k, dtype=dtype, device=dev)
            a = torch.empty(world * k, dtype=dtype, device=dev)
            torch.cuda.synchronize(dev)
            comm.reduce_scatter(buffer_of(s), buffer_of(o), _C.ReduceOp.sum, timeout_s=T, stream=sid)
            comm.all_gather(buffer_of(s[:k]), buffer_of(g), timeout_s=T, stream=sid)
            comm.all_to_all(buffer_of(s), buffer_of(a), timeout_s=T, stream=sid)
            stream.synchronize()
            full = [data(r, world * k, dtype, seed) for r in range(world)]
            tot = sum(f.double() for f in full)
            assert torch.equal(o.cpu().double(), tot[rank * k:(rank + 1) * k]), f"[rank {rank}] {label} rs"
            assert torch.equal(g.cpu(), torch.cat([f[:k] for f in full])), f"[rank {rank}] {label} ag"
            assert torch.equal(a.cpu(), torch.cat([f[rank * k:(rank + 1) * k] for f in full])), f"{label} a2a"
    comm.barrier(timeout_s=T)


if __name__ == "__main__":
    comm = compcomm.init("mpi", cuda_aware=False)
    rank, world = comm.rank(), comm.size()
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    check(comm, dev, rank, world, "staged")
    assert comm.staging_bytes > 0
    comm.pipeline_chunk_bytes = 0  # one chunk
    check(comm, dev, rank, world, "staged-1chunk")
    if _C.mpi_reports_cuda_support():
        check(compcomm.init("mpi", cuda_aware=True), dev, rank, world, "cuda-aware")
        print(f"RANK {rank} cuda-aware path ran", flush=True)
    else:
        print(f"RANK {rank} MPI is not CUDA-aware ({_C.mpi_library_version()}): staged only", flush=True)
    compcomm.shutdown()
    print(f"RANK {rank} OK", flush=True)
    sys.exit(0)
