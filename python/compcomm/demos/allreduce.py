"""``compcomm-demo allreduce``: W CPU ranks compress and all-reduce a large tensor.

Prints, per rank count, the bytes each rank sent against a plain fp32 ring allreduce, the relative
error of the 1-bit result against the exact mean (one call, and the running mean over several calls,
which error feedback drives to the exact mean), and the time of both collectives.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import List, Optional

import torch
import torch.distributed as dist

import compcomm
from compcomm.testing import run_ranks


def _rank(rank: int, world: int, numel: int, calls: int) -> dict:
    torch.manual_seed(1234 + rank)
    x = torch.randn(numel) + 0.1 * rank
    exact = x.clone()
    dist.all_reduce(exact)
    exact /= world
    comm = compcomm.get_communicator(None)
    we, se = compcomm.error_buffers(x)

    plain_times = []  # a median of as many calls as the compressed one's (at most 3)
    for _ in range(min(calls, 3)):
        plain = x.clone()
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(plain)
        plain_times.append(time.perf_counter() - start)

    running = torch.zeros(numel, dtype=torch.float64)
    times, first_err = [], None
    for k in range(calls):
        t = x.clone()
        comm.reset_bytes_sent()
        dist.barrier()
        start = time.perf_counter()
        compcomm.compressed_allreduce(t, we, se)
        times.append(time.perf_counter() - start)
        running += t
        if k == 0:
            first_err = float((t - exact).norm() / exact.norm())
    return {
        "bytes_sent": comm.bytes_sent,
        "plain_bytes": compcomm.allreduce_wire_bytes(numel, world),
        "compressed_s": sorted(times)[len(times) // 2],
        "plain_s": sorted(plain_times)[len(plain_times) // 2],
        "rel_err_one_call": first_err,
        "rel_err_running_mean": float((running / calls - exact).norm() / exact.norm()),
    }


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="compcomm-demo allreduce", description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=4, help="ranks (processes) to spawn")
    p.add_argument("--numel", type=int, default=2**24, help="elements of the fp32 tensor (default 64 MiB)")
    p.add_argument("--calls", type=int, default=10, help="compressed calls (errors carried)")
    p.add_argument("--json", help="also write the results to this file")
    a = p.parse_args(argv)
    for flag, least in (("world_size", 2), ("numel", 1), ("calls", 1)):
        if getattr(a, flag) < least:
            p.error(f"argument --{flag.replace('_', '-')}: must be >= {least}, "
                    f"got {getattr(a, flag)}")
    r = run_ranks(a.world_size, _rank, a.numel, a.calls, timeout=1800)[0]
    mib = a.numel * 4 / 2**20
    print(f"compcomm {compcomm.__version__}: {a.world_size} CPU ranks (gloo), {a.numel} fp32 elements ({mib:.0f} MiB)")
    print(f"  bytes sent per rank   compressed {r['bytes_sent']:>12,d}   plain fp32 allreduce {r['plain_bytes']:>12,d}"
          f"   ({r['plain_bytes'] / max(r['bytes_sent'], 1):.1f}x fewer)")
    print(f"  time per call         compressed {r['compressed_s'] * 1e3:9.1f} ms   plain fp32 allreduce "
          f"{r['plain_s'] * 1e3:9.1f} ms   (loopback: no network limit)")
    print(f"  relative error        one call {r['rel_err_one_call']:.3f}   mean of {a.calls} calls "
          f"{r['rel_err_running_mean']:.3f}  (error feedback)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"world_size": a.world_size, "numel": a.numel, **r}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
