"""Rank bodies for tests/test_compressors.py (module level, so run_ranks can pickle them)."""

from __future__ import annotations

from typing import Any, Dict

import torch
from _optim_cases import SHAPES, make_grads, make_params, masks_for, run_opt


def identity_runs(rank: int, world: int) -> Dict[str, Any]:
    """The 1-bit optimizers with ``compressor=IdentityCompressor``: their trajectories and what
    they keep."""
    from compcomm.compress import IdentityCompressor
    from compcomm.optim import OneBitAdam, OneBitLamb

    p0, out = make_params(), {}
    masks = [torch.tensor(m) if m is not None else None for m in masks_for()]
    kw = dict(lr=0.01, freeze_step=4, weight_decay=0.01, compressor=IdentityCompressor)
    out["adam"], _, opt, _ = run_opt(OneBitAdam, dict(kw, exact_resume=True), p0,
                                     make_grads(10, world), rank, masks=masks_for())
    sd = opt.state_dict()["compcomm"]
    out["adam_saved_errors"] = bool(sd.get("bucket_errors"))
    out["adam_error_bytes"] = opt.memory_bytes()["error_feedback"]
    out["adam_per_param"], _, _, _ = run_opt(OneBitAdam, dict(kw, per_parameter=True), p0,
                                             make_grads(10, world), rank)
    out["lamb"], _, _, _ = run_opt(OneBitLamb, kw, p0, make_grads(10, world, seed=3), rank)
    del masks
    # a NaN on the last rank in a compressed step: every rank skips it, nothing changes
    ps = [torch.nn.Parameter(torch.tensor(p)) for p in p0]
    opt = OneBitAdam(ps, lr=0.01, freeze_step=1, compressor=IdentityCompressor)
    for t, gstep in enumerate(make_grads(4, world)):
        for p, g in zip(ps, gstep[rank]):
            p.grad = torch.tensor(g)
        if t == 2 and rank == world - 1:
            ps[1].grad[3] = float("nan")
        before = [p.detach().clone() for p in ps] + [st["exp_avg"].clone()
                                                      for st in opt.state.values()]
        opt.step()
        if t == 2:
            after = [p.detach().clone() for p in ps] + [st["exp_avg"].clone()
                                                         for st in opt.state.values()]
            out["nan_skipped"] = opt.skipped_steps == 1 and opt.sched["step"] == 2 and all(
                torch.equal(a, b) for a, b in zip(before, after))
    out["shapes"] = SHAPES
    return out
