"""OneBitAdam's compressed-phase step over gloo on the CPU (W ranks on this machine, no shaping):
the whole ``step()`` (momentum, compressed exchange, update), median of ``--repeats`` steps, the
slowest rank's. For before/after comparisons run it with two installs of compcomm in turn.

Run: python bench/bench_onebit_step_gloo.py --world 2 3 --repeats 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import List

import torch


def _sizes(total: int, count: int) -> List[int]:  # bench_cpu_adam's list workload
    weights = [((i % 4) + 1) * (16 if i % 8 == 0 else 1) for i in range(count)]
    scale = total / sum(weights)
    sizes = [max(1, int(w * scale)) for w in weights]
    sizes[0] += total - sum(sizes)
    return sizes


def _rank(rank: int, world: int, numel: int, tensors: int, repeats: int) -> float:
    from compcomm.optim import OneBitAdam

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(rank)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in _sizes(numel, tensors)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    opt = OneBitAdam(params, lr=1e-3, freeze_step=1, weight_decay=0.01)
    opt.step()  # warm-up (full precision)
    opt.step()  # first compressed step: allocates the buckets and workspaces
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--numel", type=int, default=8_400_000)
    ap.add_argument("--tensors", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    import compcomm
    from compcomm.testing import run_ranks

    print(f"compcomm from {os.path.dirname(compcomm.__file__)}; load average {os.getloadavg()}")
    for w in args.world:
        meds = run_ranks(w, _rank, args.numel, args.tensors, args.repeats, timeout=600)
        print(f"W={w}: OneBitAdam.step (compressed phase, {args.numel} params in {args.tensors} "
              f"tensors, 1 thread per rank): {max(meds) * 1e3:.1f} ms (slowest rank's median)")


if __name__ == "__main__":
    main()
