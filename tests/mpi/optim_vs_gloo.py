"""Run as 2 ranks under mpirun with a gloo world too (compcomm.bench.runner, launcher="mpirun"): the
three 1-bit optimizers through compcomm's MPI communicator (comm_backend_name="mpi") end 12 steps
(warm-up and compressed phases) with the parameters of the same optimizers over the gloo group, bit
for bit (two summands: the fp32 sums do not depend on the transport's order). Prints one line per
optimizer; exits non-zero on a mismatch."""

import os
import sys

import torch
import torch.distributed as dist

import compcomm
from compcomm.optim import OneBitAdam, OneBitLamb, ZeroOneAdam


def train(cls, backend: str, rank: int, **kw) -> torch.Tensor:
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(n)) for n in (1000, 37, 4096, 5)]
    group = dist.group.WORLD if backend == "torch" else None  # None: the MPI default
    opt = cls(ps, lr=1e-2, comm_backend_name=backend, process_group=group, **kw)
    assert opt.comm.backend_name().startswith("mpi" if backend == "mpi" else "torch")
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(12):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return torch.cat([p.detach().flatten() for p in ps])


def main() -> int:
    dist.init_process_group("gloo")
    compcomm.init("mpi", cuda_aware=False)
    rank = dist.get_rank()
    bad = 0
    for cls, kw in ((OneBitAdam, dict(freeze_step=2)),
                    (ZeroOneAdam, dict(var_freeze_step=2, local_step_scaler=1)),
                    (OneBitLamb, dict(freeze_step=2))):
        same = torch.equal(train(cls, "torch", rank, **kw), train(cls, "mpi", rank, **kw))
        bad += not same
        if rank == 0:
            print(f"{cls.__name__} mpi == gloo: {same}", flush=True)
    dist.barrier()
    compcomm.shutdown()
    return 1 if bad else 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    os._exit(rc)  # skip gloo's teardown (mpirun allows the early exit: see the launcher)
