"""The small-call fast path on a GPU (issue 12): the fused kernels against their CPU twins, and a
world of one rank (LocalCommunicator, native NCCL under a one-rank torch ``nccl`` group) that runs
no collective and checks its header once, at the end of the call.

The CPU side of the same code (cache, ``Communicator.alone``, the twins) is in test_small_calls.py.
"""

from __future__ import annotations

import pytest
import torch

import compcomm
from compcomm import _C
from compcomm._buffers import buffer_of
from compcomm.errors import NonFiniteError
from _backends import no_cuda_kernels, no_gpu, skipif

K = _C.kernels
DEV = "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

pytestmark = [pytest.mark.gpu, skipif(no_gpu() or no_cuda_kernels())]


def _ids(d: torch.dtype) -> str:
    return str(d).split(".")[-1]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    a, b = a.cpu().contiguous(), b.cpu().contiguous()
    assert a.shape == b.shape and a.dtype == b.dtype
    view = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
    if a.dtype in view:
        a, b = a.view(view[a.dtype]), b.view(view[b.dtype])
    bad = (a != b).nonzero()
    assert bad.numel() == 0, f"{bad.numel()} of {a.numel()} differ, first at {bad[:5].flatten().tolist()}"


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("n", [0, 1, 7, 4099, 2**20 + 3])
def test_worker_scale_pack_header_matches_cpu(n: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(n + 1)
    P = compcomm.padded_numel(n, 1)
    m, e = torch.randn(n, generator=g).to(dtype), 0.1 * torch.randn(P, generator=g)
    hc, sc = torch.zeros(32, dtype=torch.uint8), torch.zeros(max(1, P // 8), dtype=torch.uint8)
    K.worker_scale_pack_header(buffer_of(m), buffer_of(e), buffer_of(hc), buffer_of(sc),
                               buffer_of(torch.zeros(16, dtype=torch.uint8)), magic=77)
    md, ed = m.to(DEV), e.to(DEV)
    hd = torch.full((32,), 0xEE, dtype=torch.uint8, device=DEV)
    sd = torch.full((max(1, P // 8),), 0xA5, dtype=torch.uint8, device=DEV)
    ws = torch.zeros(K.scale_workspace_bytes(P, True), dtype=torch.uint8, device=DEV)
    for _ in range(2):  # the scratch is left zero-filled: a second call agrees too
        K.worker_scale_pack_header(buffer_of(md), buffer_of(ed), buffer_of(hd), buffer_of(sd),
                                   buffer_of(ws), magic=77)
        torch.cuda.synchronize()
        _same_bits(sd[: P // 8], sc[: P // 8])
        torch.testing.assert_close(hd[:4].view(torch.float32).cpu(), hc[:4].view(torch.float32),
                                   rtol=2.5e-7, atol=0.0)
        assert torch.equal(hd[4:].cpu(), hc[4:])  # flags, numel, padded, dtype, magic


@pytest.mark.parametrize("serr_offset", [0, 1], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("world", [1, 3, 4])
@pytest.mark.parametrize("n", [7, 4099, 2**20 + 3])
def test_commit_matches_cpu(n: int, world: int, dtype: torch.dtype, serr_offset: int) -> None:
    g = torch.Generator().manual_seed(n * 7 + world)
    P = compcomm.padded_numel(n, world)
    C = P // world
    stride, oss, osb = 8, 4, C // 8 + 16
    host = {
        "signs": torch.randint(0, 256, (world * C // 8,), dtype=torch.uint8, generator=g),
        "scales": torch.rand(world * stride, generator=g) + 0.01,
        "tau": torch.rand(1, generator=g) + 0.5,
        "sigma": torch.rand(1, generator=g) + 0.5,
        "out_scales": torch.rand(world * oss, generator=g) + 0.25,
        "out_signs": torch.randint(0, 256, (world * osb,), dtype=torch.uint8, generator=g),
        "m": torch.cat([torch.randn(n, generator=g).to(dtype), torch.full((16,), 1024.0, dtype=dtype)]),
        "e": torch.randn(P, generator=g),
        "s": 0.1 * torch.randn(C + 1, generator=g),
    }
    dev = {k: v.to(DEV) for k, v in host.items()}
    for d in (host, dev):
        s = d["s"][serr_offset: serr_offset + C]
        b = buffer_of
        K.commit(b(d["signs"]), b(d["scales"]), stride, b(s), b(d["tau"]), b(d["m"][:n]), b(d["e"]),
                 b(d["sigma"]), b(d["out_scales"]), oss, b(d["out_signs"]), osb, world,
                 guard=b(d["out_scales"]), guard_stride=oss)
    torch.cuda.synchronize()
    for k in ("m", "e", "s"):
        _same_bits(dev[k], host[k])  # m includes 16 elements past n that must stay untouched


def test_commit_guard_writes_nothing() -> None:
    n, world = 4099, 2
    P = compcomm.padded_numel(n, world)
    g = torch.Generator().manual_seed(3)
    m, e, s = (torch.randn(k, generator=g).to(DEV) for k in (n, P, P // world))
    signs = torch.randint(0, 256, (P // 8,), dtype=torch.uint8, generator=g).to(DEV)
    scales = torch.tensor([0.5, 0.25], device=DEV)
    m0, e0, s0 = m.clone(), e.clone(), s.clone()
    b = buffer_of
    for bad in (float("nan"), float("inf")):
        guard = torch.tensor([1.0, bad], device=DEV)
        K.commit(b(signs), b(scales), 1, b(s), b(scales[:1]), b(m), b(e), b(scales[:1]), b(scales), 1,
                 b(signs), P // 16, world, guard=b(guard))
        torch.cuda.synchronize()
        for x, x0 in ((m, m0), (e, e0), (s, s0)):
            _same_bits(x, x0)


def _nonfinite_changes_nothing(group) -> None:
    """A world of one on CUDA: the deferred header check raises NonFiniteError, nothing written;
    unchecked (shape seen), nothing written and nothing raised; the next clean call works."""
    n = 4099
    t = torch.randn(n, device=DEV)
    we, se = compcomm.error_buffers(t, group)
    compcomm.compressed_allreduce(t, we, se, group)  # errors nonzero now
    bad = torch.randn(n, device=DEV)
    bad[17] = float("nan")
    before = [x.clone() for x in (bad, we, se)]
    with pytest.raises(NonFiniteError):
        compcomm.compressed_allreduce(bad, we, se, group)
    for x, x0 in zip((bad, we, se), before):
        _same_bits(x, x0)
    bad[17] = float("inf")
    before = [x.clone() for x in (bad, we, se)]
    compcomm.compressed_allreduce(bad, we, se, group, check=False)
    torch.cuda.synchronize()
    for x, x0 in zip((bad, we, se), before):
        _same_bits(x, x0)
    good = torch.randn(n, device=DEV)
    compcomm.compressed_allreduce(good, we, se, group)
    assert bool(torch.isfinite(good).all()) and not torch.equal(we, before[1])


def test_local_alone_nonfinite_changes_nothing() -> None:
    comm = _C.LocalCommunicator()
    assert comm.alone(0)
    _nonfinite_changes_nothing(comm)


def test_nccl_one_rank_alone() -> None:
    """The default path of issue 12's target: group=None under a one-rank torch nccl group is the
    native NCCL communicator, alone; equal to the CPU twin, all-or-nothing on NaN/Inf, and a closed
    communicator still raises."""
    import torch.distributed as dist

    if not dist.is_nccl_available():
        pytest.skip("torch was built without NCCL")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    if not compcomm.build_info()["nccl"]:
        pytest.skip("this build has no native NCCL communicator")
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        comm = compcomm.get_communicator(None)
        assert comm.backend_name() == "nccl" and comm.alone(comm.device) and not comm.alone(-1)
        g = torch.Generator().manual_seed(5)
        xs = [torch.randn(4099, generator=g) for _ in range(3)]
        outs = {}
        for dev, group in (("cpu", _C.LocalCommunicator()), (DEV, None)):
            we, se = compcomm.error_buffers(4099, group, device=dev)
            for x in xs:
                t = x.to(dev, copy=True)
                compcomm.compressed_allreduce(t, we, se, group)
            outs[dev] = (t.cpu(), we.cpu(), se.cpu())
        for a, b in zip(outs[DEV], outs["cpu"]):
            torch.testing.assert_close(a, b, rtol=0.0, atol=1e-5 * max(1.0, float(b.abs().max())))
        _nonfinite_changes_nothing(None)
        # Not alone for host buffers: NCCL still refuses them, naming the argument (checked in
        # Python before the call starts, so that peers of a wider group would be told).
        t = torch.randn(64)
        we, se = compcomm.error_buffers(t)
        t0 = t.clone()
        with pytest.raises(ValueError, match=r"argument 'tensor' is on cpu but the NCCL "
                           r"communicator is on cuda:\d"):
            compcomm.compressed_allreduce(t, we, se)
        assert torch.equal(t, t0) and int(we.count_nonzero()) == 0
        comm.abort("test: closed")
        t = torch.randn(64, device=DEV)
        we, se = compcomm.error_buffers(t, comm)
        with pytest.raises(compcomm.errors.CommError, match="closed"):
            compcomm.compressed_allreduce(t, we, se, comm)
    finally:
        dist.destroy_process_group()
        compcomm._comm.forget_process_groups()


# ---- the notice: a checked call alone waits for the worker kernel's posted header, not the stream


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("n", [0, 7, 2**20 + 3])
def test_worker_notice_matches_header(n: int, dtype: torch.dtype) -> None:
    """The device twin posts begin, what it wrote to the header, then the tag; as the CPU twin."""
    g = torch.Generator().manual_seed(n + 2)
    P = compcomm.padded_numel(n, 1)
    m, e = torch.randn(n, generator=g).to(dtype), 0.1 * torch.randn(P, generator=g)
    if n == 7:
        m[3] = float("nan")  # the flag travels too
    notices = {}
    for dev in ("cpu", DEV):
        hd = torch.zeros(32, dtype=torch.uint8, device=dev)
        sd = torch.zeros(max(1, P // 8), dtype=torch.uint8, device=dev)
        wsb = K.scale_workspace_bytes(P, dev != "cpu") or 16
        ws = torch.zeros(wsb, dtype=torch.uint8, device=dev)
        nd = torch.full((64,), 0xEE, dtype=torch.uint8, device=dev)
        md, ed = m.to(dev), e.to(dev)
        K.worker_scale_pack_header(buffer_of(md), buffer_of(ed), buffer_of(hd), buffer_of(sd),
                                   buffer_of(ws), magic=5, notice=buffer_of(nd), seq=2**33 + n)
        torch.cuda.synchronize()
        assert torch.equal(nd[:32], hd) and nd[32:40].view(torch.int64).item() == 2**33 + n
        assert nd[40:48].view(torch.int64).item() == 2**33 + n  # begin, the seqlock's first word
        assert bool((nd[48:] == 0xEE).all())
        notices[dev] = nd.cpu()
    assert torch.equal(notices[DEV][4:], notices["cpu"][4:])  # flags, sizes, magic, tag
    scales = [notices[d][:4].view(torch.float32) for d in (DEV, "cpu")]
    torch.testing.assert_close(scales[0], scales[1], rtol=2.5e-7, atol=0.0, equal_nan=True)


def _run(comm, check: bool, xs: list, streams: list) -> tuple:
    """Calls compressed_allreduce on each of xs in turn, on streams[i % len], with other work on a
    side stream in between; returns every output and the final errors."""
    n = xs[0].numel()
    we, se = compcomm.error_buffers(n, comm, device=DEV)
    side = torch.cuda.Stream()
    junk = torch.randn(1 << 20, device=DEV)
    outs = []
    for i, x in enumerate(xs):
        s = streams[i % len(streams)]
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            t = x.to(DEV, non_blocking=True)
            compcomm.compressed_allreduce(t, we, se, comm, check=check)
            outs.append(t)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.stream(side):
            junk.mul_(1.0001)  # unrelated work interleaved on another stream
    torch.cuda.synchronize()
    return torch.stack(outs).cpu(), we.cpu(), se.cpu()


def test_alone_notice_many_calls_streams_bits() -> None:
    """Hundreds of checked calls alone, alternating between two streams with other streams' work
    between them: every tag arrives, and the bits equal those of the same calls unchecked (the same
    kernels without the notice) and, to fp32 rounding of the scales, the CPU twin's."""
    g = torch.Generator().manual_seed(11)
    xs = [torch.randn(4099, generator=g) for _ in range(300)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    checked = _run(_C.LocalCommunicator(), True, xs, streams)
    comm = _C.LocalCommunicator()
    _run(comm, True, xs[:1], streams)  # sizes seen once: check=False then skips the host check
    unchecked = _run(comm, False, xs, streams)
    for a, b in zip(checked, unchecked):
        _same_bits(a, b)
    host = _C.LocalCommunicator()
    we, se = compcomm.error_buffers(4099, host)
    for i, x in enumerate(xs[:3]):  # more calls could let a scale rounding flip a sign
        t = x.clone()
        compcomm.compressed_allreduce(t, we, se, host)
        tol = 1e-5 * max(1.0, float(t.abs().max()))
        torch.testing.assert_close(checked[0][i], t, rtol=0.0, atol=tol)


def test_alone_notice_waits_for_a_busy_stream_and_times_out() -> None:
    """Behind earlier work on its stream the call waits for it (past the spinning phase); given
    less time than that work takes, it raises CommTimeoutError, queues no commit (nothing written,
    even once the stream drains), and the next call works."""
    comm = _C.LocalCommunicator()
    t = torch.randn(4099, device=DEV)
    we, se = compcomm.error_buffers(t, comm)
    compcomm.compressed_allreduce(t, we, se, comm)
    torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time ahead of the call
    compcomm.compressed_allreduce(t, we, se, comm)
    torch.cuda.synchronize()
    before = [x.clone() for x in (t, we, se)]
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s
    with pytest.raises(compcomm.errors.CommTimeoutError, match="did not finish"):
        compcomm.compressed_allreduce(t, we, se, comm, timeout=0.05)
    torch.cuda.synchronize()
    for x, x0 in zip((t, we, se), before):
        _same_bits(x, x0)
    for _ in range(3):  # a fresh notice after the abandoned one
        compcomm.compressed_allreduce(t, we, se, comm)
    torch.cuda.synchronize()
    assert bool(torch.isfinite(t).all()) and not torch.equal(we, before[1])


def test_alone_nonfinite_then_more_calls_without_sync() -> None:
    """A raising call leaves the tags in order: calls right after it, with no sync between, see
    their own verdicts (a NaN later in the series raises again)."""
    comm = _C.LocalCommunicator()
    t = torch.randn(1000, device=DEV)
    we, se = compcomm.error_buffers(t, comm)
    for i in range(40):
        if i % 10 == 5:
            bad = t.clone()
            bad[i] = float("nan")
            with pytest.raises(NonFiniteError):
                compcomm.compressed_allreduce(bad, we, se, comm)
        else:
            compcomm.compressed_allreduce(t, we, se, comm)
    torch.cuda.synchronize()
    assert bool(torch.isfinite(t).all())


def test_alone_notice_two_threads() -> None:
    """Two threads, each with its own communicator and stream, call at once: each waits on its own
    thread's notice, and each gets the bits a single thread gets."""
    import threading

    g = torch.Generator().manual_seed(12)
    xs = [torch.randn(4099, generator=g) for _ in range(100)]
    want = _run(_C.LocalCommunicator(), True, xs, [torch.cuda.Stream()])
    got: list = []

    def body() -> None:
        got.append(_run(_C.LocalCommunicator(), True, xs, [torch.cuda.Stream()]))

    threads = [threading.Thread(target=body) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(got) == 2
    for result in got:
        for a, b in zip(result, want):
            _same_bits(a, b)
