"""Rank bodies for tests/test_zero_staging.py (module-level so run_ranks can pickle them)."""

from __future__ import annotations

from typing import Any, Dict, List

import torch

import _zero_bodies as zb
import _zero_offload_cases as zc


def split_vs_whole(rank: int, world: int, cases: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The same training with buckets larger than ``reduce_bucket_size`` reduced in pieces and
    whole (the same layout: the pool buffers made as large as the largest bucket)."""
    out = []
    for case in cases:
        dtype = getattr(torch, case["dtype"])
        got, info = [], {}
        for split in (True, False):
            model = zb.make_model(dtype=dtype)
            zero = dict(zc.BUCKETS, overlap_comm=case["overlap"], **case.get("offload", {}))
            z = zc._build(model, case["stage"], zero, gradient_accumulation_steps=case["gas"])
            if split:
                info["split"] = sum(z._grads.split(0, bi) for bi in range(len(z.groups[0].buckets)))
                info["cap"], info["max_padded"] = z._grads.cap[0], z.groups[0].max_padded
            else:
                z._grads.cap = [g.max_padded for g in z.groups]
            zc._train(z, model, rank, [0, 1, 2], case["gas"], dtype)
            # staging held after a backward: pool buffers only, each of `cap` elements
            x, y = zb.batch(rank, 3, 0, dtype)
            zb.loss_fn(model, x, y).backward()
            z.wait()
            if split:
                info["pool"] = sorted({t.numel() for p in z._grads._pool.values() for t in p})
                info["staging_bytes"] = z._grads.nbytes()
            z.zero_grad()
            got.append(zc._params(z, model))
            z.close()
        out.append(dict(info, case=case, err=zc._diff(*got)))
    return out
