"""Per-bucket overhead of the 1-bit optimizers' compressed step (issues 12 and 13).

The same model (``--tensors`` fp32 tensors of ``--numel`` elements each) stepped by OneBitAdam
(or ZeroOneAdam's sync steps) in its compressed phase, on ``--world`` ranks over gloo, with three
bucket plans: ``one`` (the default: every tensor in one bucket), ``b16k``
(``reduce_bucket_size=16384``) and ``pp`` (``per_parameter=True``: one bucket per tensor). Prints,
per plan, the slowest rank's median ``step()`` time and its ratio to ``one``, round after round
(plans in turn within a round, so that a load change on a shared machine hits them alike), and
the rank's median CPU time per step (all its threads: on an oversubscribed machine, where the wall
time mostly measures waiting for a core, the steadier measure of the Python and C++ work). The
ratios are the result; absolute times depend on the machine.

CPU (2 ranks, 1 thread each)::

    python bench/bench_bucket_overhead.py --world 2 --tensors 208 --numel 4096 --rounds 3

GPU: ``--device cuda`` puts every rank on ``cuda:(rank % device_count)``. With one GPU use
``--mirror``: one process, rank 0 of a ``--world``-rank world whose peers send exactly what it
sends (collectives are local copies on the device), so the step does all the per-bucket work of a
real W-rank step (Python, launches, syncs, the exchange's local passes) and nothing crosses a
network. With one GPU per rank, ``--backend nccl`` runs real ranks (NCCL refuses two ranks on
one GPU); two ranks sharing one GPU over gloo (the default backend) need torch's gloo to take CUDA
tensors in every collective::

    python bench/bench_bucket_overhead.py --device cuda --mirror --world 2
    python bench/bench_bucket_overhead.py --device cuda --backend nccl --world 2  # 2 GPUs

``--profile`` adds, per plan, what rank 0's host issued per step over 3 more steps under
torch.profiler: kernel launches, async copies and fills, stream syncs (on CUDA; where the
per-bucket host time goes: each costs microseconds of host time whatever its size).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Dict, List

import torch

PLANS = {"one": {}, "b16k": {"reduce_bucket_size": 16384}, "pp": {"per_parameter": True}}
# host-side CUDA runtime calls counted by --profile, by name prefix
CALLS = {"launch": "cudaLaunch", "memcpy": "cudaMemcpy", "memset": "cudaMemset",
         "sync": "cudaStreamSynchronize"}


def _count_calls(opt: Any, dev: torch.device, steps: int = 3) -> Dict[str, float]:
    """CUDA runtime calls per ``opt.step()`` (CALLS), from torch.profiler over ``steps`` steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            opt.step()
        torch.cuda.synchronize(dev)
    counts = dict.fromkeys(CALLS, 0)
    for ev in prof.events():
        for key, prefix in CALLS.items():
            if ev.name.startswith(prefix):
                counts[key] += 1
    return {k: v / steps for k, v in counts.items()}


def _rank(rank: int, world: int, optim: str, plan: str, tensors: int, numel: int, steps: int,
          device: str, threads: int, mirror: bool = False, prof: bool = False) -> Dict[str, Any]:
    from compcomm.optim import OneBitAdam, ZeroOneAdam
    from compcomm.testing import mirrored_peers

    torch.set_num_threads(threads)
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    gen = torch.Generator().manual_seed(rank)
    params = [torch.nn.Parameter(torch.randn(numel, generator=gen).to(dev))
              for _ in range(tensors)]
    for p in params:
        p.grad = (torch.randn(numel, generator=gen) * 1e-3).to(dev)
    kw: Dict[str, Any] = dict(PLANS[plan], process_group=mirrored_peers(world) if mirror else None)
    if optim == "adam":
        opt = OneBitAdam(params, lr=1e-3, freeze_step=2, **kw)
    else:  # every step after the variance freeze is a sync (local_step_interval stays 1)
        opt = ZeroOneAdam(params, lr=1e-3, var_freeze_step=2, local_step_scaler=1 << 30, **kw)
    for _ in range(5):  # warm-up steps, then compressed ones that allocate buffers
        opt.step()
    times: List[float] = []
    cpu: List[float] = []
    for _ in range(steps):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0, c0 = time.perf_counter(), time.process_time()
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    calls = _count_calls(opt, dev) if prof and rank == 0 and dev.type == "cuda" else None
    return {"median": statistics.median(times), "cpu": statistics.median(cpu),
            "buckets": len(opt._buckets), "calls": calls}


