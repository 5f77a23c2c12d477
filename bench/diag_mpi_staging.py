"""Where does compcomm's host-staged MPI all_to_all lose time on a slow link? (GPU, root)

    python bench/diag_mpi_staging.py --profile eth1g --world-size 2 --bytes 8388608 [--call pair]

starts ``--world-size`` ranks under mpirun on emulated hosts sharing the local GPU (compcomm.bench
runner, MPI over TCP on the ranks' shaped links) and times, on each rank, the same all_to_all of
``--bytes`` through compcomm's MPI communicator with its buffers as: plain host memory, pinned host
memory (``host pinned``), device memory staged by hand around the pinned exchange (copy to the
host, wait, exchange, copy back: ``manual staging``), device memory staged by compcomm (``staged``,
on the default and on a side stream, in 1 MiB pieces and in one). Median and minimum of 6 calls,
slowest rank, two rounds. Results: bench/results/mpi_links_gpu_1207/README.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def rank_main(nbytes: int, call: str) -> None:
    import compcomm
    from compcomm._buffers import buffer_of

    comm = compcomm.init("mpi", cuda_aware=False)
    sync = torch.cuda.synchronize
    side = torch.cuda.Stream()
    a = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.zeros_like(a)
    h, hb = torch.zeros(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    pa, pb = h.pin_memory(), hb.pin_memory()

    def one_piece(fn):
        def run() -> None:
            chunk, comm.pipeline_chunk_bytes = comm.pipeline_chunk_bytes, 0
            try:
                fn()
            finally:
                comm.pipeline_chunk_bytes = chunk
        return run

    W = comm.size()

    def op(send: torch.Tensor, recv: torch.Tensor, **kw) -> None:
        """``call`` on (send, recv) of nbytes each; all_gather sends the first nbytes/W."""
        if call in ("all_to_all", "pair"):
            comm.all_to_all(buffer_of(send), buffer_of(recv), **kw)
        if call in ("all_gather", "pair"):
            part = nbytes // W
            comm.all_gather(buffer_of(send[:part]), buffer_of(recv[: part * W]), **kw)

    def manual() -> None:
        pa.copy_(a, non_blocking=True)
        sync()
        op(pa, pb)
        b.copy_(pb, non_blocking=True)

    def staged() -> None:
        op(a, b)

    cases = [
        ("host", lambda: op(h, hb)),
        ("host pinned", lambda: op(pa, pb)),
        ("manual staging", manual),
        ("staged", staged),
        ("staged side stream", lambda: op(a, b, stream=side.cuda_stream)),
        ("staged one piece", one_piece(staged)),
    ]
    rows = []
    for _ in range(2):
        for name, fn in cases:
            ts = []
            for _ in range(7):  # the first is a warm-up
                comm.barrier()
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                ts.append(time.perf_counter() - t0)
            t = torch.tensor(ts[1:], dtype=torch.float64)
            comm.all_reduce(buffer_of(t), compcomm._C.ReduceOp.max)
            rows.append((name, float(t.median()) * 1e3, float(t.min()) * 1e3))
    if comm.rank() == 0:
        print(f"# {call} of {nbytes} bytes, {comm.size()} ranks, "
              f"{os.environ.get('COMPCOMM_BENCH_PROFILE', '?')}; ms, slowest rank", flush=True)
        for name, med, low in rows:
            print(f"{name:>20}  median {med:9.3f}  min {low:9.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="eth1g")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--bytes", type=int, default=8 << 20)
    ap.add_argument("--timeout", type=float, default=200.0)
    ap.add_argument("--call", choices=["all_to_all", "all_gather", "pair"], default="all_to_all",
                    help="pair: all_to_all then all_gather of nbytes/W, as bench_mpi.py's exchange")
    args = ap.parse_args()
    if "OMPI_COMM_WORLD_RANK" in os.environ:
        rank_main(args.bytes, args.call)
        return
    from compcomm.bench.runner import run_on_profile

    run_on_profile(args.profile, args.world_size, [os.path.abspath(__file__), *sys.argv[1:]],
                   timeout=args.timeout, gpus=1, launcher="mpirun",
                   env={"COMPCOMM_BENCH_PROFILE": args.profile},
                   on_line=lambda line: print(line, end="", flush=True))


if __name__ == "__main__":
    main()
