"""Run under mpirun with 1-3 ranks sharing the GPU (compcomm's host-staged MPI communicator): issue
19's batched exchange and packed momentum on CUDA tensors.

1. compressed_allreduce_exchange_many on CUDA buffers equals per-bucket compressed_allreduce bit for
   bit (tensors, error buffers, bytes; three rounds, mixed dtypes), OneBitCompressor batched equals
   per bucket, bad inputs / a NaN on one rank / a size mismatch raise typed errors with nothing
   changed (the CPU test's body, tests/_compressed_batched_cases.py, on device="cuda").
2. OneBitCompressor.packed_average on CUDA: the handed-back signs and scales unpack (torch-op path)
   to the averaged buckets bit for bit.
3. ZeroOptimizer stage 2 + OneBitAdam, "exact" and "no_allgather", on CUDA parameters equals the
   same run on CPU parameters (tolerance as check_zero_gpu.py's 1-bit cases), and the replicated
   momentum is held packed on the GPU.
Prints "RANK r OK". COMPCOMM_CHECK_CPU=1 runs the same on CPU tensors (a dry run of the script)."""

from __future__ import annotations

import os
import sys

import torch

import compcomm
from compcomm.optim import OneBitAdam
from compcomm.zero import ZeroOptimizer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import _compressed_batched_cases as bc  # noqa: E402
import _zero_packed_cases as pc  # noqa: E402

STEPS = 8


def zero_run(dev, mode, rank, comm):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 32), torch.nn.Tanh(), torch.nn.Linear(32, 5))
    model = model.to(dev)
    z = ZeroOptimizer(model.parameters(), OneBitAdam, stage=2, process_group=comm, module=model,
                      optimizer_kwargs={"lr": 1e-2, "freeze_step": 2}, reduce_bucket_size=200,
                      onebit_mode=mode, gradient_clipping=5.0)
    out = []
    for t in range(1, STEPS + 1):
        g = torch.Generator().manual_seed(1000 * t + rank)
        x, y = torch.randn(16, 13, generator=g), torch.randn(16, 5, generator=g)
        torch.nn.functional.mse_loss(model(x.to(dev)), y.to(dev)).backward()
        z.step()
        out.append(torch.cat([p.detach().float().cpu().reshape(-1) for p in model.parameters()]))
    rep = z._replicated
    packed = [rep.packed.get(k)[0].device.type for k in rep.packed.keys()]
    z.close()
    return out, packed


def main() -> None:
    comm = compcomm.init("mpi", cuda_aware=False)
    rank, world = comm.rank(), comm.size()
    if os.environ.get("COMPCOMM_CHECK_CPU"):
        dev = torch.device("cpu")
    else:
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)

    got = bc.rank_body(rank, world, dev.type)
    # the per-bucket bytes, and 32 to each peer: the call-count record exchanged first
    assert got["same"] == [True] * 3 and all(a + 32 * (world - 1) == b for a, b in got["bytes"]), got
    assert got["compressor_same"] and got["after_failures_same"], got
    f = got["fails"]
    assert f["short_lists"][0] == f["small_staging"][0] == f["bad_error_size"][0] == "ValueError", f
    if world > 1:
        assert f["nonfinite"][0] == "NonFiniteError" and f["mismatch"][0] == "RankMismatchError", f
        assert f["count_mismatch"][0] == f["no_calls"][0] == "RankMismatchError", f
    assert all(v for k, v in f.items() if k.endswith("_unchanged")), f
    print(f"RANK {rank} batched exchange on {dev.type}: equal to per-bucket calls, errors typed",
          flush=True)

    got = pc.packed_average(rank, world, dev.type)
    if world > 1:
        assert got["exact"] and all(got["exact"]) and all(got["repack"]), got
    print(f"RANK {rank} packed_average on {dev.type}: exact ({len(got['exact'])} buckets)",
          flush=True)

    for mode in ("exact", "no_allgather"):
        cpu, _ = zero_run(torch.device("cpu"), mode, rank, comm)
        gpu, packed = zero_run(dev, mode, rank, comm)
        worst = max((a - b).abs().max().item() for a, b in zip(cpu, gpu))
        moved = (cpu[-1] - cpu[0]).abs().max().item()
        assert worst <= 1e-3 < moved / 2, (
            f"[rank {rank}] {mode}: |{dev.type} - cpu| = {worst}, moved {moved}")
        assert world == 1 or (packed and all(d == dev.type for d in packed)), packed
        print(f"RANK {rank} ZeRO-2 OneBitAdam {mode} on {dev.type}: max |{dev.type} - cpu| = "
              f"{worst:.3g} over {STEPS} steps, {len(packed)} packed buckets on {dev.type}",
              flush=True)
    compcomm.shutdown()
    print(f"RANK {rank} OK", flush=True)


if __name__ == "__main__":
    main()
    sys.exit(0)
