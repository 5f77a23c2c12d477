"""Edges of the compressed reduce-scatter and of OneBitCompressor: each bad input is a typed error
on the rank that made it (naming the argument or bucket and the rank), RankMismatchError on the
others, with nothing changed on any rank and the ranks still in step; a failed average leaves the
error buffers exactly as they were; the layout check handles values beyond int64.

The rank bodies are here (module level, so spawned ranks import them); every collective waits at
most a few seconds, so a regression ends in a timeout error rather than a hang."""

from __future__ import annotations

import pytest
import torch

import compcomm
from compcomm._agree import agree_layout
from compcomm.compress import OneBitCompressor
from compcomm.errors import NonFiniteError, RankMismatchError
from compcomm.testing import run_ranks

CPU = torch.device("cpu")
T = 5  # seconds a collective may wait: where a peer is left waiting, the test fails fast


def _raises(fn, cls, *words):
    """``fn()`` raises ``cls`` whose message has every one of ``words``."""
    with pytest.raises(cls) as info:
        fn()
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def _snap(*ts):
    return [t.detach().clone() for t in ts]


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _state(comp):
    return {k: (v["worker_error"], v["server_error"]) for k, v in comp.state_dict().items()}


def _same_state(a, b):
    return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)


# -- compressed_reduce_scatter: autograd checks on the cached path, out's version counter


