"""Rank bodies for tests/test_faults.py (module level, so run_ranks can pickle them)."""

from __future__ import annotations

import time
from typing import Any, Dict

import torch

TIMEOUT = 5.0


def dead_peer(rank: int, world: int) -> Dict[str, Any]:
    """The last rank leaves (its process exits) instead of joining; the others call the compressed
    allreduce and then a OneBitAdam compressed step: each gets a typed error within 2x the timeout
    and nothing changed."""
    import compcomm
    from compcomm.optim import OneBitAdam

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(1000))
    opt = OneBitAdam([p], lr=1e-2, freeze_step=0)
    if rank == world - 1:
        return {"left": True}  # the process exits: its sockets close under the others
    time.sleep(1.0)  # let it go
    out: Dict[str, Any] = {}
    t = torch.randn(4099)
    we, se = compcomm.error_buffers(t)
    before = [x.clone() for x in (t, we, se)]
    start = time.monotonic()
    try:
        compcomm.compressed_allreduce(t, we, se, timeout=TIMEOUT)
        out["allreduce"] = None
    except Exception as e:  # noqa: BLE001
        out["allreduce"] = type(e).__name__
    out["allreduce_s"] = time.monotonic() - start
    out["allreduce_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, (t, we, se)))
    opt.compressor.timeout = TIMEOUT
    p.grad = torch.randn(1000)
    p_before = p.detach().clone()
    start = time.monotonic()
    try:
        opt.step()
        out["step"] = None
    except Exception as e:  # noqa: BLE001
        out["step"] = type(e).__name__
    out["step_s"] = time.monotonic() - start
    out["step_unchanged"] = (torch.equal(p_before, p.detach()) and not opt.compressor.keys()
                             and opt.sched["step"] == 0 and "exp_avg" not in opt.state.get(p, {}))
    return out
