"""Rank bodies for tests/test_compressed_batched.py: compressed_allreduce_exchange_many against
per-bucket exchanges, and its failures."""

from __future__ import annotations

from typing import Any, Dict, List

import torch

NUMELS = [0, 1, 37, 1000, 4099]


def _buffers(numels: List[int], world: int, device: torch.device):
    from compcomm import _C
    from compcomm.collectives import padded_numel

    out = []
    for n in numels:
        p = padded_numel(n, world)
        total = _C.compressed_allreduce_layout(p, world, device.type == "cuda")["total"]
        out.append((torch.zeros(p, device=device), torch.zeros(p // world, device=device),
                    torch.zeros(max(total, 1), dtype=torch.uint8, device=device)))
    return out


def _inputs(rank: int, rnd: int, dtypes, device):
    g = torch.Generator().manual_seed(1000 * rnd + rank)
    return [torch.randn(n, generator=g).to(dt).to(device) for n, dt in zip(NUMELS, dtypes)]


def _many(comm, xs, bufs, device, timeout=60.0):
    from compcomm import _C
    from compcomm._buffers import buffer_of

    staging = torch.empty(_C.zero.compressed_allreduce_batch_bytes(
        [we.numel() for we, _, _ in bufs], comm.size()), dtype=torch.uint8, device=device)
    _C.zero.compressed_allreduce_exchange_many(
        comm, [buffer_of(x) for x in xs], [buffer_of(b[0]) for b in bufs],
        [buffer_of(b[1]) for b in bufs], [buffer_of(b[2]) for b in bufs], buffer_of(staging),
        timeout)
    for x, (we, se, ws) in zip(xs, bufs):
        _C.zero.compressed_allreduce_commit(comm, buffer_of(x), buffer_of(we), buffer_of(se),
                                            buffer_of(ws))


def _snapshot(xs, bufs):
    return [t.detach().cpu().float().clone() for t in xs] + [
        t.detach().cpu().clone() for b in bufs for t in b[:2]]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def rank_body(rank: int, world: int, device: str = "cpu") -> Dict[str, Any]:
    from compcomm import _C
    from compcomm._buffers import buffer_of
    from compcomm._comm import resolve
    from compcomm.compress import OneBitCompressor

    dev = torch.device(device)
    comm = resolve(None)
    out: Dict[str, Any] = {}

    # 1. the batched exchange against per-bucket compressed_allreduce, 3 rounds (error feedback),
    #    mixed dtypes; and the wire bytes
    dtypes = [torch.float32, torch.float32, torch.bfloat16, torch.float16, torch.float32]
    one, many = _buffers(NUMELS, world, dev), _buffers(NUMELS, world, dev)
    same, nbytes = [], []
    for rnd in range(3):
        xs1, xs2 = _inputs(rank, rnd, dtypes, dev), _inputs(rank, rnd, dtypes, dev)
        comm.reset_bytes_sent()
        for x, (we, se, ws) in zip(xs1, one):
            _C.compressed_allreduce(comm, buffer_of(x), buffer_of(we), buffer_of(se), buffer_of(ws))
        b1 = comm.bytes_sent
        comm.reset_bytes_sent()
        _many(comm, xs2, many, dev)
        nbytes.append((b1, comm.bytes_sent))
        same.append(_same(_snapshot(xs1, one), _snapshot(xs2, many)))
    out["same"], out["bytes"] = same, nbytes

    # 2. OneBitCompressor, batched (default) and per bucket: the same bits
    keys = [("k", i) for i in range(len(NUMELS))]
    comps = [OneBitCompressor(comm, batched=True), OneBitCompressor(comm, batched=False)]
    res = []
    for c in comps:
        snaps = []
        for rnd in range(3):
            xs = [x.float() for x in _inputs(rank, rnd, dtypes, dev)]
            c.average_(keys, NUMELS, lambda i: xs[i], dev)
            snaps.append([x.cpu() for x in xs])
        res.append(snaps)
        snaps.append([t.cpu() for k in keys for t in c.state_dict().get(k, {}).values()])
    out["compressor_same"] = all(_same(a, b) for a, b in zip(*res))
    for c in comps:
        c.close()

    # 3. failures: typed, on every rank, nothing but the workspaces written
    fails: Dict[str, Any] = {}
    bufs = _buffers(NUMELS, world, dev)
    xs = _inputs(rank, 7, [torch.float32] * len(NUMELS), dev)
    before = _snapshot(xs, bufs)

    def attempt(name, fn):
        try:
            fn()
            fails[name] = None
        except Exception as e:  # noqa: BLE001 -- the test compares the class and message
            fails[name] = (type(e).__name__, str(e))
        fails[name + "_unchanged"] = _same(before, _snapshot(xs, bufs))

    def short_lists():
        _C.zero.compressed_allreduce_exchange_many(
            comm, [buffer_of(x) for x in xs], [buffer_of(b[0]) for b in bufs[:-1]],
            [buffer_of(b[1]) for b in bufs], [buffer_of(b[2]) for b in bufs],
            buffer_of(torch.empty(1 << 16, dtype=torch.uint8, device=dev)), 60.0)

    def small_staging():
        _C.zero.compressed_allreduce_exchange_many(
            comm, [buffer_of(x) for x in xs], [buffer_of(b[0]) for b in bufs],
            [buffer_of(b[1]) for b in bufs], [buffer_of(b[2]) for b in bufs],
            buffer_of(torch.empty(8, dtype=torch.uint8, device=dev)), 60.0)

    def bad_error_size():
        bad = [(b[0][:8 * world] if i == 3 else b[0], b[1], b[2]) for i, b in enumerate(bufs)]
        _many(comm, xs, bad, dev)

    attempt("short_lists", short_lists)
    attempt("small_staging", small_staging)
    attempt("bad_error_size", bad_error_size)
    if world > 1:
        def nonfinite():
            ys = [x.clone() for x in xs]
            if rank == world - 1:
                ys[3][5] = float("nan")
            _many(comm, ys, bufs, dev)

        def mismatch():  # rank 0 passes another numel for bucket 2 (same padded size)
            ys = [x.clone() for x in xs]
            if rank == 0:
                ys[2] = ys[2][:-1].clone()
            _many(comm, ys, bufs, dev)

        def count_mismatch():  # rank 0 leaves out the last bucket
            n = len(bufs) - 1 if rank == 0 else len(bufs)
            _many(comm, xs[:n], bufs[:n], dev)

        def no_calls():  # rank 0 passes no bucket at all
            n = 0 if rank == 0 else len(bufs)
            _many(comm, xs[:n], bufs[:n], dev)

        attempt("nonfinite", nonfinite)
        attempt("mismatch", mismatch)
        attempt("count_mismatch", count_mismatch)
        attempt("no_calls", no_calls)
    out["fails"] = fails
    # still usable after the failures, and equal to per-bucket calls from the same state
    ref = [(we.clone(), se.clone(), ws.clone()) for we, se, ws in bufs]
    xs1, xs2 = [x.clone() for x in xs], [x.clone() for x in xs]
    for x, (we, se, ws) in zip(xs1, ref):
        _C.compressed_allreduce(comm, buffer_of(x), buffer_of(we), buffer_of(se), buffer_of(ws))
    _many(comm, xs2, bufs, dev)
    out["after_failures_same"] = _same(_snapshot(xs1, ref), _snapshot(xs2, bufs))
    return out
