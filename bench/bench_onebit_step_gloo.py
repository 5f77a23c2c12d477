"""OneBitAdam's compressed-phase step over gloo on the CPU (W ranks on this machine, no shaping):
the whole ``step()`` (momentum, compressed exchange, update), median of ``--repeats`` steps, the
slowest rank's, as now and as before the C++ momentum pass (``_before``: the torch ops it
replaced, same bits; the compressed phase has no separate finiteness pass at W > 1), runs in turn;
with "now", the CPU time per step of each rank (all its threads) and that of the bare
``compcomm.compressed_allreduce`` of one tensor of the same size (what the exchange costs without
the optimizer's staging and update). ``--split`` adds each
rank's CPU time per step in the step's parts (the momentum staged for the exchange, the exchange,
its commit, the update; means per step, where the whole step is a median), measured by wrapping
the functions that do them (W > 1: one rank's step has no exchange).

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


def _before() -> None:
    """This process stages the compressed phase's momentum as before the C++ pass (same bits):
    torch ops per tensor instead of ``cpu_multi.onebit_momentums_``."""
    from compcomm.optim import cpu_multi
    from compcomm.optim import functional as F

    def momentums(ms, gs, group, outs, num_threads=None, check=True):
        F.onebit_momentum_multi(ms, gs, group, outs)

    cpu_multi.onebit_momentums_ = momentums


def _timed(fn, repeats: int):
    """Medians of (wall, process CPU) seconds over `repeats` calls."""
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def _split(repeats: int):
    """Wraps the parts of the compressed step with CPU-time counters; returns the totals' dict."""
    import functools

    import compcomm.compress as cc
    from compcomm import _C
    from compcomm.optim import cpu_multi

    acc: dict = {}

    def wrap(owner, name, label):
        f = getattr(owner, name)

        @functools.wraps(f)
        def timed(*a, **k):
            c0 = time.process_time()
            try:
                return f(*a, **k)
            finally:
                acc[label] = acc.get(label, 0.0) + (time.process_time() - c0) / repeats

        setattr(owner, name, timed)

    wrap(cpu_multi, "onebit_momentums_", "stage")
    wrap(_C.zero, "compressed_allreduce_commit_many", "commit")
    wrap(cc.OneBitCompressor, "average_", "average")
    wrap(cpu_multi, "onebit_compressed_steps_", "update")
    return acc


def _rank(rank: int, world: int, numel: int, tensors: int, repeats: int, before: bool,
          split: bool = False):
    import compcomm
    from compcomm.optim import OneBitAdam

    if before:
        _before()
    parts = _split(repeats) if split and not before and world > 1 else None

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(rank)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in _sizes(numel, tensors)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    opt = OneBitAdam(params, lr=1e-3, freeze_step=1, weight_decay=0.01)
    opt.step()  # warm-up (full precision)
    opt.step()  # first compressed step: allocates the buckets and workspaces
    if parts is not None:
        parts.clear()
    wall, cpu = _timed(opt.step, repeats)
    if parts is not None:  # the exchange is what the average does besides staging and commit
        parts = dict(parts, exchange=parts.pop("average") - parts["stage"] - parts["commit"])
    if before:  # the bare call does not depend on the staging: timed with "now" only
        return wall, cpu, None, parts
    t = torch.randn(numel, generator=gen)
    we, se = compcomm.error_buffers(t)
    compcomm.compressed_allreduce(t, we, se)
    _, bare_cpu = _timed(lambda: compcomm.compressed_allreduce(t, we, se), repeats)
    return wall, cpu, bare_cpu, parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--numel", type=int, default=8_400_000)
    ap.add_argument("--tensors", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=2, help="before/after pairs, in turn")
    ap.add_argument("--split", action="store_true",
                    help="also each rank's CPU time per step in the step's parts (now only)")
    args = ap.parse_args()
    import compcomm
    from compcomm.testing import run_ranks

    print(f"compcomm from {os.path.dirname(compcomm.__file__)}; load average {os.getloadavg()}")
    for w in args.world:
        for r in range(args.rounds):
            got = {}
            for before in (True, False):
                meds = run_ranks(w, _rank, args.numel, args.tensors, args.repeats, before,
                                 args.split, timeout=600)
                got[before] = max(m[0] for m in meds)
            cpu = [m[1] * 1e3 for m in meds]  # of the last launch: "now"
            bare = [m[2] * 1e3 for m in meds]
            print(f"W={w} round {r + 1}: OneBitAdam.step (compressed phase, {args.numel} params in "
                  f"{args.tensors} tensors, 1 thread per rank, slowest rank's median): "
                  f"before {got[True] * 1e3:.1f} ms, now {got[False] * 1e3:.1f} ms, "
                  f"{got[True] / got[False]:.2f}x; now per rank {min(cpu):.1f}-{max(cpu):.1f} ms "
                  f"of CPU a step, the bare compressed allreduce {min(bare):.1f}-{max(bare):.1f}; "
                  f"load {os.getloadavg()[0]:.1f}")
            for rank, m in enumerate(meds if args.split and w > 1 else []):
                print(f"  rank {rank} CPU ms per step (means): " + ", ".join(
                    f"{k} {v * 1e3:.1f}" for k, v in m[3].items()))


if __name__ == "__main__":
    main()
