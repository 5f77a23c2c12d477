"""Where a 1-bit optimizer's GPU step goes: the step's wall time (CUDA events, median) against the
time its kernels keep the GPU busy (torch.profiler), per kernel, on the shapes of
bench_fused_optim.py (GPT-style, 121M fp32 parameters in 148 tensors), at W=1 in the compressed
phase. What the kernels do not cover is the host: Python before the first launch and after the
host syncs (OneBitLamb: between the statistics' sync and the apply pass). Each step is timed twice:
synchronised after every step (the host's whole time shows), and back to back (as in training,
where the host's work before the first launch overlaps the GPU's previous work), both against the
floor of one pass over p, m, v and the gradient (32 bytes a parameter at this run's copy
bandwidth).

Run: python bench/profile_optim_gpu.py [--steps 5] [--trace-dir DIR] [--host-profile N]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import sys
from typing import Dict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fused_optim import copy_bandwidth, gpt_shapes, timed  # noqa: E402


def short(name: str) -> str:
    """A kernel's name without namespaces, template and function arguments."""
    name = name.replace("(anonymous namespace)::", "").split("<")[0].split("(")[0]
    return name.split("::")[-1].removeprefix("void ")


def kernel_split(prof, steps: int) -> Dict[str, float]:
    """Microseconds per step of each kernel (and memcpy) name, from the profiler's events."""
    out: Dict[str, float] = collections.Counter()
    for e in prof.events():
        # the GPU side of the profiler's own ranges ("Optimizer.step#...") is not a kernel
        if e.device_type == torch.autograd.DeviceType.CUDA and "#" not in e.name:
            out[short(e.name)] += e.time_range.elapsed_us() / steps
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5, help="profiled steps")
    ap.add_argument("--iters", type=int, default=20, help="timed steps (median)")
    ap.add_argument("--trace-dir", default=None, help="write chrome traces here")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="also print the N functions with the most host time (cProfile, "
                         "synchronised steps)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    from torch.profiler import ProfilerActivity, profile
    from compcomm.optim import OneBitAdam, OneBitLamb

    torch.manual_seed(0)
    dev = torch.device("cuda")
    params = [torch.nn.Parameter(torch.randn(s, device=dev) * 0.02) for s in gpt_shapes()]
    for p in params:
        p.grad = torch.randn_like(p) * 0.01
    print(f"{torch.cuda.get_device_name(dev)}, {sum(p.numel() for p in params) / 1e6:.1f}M "
          f"parameters in {len(params)} tensors, torch {torch.__version__}")
    floor = sum(p.numel() for p in params) * 32 / copy_bandwidth(args.iters) * 1e3
    print(f"floor (32 bytes a parameter at this run's copy bandwidth): {floor:.3f} ms")
    for cls in (OneBitAdam, OneBitLamb):
        opt = cls(params, lr=1e-4, freeze_step=1, weight_decay=0.01)
        opt.step()  # the warm-up step; every later one is compressed
        wall = timed(opt.step, args.iters)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(args.iters):
            opt.step()
        b.record()
        b.synchronize()
        b2b = a.elapsed_time(b) / args.iters
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                opt.step()
            torch.cuda.synchronize()
        split = kernel_split(prof, args.steps)
        busy = sum(split.values())
        print(f"\n{cls.__name__}.step: {wall:.3f} ms wall ({wall / floor:.2f}x the floor), "
              f"{b2b:.3f} ms back to back ({b2b / floor:.2f}x), kernels {busy / 1e3:.3f} ms "
              f"({busy / 1e3 / wall:.0%} of the wall)")
        for name, us in sorted(split.items(), key=lambda kv: -kv[1])[:6]:
            print(f"  {us / 1e3:8.3f} ms  {name}")
        if args.host_profile:
            prof_host = cProfile.Profile()
            prof_host.enable()
            for _ in range(args.iters):
                opt.step()
                torch.cuda.synchronize()
            prof_host.disable()
            pstats.Stats(prof_host).sort_stats("tottime").print_stats(args.host_profile)
        if args.trace_dir:
            os.makedirs(args.trace_dir, exist_ok=True)
            prof.export_chrome_trace(os.path.join(args.trace_dir, f"{cls.__name__}.json"))
        del opt
    return 0


if __name__ == "__main__":
    sys.exit(main())
