"""MPI-only checks, a rank body for tests/mpi/runner.py (1-4 ranks): compressed_allreduce over MPI
equals the same call over gloo bit for bit, mpi4py interop (a Split sub-communicator), the
cuda_aware=True refusal and init's type errors. The collectives themselves are checked on every
backend by tests/conformance."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import compcomm
import compcomm.testing
from compcomm import _C
from compcomm._buffers import buffer_of
from compcomm.errors import UnsupportedError

COUNTS = [0, 1, 7, 1000, 4099]
T = 60.0  # per-call timeout: generous on an oversubscribed 2-core machine
RANK = W = -1  # set by run()


def expect(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(f"[rank {RANK}] {what}")


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


def check_init_errors() -> None:
    """init's arguments of the wrong type are TypeErrors naming them."""
    for what, bad in (("cuda_aware", lambda: compcomm.init("mpi", cuda_aware="yes")),
                      ("comm", lambda: compcomm.init("mpi", comm=3.5))):
        try:
            bad()
        except TypeError as e:
            expect(what in str(e), f"message: {e}")
        else:
            raise AssertionError(f"[rank {RANK}] init({what}=bad type) was accepted")


def run(ctx) -> None:
    """The MPI-only checks on the runner's world communicator ``ctx.comm``."""
    global RANK, W
    comm = ctx.comm
    RANK, W = comm.rank(), comm.size()
    expect(compcomm.build_info()["mpi"] and "mpi" in compcomm.available_backends(), "mpi not built")
    expect(compcomm.get_communicator(None) is comm, "init did not set the default")
    expect(comm.backend_name() == "mpi" and not comm.cuda_aware or _C.mpi_reports_cuda_support(), "detect")
    check_init_errors()
    check_compressed_vs_gloo(comm)
    check_mpi4py_interop()
    check_cuda_aware_refusal()
