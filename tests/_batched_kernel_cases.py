"""Shared bodies of tests/test_batched_kernels.py (CPU) and test_batched_kernels_gpu.py (CUDA): the
batched copies and the batched exchange + commit of compressed_allreduce_exchange_many /
compressed_allreduce_commit_many against their per-bucket forms, over mirrored peers (one process)."""

from __future__ import annotations

from typing import List, Tuple

import torch

from compcomm import _C
from compcomm._buffers import buffer_of
from compcomm.collectives import padded_numel
from compcomm.testing import cancelling_peer, mirrored_peers

# sizes (0 and 1 included) and dtypes of the buckets; `shift` starts a bucket one element into its
# storage, so the kernels' unaligned variants run too
BUCKETS = [(0, torch.float32, 0), (1, torch.float32, 0), (37, torch.bfloat16, 1), (1000, torch.float16, 0),
           (4099, torch.float32, 1), (65536 + 5, torch.float32, 0), (300, torch.float32, 0)]


def copy_jobs(device: str, count: int, seed: int = 0) -> Tuple[torch.Tensor, List[torch.Tensor],
                                                                  List[torch.Tensor]]:
    """A destination tensor and `count` (dst, src) byte views of every size and alignment class."""
    g = torch.Generator().manual_seed(seed)
    sizes = [0, 1, 3, 4, 16, 32, 100, 4096, 4097, 70000]
    srcs, dsts, off = [], [], 0
    for i in range(count):
        n = sizes[i % len(sizes)] + (i // len(sizes)) % 3
        shift = [0, 1, 4, 16][i % 4]
        src = torch.randint(0, 256, (n + shift,), generator=g, dtype=torch.uint8).to(device)[shift:]
        srcs.append(src)
        dsts.append((off + shift, n))
        off += n + shift + 16
    out = torch.zeros(off + 16, dtype=torch.uint8, device=device)
    return out, [out[a:a + n] for a, n in dsts], srcs


def buffers(world: int, device: str):
    out = []
    for n, _, _ in BUCKETS:
        p = padded_numel(n, world)
        total = _C.compressed_allreduce_layout(p, world, device == "cuda")["total"]
        out.append([torch.zeros(p, device=device), torch.zeros(p // world, device=device),
                    torch.zeros(max(total, 1), dtype=torch.uint8, device=device)])
    return out


def inputs(rnd: int, device: str) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rnd)
    xs = []
    for n, dt, shift in BUCKETS:
        base = torch.randn(n + shift, generator=g).to(dt).to(device)
        xs.append(base[shift:])
    return xs


def snapshot(xs, bufs) -> List[torch.Tensor]:
    return [x.detach().cpu().float().clone() for x in xs] + [t.cpu().clone() for b in bufs for t in b[:2]]


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def args(xs, bufs):
    return ([buffer_of(x) for x in xs], [buffer_of(b[0]) for b in bufs], [buffer_of(b[1]) for b in bufs],
            [buffer_of(b[2]) for b in bufs])


def exchange_many(comm, xs, bufs, device: str) -> None:
    staging = torch.empty(_C.zero.compressed_allreduce_batch_bytes([b[0].numel() for b in bufs], comm.size()),
                          dtype=torch.uint8, device=device)
    stream = torch.cuda.current_stream().cuda_stream if device == "cuda" else 0
    _C.zero.compressed_allreduce_exchange_many(comm, *args(xs, bufs), buffer_of(staging), 60.0, stream)


def batched_equals_per_call(world: int, device: str, rounds: int = 3) -> List[bool]:
    """Per round: [batched exchange + commit_many == per-call compressed_allreduce,
    batched exchange + per-call commits == batched exchange + commit_many]."""
    comm = mirrored_peers(world)
    stream = torch.cuda.current_stream().cuda_stream if device == "cuda" else 0
    one, many, split = buffers(world, device), buffers(world, device), buffers(world, device)
    out = []
    for rnd in range(rounds):
        x1, x2, x3 = inputs(rnd, device), inputs(rnd, device), inputs(rnd, device)
        for x, (we, se, ws) in zip(x1, one):
            _C.compressed_allreduce(comm, buffer_of(x), buffer_of(we), buffer_of(se), buffer_of(ws), 60.0, stream)
        exchange_many(comm, x2, many, device)
        _C.zero.compressed_allreduce_commit_many(comm, *args(x2, many), stream)
        exchange_many(comm, x3, split, device)
        for x, (we, se, ws) in zip(x3, split):
            _C.zero.compressed_allreduce_commit(comm, buffer_of(x), buffer_of(we), buffer_of(se), buffer_of(ws),
                                                stream)
        if device == "cuda":
            torch.cuda.synchronize()
        a, b, c = snapshot(x1, one), snapshot(x2, many), snapshot(x3, split)
        out.append([same(a, b), same(c, b)])
    return out


def commit_many_bad_argument_writes_nothing(device: str) -> Tuple[str, str, bool]:
    """A workspace too small for bucket 4 of 7: commit_many raises before committing buckets 0-3."""
    comm = mirrored_peers(2)
    bufs, xs = buffers(2, device), inputs(0, device)
    exchange_many(comm, xs, bufs, device)
    before = snapshot(xs, bufs)
    a = list(args(xs, bufs))
    a[3][4] = buffer_of(bufs[4][2][:64])
    try:
        _C.zero.compressed_allreduce_commit_many(comm, *a)
        err = ("", "")
    except Exception as e:  # noqa: BLE001 -- the test reads its class and message
        err = (type(e).__name__, str(e))
    return err[0], err[1], same(before, snapshot(xs, bufs))


def cancelled_commit_many(cancel_at: int) -> Tuple[bool, bool]:
    """A world of one rank whose `cancel_at`-th collective of a batched exchange is "cancelled" as
    an aborted NCCL collective is (abort flag set, finite garbage received, no error): the gated
    commit_many writes nothing. cancel_at = 0: never cancelled, and the same bits as per-call calls.
    Returns (unchanged, equal to per-call calls). Host buffers (the flag is host memory)."""

    comm = cancelling_peer(cancel_at)
    bufs, xs = buffers(1, "cpu"), inputs(0, "cpu")
    for b in bufs:
        b[0].normal_(0, 0.1)
        b[1].copy_(b[0][: b[1].numel()] * 0.5)
    ref_bufs = [[t.clone() for t in b] for b in bufs]
    ref_xs = [x.clone() for x in xs]
    before = snapshot(xs, bufs)
    exchange_many(comm, xs, bufs, "cpu")
    _C.zero.compressed_allreduce_commit_many(comm, *args(xs, bufs))
    unchanged = same(before, snapshot(xs, bufs))
    local = _C.LocalCommunicator()
    for x, (we, se, ws) in zip(ref_xs, ref_bufs):
        _C.compressed_allreduce(local, buffer_of(x), buffer_of(we), buffer_of(se), buffer_of(ws))
    return unchanged, same(snapshot(ref_xs, ref_bufs), snapshot(xs, bufs))


def rs_buffers(world: int, device: str):
    """Per bucket: worker error, server error, workspace, out (FSDP's per-segment reduce-scatter)."""
    return [[we, se, ws, torch.zeros(we.numel() // world, device=device)]
            for we, se, ws in buffers(world, device)]


def rs_batched_equals_per_call(world: int, device: str, rounds: int = 3) -> List[bool]:
    """compressed_reduce_scatter_exchange_many + a compressed_reduce_scatter_commit per bucket
    (compcomm.fsdp's batched segments) against one compressed_reduce_scatter per bucket, bit for
    bit per round: the outputs, both error buffers and the inputs."""
    comm = mirrored_peers(world)
    stream = torch.cuda.current_stream().cuda_stream if device == "cuda" else 0
    one, many = rs_buffers(world, device), rs_buffers(world, device)
    out = []
    for rnd in range(rounds):
        x1, x2 = inputs(rnd, device), inputs(rnd, device)
        x1 = [torch.nn.functional.pad(x.float(), (0, b[0].numel() - x.numel())) for x, b in zip(x1, one)]
        x2 = [torch.nn.functional.pad(x.float(), (0, b[0].numel() - x.numel())) for x, b in zip(x2, many)]
        for x, (we, se, ws, o) in zip(x1, one):
            _C.zero.compressed_reduce_scatter(comm, buffer_of(x), buffer_of(we), buffer_of(se),
                                              buffer_of(o), buffer_of(ws), 60.0, stream)
        staging = torch.empty(_C.zero.compressed_allreduce_batch_bytes([b[0].numel() for b in many], world),
                              dtype=torch.uint8, device=device)
        bufs = [[buffer_of(t) for t in ts] for ts in
                (x2, [b[0] for b in many], [b[1] for b in many], [b[3] for b in many], [b[2] for b in many])]
        _C.zero.compressed_reduce_scatter_exchange_many(comm, *bufs, buffer_of(staging), 60.0, stream)
        for call in zip(*bufs):
            _C.zero.compressed_reduce_scatter_commit(comm, *call, gate=False, stream=stream)
        if device == "cuda":
            torch.cuda.synchronize()
        snap = lambda xs, bs: [x.cpu().clone() for x in xs] + [t.cpu().clone() for b in bs  # noqa: E731
                                                               for t in (b[0], b[1], b[3])]
        out.append(same(snap(x1, one), snap(x2, many)))
    return out
