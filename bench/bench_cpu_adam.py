"""CPU optimizer step: compcomm's C++ kernels against torch's AdamW, same data, same run.

Two workloads (issues 17 and 12):

- ``flat``: one fp32 tensor of ``--numel`` parameters (default 2^26) at ``--threads`` threads;
- ``list``: ``--tensors`` fp32 tensors (default 100) totalling ``--list-numel`` parameters (default
  8.4M) at one thread (the 1-bit optimizers' per-parameter step on one core).

For each: ``torch.optim.AdamW`` (foreach=True; foreach=False, what ``AdamW(params)`` runs on CPU
tensors; fused=True when torch supports it on the CPU),
:class:`compcomm.optim.CPUAdam`, and the 1-bit Adam compressed-phase update (``m = averaged``,
frozen variance, weight decay) through the torch ops of ``compcomm.optim.functional`` and through
the kernel ``onebit_compressed_step_``. Times are medians of ``--repeats`` steps after one warm-up
step (which allocates the state), the rows timed in turn round after round. Ratios are against
``torch.optim.AdamW(foreach=True)`` measured in the same run.

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
from compcomm.optim.cpu_adam import (all_finite, kernel_isa, onebit_compressed_step_,
                                     onebit_local_step_, torch_sqrt_mode)

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


def interleaved_medians(steps: Dict[str, Callable[[], None]], repeats: int) -> Dict[str, float]:
    """Median seconds of each step. One warm-up call each (it allocates the optimizer state), then
    ``repeats`` rounds that time every step once in turn, so that a machine whose load changes
    during the run (other processes on a shared host) weighs on every row alike."""
    for step in steps.values():
        step()
    times: Dict[str, List[float]] = {k: [] for k in steps}
    for _ in range(repeats):
        for k, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


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


BASE = "torch AdamW foreach=True"
FLOOR = "memory floor: a += b over one flat fp32 tensor (torch, 12 B/param)"
W1_DEFAULT = ("OneBitAdam.step, compressed phase, W=1, bias_correction=False (the default; "
              "kernels)")


def onebitadam_step(sizes: List[int], kernels: bool, bias_correction: bool = True,
                    check_finite: bool = True,
                    dtype: torch.dtype = torch.float32) -> Callable[[], None]:
    """The whole ``OneBitAdam.step()`` of its compressed phase at world size 1 (no communication):
    with the C++ kernels, or with the torch ops (``COMPCOMM_FUSED_OPTIM=0`` while it runs).
    ``dtype``: the parameters' and gradients' (bf16: an fp32 master copy in the state)."""
    from compcomm.optim import OneBitAdam

    params = make_params(sizes, seed=2)
    if dtype != torch.float32:
        params = [torch.nn.Parameter(p.detach().to(dtype)) for p in params]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = OneBitAdam(params, lr=1e-3, freeze_step=1, weight_decay=0.01,
                     bias_correction=bias_correction, check_finite=check_finite)

    step = with_kernels(opt.step, kernels)
    step()  # the warm-up step; every timed one is compressed
    return step


def with_kernels(fn: Callable[[], object], kernels: bool) -> Callable[[], None]:
    """``fn`` run with the C++ kernels on, or off (``COMPCOMM_FUSED_OPTIM=0`` while it runs)."""
    def call() -> None:
        saved = os.environ.get("COMPCOMM_FUSED_OPTIM")
        os.environ["COMPCOMM_FUSED_OPTIM"] = "1" if kernels else "0"
        try:
            fn()
        finally:
            if saved is None:
                del os.environ["COMPCOMM_FUSED_OPTIM"]
            else:
                os.environ["COMPCOMM_FUSED_OPTIM"] = saved
    return call


ZERO_ONE = "ZeroOneAdam.step, local phase, W=1 (kernels)"
LAMB = "OneBitLamb.step, compressed phase, W=1 (kernels)"
LAMB_TORCH = "OneBitLamb.step, compressed phase, W=1 (COMPCOMM_FUSED_OPTIM=0)"


def sibling_step(impl: str, sizes: List[int]) -> Callable[[], None]:
    """The other two 1-bit optimizers' main-phase step at world size 1 (issue 12 asks >= 4x of
    all three): ZeroOneAdam's local step (a sync every 16th step, so the median is a local one)
    and OneBitLamb's compressed step."""
    from compcomm.optim import OneBitLamb, ZeroOneAdam

    params = make_params(sizes, seed=3)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    if impl == ZERO_ONE:
        opt = ZeroOneAdam(params, lr=1e-3, weight_decay=0.01, var_freeze_step=1,
                          local_step_scaler=1, local_step_clipper=16)
        while opt.step_kind() != "local":
            opt.step()
    else:
        opt = OneBitLamb(params, lr=1e-3, weight_decay=0.01, freeze_step=1)
        opt.step()  # the warm-up step; every timed one is compressed
        return with_kernels(opt.step, impl == LAMB)
    return opt.step


