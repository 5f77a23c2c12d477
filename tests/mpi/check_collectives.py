"""Run under mpirun (1-4 ranks): every MpiCommunicator collective on CPU buffers against numpy,
compressed_allreduce over MPI against the same call over gloo, typed errors for bad input,
mpi4py interop and the cuda_aware=True refusal. Prints "RANK r OK" at the end; any failure raises
(non-zero exit)."""

from __future__ import annotations

import os
import zlib
import sys

import numpy as np
import torch
import torch.distributed as dist

import compcomm
import compcomm.testing
from compcomm import _C
from compcomm._buffers import buffer_of
from compcomm.errors import RankMismatchError, UnsupportedError

COUNTS = [0, 1, 7, 1000, 4099]
T = 60.0  # per-call timeout: generous on an oversubscribed 2-core machine


def inputs(r: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rank r's input: small integers (exact in every dtype, so reductions are exact)."""
    g = torch.Generator().manual_seed(seed * 1009 + r)
    x = torch.randint(-8, 9, (n,), generator=g)
    if dtype == torch.uint8:
        x = x.abs()
    return x.to(dtype)


def f64(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float64).numpy()


def expect(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(f"[rank {RANK}] {what}")


def check_all_reduce(c) -> None:
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64,
                  torch.uint8):
        for op, fn in ((_C.ReduceOp.sum, np.sum), (_C.ReduceOp.max, np.max), (_C.ReduceOp.min, np.min)):
            for n in COUNTS:
                seed = zlib.crc32(f"{dtype}{int(op)}{n}".encode()) % 10000
                x = inputs(RANK, n, dtype, seed)
                c.all_reduce(buffer_of(x), op, timeout_s=T)
                want = fn(np.stack([f64(inputs(r, n, dtype, seed)) for r in range(W)]), axis=0)
                expect(np.array_equal(f64(x), want), f"all_reduce {dtype} {op} n={n}")
    # random fp32 values: equal to the float64 sum up to rounding
    x = torch.randn(4099, generator=torch.Generator().manual_seed(RANK))
    c.all_reduce(buffer_of(x), timeout_s=T)
    want = sum(torch.randn(4099, generator=torch.Generator().manual_seed(r)).double() for r in range(W))
    expect(np.allclose(f64(x), want.numpy(), rtol=1e-5, atol=1e-5), "all_reduce fp32 random")


def check_reduce_scatter(c) -> None:
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64):
        for k in (0, 1, 7, 1000):
            seed = 7 + k
            x = inputs(RANK, W * k, dtype, seed)
            out = torch.full((k,), 99, dtype=dtype)
            c.reduce_scatter(buffer_of(x), buffer_of(out), _C.ReduceOp.sum, timeout_s=T)
            total = np.sum(np.stack([f64(inputs(r, W * k, dtype, seed)) for r in range(W)]), axis=0)
            expect(np.array_equal(f64(out), total[RANK * k:(RANK + 1) * k]), f"reduce_scatter {dtype} k={k}")


def check_all_gather(c) -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.uint8):
        for n in COUNTS:
            x = inputs(RANK, n, dtype, n)
            out = torch.empty(W * n, dtype=dtype)
            c.all_gather(buffer_of(x), buffer_of(out), timeout_s=T)
            want = np.concatenate([f64(inputs(r, n, dtype, n)) for r in range(W)])
            expect(np.array_equal(f64(out), want), f"all_gather {dtype} n={n}")
    # in place: the send buffer is this rank's slot of recv
    n = 7
    out = torch.zeros(W * n)
    out[RANK * n:(RANK + 1) * n] = inputs(RANK, n, torch.float32, 3)
    c.all_gather(buffer_of(out[RANK * n:(RANK + 1) * n]), buffer_of(out), timeout_s=T)
    want = np.concatenate([f64(inputs(r, n, torch.float32, 3)) for r in range(W)])
    expect(np.array_equal(f64(out), want), "all_gather in place")


