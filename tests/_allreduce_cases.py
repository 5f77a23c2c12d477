"""Rank-side bodies for the multi-process compressed_allreduce tests (imported in spawned ranks)."""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

import compcomm
from compcomm import _C
from reference import simulate

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Relative spacing of the output dtype: the output is tau rounded to it.
DTYPE_EPS = {"float32": 0.0, "float16": 2.0**-10, "bfloat16": 2.0**-7}


def make_input(seed: int, shape, dtype: str, rank: int) -> torch.Tensor:
    """Gaussian values plus a per-rank offset, with some exact +0.0 and -0.0 entries."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g) + 0.01 * rank
    flat = t.view(-1)
    flat[::97] = 0.0
    flat[5::89] = -0.0
    return t.to(DTYPES[dtype])


def _seed(rnd: int, n: int, rank: int, dtype: str) -> int:
    """Seed of rank ``rank``'s input in round ``rnd`` of the (n, dtype) case."""
    return 1000003 * rnd + 7919 * n + 17 * rank + 3 * list(DTYPES).index(dtype)


def _signs_received(comm, padded: int, world: int) -> np.ndarray:
    """The packed worker signs this rank received in the last call ([W][C/8]: row i from rank i),
    read from ``comm``'s cached CPU workspace."""
    ws = compcomm.collectives._workspaces[comm][torch.device("cpu")]
    at = _C.compressed_allreduce_layout(padded, world, False)["signs_recv"]
    return ws[at : at + padded // 8].numpy().copy()


def _signs_sent_by(received: list, rank: int, world: int) -> np.ndarray:
    """Rank `rank`'s full packed signs, reassembled from what every server rank received from it."""
    return np.concatenate([r.reshape(world, -1)[rank] for r in received]) if received[0].size else received[0]


def compare(ref, outs, wes, ses, signs, dtype: str, world: int) -> dict:
    """How far the C++ results of one round are from the float64 oracle."""
    chunk = wes[0].size // world
    n = outs[0].size
    r = {}
    r["signs_exact"] = all(np.array_equal(signs[i], ref["worker_signs"][i]) for i in range(world))
    r["outputs_identical"] = all(np.array_equal(outs[0], o) for o in outs)
    r["we_err"] = max(
        float(np.max(np.abs(wes[i] - ref["worker_errors"][i]), initial=0.0))
        / max(float(np.max(np.abs(ref["worker_errors"][i]), initial=0.0)), 1e-30)
        for i in range(world)
    )
    # A server sign may differ only where c is within rounding of zero (fp32 vs fp64 sums).
    c_all = np.concatenate(ref["c"]) if chunk else np.zeros(0)
    cmax = float(np.max(np.abs(c_all), initial=0.0))
    near_zero = np.abs(c_all) <= 1e-5 * cmax
    se_ref = np.concatenate(ref["server_errors"]) if chunk else np.zeros(0)
    se = np.concatenate(ses)
    ok = ~near_zero
    # At W=1 the exact server error is 0 and what remains is rounding, so the scale of the
    # comparison is floored at 1% of max|c|.
    r["se_err"] = float(np.max(np.abs(se - se_ref)[ok], initial=0.0)) / max(
        float(np.max(np.abs(se_ref), initial=0.0)), 1e-2 * cmax, 1e-30
    )
    out_ref = ref["out"]
    okn = ok[:n]
    omax = float(np.max(np.abs(out_ref), initial=0.0))
    r["out_err"] = float(np.max(np.abs(outs[0] - out_ref)[okn], initial=0.0)) / max(omax, 1e-30)
    r["out_tol"] = 1e-5 + DTYPE_EPS[dtype]
    server_signs = np.where(c_all < 0, -1, 1)
    r["sign_flips"] = int(np.sum((np.sign(outs[0]) != server_signs[:n]) & (outs[0] != 0)))
    r["flips_outside_allowed"] = int(
        np.sum((np.sign(outs[0]) != server_signs[:n]) & (outs[0] != 0) & okn)
    )
    return r


def collective_cases(rank: int, world: int, sizes, dtypes, rounds: int, shapes=None) -> list:
    """Run compressed_allreduce over several rounds (errors carried); rank 0 checks every round
    against the oracle, given the C++ errors at the start of the round."""
    comm = compcomm.get_communicator(None)
    shapes = shapes or {}
    results = []
    for dtype in dtypes:
        for n in sizes:
            shape = shapes.get(n, (n,))
            p = compcomm.padded_numel(n, world)
            we_prev = [np.zeros(p, np.float32) for _ in range(world)]
            se_prev = [np.zeros(p // world, np.float32) for _ in range(world)]
            we, se = compcomm.error_buffers(n)
            for rnd in range(rounds):
                t = make_input(_seed(rnd, n, rank, dtype), shape, dtype, rank)
                comm.reset_bytes_sent()
                out = compcomm.compressed_allreduce(t, we, se)
                assert out is t and t.shape == tuple(shape) and t.dtype == DTYPES[dtype]
                sent = comm.bytes_sent
                mine = (
                    t.float().numpy().ravel().copy(),
                    we.numpy().copy(),
                    se.numpy().copy(),
                    _signs_received(comm, p, world) if p else np.zeros(0, np.uint8),
                    sent,
                )
                gathered = [None] * world if rank == 0 else None
                dist.gather_object(mine, gathered, dst=0)
                if rank != 0:
                    continue
                ms = [make_input(_seed(rnd, n, i, dtype), shape, dtype, i).float().numpy().ravel()
                      for i in range(world)]
                ref = simulate(ms, we_prev, se_prev)
                outs, wes, ses, received, sents = zip(*gathered)
                signs = [_signs_sent_by(list(received), i, world) for i in range(world)]
                r = compare(ref, outs, wes, ses, signs, dtype, world)
                r.update(dtype=dtype, n=n, round=rnd, bytes_sent=list(sents),
                         wire_bytes=compcomm.wire_bytes(n, world))
                results.append(r)
                we_prev, se_prev = list(wes), list(ses)
    return results


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
