"""CPU optimizer step: compcomm's C++ kernels against torch's AdamW, same data, same run.

Two workloads (issues 17 and 12):

- ``flat``: one fp32 tensor of ``--numel`` parameters (default 2^26) at ``--threads`` threads;
- ``list``: ``--tensors`` fp32 tensors (default 100) totalling ``--list-numel`` parameters (default
  8.4M) at one thread (the 1-bit optimizers' per-parameter step on one core).

For each: ``torch.optim.AdamW`` (foreach=True, and fused=True when torch supports it on the CPU),
:class:`compcomm.optim.CPUAdam`, and the 1-bit Adam compressed-phase update (``m = averaged``,
frozen variance, weight decay) through the torch ops of ``compcomm.optim.functional`` and through
the kernel ``onebit_compressed_step_``. Times are medians of ``--repeats`` steps after one warm-up
step (which allocates the state). Ratios are against ``torch.optim.AdamW(foreach=True)`` measured in
the same run.

Run: python bench/bench_cpu_adam.py --json bench/results/cpu_adam_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch

from compcomm.optim import CPUAdam
from compcomm.optim import functional as F
from compcomm.optim.cpu_adam import kernel_isa, onebit_compressed_step_, torch_sqrt_mode

HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def median_time(step: Callable[[], None], repeats: int) -> float:
    step()  # warm-up: allocates the optimizer state
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_params(sizes: List[int], seed: int = 0) -> List[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = []
    for n in sizes:
        p = torch.nn.Parameter(torch.randn(n, generator=g))
        p.grad = torch.randn(n, generator=g) * 1e-2
        params.append(p)
    return params


def torch_adamw(params, **kw) -> Optional[Callable[[], None]]:
    try:
        opt = torch.optim.AdamW(params, **HP, **kw)
        opt.step()
    except (RuntimeError, ValueError, TypeError):
        return None  # e.g. fused=True not supported on the CPU by this torch
    return opt.step


def onebit_states(params):
    """The compressed phase's inputs: a warm variance, a momentum buffer, the averaged momentum."""
    g = torch.Generator().manual_seed(1)
    out = []
    for p in params:
        n = p.numel()
        out.append((p.data, torch.zeros(n), torch.rand(n, generator=g) * 1e-4,
                    torch.randn(n, generator=g) * 1e-3))
    return out


def bench_workload(name: str, sizes: List[int], threads: int, repeats: int) -> List[Dict]:
    torch.set_num_threads(threads)
    total = sum(sizes)
    rows = []

    def add(impl: str, t: Optional[float]) -> None:
        rows.append({"workload": name, "impl": impl, "numel": total, "tensors": len(sizes),
                     "threads": threads, "seconds": t,
                     "ns_per_param": None if t is None else t / total * 1e9})

    params = make_params(sizes)
    for impl, kw in (("torch AdamW foreach=True", dict(foreach=True)),
                     ("torch AdamW fused=True", dict(fused=True))):
        step = torch_adamw(params, **kw)
        add(impl, None if step is None else median_time(step, repeats))
        del step
    opt = CPUAdam(params, **HP)
    add("compcomm CPUAdam", median_time(opt.step, repeats))
    del opt

    group = dict(HP, bias_correction=True)
    states = onebit_states(params)

    def torch_rules() -> None:  # the 1-bit optimizers' compressed phase as torch ops
        for w, m, v, avg in states:
            m.copy_(avg)
            F.adam_step_(w, m, v, group, 200, 100)

    def kernel() -> None:
        for w, m, v, avg in states:
            onebit_compressed_step_(w, m, v, avg, group, 200, 100, num_threads=threads)

    add("1-bit compressed step, torch ops (functional.py)", median_time(torch_rules, repeats))
    add("1-bit compressed step, compcomm kernel", median_time(kernel, repeats))
    base = rows[0]["seconds"]
    for r in rows:
        r["x_vs_torch_foreach"] = None if r["seconds"] is None else base / r["seconds"]
    return rows


def list_sizes(total: int, count: int) -> List[int]:
    """``count`` tensor sizes of a transformer-like mix (a few large, many small) summing to
    ``total``."""
    weights = [((i % 4) + 1) * (16 if i % 8 == 0 else 1) for i in range(count)]
    scale = total / sum(weights)
    sizes = [max(1, int(w * scale)) for w in weights]
    sizes[0] += total - sum(sizes)
    return sizes


def markdown(rows: List[Dict], info: Dict) -> str:
    lines = [f"Machine: {info['cpu']}, {info['cores']} cores visible; torch {info['torch']}; "
             f"kernel path {info['isa']}, sqrt mode {info['sqrt']}, threading {info['threading']}.",
             "",
             "| workload | implementation | params | tensors | threads | median ms | ns/param "
             "| x vs torch AdamW foreach |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ms = "n/a" if r["seconds"] is None else f"{r['seconds'] * 1e3:.1f}"
        ns = "n/a" if r["ns_per_param"] is None else f"{r['ns_per_param']:.2f}"
        x = "n/a" if r["x_vs_torch_foreach"] is None else f"{r['x_vs_torch_foreach']:.2f}"
        lines.append(f"| {r['workload']} | {r['impl']} | {r['numel']} | {r['tensors']} | "
                     f"{r['threads']} | {ms} | {ns} | {x} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=2**26, help="flat workload size (default 2^26)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="threads of the flat workload (default: all cores)")
    ap.add_argument("--list-numel", type=int, default=8_400_000,
                    help="list workload size (default 8.4M)")
    ap.add_argument("--tensors", type=int, default=100, help="tensors of the list workload")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per row (median)")
    ap.add_argument("--skip", choices=["flat", "list"], action="append", default=[],
                    help="leave a workload out")
    ap.add_argument("--json", default=None, help="write the rows and the machine here")
    args = ap.parse_args(argv)

    info = {"cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
            "isa": kernel_isa(), "sqrt": torch_sqrt_mode(),
            "threading": __import__("compcomm")._C.optim.threading(),
            "command": "python bench/bench_cpu_adam.py " + " ".join(argv or [])}
    rows: List[Dict] = []
    if "flat" not in args.skip:
        rows += bench_workload("flat", [args.numel], args.threads, args.repeats)
    if "list" not in args.skip:
        rows += bench_workload("list", list_sizes(args.list_numel, args.tensors), 1, args.repeats)
    print(markdown(rows, info))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