def bench_workload(name: str, sizes: List[int], threads: int, repeats: int) -> List[Dict]:
    torch.set_num_threads(threads)
    total = sum(sizes)
    params = make_params(sizes)
    steps: Dict[str, Optional[Callable[[], None]]] = {
        BASE: torch_adamw(params, foreach=True),
        "torch AdamW foreach=False (the CPU default)": torch_adamw(params, foreach=False),
        "torch AdamW fused=True": torch_adamw(params, fused=True),
        "compcomm CPUAdam": CPUAdam(params, **HP).step,
    }
    group = dict(HP, bias_correction=True)
    states = onebit_states(params)

    def torch_rules() -> None:  # the 1-bit optimizers' compressed phase as torch ops
        for w, m, v, avg in states:
            m.copy_(avg)
            F.adam_step_(w, m, v, group, 200, 100)

    def kernel() -> None:
        for w, m, v, avg in states:
            onebit_compressed_step_(w, m, v, avg, group, 200, 100, num_threads=threads)

    grads = [avg for _, _, _, avg in states]

    def local() -> None:  # W=1: momentum from the local gradient and the step in one pass
        for w, m, v, g in states:
            onebit_local_step_(w, m, v, g, group, 200, 100, num_threads=threads)

    def staged_momentum() -> None:  # what the W=1 step staged before: fresh buffers, torch ops
        for _, m, _, g in states:
            F.onebit_momentum(m, g, group, torch.empty_like(m))

    def aminmax_check() -> None:  # the gradients' finiteness check before: torch's aminmax
        ends = torch.stack([torch.stack(torch.aminmax(g.reshape(-1))) for g in grads])
        bool(torch.isfinite(ends).all())

    flat_a, flat_b = torch.ones(total), torch.full((total,), 1e-30)

    def floor() -> None:  # STREAM-like: a += b, read 8 and write 4 bytes per parameter
        flat_a.add_(flat_b)

    steps[FLOOR] = floor
    steps["1-bit compressed step, torch ops (functional.py)"] = torch_rules
    steps["1-bit compressed step, compcomm kernel"] = kernel
    steps["1-bit W=1 step (momentum + step), compcomm kernel onebit_local_step"] = local
    steps["piece: momentum staged in fresh buffers, torch ops"] = staged_momentum
    steps["piece: finiteness check, torch aminmax"] = aminmax_check
    steps["piece: finiteness check, compcomm all_finite"] = lambda: all_finite(grads)
    # whether the gradients stay cached after one read (then a fold of the check into the step's
    # pass, reading them a second time, would be nearly free): twice the row above if they do not
    steps["piece: all_finite twice in a row"] = lambda: (all_finite(grads), all_finite(grads))
    steps["OneBitAdam.step, compressed phase, W=1 (kernels)"] = onebitadam_step(sizes, True)
    steps["OneBitAdam.step, compressed phase, W=1 (COMPCOMM_FUSED_OPTIM=0)"] = \
        onebitadam_step(sizes, False)
    steps[W1_DEFAULT] = onebitadam_step(sizes, True, bias_correction=False)
    # the bound without the gradients' finiteness pass (24 instead of 28 bytes per parameter)
    steps[W1_DEFAULT + ", check_finite=False"] = onebitadam_step(
        sizes, True, bias_correction=False, check_finite=False)
    # a bf16 model (fp32 master, bf16 gradients; not torch AdamW's workload: compare installs)
    steps[W1_DEFAULT + ", bf16 parameters"] = onebitadam_step(
        sizes, True, bias_correction=False, dtype=torch.bfloat16)
    steps[W1_DEFAULT + ", bf16 parameters, check_finite=False"] = onebitadam_step(
        sizes, True, bias_correction=False, check_finite=False, dtype=torch.bfloat16)
    steps[ZERO_ONE] = sibling_step(ZERO_ONE, sizes)
    steps[LAMB] = sibling_step(LAMB, sizes)
    steps[LAMB_TORCH] = sibling_step(LAMB_TORCH, sizes)
    med = interleaved_medians({k: f for k, f in steps.items() if f is not None}, repeats)
    rows = []
    for impl in steps:
        t = med.get(impl)
        rows.append({"workload": name, "impl": impl, "numel": total, "tensors": len(sizes),
                     "threads": threads, "seconds": t,
                     "ns_per_param": None if t is None else t / total * 1e9,
                     "x_vs_torch_foreach": None if t is None else med[BASE] / t})
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
             f"kernel path {info['isa']}, sqrt mode {info['sqrt']}, threading {info['threading']}; "
             f"load average {info['load_before']:.2f} before, {info['load_after']:.2f} after.",
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


