"""Run under mpirun with 2-3 ranks, MPI initialized by mpi4py at thread level argv[1] ("funneled",
"serialized" or "multiple"). Below "multiple", compcomm's MPI communicator works from the thread
that initialized MPI and refuses any other thread with UnsupportedError naming the level (calling
MPI there would be undefined behaviour), and ZeRO and the bucketed OneBitAdam, whose background
exchanges then run inside the submitting call, still train: ZeRO-2 + AdamW (overlap_comm on and off)
equals AdamW on the ranks' averaged gradients, and OneBitAdam reaches its compressed phase with the
same parameters on every rank. Prints "RANK r OK"."""

from __future__ import annotations

import sys

from mpi4py import rc

rc.thread_level = sys.argv[1]
from mpi4py import MPI  # noqa: E402

import threading  # noqa: E402

import torch  # noqa: E402

import compcomm  # noqa: E402
from compcomm._buffers import buffer_of  # noqa: E402
from compcomm.errors import UnsupportedError  # noqa: E402
from compcomm.optim import OneBitAdam  # noqa: E402
from compcomm.zero import ZeroOptimizer  # noqa: E402

LEVELS = {"funneled": MPI.THREAD_FUNNELED, "serialized": MPI.THREAD_SERIALIZED,
          "multiple": MPI.THREAD_MULTIPLE}
STEPS = 4


def model_of() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 9), torch.nn.Tanh(), torch.nn.Linear(9, 5))


def batch(t: int, r: int):
    g = torch.Generator().manual_seed(1000 * t + r)
    return torch.randn(16, 13, generator=g), torch.randn(16, 5, generator=g)


def loss_of(model, t: int, r: int) -> torch.Tensor:
    x, y = batch(t, r)
    return torch.nn.functional.mse_loss(model(x), y)


def reference(world: int) -> torch.Tensor:
    """AdamW on the gradients averaged over the ranks' batches, in one process."""
    model = model_of()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for t in range(STEPS):
        for r in range(world):
            (loss_of(model, t, r) / world).backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def main() -> None:
    level = LEVELS[sys.argv[1]]
    assert MPI.Query_thread() == level, (MPI.Query_thread(), level)
    comm = compcomm.init("mpi", cuda_aware=False)
    rank, world = comm.rank(), comm.size()

    x = torch.ones(7)
    comm.all_reduce(buffer_of(x), timeout_s=60)  # the thread that initialized MPI
    assert torch.all(x == world), x

    caught = []

    def other_thread() -> None:
        try:
            comm.all_reduce(buffer_of(torch.ones(7)), timeout_s=60)
        except UnsupportedError as e:
            caught.append(str(e))

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    if level < MPI.THREAD_MULTIPLE:
        assert caught and f"[rank {rank}]" in caught[0] and "thread other than" in caught[0] \
            and f"MPI_THREAD_{sys.argv[1].upper()}" in caught[0], caught
    else:
        assert not caught, caught
        MPI.COMM_WORLD.Barrier()

    want = reference(world)
    for overlap in (False, True):
        model = model_of()
        z = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=2, process_group=comm,
                          module=model, optimizer_kwargs={"lr": 1e-2}, reduce_bucket_size=64,
                          overlap_comm=overlap)
        for step in range(STEPS):
            loss_of(model, step, rank).backward()
            z.step()
        got = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        z.close()
        err = (got - want).abs().max().item()
        assert err < 1e-5, f"[rank {rank}] ZeRO-2 overlap={overlap}: {err}"

    model = model_of()
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=2, comm_backend_name="mpi",
                     process_group=comm)
    for step in range(STEPS + 2):
        loss_of(model, step, rank).backward()
        opt.step()
        opt.zero_grad()
    assert opt.adam_freeze_key, f"[rank {rank}] OneBitAdam: compressed phase not reached"
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.isfinite(flat).all()
    everyone = MPI.COMM_WORLD.allgather(flat.numpy().tobytes())
    assert all(b == everyone[0] for b in everyone), f"[rank {rank}] OneBitAdam: ranks differ"
    compcomm.shutdown()
    print(f"RANK {rank} OK", flush=True)


if __name__ == "__main__":
    main()
