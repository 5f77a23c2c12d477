"""ZeRO step time, bytes per step and per-rank memory by stage, plain (AdamW) vs 1-bit (OneBitAdam,
ZeroOneAdam).

Run as a script (not collected as a benchmark test). The committed eth1g results
(bench/results/zero_eth1g.{json,md}) come from, as root:

    python bench/bench_zero.py --profile eth1g --world 2 4 --hidden 1024 --layers 4 --steps 5 \\
        --no-rs --json bench/results/zero_eth1g.json --md bench/results/zero_eth1g.md

``--profile loopback`` (the default) spawns ``--world`` processes over gloo on 127.0.0.1 with
compcomm.testing.run_ranks. ``eth1g``, ``eth10g`` and ``unshaped`` (root only) run one process per
rank, each inside its own network namespace of compcomm.bench.netns (1 or 10 Gbit/s links into a
bridge, or unshaped), launched with compcomm.bench.runner.run_on_profile; every process initializes
torch.distributed gloo from the environment, runs the same per-rank body, and rank 0 prints its
result as JSON. The namespaces are gone when the script exits.

Rows, per world size: ZeRO stage 1, 2, 3 with torch.optim.AdamW ("adamw"), stage 1, 2, 3 with
compcomm.optim.OneBitAdam ("onebit", freeze_step 1, so every timed step is in the compressed
phase: each gradient bucket's momentum contribution goes through the 1-bit compressed
reduce-scatter; stage 3 compresses each parameter on its own), and stage 1, 2 with
compcomm.optim.ZeroOneAdam ("zoadam", var_freeze_step 1, local_step_scaler 1, local_step_clipper
4: steps 1-2 update the variance, then syncs at steps 3, 4, 8, 12, ... and local steps between, so
after 4 warm-up steps every 4 timed steps are 3 local steps and one sync). Each row runs
``--warmup`` untimed steps, then ``--steps`` timed steps of forward + backward + step on one
micro-batch, measured on rank 0; reported: the median step time (zoadam: the mean, as its steps
differ) and the mean bytes rank 0's communicator put on the wire per timed step
(Communicator.bytes_sent); every step is kept in the JSON. Memory is ZeroOptimizer.memory_bytes()
on rank 0 after the last backward (before its step). Torch runs with one thread per rank.

Unless ``--no-rs``, it also times one reduce-scatter of a momentum-sized fp32 tensor: plain =
compcomm's bucketed reduce-scatter (one bucket), compressed = compcomm.zero.compressed_reduce_scatter.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List

ROWS = ("adamw1", "adamw2", "adamw3", "onebit1", "onebit2", "onebit3", "onebitna1", "onebitna2",
        "onebitsh1", "onebitsh2", "zoadam1", "zoadam2")
#: OneBitAdam rows: zero_optimization.onebit_mode of each
MODES = {"onebit": "exact", "onebitna": "no_allgather", "onebitsh": "sharded"}


def _mib(nbytes: float) -> float:
    return nbytes / 2**20


def _model(hidden: int, layers: int):
    import torch

    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods)


def _zero_body(rank: int, world: int, stage: int, opt_name: str, hidden: int, layers: int,
               steps: int, warmup: int, bucket: int) -> Dict[str, Any]:
    import torch

    from compcomm.optim import OneBitAdam, ZeroOneAdam
    from compcomm.zero import ZeroOptimizer

    torch.set_num_threads(1)
    model = _model(hidden, layers)
    mode = MODES.get(opt_name)
    if mode is not None:
        cls, kw = OneBitAdam, {"lr": 1e-4, "freeze_step": 1}
    elif opt_name == "zoadam":
        cls, kw = ZeroOneAdam, {"lr": 1e-4, "var_freeze_step": 1, "local_step_scaler": 1,
                                "local_step_clipper": 4}
    else:
        cls, kw = torch.optim.AdamW, {"lr": 1e-4}
    opt = ZeroOptimizer(model.parameters(), cls, stage=stage, module=model, optimizer_kwargs=kw,
                        reduce_bucket_size=bucket, allgather_bucket_size=bucket, overlap_comm=True,
                        onebit_mode=mode)
    torch.manual_seed(1 + rank)
    x = torch.randn(16, hidden)
    times: List[float] = []
    sent: List[int] = []
    mem = None
    for s in range(warmup + steps):
        opt.comm.barrier()
        before = opt.comm.bytes_sent
        t0 = time.perf_counter()
        model(x).pow(2).mean().backward()
        if s == warmup + steps - 1:
            mem = opt.memory_bytes()
        opt.step()
        opt.zero_grad()
        dt = time.perf_counter() - t0
        if s >= warmup:
            times.append(dt)
            sent.append(opt.comm.bytes_sent - before)
    opt.close()
    step_s = statistics.mean(times) if opt_name == "zoadam" else statistics.median(times)
    return {"step_s": step_s, "step_s_all": times, "bytes_per_step": statistics.mean(sent),
            "bytes_all": sent, "mem": mem}


def _rs_body(rank: int, world: int, numel: int, reps: int) -> Dict[str, Any]:
    import torch

    import compcomm
    from compcomm import _C
    from compcomm._buffers import buffer_of
    from compcomm._comm import resolve
    from compcomm.zero import compressed_reduce_scatter

    torch.set_num_threads(1)
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


def _conv_body(rank: int, world: int, steps: int, freeze: int, lr: float) -> Dict[str, float]:
    """Held-out MSE of a 3-layer GELU MLP (a teacher-student regression) trained with unsharded
    OneBitAdam and ZeRO stage 2 + OneBitAdam in each onebit_mode (one bucket: OneBitAdam's
    reduce_bucket_size equals ZeRO's, so "exact" compresses the same tensor)."""
    import torch

    from compcomm.optim import OneBitAdam
    from compcomm.zero import ZeroOptimizer

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(11)
    d_in, d_h, d_out, batch = 32, 64, 8, 32
    teacher = torch.nn.Sequential(torch.nn.Linear(d_in, 48), torch.nn.Tanh(), torch.nn.Linear(48, d_out))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        xs = torch.randn(world * batch * steps + 1024, d_in, generator=g)
        ys = teacher(xs) + 0.1 * torch.randn(xs.shape[0], d_out, generator=g)
    test_x, test_y = xs[-1024:], ys[-1024:]
    kw = {"lr": lr, "freeze_step": freeze}
    out: Dict[str, float] = {}
    for name in ("unsharded", "exact", "no_allgather", "sharded"):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(d_in, d_h), torch.nn.GELU(),
                                  torch.nn.Linear(d_h, d_h), torch.nn.GELU(), torch.nn.Linear(d_h, d_out))
        if name == "unsharded":
            opt = OneBitAdam(net.parameters(), **kw)
        else:
            opt = ZeroOptimizer(net.parameters(), OneBitAdam, stage=2, optimizer_kwargs=kw,
                                onebit_mode=name)
        for t in range(steps):
            i = (t * world + rank) * batch
            loss = torch.nn.functional.mse_loss(net(xs[i:i + batch]), ys[i:i + batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            out[name] = float(torch.nn.functional.mse_loss(net(test_x), test_y))
        if name != "unsharded":
            opt.close()
    return out


_BODIES = {"zero": _zero_body, "rs": _rs_body, "conv": _conv_body}


def _rank_main(spec: str) -> None:
    """One rank of a namespace profile: gloo from the environment, run a body, rank 0 prints it."""
    import datetime

    import torch.distributed as dist

    d = json.loads(spec)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    out = _BODIES[d["body"]](rank, world, *d["args"])
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    # leave together and skip interpreter teardown (see compcomm.bench.worker)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run(profile: str, world: int, body: str, *args: Any) -> Dict[str, Any]:
    """Rank 0's result of ``body`` on ``world`` ranks of ``profile``."""
    if profile == "loopback":
        from compcomm.testing import run_ranks

        return run_ranks(world, _BODIES[body], *args, timeout=600)[0]
    from compcomm.bench.runner import run_on_profile

    spec = json.dumps({"body": body, "args": list(args)})
    lines = run_on_profile(profile, world, [os.path.abspath(__file__), "--_rank", spec],
                           timeout=900)
    res = [ln for ln in lines if ln.startswith("RESULT ")]
    if not res:
        raise RuntimeError(f"{body} on {profile} W={world}: rank 0 printed no result: {lines[-5:]}")
    return json.loads(res[-1][len("RESULT "):])


def _markdown(rows: List[Dict[str, Any]], meta: Dict[str, Any]) -> str:
    out = [f"# ZeRO on {meta['profile']}: step time, bytes/step and per-rank memory", "",
           f"Model: {meta['layers']} x Linear({meta['hidden']}, {meta['hidden']}) + ReLU, "
           f"{meta['numel']} fp32 parameters ({_mib(meta['numel'] * 4):.1f} MiB); micro-batch 16; "
           f"bucket {meta['bucket']} elements; overlap_comm; one torch thread per rank. Step = "
           f"forward + backward + step, median of {meta['steps']} timed steps after "
           f"{meta['warmup']} untimed (onebit: OneBitAdam freeze_step 1, so timed steps are "
           "compressed; zoadam: ZeroOneAdam in its local-step phase, 3 local steps and one sync in "
           "every 4 steps, mean step time). Bytes = rank 0's Communicator.bytes_sent, mean per "
           "timed step. Memory = rank 0's ZeroOptimizer.memory_bytes() after backward.", "",
           f"Command: `{meta['command']}`", ""]
    for w in sorted({r["world"] for r in rows if "stage" in r}):
        out += [f"## W = {w}", "",
                "| stage | optimizer | step ms | bytes/step (MiB) | params MiB | grads MiB | "
                "master MiB | optimizer state MiB | buffers MiB |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if r.get("world") != w or "stage" not in r:
                continue
            m = r["mem"]
            out.append(f"| {r['stage']} | {r['optimizer']} | {r['step_s'] * 1e3:.1f} | "
                       f"{_mib(r['bytes_per_step']):.2f} | {_mib(m['params']):.2f} | "
                       f"{_mib(m['grads']):.2f} | {_mib(m['master']):.2f} | "
                       f"{_mib(m['optimizer_state']):.2f} | {_mib(m['buffers']):.2f} |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--_rank":
        _rank_main(sys.argv[2])
        return
    from compcomm.bench.netns import PROFILES

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", choices=list(PROFILES), default="loopback",
                    help="network: loopback (no namespaces) or a compcomm.bench.netns profile")
    ap.add_argument("--world", type=int, nargs="+", default=[2])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per row (zoadam: a multiple of 4)")
    ap.add_argument("--warmup", type=int, default=4, help="untimed steps per row (>= 4)")
    ap.add_argument("--bucket", type=int, default=int(5e5))
    ap.add_argument("--no-rs", dest="rs", action="store_false", help="skip the plain vs "
                    "compressed reduce-scatter rows")
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS),
                    help="which stage/optimizer rows to run (default: all)")
    ap.add_argument("--convergence", action="store_true", help="only the issue-19 convergence "
                    "comparison: held-out MSE of unsharded OneBitAdam vs ZeRO-2 in each onebit_mode "
                    "(3-layer GELU MLP, 400 steps, freeze 80, lr 2e-3) on each --world")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--md", help="also write a markdown table per world size here")
    args = ap.parse_args()
    if args.warmup < 4:
        ap.error("argument --warmup must be >= 4 (OneBitAdam freeze_step 1 + the first compressed "
                 "step; ZeroOneAdam's variance steps and first syncs)")

    from compcomm.zero import estimate_memory

    if args.convergence:
        for w in args.world:
            r = _run(args.profile, w, "conv", 400, 80, 2e-3)
            print(f"W={w} held-out MSE: " + ", ".join(
                f"{k} {v:.5f} ({v / r['unsharded']:.3f}x)" for k, v in r.items()), flush=True)
        return
    numel = args.layers * (args.hidden * args.hidden + args.hidden)
    rows: List[Dict[str, Any]] = []
    print(f"model: {numel} fp32 parameters ({_mib(numel * 4):.1f} MiB); {args.profile}; "
          f"bucket {args.bucket} elements", flush=True)
    print(f"{'W':>2} {'stage':>5} {'opt':>6} {'step ms':>9} {'MiB/step':>9} {'params MiB':>10} "
          f"{'grads MiB':>9} {'master MiB':>10} {'optstate MiB':>12} {'buffers MiB':>11} "
          f"{'estimate total MiB':>18}", flush=True)
    for w in args.world:
        for row in args.rows:
            opt_name, stage = row[:-1], int(row[-1])
            if opt_name != "adamw" and w == 1:
                continue  # no compression with one rank
            r = _run(args.profile, w, "zero", stage, opt_name, args.hidden, args.layers,
                     args.steps, args.warmup, args.bucket)
            m = r["mem"]
            onebit = "OneBitAdam" if opt_name in MODES else {"zoadam": "ZeroOneAdam"}.get(opt_name)
            est = estimate_memory(numel, stage, w, param_bytes=4, onebit=onebit,
                                  onebit_mode=MODES.get(opt_name))
            print(f"{w:>2} {stage:>5} {opt_name:>6} {r['step_s'] * 1e3:>9.1f} "
                  f"{_mib(r['bytes_per_step']):>9.2f} {_mib(m['params']):>10.2f} "
                  f"{_mib(m['grads']):>9.2f} {_mib(m['master']):>10.2f} "
                  f"{_mib(m['optimizer_state']):>12.2f} {_mib(m['buffers']):>11.2f} "
                  f"{_mib(est['total']):>18.2f}", flush=True)
            rows.append({"world": w, "stage": stage, "optimizer": opt_name, **r, "estimate": est})
        if w > 1 and args.rs:
            rs = _run(args.profile, w, "rs", numel, 3)
            for name, v in rs.items():
                print(f"{w:>2} reduce-scatter {name:>10}: {v['s'] * 1e3:8.1f} ms, rank 0 sent "
                      f"{_mib(v['bytes']):.3f} MiB", flush=True)
            rows.append({"world": w, "reduce_scatter": rs})
    meta = {"profile": args.profile, "hidden": args.hidden, "layers": args.layers, "numel": numel,
            "steps": args.steps, "warmup": args.warmup, "bucket": args.bucket,
            "command": "python " + " ".join(sys.argv)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(_markdown(rows, meta))


if __name__ == "__main__":
    main()
