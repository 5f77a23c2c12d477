"""GPU benchmark: compcomm.compressed_allreduce against DeepSpeed 0.19.6's NcclBackend.compressed_allreduce.

One command, one GPU, world size 1 (communication is a local copy, so this measures the compression
compute and the launch/sync overheads -- the part compcomm replaces):

    python bench/gpu_bench.py [--sizes 20,22,24,26,28] [--out bench/results]

For each size 2^k and dtype (fp32, bf16) it reports, nccl-tests style, the median time per call over
CUDA events, the effective bandwidth (logical tensor bytes / time), the ratio to DeepSpeed measured in
the same run, the fraction of the HBM floor, and the peak extra GPU memory of one call.

* HBM floor: bytes that must move / device-to-device copy bandwidth measured in the same run. Bytes
  that must move = the tensor read and written once, the fp32 worker error read and written once, and
  the fp32 server error (P/W elements) read and written once. Fraction = floor / measured time.
* compcomm modes: ``default`` (what a torchrun user calls: ``group=None`` under a torch ``nccl``
  process group, check=True), ``check`` (a LocalCommunicator, check=True: one small device-to-host copy
  + stream sync per call), ``nocheck`` (check=False: no host sync) and ``graph`` (check=False captured once in a CUDA
  graph and replayed). The default mode's share of the floor is ``fraction_of_floor_default``.
* DeepSpeed's backend computes in the dtype of its buffer and its 1-bit optimizers hold fp32
  momentum; it was never run on bf16 buffers. For bf16 we time what a DeepSpeed user would have to do:
  upcast the bf16 tensor to fp32, run NcclBackend.compressed_allreduce on it, copy the result back.
* Peak extra memory: torch.cuda.max_memory_allocated() during one call (compcomm's workspace
  allocated in that call included) minus the memory allocated before it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

import compcomm
from compcomm import collectives as _coll


def events_median(fn: Callable[[], None], iters: int, warmup: int) -> float:
    """Median seconds per call, each call timed by its own pair of CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    pairs = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        pairs.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in pairs) / 1e3


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read and written (1 GiB copies)."""
    n = 1 << 28
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    t = events_median(lambda: dst.copy_(src), 20, 5)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * 4 * n / t


def _peak_extra(fn: Callable[[], None]) -> int:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _iters_for(seconds_per_call: float, budget: float = 0.5) -> int:
    return int(min(200, max(10, budget / max(seconds_per_call, 1e-6))))


def bench_compcomm(n: int, dtype: torch.dtype, comm) -> Dict[str, object]:
    _coll._workspaces.clear()
    torch.cuda.empty_cache()
    t = torch.randn(n, device="cuda").to(dtype)
    we, se = compcomm.error_buffers(n, comm, device="cuda")
    peak = _peak_extra(lambda: compcomm.compressed_allreduce(t, we, se, comm))
    res: Dict[str, object] = {"peak_extra_bytes": peak}
    probe = events_median(lambda: compcomm.compressed_allreduce(t, we, se, comm), 3, 1)
    iters = _iters_for(probe)
    res["check"] = events_median(lambda: compcomm.compressed_allreduce(t, we, se, comm), iters, 3)
    res["nocheck"] = events_median(
        lambda: compcomm.compressed_allreduce(t, we, se, comm, check=False), iters, 3
    )
    # what a user calls: group=None under an initialized torch 'nccl' process group (compcomm's
    # native NCCL communicator when built, else the torch adapter)
    res["default"] = events_median(lambda: compcomm.compressed_allreduce(t, we, se), iters, 3)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        compcomm.compressed_allreduce(t, we, se, comm, check=False)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode="thread_local"):
        compcomm.compressed_allreduce(t, we, se, comm, check=False)
    res["graph"] = events_median(g.replay, iters, 3)
    del g, t, we, se
    return res


def bench_deepspeed(ds, n: int, dtype: torch.dtype) -> Optional[Dict[str, object]]:
    if ds is None:
        return None
    torch.cuda.empty_cache()
    t = torch.randn(n, device="cuda").to(dtype)
    p = compcomm.padded_numel(n, 1)
    we = torch.zeros(p, device="cuda")
    se = torch.zeros(p, device="cuda")
    if dtype == torch.float32:

        def call() -> None:
            ds.compressed_allreduce(t, we, se, 0)

    else:  # upcast, compress in fp32, copy back (see the module docstring)

        def call() -> None:
            buf = t.float()
            out = ds.compressed_allreduce(buf, we, se, 0)
            t.copy_(out)

    peak = _peak_extra(call)
    probe = events_median(call, 2, 1)
    iters = max(5, min(30, _iters_for(probe, 0.4)))
    res = {"time": events_median(call, iters, 2), "peak_extra_bytes": peak}
    del t, we, se
    torch.cuda.empty_cache()
    return res


def first_call_agreement(ds, n: int, comm) -> Optional[float]:
    """Max |compcomm - DeepSpeed| / max|DeepSpeed| after one fp32 call from the same state."""
    if ds is None:
        return None
    x = torch.randn(n, device="cuda")
    a, b = x.clone(), x.clone()
    we_a, se_a = compcomm.error_buffers(n, comm, device="cuda")
    we_b, se_b = we_a.clone(), se_a.clone()
    compcomm.compressed_allreduce(a, we_a, se_a, comm)
    out = ds.compressed_allreduce(b, we_b, se_b, 0)
    return float((a - out).abs().max() / out.abs().max())


def setup_deepspeed():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        import deepspeed
        from deepspeed.runtime.comm.nccl import NcclBackend

        deepspeed.init_distributed(dist_backend="nccl", auto_mpi_discovery=False)
        return NcclBackend(), deepspeed.__version__
    except Exception as e:  # report, but still benchmark compcomm
        print(f"DeepSpeed unavailable: {type(e).__name__}: {e}", file=sys.stderr)
        return None, None


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="20,22,24,26,28", help="log2 element counts")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--name", default="gpu_h200")
    args = ap.parse_args(argv)
    torch.cuda.init()
    ds, ds_version = setup_deepspeed()
    comm = compcomm.LocalCommunicator()
    bw = copy_bandwidth()
    dev = torch.cuda.get_device_properties(0)
    meta = {
        "device": torch.cuda.get_device_name(0),
        "sms": dev.multi_processor_count,
        "torch": torch.__version__,
        "compcomm": compcomm.__version__,
        "build_info": compcomm.build_info(),
        "deepspeed": ds_version,
        "copy_bandwidth_Bps": bw,
        "python": platform.python_version(),
        "world_size": 1,
        "default_communicator": compcomm.get_communicator(None).backend_name(),
        "command": "python bench/gpu_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    print(f"# {meta['device']}  copy bandwidth {bw / 1e12:.2f} TB/s  torch {torch.__version__}  "
          f"deepspeed {ds_version}")
    rows = []
    hdr = (f"{'dtype':>8} {'size':>6} {'default':>9} {'check(us)':>10} {'nocheck':>9} {'graph':>9} {'DS(us)':>10} "
           f"{'GB/s':>7} {'xDS':>6} {'floor%':>7} {'extraMB':>8} {'%tensor':>7} {'DSextraMB':>9} {'agree':>8}")
    print(hdr)
    for dname in args.dtypes.split(","):
        dtype = getattr(torch, dname)
        elt = torch.empty((), dtype=dtype).element_size()
        for k in (int(s) for s in args.sizes.split(",")):
            n = 1 << k
            p = compcomm.padded_numel(n, 1)
            c = bench_compcomm(n, dtype, comm)
            d = bench_deepspeed(ds, n, dtype)
            agree = first_call_agreement(ds, n, comm) if dtype == torch.float32 else None
            must_move = 2 * n * elt + 8 * p + 8 * p  # tensor, worker error, server error (W=1)
            floor = must_move / bw
            row = {
                "dtype": dname,
                "log2_numel": k,
                "numel": n,
                "tensor_bytes": n * elt,
                "compcomm_default_s": c["default"],
                "speedup_vs_deepspeed_default": d["time"] / c["default"] if d else None,
                "compcomm_check_s": c["check"],
                "compcomm_nocheck_s": c["nocheck"],
                "compcomm_graph_s": c["graph"],
                "compcomm_peak_extra_bytes": c["peak_extra_bytes"],
                "deepspeed_s": d["time"] if d else None,
                "deepspeed_peak_extra_bytes": d["peak_extra_bytes"] if d else None,
                "speedup_vs_deepspeed": d["time"] / c["check"] if d else None,
                "speedup_vs_deepspeed_nocheck": d["time"] / c["nocheck"] if d else None,
                "must_move_bytes": must_move,
                "floor_s": floor,
                "fraction_of_floor_default": floor / c["default"],
                "fraction_of_floor": floor / c["check"],
                "fraction_of_floor_nocheck": floor / c["nocheck"],
                "effective_GBps": n * elt / c["check"] / 1e9,
                "first_call_rel_diff_vs_deepspeed": agree,
            }
            rows.append(row)
            print(
                f"{dname:>8} {'2^' + str(k):>6} {c['default'] * 1e6:9.1f} {c['check'] * 1e6:10.1f} {c['nocheck'] * 1e6:9.1f} "
                f"{c['graph'] * 1e6:9.1f} {(d['time'] * 1e6 if d else float('nan')):10.1f} "
                f"{row['effective_GBps']:7.1f} {(row['speedup_vs_deepspeed'] or float('nan')):6.1f} "
                f"{100 * row['fraction_of_floor']:6.1f}% {c['peak_extra_bytes'] / 2**20:8.2f} "
                f"{100 * c['peak_extra_bytes'] / (n * elt):6.2f}% "
                f"{(d['peak_extra_bytes'] / 2**20 if d else float('nan')):9.1f} "
                f"{(agree if agree is not None else float('nan')):8.1e}",
                flush=True,
            )
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{args.name}.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print("wrote", path)
    try:
        plot(rows, meta, os.path.join(args.out, f"{args.name}.png"))
    except Exception as e:  # the JSON is what matters
        print(f"plot failed: {e}", file=sys.stderr)
    return 0


def plot(rows: List[dict], meta: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = sorted({r["dtype"] for r in rows}, reverse=True)
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4.5), squeeze=False)
    for ax, dname in zip(axes[0], dtypes):
        rs = [r for r in rows if r["dtype"] == dname]
        x = [r["numel"] for r in rs]
        ax.plot(x, [r["compcomm_default_s"] * 1e3 for r in rs], "D-",
                label=f"compcomm default (group=None: {meta['default_communicator']})")
        ax.plot(x, [r["compcomm_check_s"] * 1e3 for r in rs], "o-", label="compcomm (check=True)")
        ax.plot(x, [r["compcomm_nocheck_s"] * 1e3 for r in rs], "s--", label="compcomm (check=False)")
        ax.plot(x, [r["compcomm_graph_s"] * 1e3 for r in rs], "^:", label="compcomm (CUDA graph)")
        if rs[0]["deepspeed_s"] is not None:
            lbl = "DeepSpeed 0.19.6 NcclBackend" + (" (fp32 upcast)" if dname != "float32" else "")
            ax.plot(x, [r["deepspeed_s"] * 1e3 for r in rs], "x-", label=lbl)
        ax.plot(x, [r["floor_s"] * 1e3 for r in rs], "k-", lw=0.8, label="HBM floor")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("elements")
        ax.set_ylabel("ms per call (median, CUDA events)")
        ax.set_title(f"{dname}, world size 1, {meta['device']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"1-bit compressed allreduce; copy bandwidth {meta['copy_bandwidth_Bps'] / 1e12:.2f} TB/s", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("wrote", path)


if __name__ == "__main__":
    raise SystemExit(main())
