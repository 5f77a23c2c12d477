"""OneBitAdam's per-step update on one GPU: the torch._foreach path against the multi-tensor kernels
of compcomm.optim._fused, same tensors, same run, CUDA events, medians.

Model: GPT-style shapes (12 layers, d 768, vocab 46080, context 1024): 121M parameters in 148
tensors, cut into lists as the optimizer cuts them (optim._params.group_chunks). Rows:

- ``momentum``: the compressed phase's staging, out = b1 m + (1-b1) g (reads m, g; writes out);
- ``compressed step``: m = averaged; w -= lr (m / (sqrt(v)+eps) + wd w) (reads a, v, w;
  writes m, w);
- ``warm-up step``: both moments from g, then the step (reads m, v, g, w; writes m, v, w);
- each with bf16 parameters too (fp32 master updated, bf16 copy written: +2 bytes/element);
- ``one-rank compressed step``: the momentum from g, then the step, in one pass (what a world of
  one rank runs: reads m, v, g, w; writes m, w);
- ``OneBitAdam.step``: a whole compressed-phase step at W=1 (gradient checks included), with
  ``COMPCOMM_FUSED_OPTIM=0`` for the foreach column; and ``OneBitLamb.step``'s (its CUDA passes and
  its torch ops), printed under the table.

The floor is the bytes the row must move (listed per element) at this run's own
device-to-device copy bandwidth (1 GiB, read + write; about 4.2 TB/s on an H200, 3.0 on an H100).

Run: python bench/bench_fused_optim.py --out results.md [--iters 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Callable, List, Tuple

import torch

DEVICE = "cuda"


def gpt_shapes(layers: int = 12, d: int = 768, vocab: int = 46080, ctx: int = 1024
               ) -> List[Tuple[int, ...]]:
    per_layer = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,),
                 (d, 4 * d), (d,)]
    return [(vocab, d), (ctx, d)] + per_layer * layers + [(d,), (d,)]


def timed(fn: Callable[[], None], iters: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` over ``iters`` runs, each between two CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def copy_bandwidth(iters: int) -> float:
    """This run's device-to-device copy bandwidth (bytes read + written per second), 1 GiB."""
    x = torch.empty(2**28, device=DEVICE)
    y = torch.empty_like(x)
    ms = timed(lambda: y.copy_(x), iters)
    return 2 * x.numel() * 4 / (ms * 1e-3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="markdown file to write the table to")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    from compcomm.optim import OneBitAdam, OneBitLamb
    from compcomm.optim import _fused
    from compcomm.optim import functional as F
    from compcomm.optim._params import group_chunks
    if not _fused.available():
        print("compcomm was built without the CUDA kernels: nothing to compare")
        return 1

    dev = torch.device(DEVICE)
    torch.manual_seed(0)
    shapes = gpt_shapes()
    n = sum(torch.Size(s).numel() for s in shapes)
    group = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, bias_correction=False)

    def fp32s(scale: float = 1.0) -> List[torch.Tensor]:
        return [torch.randn(s, device=dev) * scale for s in shapes]

    ws, ms, vs, gs, avgs, outs = fp32s(), fp32s(0.1), [t.square() for t in fp32s(0.1)], \
        fp32s(0.01), fp32s(0.1), fp32s()
    lowps = [w.to(torch.bfloat16) for w in ws]
    # the optimizer's lists: runs of at most CHUNK_ELEMENTS elements
    chunks = [[item[2] for item in run]
              for _, run in group_chunks([(group, w, i) for i, w in enumerate(ws)])]

    def pick(ts, idx):
        return [ts[i] for i in idx]

    def foreach_momentum():
        for c in chunks:
            F.onebit_momentum_multi(pick(ms, c), pick(gs, c), group, pick(outs, c))

    def fused_momentum():
        for c in chunks:
            _fused.onebit_momentum(pick(ms, c), pick(gs, c), group, pick(outs, c), check=False)

    def foreach_step(warm: bool, low: bool):
        def run():
            for c in chunks:
                m, v, w = pick(ms, c), pick(vs, c), pick(ws, c)
                if warm:
                    F.adam_moments_multi_(m, v, pick(gs, c), group)
                else:
                    torch._foreach_copy_(m, pick(avgs, c))
                F.adam_step_multi_(w, m, v, group, 10, 10)
                if low:
                    torch._foreach_copy_(pick(lowps, c), w)
        return run

    def fused_step(warm: bool, low: bool):
        fn = _fused.adam_warmup_step_ if warm else _fused.onebit_compressed_step_
        def run():
            for c in chunks:
                fn(pick(ws, c), pick(ms, c), pick(vs, c), pick(gs if warm else avgs, c), group,
                   10, 10, pick(lowps, c) if low else None, check=False)
        return run

    rows = []  # (name, bytes per element, foreach ms, fused ms)
    rows.append(("momentum (fp32)", 12, timed(foreach_momentum, args.iters),
                 timed(fused_momentum, args.iters)))
    for low in (False, True):
        tag = "bf16 params" if low else "fp32"
        rows.append((f"compressed step ({tag})", 20 + 2 * low,
                     timed(foreach_step(False, low), args.iters),
                     timed(fused_step(False, low), args.iters)))
        rows.append((f"warm-up step ({tag})", 28 + 2 * low,
                     timed(foreach_step(True, low), args.iters),
                     timed(fused_step(True, low), args.iters)))
    rows.append(("momentum + compressed step (fp32)", 32, rows[0][2] + rows[1][2],
                 rows[0][3] + rows[1][3]))

    def foreach_local():
        for c in chunks:
            m = pick(ms, c)
            F.onebit_momentum_multi(m, pick(gs, c), group, m)
            F.adam_step_multi_(pick(ws, c), m, pick(vs, c), group, 10, 10)

    def fused_local():
        for c in chunks:
            _fused.onebit_local_step_(pick(ws, c), pick(ms, c), pick(vs, c), pick(gs, c), group,
                                      10, 10, check=False)

    rows.append(("one-rank compressed step (fp32)", 24, timed(foreach_local, args.iters),
                 timed(fused_local, args.iters)))
    for ts in (ms, vs, gs, avgs, outs, lowps, ws):
        ts.clear()  # free the micro-benchmark's tensors
    torch.cuda.empty_cache()

    # a whole compressed-phase step at W=1 (one process, no communication)
    params = [torch.nn.Parameter(torch.randn(s, device=dev) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 0.01
    opt = OneBitAdam(params, lr=1e-4, freeze_step=1, weight_decay=0.01)
    opt.step()  # the warm-up step; every later one is compressed
    step_ms = {}
    for env in ("0", "1"):
        os.environ["COMPCOMM_FUSED_OPTIM"] = env
        step_ms[env] = timed(opt.step, args.iters)
    os.environ.pop("COMPCOMM_FUSED_OPTIM")
    rows.append(("OneBitAdam.step, compressed phase, W=1 (fp32)", 32, step_ms["0"], step_ms["1"]))
    # OneBitLamb's compressed step: the CUDA passes, and its torch ops
    del opt
    lamb = OneBitLamb(params, lr=1e-4, freeze_step=1, weight_decay=0.01)
    lamb.step()
    lamb_ms = {}
    for env in ("0", "1"):
        os.environ["COMPCOMM_FUSED_OPTIM"] = env
        lamb_ms[env] = timed(lamb.step, args.iters)
    os.environ.pop("COMPCOMM_FUSED_OPTIM")
    del lamb
    bw = copy_bandwidth(args.iters)

    name = torch.cuda.get_device_name(dev)
    lines = [f"OneBitAdam update on {name}, {n / 1e6:.1f}M parameters in {len(shapes)} tensors "
             f"({len(chunks)} lists); CUDA events, median of {args.iters}; "
             f"torch {torch.__version__}",
             "",
             "| row | bytes/elem | foreach ms | fused ms | speedup "
             f"| floor ms ({bw / 1e12:.2f} TB/s) | fused / floor |",
             "|---|---|---|---|---|---|---|"]
    for row, b, fe, fu in rows:
        floor = n * b / bw * 1e3
        lines.append(f"| {row} | {b} | {fe:.3f} | {fu:.3f} | {fe / fu:.2f}x | {floor:.3f} | "
                     f"{fu / floor:.2f}x |")
    lines += ["", f"Copy bandwidth measured in this run (1 GiB fp32, read + write): "
              f"{bw / 1e12:.2f} TB/s. The foreach column is torch {torch.__version__}'s "
              "_foreach ops in the order of compcomm/optim/functional.py; the OneBitAdam.step row "
              "includes its gradient checks (one host sync) and Python overhead in both columns.",
              "", f"OneBitLamb.step, compressed phase, W=1 (fp32, gradient checks included): "
              f"CUDA passes {lamb_ms['1']:.3f} ms ({lamb_ms['1'] / (n * 32 / bw * 1e3):.2f}x the "
              f"32 bytes/elem floor above), torch ops (COMPCOMM_FUSED_OPTIM=0) "
              f"{lamb_ms['0']:.3f} ms, {lamb_ms['0'] / lamb_ms['1']:.2f}x slower."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
