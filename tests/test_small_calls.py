"""The small-call fast path of compressed_allreduce (and compressed_reduce_scatter with a given
``out``; issue 12), on the CPU.

- The validation cache: a call whose tensors match a validated call (type, address, numel, dtype,
  contiguity, device, communicator) skips the checks; anything else is checked again, so every bad
  argument still raises its typed error, and cached calls give the bits of uncached ones.
- A world of one rank on a communicator whose collectives are copies (``Communicator.alone``) runs
  no collective; a Python communicator still sees every one.
- The fused kernels (``worker_scale_pack_header``, ``commit``) against the calls they replace.
"""

from __future__ import annotations

import threading

import pytest
import torch

import compcomm
from compcomm import _C, collectives
from compcomm._buffers import buffer_of
from compcomm.errors import CommError, NonFiniteError

K = _C.kernels


def _state(n: int, seed: int, comm):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, generator=g)
    we, se = compcomm.error_buffers(t, group=comm)
    we.copy_(0.1 * torch.randn(we.numel(), generator=g))
    se.copy_(0.1 * torch.randn(se.numel(), generator=g))
    return t, we, se


def _bits(*ts: torch.Tensor) -> list:
    return [t.view(torch.int32).clone() if t.dtype == torch.float32 else t.clone() for t in ts]


def test_cached_calls_equal_uncached_calls() -> None:
    comm = _C.LocalCommunicator()
    a = _state(1003, 1, comm)
    b = [x.clone() for x in a]
    g = torch.Generator().manual_seed(2)
    for _ in range(4):
        x = torch.randn(1003, generator=g)
        a[0].copy_(x)
        b[0].copy_(x)
        compcomm.compressed_allreduce(*a, group=comm)  # cached after the first round
        collectives._prepared.clear()
        compcomm.compressed_allreduce(*b, group=comm)  # validated every time
        for u, v in zip(_bits(*a), _bits(*b)):
            assert torch.equal(u, v)


def test_cache_hit_after_fresh_tensors_at_reused_addresses() -> None:
    """New tensors may reuse a dead tensor's memory: a key match then means identical Buffers."""
    comm = _C.LocalCommunicator()
    for seed in range(5):
        t, we, se = _state(64, seed, comm)
        ref = [x.clone() for x in (t, we, se)]
        compcomm.compressed_allreduce(t, we, se, group=comm)
        collectives._prepared.clear()
        compcomm.compressed_allreduce(*ref, group=comm)
        for u, v in zip(_bits(t, we, se), _bits(*ref)):
            assert torch.equal(u, v)
        del t, we, se


def test_bad_arguments_after_a_cached_call_still_raise() -> None:
    comm = _C.LocalCommunicator()
    t, we, se = _state(64, 3, comm)
    compcomm.compressed_allreduce(t, we, se, group=comm)
    before = _bits(t, we, se)
    # Same address and numel, not contiguous.
    with pytest.raises(ValueError, match="'tensor' must be contiguous"):
        compcomm.compressed_allreduce(t.view(8, 8).t(), we, se, group=comm)
    # Same memory seen as another dtype.
    with pytest.raises(TypeError, match="'tensor' must be float32"):
        compcomm.compressed_allreduce(t.view(torch.int32), we, se, group=comm)
    with pytest.raises(TypeError, match="'worker_error' must be torch.float32"):
        compcomm.compressed_allreduce(t, we.view(torch.int32), se, group=comm)
    # A buffer that overlaps another.
    with pytest.raises(ValueError, match="overlap"):
        compcomm.compressed_allreduce(t, we, we[: se.numel()], group=comm)
    # Not a tensor at all.
    with pytest.raises(TypeError, match="'server_error' must be a torch.Tensor"):
        compcomm.compressed_allreduce(t, we, [0.0] * se.numel(), group=comm)
    # The timeout is checked on every call, cached or not.
    with pytest.raises(ValueError, match="'timeout' must be positive"):
        compcomm.compressed_allreduce(t, we, se, group=comm, timeout=-1)
    with pytest.raises(TypeError, match="'timeout'"):
        compcomm.compressed_allreduce(t, we, se, group=comm, timeout="1")
    for u, v in zip(_bits(t, we, se), before):
        assert torch.equal(u, v)


def test_resized_tensor_is_checked_again() -> None:
    comm = _C.LocalCommunicator()
    t, we, se = _state(64, 4, comm)
    compcomm.compressed_allreduce(t, we, se, group=comm)
    t.resize_(we.numel() + 8)
    with pytest.raises(ValueError, match="'worker_error' has"):
        compcomm.compressed_allreduce(t, we, se, group=comm)


