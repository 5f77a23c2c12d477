"""Rank bodies of the conformance suite: every Communicator collective, written once.

Each body runs on one rank of any backend (``body(ctx, ...)``, see tests/_backends.py) and asserts
itself: the first failing case raises ``AssertionError`` naming the backend, the world size, the
rank and the case, so the traceback that comes back points at the failing check. Many cases run in
one body so that a world is spawned once per (backend, W).

Inputs are small integers (|x| <= 8), exact in every dtype, so reductions have one right answer
whatever the order of the additions: results are compared bit for bit with numpy in float64.
The compressed allreduce is compared with the numpy oracle (tests/reference.py).
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import torch

import compcomm
from compcomm import _C
from compcomm._buffers import buffer_of
from compcomm.errors import RankMismatchError
from reference import simulate

COUNTS = (0, 1, 7, 1000, 4099)  # none divides evenly by 3 or 8 (0 and 1: the empty and tiny cases)
# fp32/fp16/bf16 are what the compressed path uses; the others are what the plain collectives accept.
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64,
          torch.uint8)
FLOATS = DTYPES[:3]  # the dtypes every case runs on; the others run the cases where the dtype matters
OPS = {"sum": (_C.ReduceOp.sum, np.sum), "max": (_C.ReduceOp.max, np.max), "min": (_C.ReduceOp.min, np.min)}


def ints(rank: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rank ``rank``'s input of a case: integers in [-8, 8] ([0, 8] for uint8), on the CPU."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    x = torch.randint(-8, 9, (n,), generator=g)
    return (x.abs() if dtype == torch.uint8 else x).to(dtype)


def f64(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().to(torch.float64).numpy()


def seed_of(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode()) % 100000


class Checker:
    """Names the case in every failure: ``[torch:gloo W=3 rank 1] all_reduce max float16 n=7: ...``."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.where = f"[{ctx.backend} W={ctx.world} rank {ctx.rank}]"

    def equal(self, got: torch.Tensor, want: np.ndarray, case: str) -> None:
        g = f64(got)
        if g.shape != want.shape or not np.array_equal(g, want):
            bad = np.flatnonzero(g != want) if g.shape == want.shape else []
            raise AssertionError(
                f"{self.where} {case}: {len(bad)} of {want.size} wrong"
                + (f", first at {bad[0]}: got {g[bad[0]]}, want {want[bad[0]]}" if len(bad) else
                   f" (shape {g.shape}, want {want.shape})"))

    def true(self, cond: bool, case: str, detail: object = "") -> None:
        if not cond:
            raise AssertionError(f"{self.where} {case}: {detail}")


# ---------------------------------------------------------------------------------------------
# One function per collective.


def all_reduce(ctx, check: Checker) -> None:
    """buf = op over ranks of buf, in place: sum/max/min x every dtype x every count."""
    c, dev, W = ctx.comm, ctx.device, ctx.world
    for dtype in DTYPES:
        for name, (op, fn) in OPS.items():
            for n in COUNTS:
                seed = seed_of("all_reduce", dtype, name, n)
                x = ints(ctx.rank, n, dtype, seed).to(dev)
                c.all_reduce(buffer_of(x), op, **ctx.kw())
                ctx.sync()
                want = fn(np.stack([f64(ints(r, n, dtype, seed)) for r in range(W)]), axis=0)
                check.equal(x, want, f"all_reduce {name} {dtype} n={n}")
    # Random fp32 values: the float64 sum up to rounding (any summation order).
    x = torch.randn(4099, generator=torch.Generator().manual_seed(ctx.rank)).to(dev)
    c.all_reduce(buffer_of(x), _C.ReduceOp.sum, **ctx.kw())
    ctx.sync()
    want = sum(torch.randn(4099, generator=torch.Generator().manual_seed(r)).double() for r in range(W))
    check.true(np.allclose(f64(x), want.numpy(), rtol=1e-5, atol=1e-5), "all_reduce sum float32 random")


