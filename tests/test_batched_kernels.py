"""The batched kernels of compressed_allreduce_exchange_many / compressed_allreduce_commit_many
(issues 12 and 13: a batch of buckets in O(1) launches per phase on a GPU), on the host: batch_copy
against a copy loop; the batched exchange + commit_many bit for bit as per-call calls (W = 1..4,
mixed dtypes, unaligned buckets, sizes 0 to 65541, three rounds of error feedback); typed errors
naming the argument, and nothing written by a commit_many with a bad argument. The CUDA twins:
test_batched_kernels_gpu.py."""

from __future__ import annotations

import pytest
import torch

from compcomm import _C
from compcomm._buffers import buffer_of

import _batched_kernel_cases as bk


@pytest.mark.parametrize("count", [0, 1, 13, 300])
def test_batch_copy_equals_a_copy_loop(count):
    out, dsts, srcs = bk.copy_jobs("cpu", count)
    want = out.clone()
    for d, s in zip(dsts, srcs):
        want[d.data_ptr() - out.data_ptr():][: s.numel()].copy_(s)
    _C.kernels.batch_copy([buffer_of(d) for d in dsts], [buffer_of(s) for s in srcs])
    assert torch.equal(out, want)


def test_batch_copy_errors_name_the_argument():
    a, b = torch.zeros(8, dtype=torch.uint8), torch.ones(16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="same length"):
        _C.kernels.batch_copy([buffer_of(a)], [])
    with pytest.raises(ValueError, match=r"dsts\[1\] has 8 bytes"):
        _C.kernels.batch_copy([buffer_of(b), buffer_of(a)], [buffer_of(a), buffer_of(b)])
    assert not a.any()  # validated before any copy


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_batched_exchange_and_commit_many_equal_per_call(world):
    assert bk.batched_equals_per_call(world, "cpu") == [[True, True]] * 3


def test_commit_many_with_a_bad_argument_writes_nothing():
    kind, msg, unchanged = bk.commit_many_bad_argument_writes_nothing("cpu")
    assert kind == "ValueError" and "workspace has 64 bytes" in msg, (kind, msg)
    assert unchanged


# collectives of a batch in a world of one rank: 1 the headers, 2 the signs, 3 the records
@pytest.mark.parametrize("cancel_at", [2, 3])
def test_cancelled_batch_commits_nothing(cancel_at):
    """The batched gate (commit_gate_many) turns a cancelled batch's commits into no-ops."""
    unchanged, _ = bk.cancelled_commit_many(cancel_at)
    assert unchanged


def test_uncancelled_batch_with_a_gate_equals_per_call():
    unchanged, equal = bk.cancelled_commit_many(0)
    assert equal and not unchanged


@pytest.mark.parametrize("cancel_at", [2, 3])
def test_cancelled_batch_without_gate_changes_state(cancel_at, monkeypatch):
    """COMPCOMM_TEST_FAULT=no_commit_gate: the same cancellation then writes, so the test above
    shows the gate at work."""
    monkeypatch.setenv("COMPCOMM_TEST_FAULT", "no_commit_gate")
    unchanged, _ = bk.cancelled_commit_many(cancel_at)
    assert not unchanged


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_batched_reduce_scatter_equals_per_call(world):
    """compcomm.fsdp's batched segments (compressed_reduce_scatter_exchange_many + a commit per
    segment) give the bits of one compressed_reduce_scatter per segment: outputs, both errors."""
    assert bk.rs_batched_equals_per_call(world, "cpu") == [True] * 3
