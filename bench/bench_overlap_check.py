"""The cost of overlap_backward's value check (compcomm.optim.overlap, "The value check") on
the CPU: OneBitAdam(overlap_backward=True) over gloo, W ranks on this machine, a model of about
``--params`` parameters in Linear layers, compressed phase. The same optimizer alternates steps
with the check and without it (``BackwardOverlap._changed`` answering "unchanged" at once), so
both are measured in the same run; also the check's own time per step. Medians of the slowest
rank.

Run: python bench/bench_overlap_check.py --world 2 --params 8000000 --steps 12
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List


def _rank(rank: int, world: int, params: int, steps: int) -> Dict[str, List[float]]:
    import torch

    from compcomm.optim import OneBitAdam
    from compcomm.optim.overlap import BackwardOverlap

    torch.set_num_threads(1)
    torch.manual_seed(0)
    width = 1024
    layers = max(1, params // (width * width + width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = OneBitAdam(model.parameters(), lr=1e-4, freeze_step=1, overlap_backward=True)
    real = BackwardOverlap._changed
    mode = {"check": True}
    spent: List[float] = []

    def changed(self, r):  # the check, timed; or skipped (the "without" steps)
        if not mode["check"]:
            return False
        t0 = time.perf_counter()
        out = real(self, r)
        spent.append(time.perf_counter() - t0)
        return out

    BackwardOverlap._changed = changed
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(16, width, generator=gen)
    out: Dict[str, List[float]] = {"with": [], "without": [], "check": []}
    for t in range(2 * steps + 3):
        mode["check"] = t % 2 == 0
        opt.zero_grad()
        t0 = time.perf_counter()
        model(x).pow(2).mean().backward()
        opt.step()
        dt = time.perf_counter() - t0
        if t >= 3:  # the warm-up step and the first compressed steps (plans, buffers) left out
            out["with" if mode["check"] else "without"].append(dt)
    out["check"] = spent[1:]
    assert opt.overlap.enabled and opt.overlap.changed_steps == 0
    out["params"] = [float(sum(p.numel() for p in model.parameters()))]
    out["overlapped"] = [float(opt.overlap.steps_overlapped)]
    return out


def main() -> None:
    from compcomm.testing import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--params", type=int, default=8_000_000)
    ap.add_argument("--steps", type=int, default=12, help="steps of each kind")
    a = ap.parse_args()
    outs = run_ranks(a.world, _rank, a.params, a.steps, timeout=600)
    med = {k: max(statistics.median(o[k]) for o in outs) for k in ("with", "without", "check")}
    print(f"OneBitAdam(overlap_backward=True), gloo W={a.world}, {int(outs[0]['params'][0]):,} "
          f"parameters, compressed phase, {a.steps} steps each, interleaved, medians (slowest "
          "rank)")
    print(f"  step with the value check    {med['with'] * 1e3:8.1f} ms")
    print(f"  step without it              {med['without'] * 1e3:8.1f} ms")
    print(f"  ratio with / without         {med['with'] / med['without']:8.3f}")
    print(f"  the check itself             {med['check'] * 1e3:8.1f} ms "
          f"({med['check'] / med['with'] * 100:.1f}% of the step)")


if __name__ == "__main__":
    main()