def reduce_scatter(ctx, check: Checker) -> None:
    """recv (k elements) = op over ranks of send's chunk rank(): sum x every dtype, max/min x
    fp32/fp16/bf16, x every k."""
    c, dev, W, me = ctx.comm, ctx.device, ctx.world, ctx.rank
    for dtype in DTYPES:
        for name, (op, fn) in OPS.items() if dtype in FLOATS else [("sum", OPS["sum"])]:
            for k in COUNTS:
                seed = seed_of("reduce_scatter", dtype, name, k)
                send = ints(me, W * k, dtype, seed).to(dev)
                recv = torch.full((k,), 99, dtype=dtype, device=dev)
                c.reduce_scatter(buffer_of(send), buffer_of(recv), op, **ctx.kw())
                ctx.sync()
                total = fn(np.stack([f64(ints(r, W * k, dtype, seed)) for r in range(W)]), axis=0)
                check.equal(recv, total[me * k:(me + 1) * k], f"reduce_scatter {name} {dtype} k={k}")
                check.equal(send, f64(ints(me, W * k, dtype, seed)), f"reduce_scatter {name} {dtype} "
                            f"k={k}: send changed")


def all_gather(ctx, check: Checker) -> None:
    """recv = concatenation over ranks of send: every dtype x count, and in place (fp32/fp16/bf16)."""
    c, dev, W, me = ctx.comm, ctx.device, ctx.world, ctx.rank
    for dtype in DTYPES:
        for n in COUNTS:
            seed = seed_of("all_gather", dtype, n)
            send = ints(me, n, dtype, seed).to(dev)
            recv = torch.full((W * n,), 99, dtype=dtype, device=dev)
            c.all_gather(buffer_of(send), buffer_of(recv), **ctx.kw())
            ctx.sync()
            want = np.concatenate([f64(ints(r, n, dtype, seed)) for r in range(W)])
            check.equal(recv, want, f"all_gather {dtype} n={n}")
            if dtype not in FLOATS:
                continue
            # In place: send is this rank's slot of recv.
            recv.zero_()
            recv[me * n:(me + 1) * n] = send
            c.all_gather(buffer_of(recv[me * n:(me + 1) * n]), buffer_of(recv), **ctx.kw())
            ctx.sync()
            check.equal(recv, want, f"all_gather in place {dtype} n={n}")


def all_to_all(ctx, check: Checker) -> None:
    """Block j of rank i's send lands as block i of rank j's recv: dtype x block size."""
    c, dev, W, me = ctx.comm, ctx.device, ctx.world, ctx.rank
    for dtype in DTYPES:
        for k in COUNTS:
            seed = seed_of("all_to_all", dtype, k)
            send = ints(me, W * k, dtype, seed).to(dev)
            recv = torch.full((W * k,), 99, dtype=dtype, device=dev)
            c.all_to_all(buffer_of(send), buffer_of(recv), **ctx.kw())
            ctx.sync()
            want = np.concatenate([f64(ints(r, W * k, dtype, seed))[me * k:(me + 1) * k] for r in range(W)])
            check.equal(recv, want, f"all_to_all {dtype} k={k}")


def broadcast(ctx, check: Checker) -> None:
    """buf = root's buf everywhere: every root x fp32/fp16/bf16 x count; the last root x every dtype."""
    c, dev, W = ctx.comm, ctx.device, ctx.world
    for root in range(W):
        for dtype in DTYPES if root == W - 1 else FLOATS:
            for n in COUNTS:
                seed = seed_of("broadcast", root, dtype, n)
                x = ints(ctx.rank, n, dtype, seed).to(dev)
                c.broadcast(buffer_of(x), root, **ctx.kw())
                ctx.sync()
                check.equal(x, f64(ints(root, n, dtype, seed)), f"broadcast root={root} {dtype} n={n}")


def barrier(ctx, check: Checker, scratch: str) -> None:
    """No rank leaves a barrier before every rank has entered it: each rank leaves a mark in a shared
    folder before the barrier and must see every rank's mark after it (three rounds)."""
    folder = Path(scratch)
    for rnd in range(3):
        (folder / f"barrier{rnd}-rank{ctx.rank}").touch()
        ctx.comm.barrier(timeout_s=ctx.timeout)
        missing = [r for r in range(ctx.world) if not (folder / f"barrier{rnd}-rank{r}").exists()]
        check.true(not missing, f"barrier round {rnd}", f"left before rank(s) {missing} entered")


