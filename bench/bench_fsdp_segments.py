"""What tensor-aligned segments cost compcomm.fsdp's 1-bit reduce-scatter, CPU, gloo.

For compcomm-bench train's model (``fully_shard`` per block and the root, fp32), rank 0 times the
1-bit reduce-scatter of one transformer block (``OneBitReduceScatter.__call__`` on a random input
of that block's FSDP layout) with one segment per module (``segment_elements=None``, the layout
before segments), with the default tensor-aligned segments (16384) in one batched exchange, and
with one exchange per segment (``batch_segments=False``), interleaved, median of ``--reps`` each,
in one run; and the whole model's reductions per step (all modules). Every
segment has its own worker, server and commit passes (and, unbatched, two collectives). Run it
under the benchmark lock.

Run: flock /tmp/compcomm-bench.lock python bench/bench_fsdp_segments.py --world 2 \
         --out bench/results/fsdp_segments_cpu.md
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Dict


def _rank(rank: int, world: int, model_name: str, reps: int) -> Dict[str, Any]:
    import torch
    from torch.distributed.fsdp import FSDPModule

    import compcomm.fsdp as cf
    from compcomm.bench.train_rank import MODELS, build_model
    from compcomm.bench.train_setups import shard_blocks

    cfg = MODELS[model_name]
    torch.manual_seed(0)
    model = build_model(**cfg)
    mesh = shard_blocks(model, world)
    group = mesh.get_group()
    mods = [(n or "<root>", m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    layouts = {}
    for limit in (None, 16384, "unbatched"):
        st = cf.onebit(model, warmup_steps=0, mode="gradient",
                       segment_elements=None if limit is None else 16384)
        st.batch_segments = limit != "unbatched"
        layouts[limit] = (st, {n: sum(st.segments[n]) for n, _ in mods if n in st.segments})
    name = "blocks.0"
    s = layouts[None][1][name]
    gen = torch.Generator().manual_seed(rank)
    inp = torch.randn(world * s, generator=gen)
    out = torch.empty(s)
    inputs = {n: torch.randn(world * sz, generator=gen) for n, sz in layouts[None][1].items()}
    outs = {n: torch.empty(sz) for n, sz in layouts[None][1].items()}
    modes = (None, 16384, "unbatched")
    times: Dict[Any, list] = {m: [] for m in modes}
    whole: Dict[Any, list] = {m: [] for m in modes}
    for i in range(reps + 1):
        for limit in modes:
            st, sizes = layouts[limit]
            rs = cf.OneBitReduceScatter(st, name)
            t0 = time.perf_counter()
            rs(out, inp, group, torch.distributed.ReduceOp.AVG)
            t1 = time.perf_counter()
            for n, sz in sizes.items():  # every module once: one step's reductions
                cf.OneBitReduceScatter(st, n)(outs[n], inputs[n], group,
                                             torch.distributed.ReduceOp.AVG)
            t2 = time.perf_counter()
            if i:  # the first round warms up
                times[limit].append(t1 - t0)
                whole[limit].append(t2 - t1)
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    st16 = layouts[16384][0]
    return {"block_elems": world * s, "block_segments": len(st16.segments[name]),
            "all_segments": sum(len(v) for v in st16.segments.values()), "modules": len(mods),
            "block_ms": {str(k): 1e3 * med(v) for k, v in times.items()},
            "step_ms": {str(k): 1e3 * med(v) for k, v in whole.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tests"))
    from compcomm.testing import run_ranks

    r = run_ranks(a.world, _rank, a.model, a.reps, timeout=600)[0]
    b, st = r["block_ms"], r["step_ms"]
    text = (f"# Tensor-aligned segments in compcomm.fsdp's 1-bit reduce-scatter (CPU, gloo, W={a.world})\n\n"
            f"Machine: 2-core VM shared with other agents, one run under the benchmark lock, rank 0, "
            f"median of {a.reps}; `python bench/bench_fsdp_segments.py --world {a.world} --model "
            f"{a.model}`. Model `{a.model}` (compcomm-bench train's), fp32, {r['modules']} FSDP "
            f"modules, {r['all_segments']} segments in all with the default 16384.\n\n"
            "| what | one segment per module | segments, batched (default) | ratio | "
            "segments, one exchange each | ratio |\n|---|---:|---:|---:|---:|---:|\n"
            f"| one block ({r['block_elems']} elements, {r['block_segments']} segments) | "
            f"{b['None']:.2f} ms | {b['16384']:.2f} ms | {b['16384'] / b['None']:.2f}x | "
            f"{b['unbatched']:.2f} ms | {b['unbatched'] / b['None']:.2f}x |\n"
            f"| every module once (one step's reductions) | {st['None']:.2f} ms | "
            f"{st['16384']:.2f} ms | {st['16384'] / st['None']:.2f}x | {st['unbatched']:.2f} ms | "
            f"{st['unbatched'] / st['None']:.2f}x |\n")
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