def _mirror_rank(rank: int, one: int, world: int, prof: bool, *run: Any) -> Dict[str, Any]:
    return _rank(0, world, *run, mirror=True, prof=prof)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tensors", type=int, default=208)
    ap.add_argument("--numel", type=int, default=4096, help="elements per tensor")
    ap.add_argument("--steps", type=int, default=50, help="timed steps per run")
    ap.add_argument("--rounds", type=int, default=3, help="runs of every plan, in turn")
    ap.add_argument("--optim", choices=("adam", "zoadam"), default="adam")
    ap.add_argument("--plans", nargs="+", choices=tuple(PLANS), default=list(PLANS))
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--backend", default="gloo", help="torch.distributed backend (gloo, nccl)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--mirror", action="store_true",
                    help="one process whose --world - 1 peers mirror it (no network; one GPU)")
    ap.add_argument("--profile", action="store_true",
                    help="also count rank 0's CUDA launches, copies and syncs per step")
    args = ap.parse_args()
    import compcomm
    from compcomm.testing import run_ranks

    how = "mirrored peers" if args.mirror else args.backend
    print(f"compcomm from {os.path.dirname(compcomm.__file__)}; {args.optim}, W={args.world} "
          f"{how} on {args.device}, {args.tensors} x {args.numel} fp32, "
          f"{args.threads} thread(s) per rank; load {os.getloadavg()[0]:.1f}")
    best: Dict[str, float] = {}
    best_cpu: Dict[str, float] = {}
    for r in range(args.rounds):
        got: Dict[str, float] = {}
        cpu: Dict[str, float] = {}
        for plan in args.plans:
            run = (args.optim, plan, args.tensors, args.numel, args.steps, args.device,
                   args.threads)
            prof = args.profile and r == 0  # counted in the first round
            if args.mirror:
                res = run_ranks(1, _mirror_rank, args.world, prof, *run, backend="none", timeout=600)
            else:
                res = run_ranks(args.world, _rank, *run, False, prof, backend=args.backend,
                                timeout=600)
            got[plan] = max(x["median"] for x in res)
            cpu[plan] = max(x["cpu"] for x in res)
            best[plan] = min(best.get(plan, float("inf")), got[plan])
            best_cpu[plan] = min(best_cpu.get(plan, float("inf")), cpu[plan])
            buckets = res[0]["buckets"]
            ratio = (f" ({got[plan] / got['one']:.2f}x one bucket), cpu {cpu[plan] * 1e3:.3f} ms "
                     f"({cpu[plan] / cpu['one']:.2f}x)" if "one" in got else "")
            print(f"round {r + 1} {plan:>4}: {buckets:4d} buckets, {got[plan] * 1e3:8.3f} ms/step"
                  f"{ratio}; load {os.getloadavg()[0]:.1f}", flush=True)
            if res[0].get("calls"):
                print(f"  per step ({plan}): " + ", ".join(
                    f"{k} {v:.0f}" for k, v in res[0]["calls"].items()), flush=True)
    if "one" in best:
        print("best of rounds, wall: " + ", ".join(
            f"{p} {best[p] * 1e3:.3f} ms ({best[p] / best['one']:.2f}x)" for p in best))
        print("best of rounds, cpu:  " + ", ".join(
            f"{p} {best_cpu[p] * 1e3:.3f} ms ({best_cpu[p] / best_cpu['one']:.2f}x)"
            for p in best_cpu))


if __name__ == "__main__":
    main()
