"""MPI communicator benchmark (nccl-tests columns): all_reduce and compressed_allreduce over
compcomm's MPI communicator (CPU buffers; device buffers host-staged and CUDA-aware where
available) against the torch/gloo adapter, same ranks, same run.

Run (4 ranks)::

    mpirun --allow-run-as-root --oversubscribe -np 4 python bench/bench_mpi.py [--sizes 1K,1M,16M]

or through pytest (``pytest bench/bench_mpi.py --benchmark-only --benchmark-enable``), which
launches it with 2 ranks at small sizes.

``--compare`` times only compcomm's compressed_allreduce over ``compcomm.init("mpi",
cuda_aware=False)`` (host-staged when ``--device cuda``) and, when ``deepspeed`` is importable and
the tensors are on a GPU, DeepSpeed's ``MpiBackend(cuda_aware=False).compressed_allreduce`` on the
same tensors, interleaved call by call; it prints wall-time medians (each call's time is the
slowest rank's) and their ratio. DeepSpeed's backend needs cupy and CUDA tensors, so on CPU only
the compcomm column is printed::

    mpirun --allow-run-as-root --oversubscribe -np 2 python bench/bench_mpi.py --compare \
        --device cuda --sizes 256K..256M      # 2^16..2^26 fp32 elements

On emulated hosts over Ethernet-like links (root, iproute2; see compcomm.bench.netns), ``--profile``
starts ``--world-size`` ranks of this script under one mpirun, each in its own network namespace
with a shaped veth, MPI over TCP on those links only (no shared memory); with ``--device cuda``
they share the local GPU(s), host-staged::

    python bench/bench_mpi.py --compare --device cuda --profile eth10g --world-size 4 \
        --sizes 256K..256M

Columns: size (logical bytes of the fp32 tensor), count, dtype, time (us, mean over iterations,
rank 0 decides the count and broadcasts it), algbw = size/time, busbw = algbw * 2(W-1)/W (both
logical bytes: the compressed path sends ~32x fewer wire bytes, see ``wire``), #wrong (first
iteration checked against numpy for all_reduce; MPI vs gloo equality for compressed).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List

import numpy as np
import torch


def timeit(fn, comm, min_time: float = 0.3, max_iters: int = 50) -> float:
    from compcomm._buffers import buffer_of

    fn()  # warm-up
    t0 = time.perf_counter()
    fn()
    one = time.perf_counter() - t0
    n = torch.tensor([max(1, min(max_iters, int(min_time / max(one, 1e-6))))], dtype=torch.int64)
    comm.broadcast(buffer_of(n), 0)  # rank 0 decides
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(int(n)):
        fn()
    return (time.perf_counter() - t0) / int(n)


def deepspeed_backend(device: str):
    """DeepSpeed 0.19.x's host-staged MpiBackend, or None (not importable, or CPU tensors: its
    compression runs in cupy)."""
    if device == "cpu":
        return None
    try:
        from deepspeed.runtime.comm.mpi import MpiBackend
    except ImportError:
        return None
    return MpiBackend(cuda_aware=False)


def compare(comm, sizes, device: str, iters: int) -> None:
    """compcomm vs DeepSpeed compressed_allreduce, same tensors, interleaved, medians of the
    slowest rank's wall time per call."""
    import compcomm
    from compcomm._buffers import buffer_of

    rank, W = comm.rank(), comm.size()
    ds = deepspeed_backend(device)
    try:
        from mpi4py import MPI

        world = MPI.COMM_WORLD
    except ImportError:
        world = None
    cuda = device != "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    local_rank = torch.cuda.current_device() if cuda else 0
    if rank == 0:
        where = os.environ.get("COMPCOMM_BENCH_PROFILE")
        if where:
            print(f"# emulated hosts: profile {where}, MPI over TCP on the ranks' links")
        print(f"# compressed_allreduce, {W} ranks, {device}, compcomm mpi cuda_aware=False vs "
              f"{'DeepSpeed MpiBackend(cuda_aware=False)' if ds else 'no DeepSpeed (not importable or CPU)'}"
              f", {iters} interleaved calls, median of the slowest rank")
        print("# exchange(ms): compcomm's communicator alone on the algorithm's wire exchange (all_to_all of")
        print("#   the signs, all_gather of the records) on host memory; blocking(ms): the same with mpi4py's")
        print("#   blocking Alltoall/Allgather, a floor for the MPI part")
        if cuda:
            print("# staged(ms): the exchange on device buffers (host-staged in 1 MiB pieces); whole(ms): "
                  "the compressed call and staged1(ms) that exchange with pipeline_chunk_bytes=0 (one piece)")
        print(f"# {'count':>10} {'size':>10} {'compcomm(ms)':>12} {'deepspeed(ms)':>13} {'ds/compcomm':>11} "
              f"{'exchange(ms)':>12} {'blocking(ms)':>12}"
              + (f" {'staged(ms)':>10} {'whole(ms)':>10} {'staged1(ms)':>11}" if cuda else ""))
    for size in sizes:
        n = size // 4
        g = torch.Generator().manual_seed(rank)
        m = torch.randn(n, generator=g).to(device)
        we, se = compcomm.error_buffers(n, comm, device=device)
        # DeepSpeed's own errors (its padding rule is the same one: ONEBIT_SPEC.md a.1)
        dwe, dse = torch.zeros_like(we), torch.zeros_like(se)
        dm = m.clone()

        def timed(fn) -> float:
            comm.barrier()
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            return time.perf_counter() - t0

        P = we.numel()
        chunk = P // W
        signs, signs_recv = np.zeros(P // 8, np.uint8), np.zeros(P // 8, np.uint8)
        rec = np.zeros(16 + -(-chunk // 128) * 16, np.uint8)
        recs = np.zeros(rec.size * W, np.uint8)

        def exchange() -> None:
            comm.all_to_all(buffer_of(torch.from_numpy(signs)), buffer_of(torch.from_numpy(signs_recv)))
            comm.all_gather(buffer_of(torch.from_numpy(rec)), buffer_of(torch.from_numpy(recs)))

        def blocking() -> None:
            world.Alltoall(signs, signs_recv)
            world.Allgather(rec, recs)

        dev_bufs = [buffer_of(torch.from_numpy(a).to(device)) for a in (signs, signs_recv, rec, recs)]

        def staged() -> None:
            comm.all_to_all(dev_bufs[0], dev_bufs[1])
            comm.all_gather(dev_bufs[2], dev_bufs[3])

        def one_piece(fn):
            def run() -> None:
                chunk_bytes, comm.pipeline_chunk_bytes = comm.pipeline_chunk_bytes, 0
                try:
                    fn()
                finally:
                    comm.pipeline_chunk_bytes = chunk_bytes
            return run

        ours, theirs, xch, floor, stg, whole, stg1 = [], [], [], [], [], [], []
        for i in range(iters + 1):  # the first of each is a warm-up
            ours.append(timed(lambda: compcomm.compressed_allreduce(m, we, se, comm)))
            if ds is not None:
                theirs.append(timed(lambda: ds.compressed_allreduce(dm, dwe, dse, local_rank)))
            xch.append(timed(exchange))
            floor.append(timed(blocking) if world is not None else 0.0)
            if cuda:
                stg.append(timed(staged))
                whole.append(timed(one_piece(lambda: compcomm.compressed_allreduce(m, we, se, comm))))
                stg1.append(timed(one_piece(staged)))
        cols = [ours, theirs or [0.0] * (iters + 1), xch, floor] + ([stg, whole, stg1] if cuda else [])
        t = torch.tensor([c[1:] for c in cols], dtype=torch.float64)
        comm.all_reduce(buffer_of(t), compcomm._C.ReduceOp.max)
        a, b, x, c, *more = (float(v) for v in t.median(dim=1).values)
        if rank == 0:
            ratio = f"{b / a:>11.2f}" if ds is not None else f"{'-':>11}"
            dcol = f"{b * 1e3:>13.3f}" if ds is not None else f"{'-':>13}"
            ccol = f"{c * 1e3:>12.3f}" if world is not None else f"{'-':>12}"
            extra = "".join(f" {v * 1e3:>{w}.3f}" for v, w in zip(more, (10, 10, 11)))
            print(f"  {n:>10} {size:>10} {a * 1e3:>12.3f} {dcol} {ratio} {x * 1e3:>12.3f} {ccol}{extra}",
                  flush=True)


def launch(args: argparse.Namespace, argv: List[str]) -> int:
    """``--profile``: this script as ``--world-size`` ranks under mpirun on emulated hosts."""
    from compcomm.bench.netns import NetnsError
    from compcomm.bench.runner import SweepError, run_on_profile

    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    env = {"COMPCOMM_BENCH_PROFILE": args.profile, "PYTHONUNBUFFERED": "1"}
    try:
        run_on_profile(args.profile, args.world_size, [os.path.abspath(__file__), *argv],
                       timeout=args.timeout, gpus=gpus, env=env, launcher="mpirun",
                       on_line=lambda line: print(line, end="", flush=True))
    except (SweepError, NetnsError) as e:
        print(f"bench_mpi: {args.profile} W={args.world_size} failed: {e}", file=sys.stderr)
        return 1
    return 0


def main() -> None:
    import torch.distributed as dist

    import compcomm
    import compcomm.testing
    from compcomm._buffers import buffer_of
    from compcomm.bench.cli import parse_sizes

    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4K,256K,4M,32M", help="bytes: 4K,1M, 2^12..2^20")
    ap.add_argument("--compare", action="store_true",
                    help="only compressed_allreduce, compcomm vs DeepSpeed's MpiBackend when importable")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="--compare: tensor device")
    ap.add_argument("--iters", type=int, default=20, help="--compare: timed calls per size and library")
    ap.add_argument("--profile", default=None,
                    help="start --world-size ranks under mpirun on this compcomm.bench.netns "
                         "profile "
                         "(eth1g, eth10g, eth25g, unshaped: root; loopback)")
    ap.add_argument("--world-size", type=int, default=2, help="ranks for --profile")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds for a --profile run")
    args = ap.parse_args()
    if args.profile and "COMPCOMM_BENCH_PROFILE" not in os.environ:
        sys.exit(launch(args, sys.argv[1:]))
    try:
        sizes = parse_sizes(args.sizes)
    except ValueError as e:
        ap.error(str(e))
    comm = compcomm.init("mpi", cuda_aware=False)
    rank, W = comm.rank(), comm.size()
    if args.compare:
        if args.device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        compare(comm, sizes, args.device, args.iters)
        compcomm.shutdown()
        return
    port = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        port[0] = compcomm.testing.free_port()
    comm.broadcast(buffer_of(port), 0)
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")  # --profile: rank 0's address on its link
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{int(port)}", rank=rank,
                            world_size=W)
    gloo = compcomm.TorchCommunicator()
    paths = [("mpi-cpu", comm, "cpu"), ("gloo-cpu", gloo, "cpu")]
    if torch.cuda.is_available() and compcomm._C.mpi_cuda_built():
        dev = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(dev)
        paths.append(("mpi-staged", comm, dev))
        if compcomm._C.mpi_reports_cuda_support():
            paths.append(("mpi-cuda-aware", compcomm.make_communicator("mpi", cuda_aware=True), dev))
    if rank == 0:
        print(f"# compcomm MPI bench: {W} ranks, {compcomm._C.mpi_library_version()}")
        print(f"# {'path':>15} {'op':>11} {'size':>10} {'count':>9} {'dtype':>6} {'time(us)':>10} "
              f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'wire(B)':>10} {'#wrong':>6}")
    for size in sizes:
        count = size // 4
        for name, c, dev in paths:
            # plain all_reduce (sum), first iteration checked
            x = torch.full((count,), float(rank + 1), device=dev)
            c.all_reduce(buffer_of(x), timeout_s=600, stream=0)
            if dev != "cpu":
                torch.cuda.synchronize()
            wrong = int((x.cpu() != W * (W + 1) / 2).sum())
            sync = (lambda: torch.cuda.synchronize()) if dev != "cpu" else (lambda: None)
            t = timeit(lambda: (c.all_reduce(buffer_of(x), timeout_s=600), sync()), comm)
            rows = [("all_reduce", t, 2 * size * (W - 1) // W, wrong)]
            if dev == "cpu":  # compressed allreduce (CPU kernels; GPU kernels are another issue's)
                g = torch.Generator().manual_seed(rank)
                m = torch.randn(count, generator=g)
                we, se = compcomm.error_buffers(count, c)
                t = timeit(lambda: compcomm.compressed_allreduce(m, we, se, c), comm)
                rows.append(("compressed", t, compcomm.wire_bytes(count, W), 0))
            for op, t, wire, wrong in rows:
                alg = size / t / 1e9
                if rank == 0:
                    print(f"  {name:>15} {op:>11} {size:>10} {count:>9} {'fp32':>6} {t * 1e6:>10.1f} "
                          f"{alg:>11.3f} {alg * 2 * (W - 1) / W:>11.3f} {wire:>10} {wrong:>6}", flush=True)
    # compressed over MPI == over gloo (first-iteration check of the compressed rows)
    n = 1 << 16
    m1 = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    m2 = m1.clone()
    a, b = compcomm.error_buffers(n, comm), compcomm.error_buffers(n, gloo)
    compcomm.compressed_allreduce(m1, *a, comm)
    compcomm.compressed_allreduce(m2, *b, gloo)
    if rank == 0:
        print(f"# compressed MPI vs gloo #wrong: {int((m1 != m2).sum())}")
    dist.destroy_process_group()
    compcomm.shutdown()


def test_bench_mpi(benchmark) -> None:
    """pytest-benchmark entry: runs the script under mpirun with 2 ranks at small sizes."""
    import shutil
    import subprocess

    import pytest

    import compcomm
    from compcomm.testing import mpirun_command

    if shutil.which("mpirun") is None or not compcomm.build_info()["mpi"]:
        pytest.skip("needs mpirun and compcomm built with MPI")
    cmd = mpirun_command(2, os.path.abspath(__file__), "--sizes", "4K,1M")

    def run() -> str:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    text = benchmark.pedantic(run, rounds=1, iterations=1)
    print(text)
    assert "compressed MPI vs gloo #wrong: 0" in text


if __name__ == "__main__":
    main()
    sys.exit(0)