def test_nonfinite_on_a_cached_call_raises_and_changes_nothing() -> None:
    comm = _C.LocalCommunicator()
    t, we, se = _state(100, 5, comm)
    compcomm.compressed_allreduce(t, we, se, group=comm)
    t[7] = float("nan")
    before = _bits(t, we, se)
    with pytest.raises(NonFiniteError):
        compcomm.compressed_allreduce(t, we, se, group=comm)
    for u, v in zip(_bits(t, we, se), before):
        assert torch.equal(u, v)


def test_busy_communicator_refused_on_the_cached_path() -> None:
    comm = _C.LocalCommunicator()
    t, we, se = _state(64, 6, comm)
    compcomm.compressed_allreduce(t, we, se, group=comm)  # now cached
    lock = collectives._lock(comm)
    assert lock.acquire(blocking=False)  # as another thread's call would hold it
    try:
        before = _bits(t, we, se)
        with pytest.raises(CommError, match="in use by another thread"):
            compcomm.compressed_allreduce(t, we, se, group=comm)
        for u, v in zip(_bits(t, we, se), before):
            assert torch.equal(u, v)
    finally:
        lock.release()
    compcomm.compressed_allreduce(t, we, se, group=comm)


def test_two_threads_two_communicators_cached() -> None:
    """Each thread on its own communicator, many cached calls: same bits as one after another."""
    comms = [_C.LocalCommunicator(), _C.LocalCommunicator()]
    states = [_state(4099, 10 + i, c) for i, c in enumerate(comms)]
    refs = [[x.clone() for x in s] for s in states]
    for s, c in zip(refs, comms):
        for _ in range(50):
            compcomm.compressed_allreduce(*s, group=c)

    def run(i: int) -> None:
        for _ in range(50):
            compcomm.compressed_allreduce(*states[i], group=comms[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for s, r in zip(states, refs):
        for u, v in zip(_bits(*s), _bits(*r)):
            assert torch.equal(u, v)


def test_cache_is_bounded() -> None:
    comm = _C.LocalCommunicator()
    t, we, se = _state(8, 7, comm)
    for i in range(collectives._PREPARED_MAX + 5):
        compcomm.compressed_allreduce(t[: 1 + i % 8], we, se, group=comm)
        compcomm.compressed_allreduce(t, we, se, group=comm, timeout=1.0 + i)
    assert len(collectives._prepared) <= collectives._PREPARED_MAX


def test_cache_holds_no_tensor() -> None:
    import gc
    import weakref

    comm = _C.LocalCommunicator()
    t, we, se = _state(64, 8, comm)
    compcomm.compressed_allreduce(t, we, se, group=comm)
    refs = [weakref.ref(x) for x in (t, we, se)]
    del t, we, se
    gc.collect()
    assert all(r() is None for r in refs)


def test_cache_keeps_no_workspace_of_a_dropped_communicator() -> None:
    import gc
    import weakref

    comm = _C.LocalCommunicator()
    t, we, se = _state(4099, 12, comm)
    compcomm.compressed_allreduce(t, we, se, group=comm)
    ws = weakref.ref(collectives._workspaces[comm][t.device])
    assert ws() is not None
    del comm
    gc.collect()
    assert ws() is None


def _rs(t, we, se, out, comm, **kw):
    return compcomm.compressed_reduce_scatter(t, we, se, out=out, group=comm, **kw)


def test_cached_reduce_scatter_calls_equal_uncached_calls() -> None:
    """compressed_reduce_scatter with a given ``out`` caches its checks as compressed_allreduce
    does: the same bits as calls validated every time, and one cache entry for the argument set."""
    comm = _C.LocalCommunicator()
    a = list(_state(1003, 21, comm))
    a.append(torch.empty(a[2].numel()))
    b = [x.clone() for x in a]
    g = torch.Generator().manual_seed(22)
    collectives._prepared.clear()
    for _ in range(4):
        x = torch.randn(1003, generator=g)
        a[0].copy_(x)
        b[0].copy_(x)
        assert _rs(*a, comm) is a[3]
        assert [k for k in collectives._prepared if k[0] == "compressed_reduce_scatter"]
        collectives._prepared.clear()
        _rs(*b, comm)
        collectives._prepared.clear()
        for u, v in zip(_bits(*a), _bits(*b)):
            assert torch.equal(u, v)
    # without out: a fresh result each call, nothing cached
    got = compcomm.compressed_reduce_scatter(*[x.clone() for x in b[:3]], group=comm)
    assert got.numel() == b[3].numel() and got.data_ptr() != b[3].data_ptr()
    assert not collectives._prepared


def test_bad_arguments_after_a_cached_reduce_scatter_still_raise() -> None:
    comm = _C.LocalCommunicator()
    t, we, se = _state(64, 23, comm)
    out = torch.empty(se.numel())
    _rs(t, we, se, out, comm)
    before = _bits(t, we, se, out)
    with pytest.raises(ValueError, match="'out'"):
        _rs(t, we, se, torch.empty(se.numel() + 8)[: se.numel() - 8], comm)
    with pytest.raises(TypeError, match="'out'"):
        _rs(t, we, se, out.view(torch.int32), comm)
    with pytest.raises(ValueError, match="overlap"):
        _rs(t, we, se, we[: se.numel()], comm)
    with pytest.raises(ValueError, match="'tensor' must be contiguous"):
        _rs(t.view(8, 8).t(), we, se, out, comm)
    with pytest.raises(ValueError, match="'timeout' must be positive"):
        _rs(t, we, se, out, comm, timeout=-1)
    for u, v in zip(_bits(t, we, se, out), before):
        assert torch.equal(u, v)


def test_busy_communicator_refused_on_the_cached_reduce_scatter() -> None:
    comm = _C.LocalCommunicator()
    t, we, se = _state(64, 24, comm)
    out = torch.empty(se.numel())
    _rs(t, we, se, out, comm)  # now cached
    lock = collectives._lock(comm)
    assert lock.acquire(blocking=False)  # as another thread's call would hold it
    try:
        before = _bits(t, we, se, out)
        with pytest.raises(CommError, match="in use by another thread"):
            _rs(t, we, se, out, comm)
        for u, v in zip(_bits(t, we, se, out), before):
            assert torch.equal(u, v)
    finally:
        lock.release()
    _rs(t, we, se, out, comm)


def test_cleared_workspaces_are_made_again() -> None:
    comm = _C.LocalCommunicator()
    a = _state(4099, 13, comm)
    b = [x.clone() for x in a]
    compcomm.compressed_allreduce(*a, group=comm)
    collectives._workspaces.clear()  # what bench/gpu_bench.py does between sizes
    compcomm.compressed_allreduce(*a, group=comm)
    assert comm in collectives._workspaces
    other = _C.LocalCommunicator()
    for _ in range(2):
        compcomm.compressed_allreduce(*b, group=other)
    for u, v in zip(_bits(*a), _bits(*b)):
        assert torch.equal(u, v)


# ---- Communicator.alone ----------------------------------------------------------------------------


class _Counting(_C.Communicator):
    """A Python world of one rank that counts its collectives (copies)."""

    def __init__(self) -> None:
        _C.Communicator.__init__(self)
        self.calls = 0

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1

    def backend_name(self) -> str:
        return "test:counting"

    def _copy(self, send, recv) -> None:
        from compcomm._buffers import tensor_of

        self.calls += 1
        if send.data != recv.data:
            tensor_of(recv).copy_(tensor_of(send))

    def do_all_to_all(self, send, recv, opts) -> None:
        self._copy(send, recv)

    def do_all_gather(self, send, recv, opts) -> None:
        self._copy(send, recv)


def test_alone_only_for_backends_that_say_so() -> None:
    assert _C.LocalCommunicator().alone(-1) and _C.LocalCommunicator().alone(0)
    counting = _Counting()
    assert not counting.alone(-1)
    assert _C.LocalCommunicator().id != _C.LocalCommunicator().id


def test_local_runs_no_collective_python_world_of_one_runs_all() -> None:
    """Same bits either way; only the Python communicator saw collectives (3 per call)."""
    local, counting = _C.LocalCommunicator(), _Counting()
    a = _state(4099, 9, local)
    b = [x.clone() for x in a]
    for _ in range(3):
        compcomm.compressed_allreduce(*a, group=local)
        compcomm.compressed_allreduce(*b, group=counting)
    assert counting.calls == 9
    assert local.bytes_sent == 0
    for u, v in zip(_bits(*a), _bits(*b)):
        assert torch.equal(u, v)


def _poison(case: str, t: torch.Tensor, we: torch.Tensor, se: torch.Tensor) -> None:
    if case == "nan":
        t[5] = float("nan")
    elif case == "inf":
        t[-1] = float("-inf")
    elif case == "inf_in_error":
        we[3] = float("inf")
    elif case == "norm_overflow":  # finite inputs whose norm overflows float32
        t.fill_(3e38 if t.dtype == torch.float32 else 6e4)
        we.fill_(3e38)
    elif case == "nan_in_server_error":  # finite inputs: the commit writes nothing (CPU: raises)
        se[2] = float("nan")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ["clean", "nan", "inf", "inf_in_error", "norm_overflow",
                                  "nan_in_server_error"])
def test_deferred_check_alone_equals_checked_call(case: str, dtype: torch.dtype) -> None:
    """Alone, the header is checked after the guarded commit; a Python world of one checks it
    between the exchanges. Same error (or none) and the same bits after, for every input."""
    local, counting = _C.LocalCommunicator(), _Counting()
    base = list(_state(4099, 14, local))
    base[0] = base[0].to(dtype)
    results = []
    for comm in (local, counting):
        t, we, se = (x.clone() for x in base)
        compcomm.compressed_allreduce(t, we, se, group=comm)  # nonzero errors, shape seen
        _poison(case, t, we, se)
        before = _bits(t.float(), we, se)
        raised = None
        try:
            compcomm.compressed_allreduce(t, we, se, group=comm)
        except NonFiniteError as e:
            raised = type(e).__name__
        after = _bits(t.float(), we, se)
        if case != "clean":  # nothing written, raised or not
            assert all(torch.equal(u, v) for u, v in zip(before, after)), case
        results.append((raised, after))
    assert results[0][0] == results[1][0]
    expect = None if case == "clean" else "NonFiniteError"
    assert results[0][0] == expect
    for u, v in zip(results[0][1], results[1][1]):
        assert torch.equal(u, v)


def test_reduce_scatter_alone_equals_python_world_of_one() -> None:
    local, counting = _C.LocalCommunicator(), _Counting()
    a = _state(1001, 11, local)
    b = [x.clone() for x in a]
    out_a = collectives.compressed_reduce_scatter(*a, group=local)
    out_b = collectives.compressed_reduce_scatter(*b, group=counting)
    assert counting.calls == 2  # header, signs (no records' all-gather)
    for u, v in zip(_bits(out_a, *a), _bits(out_b, *b)):
        assert torch.equal(u, v)


# ---- fused kernels against the calls they replace -------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [0, 1, 7, 4099])
def test_worker_scale_pack_header_equals_two_calls(n: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(n)
    m = torch.randn(n, generator=g).to(dtype)
    P = compcomm.padded_numel(n, 1)
    e = 0.1 * torch.randn(P, generator=g)
    ws = torch.zeros(16, dtype=torch.uint8)
    scale, signs = torch.zeros(1), torch.zeros(max(1, P // 8), dtype=torch.uint8)
    K.worker_scale_pack(buffer_of(m), buffer_of(e), buffer_of(scale), buffer_of(signs), buffer_of(ws))
    header = torch.zeros(32, dtype=torch.uint8)
    signs2 = torch.full_like(signs, 0x5A)[: signs.numel()]
    if P == 0:
        signs2.copy_(signs)
    K.worker_scale_pack_header(buffer_of(m), buffer_of(e), buffer_of(header), buffer_of(signs2),
                               buffer_of(ws), magic=0xC0C0B175)
    assert torch.equal(signs2[: P // 8], signs[: P // 8])
    assert header[:4].view(torch.float32).item() == scale.item()
    words = header.view(torch.int32)
    assert words[1].item() == 0  # flags: finite
    assert header[8:16].view(torch.int64).item() == n
    assert header[16:24].view(torch.int64).item() == P
    assert words[6].item() == int(buffer_of(m).dtype.value)
    assert header[28:32].view(torch.int32).item() == 0xC0C0B175 - 2**32


def test_worker_scale_pack_header_flags_nonfinite() -> None:
    m = torch.ones(16)
    m[3] = float("inf")
    e = torch.zeros(16)
    header, signs, ws = torch.zeros(32, dtype=torch.uint8), torch.zeros(2, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)
    K.worker_scale_pack_header(buffer_of(m), buffer_of(e), buffer_of(header), buffer_of(signs), buffer_of(ws))
    assert header.view(torch.int32)[1].item() == 1


@pytest.mark.parametrize("n", [0, 7, 4099])
def test_worker_scale_pack_header_posts_notice(n: int) -> None:
    """With a notice, the header goes there too, between begin and tag (the CPU twin of what a
    whole call alone waits on); without one, the notice is not touched."""
    m = torch.randn(n)
    m[n // 2:] = float("nan") if n else 0.0
    P = compcomm.padded_numel(n, 1)
    e, ws = torch.zeros(P), torch.zeros(16, dtype=torch.uint8)
    header = torch.zeros(32, dtype=torch.uint8)
    signs = torch.zeros(max(1, P // 8), dtype=torch.uint8)
    notice = torch.full((64,), 0xEE, dtype=torch.uint8)
    K.worker_scale_pack_header(buffer_of(m), buffer_of(e), buffer_of(header), buffer_of(signs),
                               buffer_of(ws), magic=9)
    assert bool((notice == 0xEE).all())
    seq = 2**40 + 5
    K.worker_scale_pack_header(buffer_of(m), buffer_of(e), buffer_of(header), buffer_of(signs),
                               buffer_of(ws), magic=9, notice=buffer_of(notice), seq=seq)
    assert torch.equal(notice[:32], header) and notice[32:40].view(torch.int64).item() == seq
    assert header.view(torch.int32)[1].item() == (1 if n > 1 else 0)  # the flag travels with it
    assert notice[40:48].view(torch.int64).item() == seq  # begin: the seqlock's first word
    assert bool((notice[48:] == 0xEE).all())
    with pytest.raises(ValueError, match="notice needs 64 bytes"):
        K.worker_scale_pack_header(buffer_of(m), buffer_of(e), buffer_of(header), buffer_of(signs),
                                   buffer_of(ws), notice=buffer_of(notice[:40]), seq=1)
    wide = torch.zeros(72, dtype=torch.uint8)
    with pytest.raises(ValueError, match="8-byte aligned"):
        K.worker_scale_pack_header(buffer_of(m), buffer_of(e), buffer_of(header), buffer_of(signs),
                                   buffer_of(ws), notice=buffer_of(wide[1:65]), seq=1)


def test_alone_many_calls_raising_ones_between() -> None:
    """A whole call alone takes its verdict from its thread's notice, tagged per call: many calls,
    raising ones among them, on two threads at once, give what one thread's sequence gives."""
    def run(results: list) -> None:
        comm = _C.LocalCommunicator()
        t, we, se = _state(4099, 3, comm)
        for i in range(150):
            if i % 7 == 3:
                bad = t.clone()
                bad[i] = float("inf")
                with pytest.raises(NonFiniteError):
                    compcomm.compressed_allreduce(bad, we, se, comm)
            t.add_(0.5)
            compcomm.compressed_allreduce(t, we, se, comm)
        results.append(_bits(t, we, se))

    alone: list = []
    run(alone)
    both: list = []
    threads = [threading.Thread(target=run, args=(both,)) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(both) == 2
    for b in both:
        assert all(torch.equal(x, y) for x, y in zip(b, alone[0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("world", [1, 3, 4])
def test_commit_equals_two_calls(world: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(world)
    n = 4099
    P = compcomm.padded_numel(n, world)
    C = P // world
    stride, oss, osb = 8, 4, C // 8 + 16
    signs = torch.randint(0, 256, (world * C // 8,), dtype=torch.uint8, generator=g)
    scales = torch.rand(world * stride, generator=g) + 0.01
    tau = torch.rand(1, generator=g) + 0.5
    sigma = torch.rand(1, generator=g) + 0.5
    out_scales = torch.rand(world * oss, generator=g) + 0.25
    out_signs = torch.randint(0, 256, (world * osb,), dtype=torch.uint8, generator=g)
    m0 = torch.randn(n, generator=g).to(dtype)
    e0, s0 = torch.randn(P, generator=g), 0.1 * torch.randn(C, generator=g)
    b = lambda t: buffer_of(t)  # noqa: E731
    m1, e1, s1 = m0.clone(), e0.clone(), s0.clone()
    K.server_update(b(signs), b(scales), stride, world, b(s1), b(tau))
    K.worker_update_decompress(b(m1), b(e1), b(sigma), b(out_scales), oss, b(out_signs), osb, world)
    m2, e2, s2 = m0.clone(), e0.clone(), s0.clone()
    K.commit(b(signs), b(scales), stride, b(s2), b(tau), b(m2), b(e2), b(sigma), b(out_scales), oss,
             b(out_signs), osb, world, guard=b(out_scales), guard_stride=oss)
    for u, v in zip(_bits(m1, e1, s1), _bits(m2, e2, s2)):
        assert torch.equal(u, v)
    # A non-finite guard scale: neither part writes.
    out_scales[(world - 1) * oss] = float("inf")
    m3, e3, s3 = m0.clone(), e0.clone(), s0.clone()
    K.commit(b(signs), b(scales), stride, b(s3), b(tau), b(m3), b(e3), b(sigma), b(out_scales), oss,
             b(out_signs), osb, world, guard=b(out_scales), guard_stride=oss)
    for u, v in zip(_bits(m3, e3, s3), _bits(m0, e0, s0)):
        assert torch.equal(u, v)