def check_all_to_all(c) -> None:
    for dtype in (torch.float32, torch.float16, torch.uint8):
        for k in (0, 1, 7, 1000):
            x = inputs(RANK, W * k, dtype, 11 + k)
            out = torch.empty(W * k, dtype=dtype)
            c.all_to_all(buffer_of(x), buffer_of(out), timeout_s=T)
            want = np.concatenate([f64(inputs(r, W * k, dtype, 11 + k))[RANK * k:(RANK + 1) * k] for r in range(W)])
            expect(np.array_equal(f64(out), want), f"all_to_all {dtype} k={k}")


def check_broadcast(c) -> None:
    for root in range(W):
        for n in COUNTS:
            x = inputs(RANK, n, torch.float16, root * 31 + n)
            c.broadcast(buffer_of(x), root, timeout_s=T)
            expect(np.array_equal(f64(x), f64(inputs(root, n, torch.float16, root * 31 + n))),
                   f"broadcast root={root} n={n}")
    c.barrier(timeout_s=T)


def check_bytes_and_errors(c) -> None:
    c.reset_bytes_sent()
    x = torch.ones(1000)
    c.all_reduce(buffer_of(x), timeout_s=T)
    expect(c.bytes_sent == 2 * 4000 * (W - 1) // W, f"bytes_sent {c.bytes_sent}")
    for bad in (
        lambda: c.all_to_all(buffer_of(torch.ones(W * 3)), buffer_of(torch.ones(W * 3 + 1)), timeout_s=T),
        lambda: c.all_gather(buffer_of(torch.ones(3)), buffer_of(torch.ones(3 * W + 1)), timeout_s=T),
        lambda: c.broadcast(buffer_of(x), W, timeout_s=T),
        lambda: c.all_reduce(buffer_of(x), timeout_s=-1.0),
        lambda: compcomm.init("bogus"),
    ):
        try:
            bad()
        except ValueError as e:
            expect("must" in str(e) or "not a rank" in str(e) or "positive" in str(e), f"message: {e}")
        else:
            raise AssertionError(f"[rank {RANK}] bad input was accepted")
    for bad_type in (lambda: compcomm.init("mpi", cuda_aware="yes"), lambda: compcomm.init("mpi", comm=3.5)):
        try:
            bad_type()
        except TypeError:
            pass
        else:
            raise AssertionError(f"[rank {RANK}] bad type was accepted")
    # Ranks disagreeing on the size: every rank raises RankMismatchError (the header exchange).
    if W > 1:
        n = 100 + (RANK == 0)
        t = torch.randn(n)
        we, se = compcomm.error_buffers(128 * W, c)
        before = t.clone()
        try:
            compcomm.compressed_allreduce(t, we, se, c, timeout=T)
        except RankMismatchError as e:
            expect("numel=101" in str(e), f"mismatch message: {e}")
        else:
            raise AssertionError(f"[rank {RANK}] size mismatch not detected")
        expect(torch.equal(t, before), "tensor changed by a failed call")


def check_compressed_vs_gloo(c) -> None:
    """compressed_allreduce over MPI == the same call over gloo, bit for bit, errors carried."""
    port = torch.zeros(1, dtype=torch.int64)
    if RANK == 0:
        port[0] = compcomm.testing.free_port()
    c.broadcast(buffer_of(port), 0, timeout_s=T)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{int(port)}", rank=RANK, world_size=W)
    gloo = compcomm.TorchCommunicator()
    try:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for n in COUNTS:
                we_m, se_m = compcomm.error_buffers(n, c)
                we_g, se_g = compcomm.error_buffers(n, gloo)
                for step in range(3):
                    g = torch.Generator().manual_seed(1000 * step + 17 * RANK + n)
                    t = torch.randn(n, generator=g).to(dtype)
                    t_m, t_g = t.clone(), t.clone()
                    compcomm.compressed_allreduce(t_m, we_m, se_m, None, timeout=T)  # default = MPI
                    compcomm.compressed_allreduce(t_g, we_g, se_g, gloo, timeout=T)
                    what = f"compressed_allreduce {dtype} n={n} step={step}"
                    expect(torch.equal(t_m, t_g), what + ": MPI and gloo differ")
                    expect(torch.equal(we_m, we_g) and torch.equal(se_m, se_g), what + ": errors differ")
                    # identical on every rank
                    allr = torch.empty(W * n, dtype=dtype)
                    c.all_gather(buffer_of(t_m), buffer_of(allr), timeout_s=T)
                    expect(all(torch.equal(allr[r * n:(r + 1) * n], t_m) for r in range(W)), what + ": ranks differ")
                    if n and W > 1:
                        expect(bool(we_m.abs().sum() > 0), what + ": no error feedback")
    finally:
        dist.destroy_process_group()


def check_mpi4py_interop() -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    expect(world.rank == RANK and world.size == W, "mpi4py sees another world")
    sub = world.Split(color=RANK % 2, key=RANK)
    c = compcomm.init("mpi", comm=sub)
    expect(c.size() == sub.size and c.rank() == sub.rank, "sub-communicator rank/size")
    x = torch.tensor([float(RANK)], dtype=torch.float64)
    c.all_reduce(buffer_of(x), timeout_s=T)
    expect(float(x) == sum(r for r in range(W) if r % 2 == RANK % 2), f"sub all_reduce {float(x)}")
    t = torch.randn(33, generator=torch.Generator().manual_seed(RANK % 2))  # equal within a sub group
    we, se = compcomm.error_buffers(t)
    compcomm.compressed_allreduce(t, we, se)  # group=None: the sub-communicator
    expect(world.allreduce(1) == W, "mpi4py still works")  # and mpi4py's own traffic is unaffected
    compcomm.shutdown()
    sub.Free()


def check_cuda_aware_refusal() -> None:
    reported = _C.mpi_reports_cuda_support()
    if reported and _C.mpi_cuda_built():
        c = compcomm.init("mpi", cuda_aware=True)
        expect(c.cuda_aware, "cuda_aware=True accepted but not used")
    else:
        try:
            compcomm.init("mpi", cuda_aware=True)
        except UnsupportedError as e:
            expect("cuda_aware=True" in str(e) and "cuda_aware=False" in str(e), f"refusal message: {e}")
        else:
            raise AssertionError(f"[rank {RANK}] cuda_aware=True accepted by a non-CUDA-aware MPI")
        if _C.mpi_cuda_built():  # the override for MPIs that cannot report CUDA support
            os.environ["COMPCOMM_MPI_CUDA_AWARE"] = "1"
            expect(compcomm.init("mpi", cuda_aware=True).cuda_aware, "override ignored")
            del os.environ["COMPCOMM_MPI_CUDA_AWARE"]
    expect(compcomm.init("mpi", cuda_aware=False).cuda_aware is False, "cuda_aware=False")
    compcomm.shutdown()


if __name__ == "__main__":
    expect(compcomm.build_info()["mpi"] and "mpi" in compcomm.available_backends(), "mpi not built")
    comm = compcomm.init("mpi")  # no torch.distributed needed
    RANK, W = comm.rank(), comm.size()
    expect(compcomm.get_communicator(None) is comm, "init did not set the default")
    expect(comm.backend_name() == "mpi" and not comm.cuda_aware or _C.mpi_reports_cuda_support(), "detect")
    check_all_reduce(comm)
    check_reduce_scatter(comm)
    check_all_gather(comm)
    check_all_to_all(comm)
    check_broadcast(comm)
    check_bytes_and_errors(comm)
    check_compressed_vs_gloo(comm)
    check_mpi4py_interop()
    check_cuda_aware_refusal()
    print(f"RANK {RANK} OK", flush=True)
    sys.exit(0)
