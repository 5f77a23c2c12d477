"""Where one rank's CPU time goes in a compressed allreduce: the four CPU kernel passes of one call
(ONEBIT_SPEC.md a.2), timed one by one on one thread, next to a STREAM-like ``a += b`` floor
measured in the same run.

Passes, for ``--count`` fp32 elements at world size ``--world`` (chunk = count / world):

- worker pass (``worker_scale_pack``): reads m and e (8 bytes per element);
- server pass (``server_scale_pack``): W sign chunks and the server error (chunk elements);
- server update (``server_update``, part of the commit): reads and writes the server error;
- worker commit (``worker_update_decompress``): reads m and e, writes e and m (16 bytes).

The sum of the four is the compute one rank needs per call; W ranks sharing C cores need at
least W * sum / C of wall time per call for it, whatever the wire does (issue 12's eth1g target:
W = 4 on 2 cores). Times are medians of ``--repeats`` rounds, the rows timed in turn.

Run: python bench/bench_cpu_phases.py [--count 16777216] [--world 4] [--repeats 9]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable, Dict, List

import torch

from compcomm import _C
from compcomm._buffers import buffer_of as B

K = _C.kernels


def passes(count: int, world: int) -> Dict[str, tuple]:
    """name -> (callable, bytes per call) for the four passes on random data."""
    chunk = count // world
    g = torch.Generator().manual_seed(0)
    m, e = torch.randn(count, generator=g), torch.randn(count, generator=g) * 0.1
    scale, ws = torch.ones(1), torch.zeros(1, dtype=torch.uint8)
    signs = torch.zeros(count // 8, dtype=torch.uint8)
    all_signs = torch.randint(0, 256, (count // 8,), dtype=torch.uint8, generator=g)
    scales = torch.rand(world, generator=g) + 0.5
    serr = torch.randn(chunk, generator=g) * 0.01
    tau, packed = torch.ones(1), torch.zeros(chunk // 8, dtype=torch.uint8)
    out_scales = torch.rand(world, generator=g) + 0.5
    a, b = torch.ones(count), torch.full((count,), 1e-30)
    keep = (m, e, scale, ws, signs, all_signs, scales, serr, tau, packed, out_scales, a, b)
    return {
        "worker pass (worker_scale_pack)": (
            lambda: K.worker_scale_pack(B(m), B(e), B(scale), B(signs), B(ws)), 8 * count),
        "server pass (server_scale_pack)": (
            lambda: K.server_scale_pack(B(all_signs), B(scales), 1, world, B(serr), B(tau), B(packed),
                                        B(ws)), 4 * chunk + count // 8),
        "server update (server_update)": (
            lambda: K.server_update(B(all_signs), B(scales), 1, world, B(serr), B(tau)),
            8 * chunk + count // 8),
        "worker commit (worker_update_decompress)": (
            lambda: K.worker_update_decompress(B(m), B(e), B(scale), B(out_scales), 1, B(all_signs),
                                               chunk // 8, world), 16 * count),
        "floor: a += b (torch, one thread)": (lambda: (keep, a.add_(b)), 12 * count),
    }


def medians(rows: Dict[str, tuple], repeats: int) -> Dict[str, float]:
    for f, _ in rows.values():
        f()
    times: Dict[str, List[float]] = {k: [] for k in rows}
    for _ in range(repeats):
        for k, (f, _) in rows.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=2**24)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                    help="cores the W ranks share (for the per-call compute bound)")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args(argv)
    if args.count % (8 * args.world):
        ap.error("--count must be a multiple of 8 * --world")
    torch.set_num_threads(1)
    rows = passes(args.count, args.world)
    med = medians(rows, args.repeats)
    load = os.getloadavg()[0]
    print(f"count {args.count} fp32, W = {args.world}, one thread; load average {load:.2f}")
    print("\n| pass | median ms | bytes | GB/s |\n|---|---|---|---|")
    for k, (_, nbytes) in rows.items():
        print(f"| {k} | {med[k] * 1e3:.2f} | {nbytes / 2**20:.0f} MiB | {nbytes / med[k] / 1e9:.1f} |")
    call = sum(t for k, t in med.items() if not k.startswith("floor"))
    print(f"\n- compute of one rank per call: {call * 1e3:.1f} ms; {args.world} ranks on "
          f"{args.cores} cores: >= {call * args.world / args.cores * 1e3:.1f} ms of wall per call")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
