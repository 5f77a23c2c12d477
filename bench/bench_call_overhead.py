"""Host overhead of one small compressed_allreduce call, on the CPU (issue 12's latency work).

    python bench/bench_call_overhead.py [--numel 1024] [--out bench/results]

Three ways to make the same call on a LocalCommunicator, timed in one run (best of 7 repeats of
N calls each, microseconds per call):

* ``cached``: ``compcomm.compressed_allreduce`` as users call it (its validation cached per
  communicator and tensors after the first call);
* ``validated``: the same with the cache cleared before every call (every check and Buffer made
  again: the Python cost before the cache);
* ``core``: ``_C.compressed_allreduce`` on prebuilt Buffers (the C++ call alone, kernels included).

``cached - core`` is what the Python layer still costs per call; ``validated - cached`` what the
cache saves. Small ``numel`` keeps the kernels' share small. On a GPU the same Python layer runs in
front of the kernel launches (bench/bench_latency.py measures that path).
"""

from __future__ import annotations

import argparse
import os
import time
import timeit
from typing import List, Optional

import torch

import compcomm
from compcomm import _C, collectives
from compcomm._buffers import buffer_of
from bench_cpu_adam import cpu_model  # bench/ is on sys.path when this script runs


def per_call_us(fn, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=7)) / number * 1e6


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=1024)
    ap.add_argument("--number", type=int, default=2000)
    ap.add_argument("--out", default=None, help="write call_overhead_cpu.md here")
    args = ap.parse_args(argv)
    comm = _C.LocalCommunicator()
    t = torch.randn(args.numel)
    we, se = compcomm.error_buffers(t, group=comm)

    def cached() -> None:
        compcomm.compressed_allreduce(t, we, se, group=comm)

    def validated() -> None:
        collectives._prepared.clear()
        compcomm.compressed_allreduce(t, we, se, group=comm)

    cached()
    ws = collectives._workspaces[comm][t.device]
    bufs = [buffer_of(x) for x in (t, we, se, ws)]

    def core() -> None:
        _C.compressed_allreduce(comm, *bufs, 600.0, 0, True)

    res = {name: per_call_us(fn, args.number) for name, fn in
           (("cached", cached), ("validated", validated), ("core", core))}
    lines = [
        f"# Host overhead of one compressed_allreduce of {args.numel} fp32 (CPU, LocalCommunicator)",
        "",
        f"Command: `python bench/bench_call_overhead.py --numel {args.numel}`; "
        f"{cpu_model()} ({os.cpu_count()} cores, shared), torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Best of 7 x {args.number} calls.",
        "",
        "| cached us | validated us | core us | Python layer, cached | Python layer, validated |"
        " validated / cached |",
        "|---|---|---|---|---|---|",
        f"| {res['cached']:.2f} | {res['validated']:.2f} | {res['core']:.2f} | "
        f"{res['cached'] - res['core']:.2f} | {res['validated'] - res['core']:.2f} | "
        f"{res['validated'] / res['cached']:.2f}x |",
    ]
    md = "\n".join(lines) + "\n"
    print(md)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "call_overhead_cpu.md"), "w") as f:
            f.write(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
