"""Bytes and memory of compcomm's FSDP2 all-gather (compcomm.fsdp.compressed_allgather), CPU, gloo.

For compcomm-bench train's model (``fully_shard`` per block and the root, fp32 on the CPU), one
training step per mode after a first one, rank 0: the all-gather bytes this rank sent per step
(ring convention), the gathers and cache hits, the cache's peak bytes (held from a module's forward
gather to its backward one) against the model's parameter bytes, and the bytes FSDP's own
all-gather sends for the same step. ``--kernels N``: also the time of this process's int8
quantize of an N-element fp32 shard and dequantize of W such shards, as ratios to copying the same
fp32 data (one run, median of 7; run it under the benchmark lock).

Run: python bench/bench_fsdp_gather.py --world 2 --model tiny --out bench/results/fsdp_gather_cpu.md
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List

MODES = {"fsdp": None, "cache": dict(quantized=False, cache=True),
         "int8": dict(quantized=True, cache=False), "int8+cache": dict(quantized=True, cache=True)}


def _rank(rank: int, world: int, model_name: str) -> List[Dict[str, Any]]:
    import torch
    from torch.distributed.fsdp import FSDPModule

    import compcomm.fsdp as cf
    import compcomm.fsdp_gather as fg
    from compcomm.bench.train_rank import MODELS, build_model
    from compcomm.bench.train_setups import shard_blocks

    cfg = MODELS[model_name]
    out = []
    for mode, kw in MODES.items():
        torch.manual_seed(0)
        model = build_model(**cfg)
        shard_blocks(model, world)
        nparams = sum(p.numel() for p in model.parameters())
        if kw:
            st = cf.compressed_allgather(model, **kw)
        else:  # FSDP's own gather, counted the same way: an exact, cache-less state
            st = fg.GatherState(False, False, 256)
            for n, m in model.named_modules():
                if isinstance(m, FSDPModule):
                    m.set_custom_all_gather(fg.CompressedAllGather(st, n, m))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randint(0, 256, (2, cfg["seq"]), generator=torch.Generator().manual_seed(rank))
        counts = []
        for _ in range(2):
            before = dict(st.counters())
            opt.zero_grad()
            logits = model(x)
            logits.float().pow(2).mean().backward()
            opt.step()
            counts.append({k: v - before[k] for k, v in st.counters().items()})
        out.append({"mode": mode, "params": nparams, "param_bytes": nparams * 4, **counts[-1],
                    "peak_cache_bytes": st.peak_cache_bytes})
    return out


def _kernel_lines(n: int, world: int) -> List[str]:
    import statistics
    import time

    import torch

    from compcomm.quantize import dequantize_blockwise, quantize_blockwise, round_stochastic

    torch.set_num_threads(1)
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    out = torch.empty(world * n)
    payload = torch.cat([quantize_blockwise(x)] * world)
    src = torch.randn(world * n)

    def med(fn: Any) -> float:
        fn()
        ts = []
        for _ in range(7):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    copy_one = med(lambda: x.clone())
    copy_all = med(lambda: out.copy_(src))
    q = med(lambda: quantize_blockwise(x))
    gen = torch.Generator().manual_seed(1)
    qs = med(lambda: quantize_blockwise(x, generator=gen))
    cast = med(lambda: x.to(torch.bfloat16))
    casts = med(lambda: round_stochastic(x, torch.bfloat16, gen))
    d = med(lambda: dequantize_blockwise(payload, n, out))
    return ["", f"Kernels (torch ops, one thread, fp32, n = {n}, W = {world}; median of 7):", "",
            f"- quantize one shard: {q * 1e3:.2f} ms = {q / copy_one:.1f}x a copy of the shard "
            f"({copy_one * 1e3:.2f} ms)",
            f"- quantize one shard, stochastic rounding: {qs * 1e3:.2f} ms = {qs / q:.2f}x round "
            f"to nearest",
            f"- bf16 cast of one shard, stochastic: {casts * 1e3:.2f} ms = {casts / cast:.2f}x "
            f"torch's cast ({cast * 1e3:.2f} ms)",
            f"- dequantize W shards: {d * 1e3:.2f} ms = {d / copy_all:.1f}x a copy of the W shards "
            f"({copy_all * 1e3:.2f} ms)"]


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--out", default=None)
    ap.add_argument("--kernels", type=int, default=0, help="also time the int8 kernels on N elements")
    a = ap.parse_args(argv)
    from compcomm.testing import run_ranks

    rows = run_ranks(a.world, _rank, a.model, timeout=600)[0]
    base = rows[0]["bytes_sent"]
    lines = [f"# compcomm's FSDP2 all-gather: bytes and cache memory (CPU, gloo, W={a.world}, "
             f"model {a.model}, {rows[0]['params']} parameters, fp32; rank 0, one step)", "",
             "| mode | gathers | cache hits | gather bytes/step | vs FSDP | cache peak | "
             "cache peak / parameter bytes |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['gathers']} | {r['hits']} | {r['bytes_sent']} | "
                     f"{base / r['bytes_sent']:.2f}x fewer | {r['peak_cache_bytes']} | "
                     f"{r['peak_cache_bytes'] / r['param_bytes']:.3f} |")
    if a.kernels:
        lines += _kernel_lines(a.kernels, a.world)
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