def _rs_autograd_body(rank, world):
    torch.manual_seed(rank)
    n = 16
    t = torch.randn(n)
    we, se = compcomm.error_buffers(n)
    out = torch.empty(we.numel() // world)
    compcomm.compressed_reduce_scatter(t, we, se, out=out, timeout=T)  # cached from now on
    for culprit in ("tensor", "out"):
        bad = t if culprit == "tensor" else out
        before = _snap(t, we, se, out)
        if rank == 1:
            bad.requires_grad_(True)
            _raises(lambda: compcomm.compressed_reduce_scatter(t, we, se, out=out, timeout=T),
                    ValueError, "[rank 1]", f"argument '{culprit}' requires grad")
            bad.requires_grad_(False)
        else:
            _raises(lambda: compcomm.compressed_reduce_scatter(t, we, se, out=out, timeout=T),
                    RankMismatchError, "rank 1: rejected its arguments")
        assert _same(before, _snap(t, we, se, out))
    # an out that requires grad is refused on the uncached path too
    fresh = torch.empty(we.numel() // world, requires_grad=rank == 0)
    if rank == 0:
        _raises(lambda: compcomm.compressed_reduce_scatter(t, we, se, out=fresh, timeout=T),
                ValueError, "[rank 0]", "argument 'out' requires grad")
    else:
        _raises(lambda: compcomm.compressed_reduce_scatter(t, we, se, out=fresh, timeout=T),
                RankMismatchError, "rank 0: rejected its arguments")
    compcomm.compressed_reduce_scatter(t, we, se, out=out, timeout=T)  # still in step
    return True


def test_reduce_scatter_cached_call_checks_requires_grad_of_tensor_and_out():
    """A regression: a call with the buffers of the last one skipped the requires-grad check
    (tensor overwritten under autograd); ``out`` was never checked."""
    assert run_ranks(2, _rs_autograd_body, timeout=60) == [True, True]


def _rs_version_body(rank, world):
    torch.manual_seed(rank)
    t = torch.randn(32)
    we, se = compcomm.error_buffers(32)
    out = torch.randn(we.numel() // world)
    w = torch.ones_like(out, requires_grad=True)
    y = (w * out).sum()  # saves out
    version = out._version
    compcomm.compressed_reduce_scatter(t, we, se, out=out, timeout=T)
    assert out._version > version
    _raises(y.backward, RuntimeError, "modified by an inplace operation")
    return True


def test_reduce_scatter_bumps_the_version_of_out():
    """A regression: out was written without bumping its version, so a graph that saved it
    used the overwritten values at backward, silently."""
    assert run_ranks(2, _rs_version_body, timeout=60) == [True, True]


# -- OneBitCompressor.average_


def _no_buckets_body(rank, world, batched):
    comp = OneBitCompressor(compcomm.get_communicator(None), timeout=T, batched=batched)
    try:
        for odd in ([64], [64, 32]):
            numels = odd if rank == 1 else []
            bufs = [torch.randn(n) for n in numels]
            before = _snap(*bufs)
            _raises(lambda: comp.average_(list(range(len(numels))), numels, lambda i: bufs[i],
                                          CPU),
                    RankMismatchError, f"[rank {rank}]")
            assert _same(before, bufs) and comp.keys() == []
        comp.average_([], [], lambda i: None, CPU)  # no bucket anywhere: nothing to do
        bufs = [torch.full((64,), float(rank + 1))]
        comp.average_(["a"], [64], lambda i: bufs[i], CPU)  # still in step
        assert torch.allclose(bufs[0], torch.full((64,), 1.5))
    finally:
        comp.close()
    return True


@pytest.mark.parametrize("batched", [True, False])
def test_compressor_with_no_bucket_on_one_rank(batched):
    """A regression (batched): the rank without buckets returned at once, its peer waited in
    the exchange until its timeout."""
    assert run_ranks(2, _no_buckets_body, batched, timeout=60) == [True, True]


def _resize_fail_body(rank, world, batched):
    comp = OneBitCompressor(compcomm.get_communicator(None), timeout=T, batched=batched)
    try:
        torch.manual_seed(rank)
        b = [torch.randn(64), torch.randn(64)]
        comp.average_(["a", "b"], [64, 64], lambda i: b[i], CPU)
        before = _state(comp)
        assert before["a"][0].abs().sum() > 0
        # bucket "a" grows; a NaN on rank 1 makes the call fail on every rank
        b2 = [torch.randn(200), torch.randn(64)]
        if rank == 1:
            b2[0][5] = float("nan")
        _raises(lambda: comp.average_(["a", "b"], [200, 64], lambda i: b2[i], CPU),
                NonFiniteError, "rank(s) 1")
        assert _same_state(before, _state(comp))
        # the same through launch_ / drop_launched (the optimizers' backward overlap)
        launch = comp.launch_(["a"], [200], [torch.randn(200)], CPU)
        assert comp.wait_launched([launch]) is None
        comp.drop_launched([launch])
        assert _same_state(before, _state(comp))
        # and ZeRO's reduce_scatter_ (its error_buffers are replaced when the size changes)
        x = torch.randn(64)
        comp.reduce_scatter_("rs", x, torch.empty(64 // world))
        rs_before = _state(comp)
        x = torch.randn(128)
        if rank == 1:
            x[3] = float("inf")
        _raises(lambda: comp.reduce_scatter_("rs", x, torch.empty(128 // world)),
                NonFiniteError, "rank(s) 1")
        assert _same_state(rs_before, _state(comp))
        comp.average_(["a", "b"], [64, 64], lambda i: b[i], CPU)  # still in step
    finally:
        comp.close()
    return True


@pytest.mark.parametrize("batched", [True, False])
def test_failed_average_keeps_the_buffers_of_a_resized_bucket(batched):
    """A regression: a bucket whose size changed got new zero buffers before the exchange; when
    the exchange failed only new keys were dropped, so its old error feedback was lost."""
    assert run_ranks(2, _resize_fail_body, batched, timeout=60) == [True, True]


def _dup_keys_body(rank, world, batched):
    comp = OneBitCompressor(compcomm.get_communicator(None), timeout=T, batched=batched)
    try:
        for who in ((0, 1), (1,)):  # both ranks name a key twice; rank 1 only
            keys = ["a", "a"] if rank in who else ["a", "b"]
            bufs = [torch.randn(64), torch.randn(64)]
            before = _snap(*bufs)
            if rank in who:
                _raises(lambda: comp.average_(keys, [64, 64], lambda i: bufs[i], CPU),
                        ValueError, f"[rank {rank}]", "argument 'keys'", "'a' twice")
            else:
                _raises(lambda: comp.average_(keys, [64, 64], lambda i: bufs[i], CPU),
                        RankMismatchError, "rank 1")
            assert _same(before, bufs) and comp.keys() == []
        bufs = [torch.randn(64), torch.randn(64)]
        comp.average_(["a", "b"], [64, 64], lambda i: bufs[i], CPU)  # still in step
        assert sorted(comp.keys()) == ["a", "b"]
    finally:
        comp.close()
    return True


@pytest.mark.parametrize("batched", [True, False])
def test_duplicate_bucket_keys_are_rejected(batched):
    """A regression: two buckets of one key shared (or replaced) one pair of error buffers."""
    assert run_ranks(2, _dup_keys_body, batched, timeout=60) == [True, True]


def _staged_body(rank, world, batched):
    comp = OneBitCompressor(compcomm.get_communicator(None), timeout=T, batched=batched)
    try:
        torch.manual_seed(rank)
        good = [torch.randn(64), torch.randn(64)]
        comp.average_(["a", "b"], [64, 64], lambda i: good[i].clone(), CPU)
        state = _state(comp)
        base = torch.randn(128)
        wrong = {"non-contiguous": base[::2], "dtype torch.float64": torch.randn(64).double(),
                 "10 elements": torch.randn(10)}
        for bucket in (0, 1):  # bucket 1: after bucket 0's exchange when not batched
            for what, t in wrong.items():
                bufs = [torch.randn(64), torch.randn(64)]
                bufs[bucket] = t if rank == 1 else bufs[bucket]
                before, base_before = _snap(*bufs), base.clone()
                if rank == 1:
                    _raises(lambda: comp.average_(["a", "b"], [64, 64], lambda i: bufs[i], CPU),
                            ValueError, "[rank 1]", f"stage({bucket})",
                            f"bucket {'ab'[bucket]!r}", what)
                else:
                    _raises(lambda: comp.average_(["a", "b"], [64, 64], lambda i: bufs[i], CPU),
                            RankMismatchError, "rank 1")
                assert _same(before, bufs) and torch.equal(base, base_before)
                assert _same_state(state, _state(comp))
        comp.average_(["a", "b"], [64, 64], lambda i: good[i], CPU)  # still in step
    finally:
        comp.close()
    return True


@pytest.mark.parametrize("batched", [True, False])
def test_staged_bucket_is_checked(batched):
    """A regression: what stage(i) returned was not checked; a strided view had memory outside
    it overwritten, a short tensor was read and written past its end."""
    assert run_ranks(2, _staged_body, batched, timeout=60) == [True, True]


def test_staged_bucket_is_checked_on_one_rank():
    comp = OneBitCompressor(compcomm.get_communicator(None))
    _raises(lambda: comp.average_(["a"], [8], lambda i: torch.zeros(16)[::2], CPU),
            ValueError, "[rank 0]", "stage(0) (bucket 'a')", "non-contiguous")
    _raises(lambda: comp.average_(["a", "a"], [8, 8], lambda i: torch.zeros(8), CPU),
            ValueError, "[rank 0]", "'a' twice")
    _raises(lambda: comp.average_(["a"], [-8], lambda i: torch.zeros(8), CPU),
            ValueError, "[rank 0]", "bucket 'a' has numel -8")


# -- OneBitCompressor.load_state_dict


def test_compressor_load_state_dict_checks_every_bucket_first():
    """A regression: only sizes were checked, so a float64 (or 2-D, strided, ...) buffer was
    loaded and failed later, in an exchange, on that rank alone."""
    comp = OneBitCompressor(compcomm.get_communicator(None))
    good = {"a": {"worker_error": torch.randn(64), "server_error": torch.randn(64)},
            "b": {"worker_error": torch.randn(8), "server_error": torch.randn(8)}}
    comp.load_state_dict(good)
    before = _state(comp)

    def bad(key, **change):
        sd = {k: dict(v) for k, v in good.items()}
        sd[key].update(change)
        return sd

    cases = [
        (bad("b", worker_error=torch.randn(8).double()), TypeError, "must be torch.float32"),
        (bad("b", server_error=torch.randn(8).int()), TypeError, "must be torch.float32"),
        (bad("b", worker_error=torch.randn(2, 4)), ValueError, "must be 1-D and contiguous"),
        (bad("b", worker_error=torch.randn(16)[::2]), ValueError, "must be 1-D and contiguous"),
        (bad("b", worker_error=torch.empty(8, device="meta")), ValueError, "not the CPU"),
        (bad("b", worker_error=[0.0] * 8), TypeError, "must be a torch.Tensor"),
        (bad("b", worker_error=torch.randn(16)), ValueError, "not for a world of 1"),
    ]
    for sd, cls, words in cases:
        _raises(lambda: comp.load_state_dict(sd), cls, "[rank 0]", "bucket 'b'", words)
        assert _same_state(before, _state(comp))  # bucket 'a' not loaded either
    _raises(lambda: comp.load_state_dict({"b": {"worker_error": torch.randn(8)}}), TypeError,
            "[rank 0]", "bucket 'b'", "'server_error' must be a torch.Tensor, got NoneType")
    _raises(lambda: comp.load_state_dict({"b": 3}), TypeError, "bucket 'b'", "must be a dict")


# -- the layout check: values beyond int64


def _agree_big_body(rank, world):
    comm = compcomm.get_communicator(None)
    for big in (10**19, 10**20, -(10**30), 2**200):
        v = big if rank == 0 else 5
        _raises(lambda: agree_layout(comm, "test", [("n", 1, False), ("freeze_step", v, False)],
                                     timeout=T),
                RankMismatchError, f"freeze_step (rank 0: {big}, rank 1: 5)")
    # the same big value everywhere agrees; two values too large to send still differ
    agree_layout(comm, "test", [("freeze_step", 10**40, False)], timeout=T)
    huge = 2**10000 + rank
    _raises(lambda: agree_layout(comm, "test", [("freeze_step", huge, False)], timeout=T),
            RankMismatchError, "freeze_step (rank 0: an integer of more than")
    # a field that differs next to one beyond int64 that does not
    _raises(lambda: agree_layout(comm, "test", [("big", 10**20, False), ("n", rank, False)],
                                 timeout=T),
            RankMismatchError, "n (rank 0: 0, rank 1: 1)")
    return True


def test_agree_layout_handles_values_beyond_int64():
    """A regression: the rank with the big value raised an overflow alone (its peer waited until
    its timeout), or a value in [2**63, 2**64) was reported as a negative number."""
    assert run_ranks(2, _agree_big_body, timeout=60) == [True, True]


# -- a rank in compressed_allreduce meeting a peer in compressed_reduce_scatter


def _allreduce_meets_reduce_scatter_body(rank, world):
    n = 64
    torch.manual_seed(rank)
    t = torch.randn(n)
    we, se = compcomm.error_buffers(n)
    before = _snap(t, we, se)
    if rank == 0:
        call = lambda: compcomm.compressed_allreduce(t, we, se, timeout=T)  # noqa: E731
    else:
        call = lambda: compcomm.compressed_reduce_scatter(t, we, se, timeout=T)  # noqa: E731
    # their first collectives are the same all_gather: before, they paired (the reduce-scatter
    # committed, the allreduce timed out); now both see the other's kind of call
    _raises(call, RankMismatchError, f"[rank {rank}]", "compressed_reduce_scatter call"
            if rank == 0 else "compressed_allreduce call")
    assert _same(before, _snap(t, we, se))
    compcomm.compressed_allreduce(t, we, se, timeout=T)  # still in step
    return True


def test_allreduce_meeting_reduce_scatter_raises_on_both():
    assert run_ranks(2, _allreduce_meets_reduce_scatter_body, timeout=120) == [True, True]
