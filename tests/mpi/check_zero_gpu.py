"""Run under mpirun with 1-3 ranks sharing the GPU: ZeroOptimizer on CUDA parameters over compcomm's
host-staged MPI communicator against the same run on CPU parameters over the same communicator --
stage 1/2/3 with AdamW (fp32, and bf16 for stage 2), OneBitAdam stage 2 into its compressed phase
(buckets compressed in step(), and exchanged during backward with overlap_comm) and stage 3,
ZeroOneAdam stage 1 through its 1-bit gradient steps into its local phase -- and a checkpoint saved
from the GPU run loaded into a CPU optimizer. argv[1]: a directory shared by the ranks.
Prints "RANK r OK"."""

from __future__ import annotations

import sys

import torch

import compcomm
from compcomm.optim import OneBitAdam, ZeroOneAdam
from compcomm.zero import ZeroOptimizer, load_checkpoint, save_checkpoint

STEPS = 8
ZOA = {"lr": 1e-2, "var_freeze_step": 4, "var_update_scaler": 1, "local_step_scaler": 1,
       "local_step_clipper": 2}
# label, stage, optimizer, kwargs, dtype, tolerance (max |cuda - cpu| over the parameters): the
# 1-bit scales differ in the last bits (the fp64 norm sums run in another order); bf16: one ulp
CASES = [
    ("adamw-stage1", 1, torch.optim.AdamW, {"lr": 1e-2}, torch.float32, 1e-5),
    ("adamw-stage2-bf16", 2, torch.optim.AdamW, {"lr": 1e-2}, torch.bfloat16, 2e-2),
    ("adamw-stage3", 3, torch.optim.AdamW, {"lr": 1e-2}, torch.float32, 1e-5),
    ("onebit-stage2", 2, OneBitAdam, {"lr": 1e-2, "freeze_step": 2}, torch.float32, 1e-3),
    ("onebit-stage2-overlap", 2, OneBitAdam, {"lr": 1e-2, "freeze_step": 2}, torch.float32, 1e-3),
    ("onebit-stage3-overlap", 3, OneBitAdam, {"lr": 1e-2, "freeze_step": 2}, torch.float32, 1e-3),
    ("zoadam-stage1", 1, ZeroOneAdam, ZOA, torch.float32, 1e-3),
]


def build(dev, stage, cls, kw, dtype, comm, overlap=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 32), torch.nn.Tanh(), torch.nn.Linear(32, 5))
    model = model.to(device=dev, dtype=dtype)
    # overlap: the 1-bit exchanges run during backward, which needs no clipping
    z = ZeroOptimizer(model.parameters(), cls, stage=stage, process_group=comm, module=model,
                      optimizer_kwargs=dict(kw), reduce_bucket_size=200, overlap_comm=overlap,
                      gradient_clipping=0.0 if overlap else 5.0)
    return model, z


def train(model, z, rank, first, last, dev, dtype):
    out = []
    for t in range(first, last + 1):
        g = torch.Generator().manual_seed(1000 * t + rank)
        x, y = torch.randn(16, 13, generator=g), torch.randn(16, 5, generator=g)
        loss = torch.nn.functional.mse_loss(model(x.to(dev, dtype)).float(), y.to(dev))
        loss.backward()
        z.step()
        z.gather_parameters()  # stage 3 (no-op for 1/2)
        out.append(torch.cat([p.detach().float().cpu().reshape(-1) for p in model.parameters()]))
    return out


def main() -> None:
    comm = compcomm.init("mpi", cuda_aware=False)
    rank, world = comm.rank(), comm.size()
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    cpu = torch.device("cpu")
    for label, stage, cls, kw, dtype, tol in CASES:
        runs = {}
        for d in (cpu, dev):
            model, z = build(d, stage, cls, kw, dtype, comm, overlap=label.endswith("overlap"))
            runs[d.type] = train(model, z, rank, 1, STEPS, d, dtype)
            assert z.device == d and all(p.device == d for p in model.parameters()), label
            if cls is ZeroOneAdam:
                assert z._local_phase, f"[rank {rank}] {label}: local phase not reached"
            if cls is OneBitAdam:
                assert z._compressed_phase(), f"[rank {rank}] {label}: compressed phase not reached"
            if d == dev and cls is ZeroOneAdam:
                save_checkpoint(z, sys.argv[1], module=model)
                gpu_next = train(model, z, rank, STEPS + 1, STEPS + 1, d, dtype)[0]
            z.close()
        moved = (runs["cpu"][-1] - runs["cpu"][0]).abs().max().item()
        worst = 0.0
        for t, (a, b) in enumerate(zip(runs["cpu"], runs["cuda"]), start=1):
            diff = (a - b).abs().max().item()
            assert diff <= tol, f"[rank {rank}] {label} step {t}: |cuda - cpu| = {diff} > {tol}"
            worst = max(worst, diff)
        assert moved > 2 * tol, f"[rank {rank}] {label}: parameters moved only {moved}"
        print(f"RANK {rank} {label}: max |cuda - cpu| = {worst:.3g} (tolerance {tol}, parameters "
              f"moved {moved:.3g}) over {STEPS} steps", flush=True)
    # the GPU checkpoint (ZeroOneAdam's local phase) resumes on the CPU
    model, z = build(cpu, 1, ZeroOneAdam, ZOA, torch.float32, comm)
    load_checkpoint(z, sys.argv[1])
    assert z._local_phase
    cpu_next = train(model, z, rank, STEPS + 1, STEPS + 1, cpu, torch.float32)[0]
    z.close()
    diff = (cpu_next - gpu_next).abs().max().item()
    assert diff <= 1e-3, f"[rank {rank}] GPU checkpoint resumed on CPU: differs by {diff}"
    compcomm.shutdown()
    print(f"RANK {rank} OK", flush=True)


if __name__ == "__main__":
    main()
    sys.exit(0)
