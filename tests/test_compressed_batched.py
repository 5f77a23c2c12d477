"""compressed_allreduce_exchange_many (issue 19): several buckets' compressed allreduces exchanged
in three collectives instead of three per bucket. Equal bit for bit to per-bucket calls (tensors
and both error buffers, three rounds of error feedback, mixed dtypes, sizes 0, 1, 37, 1000, 4099)
and sending the same bytes, at W = 1..4; OneBitCompressor batched and per bucket give the same
bits; bad inputs raise typed errors naming the argument, a rank's non-finite input or a size
that differs raises on every rank, and nothing but the workspaces is written."""

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
        assert all(a == b for a, b in got["bytes"]), got["bytes"]
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
            names += ["nonfinite", "mismatch"]
        for n in names:
            assert f[n + "_unchanged"], n
        assert results[world][r]["after_failures_same"]


def test_staging_bytes_query():
    from compcomm import _C

    assert _C.zero.compressed_allreduce_batch_bytes([], 2) == 0
    assert _C.zero.compressed_allreduce_batch_bytes([16, 0, 32], 2) > 0
    with pytest.raises(ValueError):
        _C.zero.compressed_allreduce_batch_bytes([12], 2)  # not a multiple of 8 * world