def bytes_sent(ctx, check: Checker) -> None:
    """bytes_sent counts what each call puts on the wire (nccl-tests' ring conventions, cpp/comm.h);
    a call rejected for bad arguments counts nothing."""
    c, dev, W = ctx.comm, ctx.device, ctx.world
    cases: List[tuple] = []
    for dtype, n in ((torch.float32, 1000), (torch.float16, 7), (torch.uint8, 4099), (torch.int64, 0)):
        e = torch.tensor([], dtype=dtype).element_size()
        full, part = W * n, n  # element counts of the two buffers
        cases += [
            (f"all_reduce {dtype} n={full}", "all_reduce", dtype, full, part, 2 * full * e * (W - 1) // W),
            (f"reduce_scatter {dtype} k={part}", "reduce_scatter", dtype, full, part, part * e * (W - 1)),
            (f"all_gather {dtype} n={part}", "all_gather", dtype, full, part, part * e * (W - 1)),
            (f"all_to_all {dtype} k={part}", "all_to_all", dtype, full, part, full * e // W * (W - 1)),
            (f"broadcast {dtype} n={part}", "broadcast", dtype, full, part, part * e if W > 1 else 0),
            ("barrier", "barrier", dtype, full, part, 0),
        ]
    calls = {
        "all_reduce": lambda buf, part: c.all_reduce(buffer_of(buf), _C.ReduceOp.sum, **ctx.kw()),
        "reduce_scatter": lambda buf, part: c.reduce_scatter(buffer_of(buf), buffer_of(part),
                                                             _C.ReduceOp.sum, **ctx.kw()),
        "all_gather": lambda buf, part: c.all_gather(buffer_of(part), buffer_of(buf), **ctx.kw()),
        "all_to_all": lambda buf, part: c.all_to_all(buffer_of(buf), buffer_of(buf.clone()), **ctx.kw()),
        "broadcast": lambda buf, part: c.broadcast(buffer_of(part), W - 1, **ctx.kw()),
        "barrier": lambda buf, part: c.barrier(timeout_s=ctx.timeout),
    }
    for case, call, dtype, full, part, want in cases:
        buf = torch.zeros(full, dtype=dtype, device=dev)
        c.reset_bytes_sent()
        calls[call](buf, torch.zeros(part, dtype=dtype, device=dev))
        ctx.sync()
        check.true(c.bytes_sent == want, f"bytes_sent after {case}", f"{c.bytes_sent}, want {want}")
    argument_errors(ctx, check)


def argument_errors(ctx, check: Checker) -> None:
    """Bad sizes, a root that is not a rank and a non-positive timeout raise ValueError naming the
    problem on every rank, before anything is sent (bytes_sent unchanged; the next call works)."""
    c, dev, W = ctx.comm, ctx.device, ctx.world
    x = torch.ones(12, device=dev)
    kw = ctx.kw()
    bad = {
        "all_to_all send/recv sizes differ":
            lambda: c.all_to_all(buffer_of(torch.ones(W * 3, device=dev)),
                                 buffer_of(torch.ones(W * 3 + 1, device=dev)), **kw),
        "all_gather recv not W x send":
            lambda: c.all_gather(buffer_of(torch.ones(3, device=dev)),
                                 buffer_of(torch.ones(3 * W + 1, device=dev)), **kw),
        "reduce_scatter send not W x recv":
            lambda: c.reduce_scatter(buffer_of(torch.ones(3 * W + 1, device=dev)),
                                     buffer_of(torch.ones(3, device=dev)), _C.ReduceOp.sum, **kw),
        "reduce_scatter dtypes differ":
            lambda: c.reduce_scatter(buffer_of(torch.ones(3 * W, device=dev)),
                                     buffer_of(torch.ones(3, device=dev, dtype=torch.float64)),
                                     _C.ReduceOp.sum, **kw),
        "broadcast root W": lambda: c.broadcast(buffer_of(x), W, **kw),
        "broadcast root -1": lambda: c.broadcast(buffer_of(x), -1, **kw),
        "all_reduce timeout -1": lambda: c.all_reduce(buffer_of(x), _C.ReduceOp.sum,
                                                      **{**kw, "timeout_s": -1.0}),
    }
    c.reset_bytes_sent()
    for case, call in bad.items():
        try:
            call()
        except ValueError as e:
            text = str(e)
            check.true(any(w in text for w in ("must", "not a rank", "positive")), case, f"message: {text}")
        else:
            check.true(False, case, "bad arguments were accepted")
    check.true(c.bytes_sent == 0, "rejected calls", f"counted {c.bytes_sent} bytes")
    c.all_reduce(buffer_of(x), _C.ReduceOp.sum, **kw)
    ctx.sync()
    check.equal(x, np.full(12, float(W)), "all_reduce after rejected calls")


ALL: Dict[str, Callable[..., None]] = {
    "all_reduce": all_reduce,
    "reduce_scatter": reduce_scatter,
    "all_gather": all_gather,
    "all_to_all": all_to_all,
    "broadcast": broadcast,
    "bytes_sent": bytes_sent,
}


def collectives(ctx, scratch: str, only: Sequence[str] = ()) -> None:
    """Every collective body in turn (``only``: a subset by name), then the barrier check."""
    check = Checker(ctx)
    for name, body in ALL.items():
        if not only or name in only:
            body(ctx, check)
    if not only or "barrier" in only:
        barrier(ctx, check, scratch)


def suite(ctx, scratch: str, compressed: Optional[dict] = None) -> None:
    """The whole conformance suite on one world (one spawn): :func:`collectives`, then
    :func:`compressed_allreduce` with the keyword arguments ``compressed`` (None: skipped)."""
    collectives(ctx, scratch)
    if compressed is not None:
        compressed_allreduce(ctx, **compressed)


# ---------------------------------------------------------------------------------------------
# compressed_allreduce against the numpy oracle.

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_EPS = {"float32": 0.0, "float16": 2.0**-10, "bfloat16": 2.0**-7}  # the output is tau rounded to it


def make_input(seed: int, shape: Sequence[int], dtype: str, rank: int) -> torch.Tensor:
    """Gaussian values plus a per-rank offset, with some exact +0.0 and -0.0 entries (on the CPU)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(tuple(shape), generator=g) + 0.01 * rank
    flat = t.view(-1)
    flat[::97] = 0.0
    flat[5::89] = -0.0
    return t.to(TORCH_DTYPES[dtype])


def _seed(rnd: int, n: int, rank: int, dtype: str) -> int:
    return 1000003 * rnd + 7919 * n + 17 * rank + 3 * list(TORCH_DTYPES).index(dtype)


def _gather(ctx, t: torch.Tensor) -> List[np.ndarray]:
    """Every rank's copy of ``t`` (same shape everywhere), through the communicator under test."""
    flat = t.reshape(-1)
    out = torch.empty(ctx.world * flat.numel(), dtype=t.dtype, device=t.device)
    ctx.comm.all_gather(buffer_of(flat.contiguous()), buffer_of(out), **ctx.kw())
    ctx.sync()
    return [a.numpy() for a in out.cpu().to(torch.float32).reshape(ctx.world, -1)] if flat.numel() else \
        [np.zeros(0, np.float32)] * ctx.world


def _signs_received(ctx, padded: int) -> np.ndarray:
    """The packed worker signs this rank received in the last call ([W][C/8]: row i from rank i),
    read from the communicator's cached workspace."""
    cuda = ctx.device.type == "cuda"
    ws = compcomm.collectives._workspaces[ctx.comm][ctx.device]
    at = _C.compressed_allreduce_layout(padded, ctx.world, cuda)["signs_recv"]
    return ws[at:at + padded // 8].cpu().numpy().copy()


def _design_formula_bytes(padded: int, world: int) -> float:
    """DESIGN.md: N/8 (W-1)/W (phase 1) + N/(8W) (W-1) (phase 2), without the per-peer scales."""
    return padded / 8 * (world - 1) / world + padded / (8 * world) * (world - 1)


def _check_round(check: Checker, ctx, case: str, ref: dict, out: np.ndarray, outs: List[np.ndarray],
                 we: np.ndarray, se: np.ndarray, signs: np.ndarray, dtype: str, n: int) -> None:
    """This rank's results of one round against the float64 oracle."""
    W, me = ctx.world, ctx.rank
    p = we.size
    chunk = p // W
    if p:
        for i in range(W):
            check.true(np.array_equal(signs.reshape(W, -1)[i], ref["worker_signs"][i].reshape(W, -1)[me]),
                       case, f"signs received from rank {i} differ from the oracle's")
    check.true(all(np.array_equal(outs[0], o) for o in outs), case, "outputs differ between ranks")
    we_ref = ref["worker_errors"][me]
    we_err = float(np.max(np.abs(we - we_ref), initial=0.0)) / max(float(np.max(np.abs(we_ref), initial=0.0)),
                                                                   1e-30)
    check.true(we_err <= 1e-5, case, f"worker error off by {we_err:.3g} (relative)")
    # A server sign may differ only where c is within rounding of zero (fp32 vs fp64 sums).
    c_all = np.concatenate(ref["c"]) if chunk else np.zeros(0)
    cmax = float(np.max(np.abs(c_all), initial=0.0))
    ok = ~(np.abs(c_all) <= 1e-5 * cmax)
    se_all = np.concatenate(ref["server_errors"]) if chunk else np.zeros(0)
    mine = slice(me * chunk, (me + 1) * chunk)
    # At W=1 the exact server error is 0 and what remains is rounding: the scale is floored at 1% max|c|.
    scale = max(float(np.max(np.abs(se_all), initial=0.0)), 1e-2 * cmax, 1e-30)
    se_err = float(np.max(np.abs(se - se_all[mine])[ok[mine]], initial=0.0)) / scale
    check.true(se_err <= 1e-5, case, f"server error off by {se_err:.3g} (relative)")
    okn = ok[:n]
    out_ref = ref["out"]
    omax = float(np.max(np.abs(out_ref), initial=0.0))
    out_err = float(np.max(np.abs(out - out_ref)[okn], initial=0.0)) / max(omax, 1e-30)
    check.true(out_err <= 1e-5 + DTYPE_EPS[dtype], case, f"output off by {out_err:.3g} (relative)")
    flipped = (np.sign(out) != np.where(c_all < 0, -1, 1)[:n]) & (out != 0)
    check.true(int(np.sum(flipped & okn)) == 0, case, "output sign differs from the oracle's away from 0")
    check.true(int(np.sum(flipped)) <= max(1, n // 10000), case, f"{int(np.sum(flipped))} sign flips")


def compressed_allreduce(ctx, sizes: Sequence[Sequence[int]], dtypes: Sequence[str],
                         shapes: Sequence[Sequence] = ()) -> None:
    """compcomm.compressed_allreduce, ``rounds`` calls (errors carried) per (dtype, (size, rounds)
    in ``sizes``): each round against the float64 oracle started from the errors every rank held
    before it; bytes on the wire = wire_bytes(); then ranks that disagree on the size raise
    RankMismatchError."""
    check = Checker(ctx)
    W, me, dev, comm = ctx.world, ctx.rank, ctx.device, ctx.comm
    shape_of = {int(n): tuple(s) for n, s in shapes}
    for dtype in dtypes:
        for n, rounds in sizes:
            shape = shape_of.get(n, (n,))
            p = compcomm.padded_numel(n, W)
            we, se = (e.to(dev) for e in compcomm.error_buffers(n, comm))
            for rnd in range(rounds):
                case = f"compressed_allreduce {dtype} n={n} round={rnd}"
                we_prev, se_prev = _gather(ctx, we), _gather(ctx, se)
                t = make_input(_seed(rnd, n, me, dtype), shape, dtype, me).to(dev)
                comm.reset_bytes_sent()
                res = compcomm.compressed_allreduce(t, we, se, comm, timeout=ctx.timeout)
                ctx.sync()
                sent = comm.bytes_sent
                check.true(res is t and t.shape == shape and t.dtype == TORCH_DTYPES[dtype], case,
                           "not in place")
                check.true(sent == compcomm.wire_bytes(n, W), case, f"bytes_sent {sent}, "
                           f"wire_bytes() {compcomm.wire_bytes(n, W)}")
                overhead = sent - _design_formula_bytes(p, W)  # headers and scales: 48-63 bytes per peer
                check.true(0 <= overhead <= (W - 1) * (32 + 16 + 15), case, f"wire overhead {overhead}")
                signs = _signs_received(ctx, p) if p else np.zeros(0, np.uint8)
                outs = _gather(ctx, t)
                ms = [make_input(_seed(rnd, n, i, dtype), shape, dtype, i).float().numpy().ravel()
                      for i in range(W)]
                ref = simulate(ms, we_prev, se_prev)
                _check_round(check, ctx, case, ref, t.float().cpu().numpy().ravel(), outs,
                             we.cpu().numpy(), se.cpu().numpy(), signs, dtype, n)
    if W > 1:  # ranks disagreeing on the size: every rank raises (the header exchange), nothing changes
        t = torch.randn(100 + (me == 0)).to(dev)
        we, se = (e.to(dev) for e in compcomm.error_buffers(128 * W, comm))
        before = t.clone()
        try:
            compcomm.compressed_allreduce(t, we, se, comm, timeout=ctx.timeout)
        except RankMismatchError as e:
            check.true("numel=101" in str(e), "size mismatch", f"message: {e}")
        else:
            check.true(False, "size mismatch", "not detected")
        check.true(torch.equal(t, before), "size mismatch", "tensor changed by a failed call")
