"""Small-call latency of compcomm.compressed_allreduce on one GPU, world size 1 (issue 12).

    python bench/bench_latency.py [--sizes 20,28] [--out DIR]

Target: the default path (``group=None`` under a one-rank torch ``nccl`` process group, which is
compcomm's native NCCL communicator; eager; ``check=True``) at 2^20 fp32 <= 40 us per call.

For each size it times, in one run:

* ``default``         group=None (native NCCL, alone), check=True: what a torchrun user calls
* ``default_nocheck`` the same with check=False (no host sync)
* ``local``           a LocalCommunicator, check=True
* ``local_nocheck``   a LocalCommunicator, check=False
* ``graph``           local, check=False, captured once in a CUDA graph and replayed (the GPU work
  alone: no host launches)
* ``nccl_allreduce``  torch's plain fp32 all_reduce of the same tensor (a reference)

Two clocks: ``events_us`` is the median over calls of a CUDA-event pair recorded around each call
(what bench/gpu_bench.py reports; with a host sync inside the call it includes all host time of the
call); ``wall_us`` is host wall time of N back-to-back calls ending in a device sync, divided by N.
Then torch.profiler records one default call per size: its kernels and memory copies (device side)
and its CUDA runtime calls (host side), so the launches and syncs can be counted.
Writes ``latency.json`` and ``latency.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

import compcomm
from compcomm import _C
from gpu_bench import events_median  # bench/ is on sys.path when this script runs

TARGET_US = 40.0


def events_us(fn: Callable[[], None], iters: int, warmup: int = 5) -> float:
    """Median microseconds per call, each call between its own pair of CUDA events."""
    return events_median(fn, iters, warmup) * 1e6


def wall_us(fn: Callable[[], None], iters: int, warmup: int = 5) -> float:
    """Host wall microseconds per call over ``iters`` back-to-back calls and one final sync."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def profile_one(fn: Callable[[], None]) -> Dict[str, List[dict]]:
    """One call under torch.profiler: device events (kernels, copies) and host CUDA/NCCL calls."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    device, host = [], []
    for e in prof.events():
        dt = str(getattr(e, "device_type", ""))
        dur = float(getattr(e, "device_time", 0.0) or getattr(e, "cuda_time", 0.0) or 0.0)
        if dt.endswith("CUDA"):
            device.append({"name": e.name, "us": round(dur, 2)})
        elif e.name.startswith(("cuda", "nccl", "cu")) and not e.name.startswith("cudaDeviceSync"):
            host.append({"name": e.name, "us": round(float(e.cpu_time_total), 2)})
    return {"device": device, "host_api": host}


def run_size(k: int, local: _C.Communicator, iters: int) -> Dict[str, object]:
    n = 1 << k
    torch.manual_seed(k)
    t = torch.randn(n, device="cuda")
    we, se = compcomm.error_buffers(t)  # group=None: the one-rank nccl group (padding of W=1)
    we_l, se_l = compcomm.error_buffers(t, local)
    calls = {
        "default": lambda: compcomm.compressed_allreduce(t, we, se),
        "default_nocheck": lambda: compcomm.compressed_allreduce(t, we, se, check=False),
        "local": lambda: compcomm.compressed_allreduce(t, we_l, se_l, local),
        "local_nocheck": lambda: compcomm.compressed_allreduce(t, we_l, se_l, local, check=False),
        "nccl_allreduce": lambda: dist.all_reduce(t),
    }
    row: Dict[str, object] = {"log2_numel": k, "numel": n}
    for name, fn in calls.items():
        row[name] = {"events_us": events_us(fn, iters), "wall_us": wall_us(fn, iters)}
    # The GPU work alone: one local unchecked call captured and replayed.
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        calls["local_nocheck"]()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        calls["local_nocheck"]()
    row["graph"] = {"events_us": events_us(g.replay, iters), "wall_us": wall_us(g.replay, iters)}
    try:
        row["profile_default"] = profile_one(calls["default"])
    except Exception as e:  # the timings are what matters
        row["profile_default"] = {"error": f"{type(e).__name__}: {e}"}
    del g, t, we, se, we_l, se_l
    torch.cuda.empty_cache()
    return row


def markdown(meta: dict, rows: List[dict]) -> str:
    modes = ["default", "default_nocheck", "local", "local_nocheck", "graph", "nccl_allreduce"]
    out = [f"# compressed_allreduce latency, {meta['device']}, world size 1 ({meta['date']})", "",
           f"Command: `{meta['command']}`; torch {meta['torch']}; default communicator: "
           f"{meta['default_communicator']} (alone: {meta['default_alone']}).", "",
           "Per call, fp32. events = median CUDA-event time around each call; wall = host time of "
           "back-to-back calls / N.", "",
           "| size | " + " | ".join(f"{m} events us | {m} wall us" for m in modes) + " |",
           "|---|" + "---|---|" * len(modes)]
    for r in rows:
        cells = []
        for m in modes:
            cells += [f"{r[m]['events_us']:.1f}", f"{r[m]['wall_us']:.1f}"]
        out.append(f"| 2^{r['log2_numel']} | " + " | ".join(cells) + " |")
    out.append("")
    for r in rows:
        if r["log2_numel"] == 20:
            v = r["default"]["events_us"]
            out.append(f"Target (default path, 2^20 fp32 <= {TARGET_US:.0f} us): {v:.1f} us -> "
                       f"{'MET' if v <= TARGET_US else 'NOT MET'}.")
            out.append("")
    for r in rows:
        p = r.get("profile_default", {})
        out.append(f"## One default call at 2^{r['log2_numel']} under torch.profiler")
        if "error" in p:
            out.append(f"profiler failed: {p['error']}")
            continue
        out.append(f"Device ({len(p['device'])}): " + ", ".join(
            f"{d['name'][:60]} {d['us']} us" for d in p["device"]))
        out.append("")
        out.append(f"Host API ({len(p['host_api'])}): " + ", ".join(
            f"{d['name']} {d['us']} us" for d in p["host_api"]))
        out.append("")
    return "\n".join(out) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="20,28", help="log2 element counts")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    local = _C.LocalCommunicator()
    default = compcomm.get_communicator(None)
    meta = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "build_info": compcomm.build_info(),
        "default_communicator": default.backend_name(),
        "default_alone": bool(default.alone(torch.cuda.current_device())),
        "command": "python bench/bench_latency.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    rows: List[dict] = []
    os.makedirs(args.out, exist_ok=True)
    for k in (int(x) for x in args.sizes.split(",")):
        iters = args.iters if k <= 24 else max(20, args.iters // 10)
        r = run_size(k, local, iters)
        rows.append(r)
        print(f"2^{k}: " + "  ".join(f"{m} {r[m]['events_us']:.1f}/{r[m]['wall_us']:.1f} us" for m in
                                     ("default", "default_nocheck", "local", "local_nocheck", "graph",
                                      "nccl_allreduce")), flush=True)
        # written after every size, so a run cut short still leaves what it measured
        with open(os.path.join(args.out, "latency.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        md = markdown(meta, rows)
        with open(os.path.join(args.out, "latency.md"), "w") as f:
            f.write(md)
    print(md)
    compcomm._comm.forget_process_groups()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
