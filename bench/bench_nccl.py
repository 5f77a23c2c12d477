"""Compressed allreduce on GPUs: compcomm's native NCCL backend vs the torch adapter vs DeepSpeed.

One command, one device call (bench/run_nccl_gpu.sh runs it)::

    python bench/bench_nccl.py                       # world size 1, this process, cuda:0
    torchrun --nproc_per_node=4 bench/bench_nccl.py --out bench/results/nccl_h200x4

Series, for fp32 tensors of 2^16..2^28 elements (``--min-log``/``--max-log``):

- ``native``: ``compcomm.compressed_allreduce`` through the native NCCL communicator
  (``compcomm._nccl.make_nccl_communicator``): the whole algorithm in C++ on one stream.
- ``torch_adapter``: the same call through compcomm's TorchCommunicator over torch's
  ProcessGroupNCCL (a Python callback per collective).
- ``deepspeed``: DeepSpeed 0.19.6's ``NcclBackend.compressed_allreduce`` (needs cupy).
- ``nccl_allreduce`` / ``torch_allreduce``: the plain fp32 allreduce through the native communicator
  and through torch, the reference every compressed figure is a ratio against;
  ``nccl_allreduce_nonblocking``: the same through a non-blocking NCCL communicator.

Time: median over iterations of CUDA-event time from before the call to after it (calls issued back
to back, so a host-bound path shows its host time). Rank 0 picks the iteration count from a timed
warm-up and broadcasts it. The first call of each compressed series is checked against the native
result on the same input (#wrong: elements differing by more than 1e-5 relative). Sizes are logical
(uncompressed) fp32 bytes; wire bytes are listed too. Writes ``<out>.json`` and ``<out>.png``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch

TARGETS_US = {16: 25.0, 20: 40.0}  # world size 1 on an H200 (issue: NCCL backend)


def _timed(fn: Callable[[], Any], iters: int) -> Dict[str, float]:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(iters):
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / iters
    us = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))
    return {
        "median_us": statistics.median(us),
        "p10_us": us[len(us) // 10],
        "p90_us": us[(len(us) * 9) // 10],
        "wall_us_per_iter": wall * 1e6,
        "iters": iters,
    }


def _iterations(fn: Callable[[], Any], budget_s: float, world: int) -> int:
    """Rank 0 times a few calls and decides how many fit in budget_s; every rank gets its choice."""
    import torch.distributed as dist

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    per = (time.perf_counter() - t0) / 5
    n = torch.tensor([max(5, min(300, int(budget_s / max(per, 1e-7))))], device="cuda")
    if world > 1:
        dist.broadcast(n, src=0)
    return int(n.item())


def _wrong(got: torch.Tensor, want: torch.Tensor) -> int:
    tol = 1e-5 * want.abs().max().clamp_min(1e-30)
    return int(((got.float() - want.float()).abs() > tol).sum().item())


def _deepspeed_backend() -> Any:
    import deepspeed
    import deepspeed.comm as ds_dist
    from deepspeed.runtime.comm.nccl import NcclBackend  # imports cupy

    if not ds_dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl", auto_mpi_discovery=False)
    return NcclBackend()


def main(argv: Optional[List[str]] = None) -> int:
    import compcomm
    import torch.distributed as dist
    from compcomm._buffers import buffer_of
    from compcomm._nccl import make_nccl_communicator, shutdown_nccl

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--min-log", type=int, default=16)
    p.add_argument("--max-log", type=int, default=28)
    p.add_argument(
        "--budget", type=float, default=0.4, help="seconds of timed calls per series and size"
    )
    p.add_argument("--out", default=None, help="output path without extension")
    p.add_argument("--skip", default="", help="comma-separated series to skip")
    args = p.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench_nccl: no CUDA device", file=sys.stderr)
        return 2
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    if "RANK" not in os.environ:  # run directly: a world of one rank in this process
        from compcomm.testing import free_port

        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1"
        )
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    out = args.out or f"bench/results/nccl_h200{'' if world == 1 else f'x{world}'}"
    skip = set(filter(None, args.skip.split(",")))

    info = compcomm.build_info()
    native = make_nccl_communicator(device=local)
    native_nb = make_nccl_communicator(device=local, blocking=False)
    result: Dict[str, Any] = {
        "device": torch.cuda.get_device_name(local),
        "world_size": world,
        "torch": torch.__version__,
        "torch_nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "compcomm_build": {
            k: info[k] for k in ("version", "cuda", "cuda_version", "nccl", "nccl_version")
        },
        "nccl_library": compcomm._C.nccl.load([]),
        "nccl_runtime_version": compcomm._C.nccl.runtime_version(),
        "timing": "median CUDA-event time per call, calls back to back; fp32; sizes are logical bytes",
        "series": {},
        "skipped": {},
        "checks": [],
    }
    ds = None
    if "deepspeed" not in skip:
        try:
            ds = _deepspeed_backend()
            import deepspeed

            result["deepspeed_version"] = deepspeed.__version__
        except Exception as e:  # missing package, missing cupy, ...
            result["skipped"]["deepspeed"] = f"{type(e).__name__}: {e}"
    if not info["cuda"]:
        for s in ("native", "torch_adapter"):
            result["skipped"][s] = "this build has no CUDA kernels (compressed allreduce on GPU)"
            skip.add(s)

    def add(series: str, log2: int, stats: Dict[str, float], **extra: Any) -> None:
        n = 1 << log2
        row = {"log2": log2, "numel": n, "bytes": 4 * n, **stats, **extra}
        row["algbw_GBps"] = 4 * n / (stats["median_us"] * 1e-6) / 1e9
        result["series"].setdefault(series, []).append(row)
        if rank == 0:
            print(
                f"{series:>15} 2^{log2:<2} {stats['median_us']:12.1f} us  iters {stats['iters']}",
                flush=True,
            )

    for log2 in range(args.min_log, args.max_log + 1):
        n = 1 << log2
        gen = torch.Generator(device="cuda").manual_seed(1000 + rank)
        x0 = torch.randn(n, device="cuda", generator=gen)
        padded = compcomm.padded_numel(n, world)
        wire = compcomm.wire_bytes(n, world, padded)

        # Plain allreduce, native and torch.
        buf = x0.clone()
        if "nccl_allreduce" not in skip:
            st = torch.cuda.current_stream().cuda_stream
            f = functools.partial(native.all_reduce, buffer_of(buf), stream=st)
            add("nccl_allreduce", log2, _timed(f, _iterations(f, args.budget, world)))
        if "nccl_allreduce_nonblocking" not in skip:
            st = torch.cuda.current_stream().cuda_stream
            f = functools.partial(native_nb.all_reduce, buffer_of(buf), stream=st)
            add("nccl_allreduce_nonblocking", log2, _timed(f, _iterations(f, args.budget, world)))
        if "torch_allreduce" not in skip:
            f = functools.partial(dist.all_reduce, buf)
            add("torch_allreduce", log2, _timed(f, _iterations(f, args.budget, world)))
        f = None  # drop the closure over buf
        del buf

        # The first call of each compressed series on the same input, then timing.
        first: Dict[str, torch.Tensor] = {}
        for series, group in (("native", native), ("torch_adapter", dist.group.WORLD)):
            if series in skip:
                continue
            we = torch.zeros(padded, device="cuda")
            se = torch.zeros(padded // world, device="cuda")
            t = x0.clone()
            compcomm.compressed_allreduce(t, we, se, group=group)
            first[series] = t.clone()  # t is overwritten by the timed calls
            f = functools.partial(compcomm.compressed_allreduce, t, we, se, group=group)
            add(series, log2, _timed(f, _iterations(f, args.budget, world)), wire_bytes=wire)
            del we, se, f
        if ds is not None:
            try:
                we = torch.zeros(padded, device="cuda")
                se = torch.zeros(padded // world, device="cuda")
                t = x0.clone()
                first["deepspeed"] = ds.compressed_allreduce(t, we, se, local).clone()
                f = functools.partial(ds.compressed_allreduce, t, we, se, local)
                add("deepspeed", log2, _timed(f, _iterations(f, args.budget, world)))
                del we, se, f
            except Exception as e:
                result["skipped"]["deepspeed"] = f"failed at 2^{log2}: {type(e).__name__}: {e}"
                ds = None
        if "native" in first:
            for other in ("torch_adapter", "deepspeed"):
                if other in first:
                    result["checks"].append(
                        {
                            "log2": log2,
                            "series": other,
                            "vs": "native",
                            "wrong": _wrong(first[other], first["native"]),
                        }
                    )
        del first, x0
        torch.cuda.empty_cache()

    # Ratios against the plain allreduce of the same run, and the W=1 targets.
    ref = {r["log2"]: r["median_us"] for r in result["series"].get("torch_allreduce", [])}
    for rows in result["series"].values():
        for r in rows:
            if r["log2"] in ref:
                r["vs_torch_allreduce"] = r["median_us"] / ref[r["log2"]]
    if world == 1 and "native" in result["series"]:
        t = {r["log2"]: r["median_us"] for r in result["series"]["native"]}
        result["targets"] = {
            f"2^{k}": {
                "target_us": v,
                "median_us": t.get(k),
                "met": t.get(k) is not None and t[k] <= v,
            }
            for k, v in TARGETS_US.items()
        }
    if rank == 0:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out + ".json", "w") as fh:
            json.dump(result, fh, indent=1)
        _plot(result, out + ".png")
        print(json.dumps({k: result[k] for k in ("skipped", "checks", "nccl_library")}, indent=1))
        if "targets" in result:
            print("targets:", json.dumps(result["targets"]))
    shutdown_nccl()
    dist.destroy_process_group()
    return 0


def _plot(result: Dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for series, rows in result["series"].items():
        ax.plot(
            [r["numel"] for r in rows], [r["median_us"] for r in rows], marker="o", label=series
        )
    if "targets" in result:
        for k, v in result["targets"].items():
            ax.plot([1 << int(k[2:])], [v["target_us"]], "k*", markersize=10)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("fp32 elements")
    ax.set_ylabel("median time per call (us)")
    ax.set_title(
        f"compressed allreduce, {result['device']}, world size {result['world_size']} (stars: targets)"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
