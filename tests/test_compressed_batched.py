"""compressed_allreduce_exchange_many (issue 19): several buckets' compressed allreduces exchanged
in three collectives instead of three per bucket. Equal bit for bit to per-bucket calls (tensors
and both error buffers, three rounds of error feedback, mixed dtypes, sizes 0, 1, 37, 1000, 4099)
and sending the same bytes (plus the call count), at W = 1..4; OneBitCompressor batched and per bucket give the same
bits; bad inputs raise typed errors naming the argument, a rank's non-finite input, a size
or a number of calls that differs raises on every rank, and nothing but the workspaces is written."""

from __future__ import annotations

import pytest

from compcomm.testing import run_ranks

import _compressed_batched_cases as bc


@pytest.fixture(scope="module")
def results():
    return {w: run_ranks(w, bc.rank_body, timeout=300) for w in (1, 2, 3, 4)}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_batched_equals_per_bucket(results, world):
    for r in range(world):
        got = results[world][r]
        assert got["same"] == [True] * 3
        # the same bytes, and 32 to each peer: the call-count record, exchanged first
        assert all(a + 32 * (world - 1) == b for a, b in got["bytes"]), got["bytes"]
        assert got["compressor_same"]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_bad_inputs_raise_typed_errors_and_change_nothing(results, world):
    for r in range(world):
        f = results[world][r]["fails"]
        assert f["short_lists"][0] == "ValueError" and "worker_errors" in f["short_lists"][1]
        assert f["small_staging"][0] == "ValueError" and "staging" in f["small_staging"][1]
        assert f["bad_error_size"][0] == "ValueError" and "worker_error" in f["bad_error_size"][1]
        names = ["short_lists", "small_staging", "bad_error_size"]
        if world > 1:
            assert f["nonfinite"][0] == "NonFiniteError", f["nonfinite"]
            assert f"rank(s) {world - 1}" in f["nonfinite"][1]
            assert f["mismatch"][0] == "RankMismatchError", f["mismatch"]
            want = ", ".join(f"rank {i}: {len(bc.NUMELS) - (i == 0)}" for i in range(world))
            assert f["count_mismatch"][0] == "RankMismatchError", f["count_mismatch"]
            assert f"different numbers of calls ({want})" in f["count_mismatch"][1]
            want = ", ".join(f"rank {i}: {0 if i == 0 else len(bc.NUMELS)}" for i in range(world))
            assert f["no_calls"][0] == "RankMismatchError" and want in f["no_calls"][1], f["no_calls"]
            names += ["nonfinite", "mismatch", "count_mismatch", "no_calls"]
        for n in names:
            assert f[n + "_unchanged"], n
        assert results[world][r]["after_failures_same"]


def test_staging_bytes_query():
    from compcomm import _C

    assert _C.zero.compressed_allreduce_batch_bytes([], 2) > 0  # the call counts
    assert _C.zero.compressed_allreduce_batch_bytes([16, 0, 32], 2) > 0
    with pytest.raises(ValueError):
        _C.zero.compressed_allreduce_batch_bytes([12], 2)  # not a multiple of 8 * world
