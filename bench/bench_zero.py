"""ZeRO step time and per-rank memory by stage, and plain vs 1-bit compressed reduce-scatter.

Run as a script (not collected as a benchmark test):

    python bench/bench_zero.py --world 2 --hidden 1024 --layers 4 --steps 3

Each configuration spawns ``--world`` processes over gloo on loopback (this script does not shape
the network: on the namespace harness, run it inside it). Step time is the median over ``--steps``
timed steps after one warm-up step, measured on rank 0, of forward + backward + step for one
micro-batch. Memory is ZeroOptimizer.memory_bytes() on rank 0 after a backward (before its step).
The reduce-scatter rows time one call on a momentum-sized fp32 tensor (numel = model parameters):
plain = compcomm's bucketed reduce-scatter (one bucket), compressed = compcomm.zero.compressed_
reduce_scatter; bytes are what rank 0 put on the wire (Communicator.bytes_sent).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Dict


def _model(hidden: int, layers: int):
    import torch

    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods)


def _zero_body(rank: int, world: int, stage: int, hidden: int, layers: int, steps: int,
               bucket: int) -> Dict[str, Any]:
    import torch

    from compcomm.zero import ZeroOptimizer

    model = _model(hidden, layers)
    opt = ZeroOptimizer(model.parameters(), torch.optim.Adam, stage=stage, module=model,
                        optimizer_kwargs={"lr": 1e-4}, reduce_bucket_size=bucket,
                        allgather_bucket_size=bucket, overlap_comm=True)
    x = torch.randn(16, hidden)
    times = []
    mem = None
    for s in range(steps + 1):
        t0 = time.perf_counter()
        model(x).pow(2).mean().backward()
        if s == steps:
            mem = opt.memory_bytes()
        opt.step()
        times.append(time.perf_counter() - t0)
    opt.close()
    return {"step_s": statistics.median(times[1:]), "mem": mem}


def _rs_body(rank: int, world: int, numel: int, reps: int) -> Dict[str, Any]:
    import torch

    import compcomm
    from compcomm import _C
    from compcomm._buffers import buffer_of
    from compcomm._comm import resolve
    from compcomm.zero import compressed_reduce_scatter

    comm = resolve(None)
    P = compcomm.padded_numel(numel, world)
    plan = _C.zero.plan_buckets([numel], 0, world, 8)
    flat = torch.randn(plan.flat_numel)
    shard = torch.empty(plan.shard_numel)
    we, se = compcomm.error_buffers(numel)
    m = torch.randn(numel)
    out: Dict[str, Any] = {}
    for name in ("plain", "compressed"):
        ts = []
        for i in range(reps + 1):
            comm.barrier()
            comm.reset_bytes_sent()
            t0 = time.perf_counter()
            if name == "plain":
                _C.zero.bucketed_reduce_scatter(comm, plan, buffer_of(flat), buffer_of(shard))
            else:
                compressed_reduce_scatter(m.clone(), we, se)
            ts.append(time.perf_counter() - t0)
        out[name] = {"s": statistics.median(ts[1:]), "bytes": comm.bytes_sent, "padded": P}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, nargs="+", default=[2])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--bucket", type=int, default=int(5e5))
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    from compcomm.testing import run_ranks
    from compcomm.zero import estimate_memory

    numel = args.layers * (args.hidden * args.hidden + args.hidden)
    rows = []
    print(f"model: {numel} fp32 parameters ({numel * 4 / 2**20:.1f} MiB); loopback gloo; "
          f"bucket {args.bucket} elements")
    print(f"{'W':>2} {'stage':>5} {'step ms':>9} {'params MiB':>10} {'grads MiB':>9} {'master MiB':>10} "
          f"{'optstate MiB':>12} {'buffers MiB':>11} {'estimate total MiB':>18}")
    for w in args.world:
        for stage in (1, 2, 3):
            r = run_ranks(w, _zero_body, stage, args.hidden, args.layers, args.steps, args.bucket,
                          timeout=600)[0]
            m = r["mem"]
            est = estimate_memory(numel, stage, w, param_bytes=4)
            mib = lambda b: b / 2**20  # noqa: E731
            print(f"{w:>2} {stage:>5} {r['step_s'] * 1e3:>9.1f} {mib(m['params']):>10.2f} "
                  f"{mib(m['grads']):>9.2f} {mib(m['master']):>10.2f} {mib(m['optimizer_state']):>12.2f} "
                  f"{mib(m['buffers']):>11.2f} {mib(est['total']):>18.2f}")
            rows.append({"world": w, "stage": stage, **r, "estimate": est})
        if w > 1:
            rs = run_ranks(w, _rs_body, numel, 3, timeout=600)[0]
            for name, v in rs.items():
                print(f"{w:>2} reduce-scatter {name:>10}: {v['s'] * 1e3:8.1f} ms, rank 0 sent "
                      f"{v['bytes'] / 2**20:.3f} MiB")
            rows.append({"world": w, "reduce_scatter": rs})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