def targets(rows: List[Dict]) -> str:
    """The issues' targets, as ratios from this run."""
    def x(workload: str, impl: str) -> Optional[float]:
        for r in rows:
            if r["workload"] == workload and r["impl"] == impl:
                return r["x_vs_torch_foreach"]
        return None

    out = []
    a = x("flat", "compcomm CPUAdam")
    if a is not None:
        out.append(f"- CPUAdam vs torch AdamW (foreach) on the flat workload: {a:.2f}x "
                   "(issue 17: >= 1.5x on 2 cores, >= 4x on 16 cores)")
    b = x("list", "1-bit compressed step, compcomm kernel")
    if b is not None:
        out.append(f"- 1-bit compressed-phase step (kernel) vs torch AdamW (foreach), list workload, "
                   f"one thread: {b:.2f}x (issue 12: >= 4x)")
    d = x("list", "1-bit W=1 step (momentum + step), compcomm kernel onebit_local_step")
    if d is not None:
        out.append(f"- 1-bit W=1 step kernel (momentum + step) vs torch AdamW (foreach), list "
                   f"workload, one thread: {d:.2f}x")
    c = x("list", "OneBitAdam.step, compressed phase, W=1 (kernels)")
    if c is not None:
        out.append(f"- OneBitAdam.step (compressed phase, W=1) vs torch AdamW (foreach), list "
                   f"workload, one thread: {c:.2f}x (issue 12: >= 4x)")
    e = x("list", W1_DEFAULT)
    if e is not None:
        out.append(f"- the same with OneBitAdam's default bias_correction=False: {e:.2f}x")
    for impl in (ZERO_ONE, LAMB):
        z = x("list", impl)
        if z is not None:
            out.append(f"- {impl.split('.')[0]}'s step vs torch AdamW (foreach), list workload, "
                       f"one thread: {z:.2f}x (issue 12: >= 4x)")
    secs = {(r["workload"], r["impl"]): r["seconds"] for r in rows}
    f, w1 = secs.get(("list", FLOOR)), secs.get(("list", W1_DEFAULT))
    if f and w1:
        numel = next(r["numel"] for r in rows if r["workload"] == "list")
        bw = 12 * numel / f
        # the W=1 step: finiteness pass (read g) + update (read w, m, v, g; write w, m)
        floor_ms = 28 * numel / bw * 1e3
        out.append(f"- memory floor in this run (a += b, one thread): {bw / 1e9:.1f} GB/s; the W=1 "
                   f"step's 28 B/param at that speed: {floor_ms:.1f} ms; OneBitAdam.step (default "
                   f"args) takes {w1 * 1e3:.1f} ms, {floor_ms / (w1 * 1e3):.0%} of the floor's "
                   "speed")
    return "\n".join(out)


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
            "load_before": os.getloadavg()[0],
            "isa": kernel_isa(), "sqrt": torch_sqrt_mode(),
            "threading": __import__("compcomm")._C.optim.threading(),
            "command": "python bench/bench_cpu_adam.py " + " ".join(argv or [])}
    rows: List[Dict] = []
    if "flat" not in args.skip:
        rows += bench_workload("flat", [args.numel], args.threads, args.repeats)
    if "list" not in args.skip:
        rows += bench_workload("list", list_sizes(args.list_numel, args.tensors), 1, args.repeats)
    info["load_after"] = os.getloadavg()[0]
    print(markdown(rows, info))
    print()
    print(targets(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
