"""Compressed allreduce on GPUs: compcomm's native NCCL backend vs the torch adapter vs DeepSpeed.

One command, one device call (bench/run_nccl_gpu.sh runs it)::

    python bench/bench_nccl.py                       # world size 1, this process, cuda:0
    torchrun --nproc_per_node=4 bench/bench_nccl.py --out bench/results/nccl_h200x4

Series, for fp32 tensors of 2^16..2^28 elements (``--min-log``/``--max-log``):

- ``native``: ``compcomm.compressed_allreduce`` through the native NCCL communicator
  (``compcomm._nccl.make_nccl_communicator``): the whole algorithm in C++ on one stream.
- ``torch_adapter``: the same call through compcomm's TorchCommunicator over torch's
  ProcessGroupNCCL (a Python callback per collective), made explicitly: ``group=`` a torch
  ``nccl`` group now resolves to the native communicator.
- ``deepspeed``: DeepSpeed 0.19.6's ``NcclBackend.compressed_allreduce`` (needs cupy).
- ``nccl_allreduce`` / ``torch_allreduce``: the plain fp32 allreduce through the native communicator
  and through torch, the reference every compressed figure is a ratio against;
  ``nccl_allreduce_nonblocking``: the same through a non-blocking NCCL communicator.

On emulated hosts over Ethernet-like links (root, iproute2; see compcomm.bench.netns): ``--profile``
launches ``--world-size`` ranks of this script, each in its own network namespace with a shaped
veth, an own ``NCCL_HOSTID`` and NCCL over sockets on that veth, all sharing the local GPU(s)::

    python bench/bench_nccl.py --profile eth1g --world-size 4 --max-log 24 --log-step 2 --quick

There, and whenever ``--all-series`` is given, it also times the plain collectives a training step
uses: ``torch_allreduce_bf16``, ``torch_reduce_scatter`` (fp32) / ``torch_reduce_scatter_bf16``
and compcomm's 1-bit ``compressed_reduce_scatter`` through the native communicator
(``native_rs``) and through the TorchCommunicator (``torch_adapter_rs``).
Every row carries nccl-tests' columns: logical bytes, wire bytes one rank sends, algbw = logical
bytes / time, busbw = algbw * 2(W-1)/W (allreduce) or (W-1)/W (reduce-scatter).

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


#: warm-up calls, probe calls and the fewest timed calls (--quick: 1, 1, 2 for slow links)
_ITERS = {"warmup": 3, "probe": 5, "min": 5}


def _iterations(fn: Callable[[], Any], budget_s: float, world: int) -> int:
    """Rank 0 times a few calls and decides how many fit in budget_s; every rank gets its choice."""
    import torch.distributed as dist

    for _ in range(_ITERS["warmup"]):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(_ITERS["probe"]):
        fn()
    torch.cuda.synchronize()
    per = (time.perf_counter() - t0) / _ITERS["probe"]
    n = torch.tensor([max(_ITERS["min"], min(300, int(budget_s / max(per, 1e-7))))], device="cuda")
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
    p.add_argument("--log-step", type=int, default=1, help="sizes 2^min-log, 2^(min-log+step), ...")
    p.add_argument("--quick", action="store_true",
                   help="1 warm-up call, 1 probe call, at least 2 timed calls (slow links)")
    p.add_argument("--all-series", action="store_true",
                   help="also bf16 allreduce, fp32/bf16 reduce-scatter, 1-bit reduce-scatter")
    p.add_argument("--profile", default=None,
                   help="launch --world-size ranks as emulated hosts on this compcomm.bench.netns "
                        "profile (eth1g, eth10g, eth25g, unshaped: root; loopback)")
    p.add_argument("--world-size", type=int, default=2, help="ranks for --profile")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for a --profile run")
    args = p.parse_args(argv)
    if args.profile and "RANK" not in os.environ:
        return _launch(args, list(sys.argv[1:] if argv is None else argv))
    if args.quick:
        _ITERS.update(warmup=1, probe=1, min=2)
    if os.environ.get("COMPCOMM_BENCH_PROFILE"):
        args.all_series = True

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
    prof = os.environ.get("COMPCOMM_BENCH_PROFILE")
    out = args.out or (f"bench/results/nccl_{prof}_w{world}" if prof else
                       f"bench/results/nccl_h200{'' if world == 1 else f'x{world}'}")
    skip = set(filter(None, args.skip.split(",")))

    info = compcomm.build_info()
    native = make_nccl_communicator(device=local)
    native_nb = make_nccl_communicator(device=local, blocking=False)
    # explicit: group=dist.group.WORLD would resolve to a native communicator too
    adapter = compcomm.TorchCommunicator(dist.group.WORLD)
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
        "timing": "median CUDA-event time per call, calls back to back; fp32 unless the series "
                  "says bf16; sizes are logical bytes",
        "profile": prof or "local",
        "emulated_hosts": bool(prof),
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

    def add(series: str, log2: int, stats: Dict[str, float], esize: int = 4,
            **extra: Any) -> None:
        n = 1 << log2
        rs = "reduce_scatter" in series or series.endswith("_rs")
        row = {"log2": log2, "numel": n, "bytes": esize * n, "dtype": "bf16" if esize == 2 else "fp32",
               **stats, **extra}
        if "wire_bytes" not in row:  # plain ring: what one rank sends per call
            row["wire_bytes"] = (esize * n * (world - 1) // world) * (1 if rs else 2)
        row["algbw_GBps"] = esize * n / (stats["median_us"] * 1e-6) / 1e9
        row["busbw_GBps"] = row["algbw_GBps"] * (world - 1) / world * (1 if rs else 2)
        result["series"].setdefault(series, []).append(row)
        if rank == 0:
            print(
                f"{series:>15} 2^{log2:<2} {stats['median_us']:12.1f} us  iters {stats['iters']}",
                flush=True,
            )

    for log2 in range(args.min_log, args.max_log + 1, args.log_step):
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
        if args.all_series:
            b16 = x0.to(torch.bfloat16)
            if "torch_allreduce_bf16" not in skip:
                f = functools.partial(dist.all_reduce, b16)
                add("torch_allreduce_bf16", log2, _timed(f, _iterations(f, args.budget, world)),
                    esize=2)
            for name, src in (("torch_reduce_scatter", x0), ("torch_reduce_scatter_bf16", b16)):
                if name in skip or n % world:
                    continue
                dst = torch.empty(n // world, dtype=src.dtype, device="cuda")
                f = functools.partial(dist.reduce_scatter_tensor, dst, src)
                add(name, log2, _timed(f, _iterations(f, args.budget, world)),
                    esize=src.element_size())
                del dst
            for name, comm in (("native_rs", native), ("torch_adapter_rs", adapter)):
                if name in skip or not info["cuda"]:
                    continue
                from compcomm.zero import compressed_reduce_scatter

                we = torch.zeros(padded, device="cuda")
                se = torch.zeros(padded // world, device="cuda")
                t = x0.clone()
                o = torch.empty(padded // world, device="cuda")
                f = functools.partial(compressed_reduce_scatter, t, we, se, o, group=comm)
                b0 = comm.bytes_sent
                f()  # counts the bytes one call sends (about half the compressed allreduce's)
                rs_wire = comm.bytes_sent - b0
                add(name, log2, _timed(f, _iterations(f, args.budget, world)),
                    wire_bytes=rs_wire)
                del we, se, t, o
            f = None
            del b16

        # The first call of each compressed series on the same input, then timing.
        first: Dict[str, torch.Tensor] = {}
        for series, group in (("native", native), ("torch_adapter", adapter)):
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
                add("deepspeed", log2, _timed(f, _iterations(f, args.budget, world)),
                    wire_bytes=wire)
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


def _launch(args: argparse.Namespace, argv: List[str]) -> int:
    """``--profile``: run this script as ``--world-size`` emulated GPU hosts (compcomm.bench.runner
    gives each rank its namespace, shaped veth, NCCL_HOSTID, NCCL socket env and LOCAL_RANK)."""
    from compcomm.bench.runner import SweepError, run_on_profile

    gpus = torch.cuda.device_count()
    if gpus == 0:
        print("bench_nccl: no CUDA device", file=sys.stderr)
        return 2
    env = {"COMPCOMM_BENCH_PROFILE": args.profile, "PYTHONUNBUFFERED": "1"}
    try:
        run_on_profile(args.profile, args.world_size, [os.path.abspath(__file__), *argv],
                       timeout=args.timeout, gpus=gpus, env=env,
                       on_line=lambda line: print(line, end="", flush=True))
    except SweepError as e:
        print(f"bench_nccl: {args.profile} W={args.world_size} failed: {e}", file=sys.stderr)
        return 1
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
    where = "" if not result.get("emulated_hosts") else (
        f", {result['profile']} emulated hosts sharing the GPU")
    ax.set_title(
        f"{result['device']}, world size {result['world_size']}{where} (stars: targets)",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
