"""Rank-side bodies for the multi-process compressed_allreduce tests (imported in spawned ranks).

The comparison with the numpy oracle runs on every backend in tests/conformance."""

from __future__ import annotations

import time

import torch

import compcomm

def feedback_case(rank: int, world: int, n: int, calls: int) -> dict:
    """Same input every call: the running mean of the outputs converges to the true mean."""
    g = torch.Generator().manual_seed(42 + rank)
    x = torch.randn(n, generator=g) + 0.5 * rank
    true = torch.stack([torch.randn(n, generator=torch.Generator().manual_seed(42 + i)) + 0.5 * i
                        for i in range(world)]).mean(0)
    we, se = compcomm.error_buffers(n)
    acc = torch.zeros(n, dtype=torch.float64)
    errs = {}
    for k in range(1, calls + 1):
        t = x.clone()
        compcomm.compressed_allreduce(t, we, se)
        acc += t
        if k in (1, 10, calls):
            errs[k] = float((acc / k - true).norm() / true.norm())
    return errs


def bad_input_cases(rank: int, world: int) -> dict:
    """Cross-rank problems: every rank must raise the same typed error and change nothing."""
    out = {}

    def attempt(name, t, we, se, **kw):
        before = (t.clone(), we.clone(), se.clone())
        try:
            compcomm.compressed_allreduce(t, we, se, **kw)
            out[name] = ("no error", None, True)
        except Exception as e:  # noqa: BLE001 - recorded and asserted by the test
            unchanged = all(  # bitwise, so NaN == NaN
                torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, (t, we, se))
            )
            out[name] = (type(e).__name__, str(e), unchanged)

    # Different numel per rank (same padded size).
    n = 1000 + rank
    t = torch.randn(n)
    we = torch.randn(compcomm.padded_numel(1000 + world, world)) * 0.1
    se = torch.randn(we.numel() // world) * 0.1
    attempt("numel_mismatch", t, we, se)
    # Different dtype per rank.
    t = torch.randn(64).to(torch.float16 if rank == 1 else torch.float32)
    we, se = compcomm.error_buffers(64)
    attempt("dtype_mismatch", t, we, se)
    # NaN / Inf on the last rank only (in the tensor, then in the worker error).
    t = torch.randn(100)
    if rank == world - 1:
        t[3] = float("nan")
    we, se = compcomm.error_buffers(100)
    we += 0.25
    attempt("nan", t, we, se)
    t = torch.randn(100)
    we, se = compcomm.error_buffers(100)
    if rank == world - 1:
        we[7] = float("inf")
    attempt("inf_in_error", t, we, se)
    # The group still works after those errors.
    t = torch.ones(100) * (rank + 1)
    we, se = compcomm.error_buffers(100)
    compcomm.compressed_allreduce(t, we, se)
    out["works_after"] = float(t.mean())
    # Rank 0 calls alone: it must time out instead of hanging.
    if rank == 0:
        t = torch.randn(100)
        we, se = compcomm.error_buffers(100)
        start = time.monotonic()
        attempt("timeout", t, we, se, timeout=3.0)
        out["timeout_seconds"] = time.monotonic() - start
    else:
        time.sleep(8.0)  # stay alive (but silent) past rank 0's deadline
    return out
