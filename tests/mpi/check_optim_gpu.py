"""Run under mpirun with 2-3 ranks sharing the GPU (host-staged MPI): the 1-bit optimizers with CUDA
parameters -- bucketed (several buckets exchanged on the communication thread, then committed),
per-parameter and ZeroOneAdam's syncs -- follow the same trajectory as with CPU parameters over the
same communicator, and a NaN on one rank skips the step on every rank with nothing changed; ranks
that disagree on their buckets (from the start, or one rank alone in the compressed phase) raise
RankMismatchError on every rank with nothing changed. Prints "RANK r OK"."""

from __future__ import annotations

import sys

import torch

import compcomm
from compcomm.errors import RankMismatchError
from compcomm.optim import OneBitAdam, ZeroOneAdam

SHAPES = [(37, 5), (130,), (3, 40), (1000,)]


def grads(rank: int, step: int, device) -> list:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [(torch.randn(s, generator=g) * 0.1 + 0.01 * (rank + 1)).to(device) for s in SHAPES]


def run(cls, kw, device, rank, steps=8, nan_step=None):
    g0 = torch.Generator().manual_seed(5)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g0).to(device)) for s in SHAPES]
    opt = cls(ps, lr=0.01, **kw)
    traj = []
    for t in range(steps):
        for p, g in zip(ps, grads(rank, t, device)):
            p.grad = g
        if t == nan_step and rank == 0:
            ps[1].grad[3] = float("nan")
        before = [p.detach().clone() for p in ps]
        opt.step()
        if t == nan_step:
            assert opt.skipped_steps == 1, f"[rank {rank}] {cls.__name__} skipped {opt.skipped_steps}"
            assert all(torch.equal(a, b) for a, b in zip(before, ps)), "skipped step changed params"
        traj.append(torch.cat([p.detach().reshape(-1).cpu() for p in ps]))
    return traj


def mismatch(device, rank: int, world: int) -> None:
    """The last rank's reduce_bucket_size differs (checked at the first step); then, with agreed
    buckets, the last rank alone drops a gradient in the compressed phase: its layout check meets
    the others' batched exchange (both 32-byte records in device memory here)."""
    odd = rank == world - 1
    for kw, drop in ((dict(freeze_step=2, reduce_bucket_size=300 if odd else 10**6), False),
                     (dict(freeze_step=2, reduce_bucket_size=300), True)):
        g0 = torch.Generator().manual_seed(5)
        ps = [torch.nn.Parameter(torch.randn(s, generator=g0).to(device)) for s in SHAPES]
        opt = OneBitAdam(ps, lr=0.01, **kw)
        for t in range(4 if drop else 1):
            for p, g in zip(ps, grads(rank, t, device)):
                p.grad = g
            if t < 3 and drop:
                opt.step()
        if drop and odd:
            ps[1].grad = None
        before = [p.detach().clone() for p in ps] + [opt.state_dict()["compcomm"]["sched"]]
        try:
            opt.step()
            raise AssertionError(f"[rank {rank}] {kw} drop={drop}: no RankMismatchError")
        except RankMismatchError as e:
            print(f"RANK {rank} mismatch drop={drop}: {e}", flush=True)
        after = [p.detach().clone() for p in ps] + [opt.state_dict()["compcomm"]["sched"]]
        assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                   for a, b in zip(before, after)), f"[rank {rank}] a failed step changed state"


if __name__ == "__main__":
    comm = compcomm.init("mpi", cuda_aware=False)
    rank = comm.rank()
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    z1 = dict(var_freeze_step=3, var_update_scaler=1, local_step_scaler=1, local_step_clipper=2)
    cases = [(OneBitAdam, dict(freeze_step=2, reduce_bucket_size=300)),
             (OneBitAdam, dict(freeze_step=2)),
             (OneBitAdam, dict(freeze_step=2, per_parameter=True)),
             (ZeroOneAdam, dict(z1, reduce_bucket_size=300))]
    for cls, kw in cases:
        cpu = run(cls, kw, torch.device("cpu"), rank)
        gpu = run(cls, kw, dev, rank)
        diff = max(float((a - b).abs().max()) for a, b in zip(cpu, gpu))
        assert diff < 1e-4, f"[rank {rank}] {cls.__name__} {kw}: GPU vs CPU differ by {diff}"
        print(f"RANK {rank} {cls.__name__} {kw} max |gpu - cpu| = {diff:.2e}", flush=True)
        run(cls, kw, dev, rank, nan_step=5)
    mismatch(dev, rank, comm.size())
    compcomm.shutdown()
    print(f"RANK {rank} OK", flush=True)
    sys.exit(0)
