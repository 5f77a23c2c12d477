"""compressed_allreduce over real processes (torch.distributed/gloo) against the numpy oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import compcomm
from compcomm.testing import run_ranks

from _allreduce_cases import bad_input_cases, collective_cases, feedback_case

SIZES = [0, 1, 7, 1000, 4099, 2**20 + 3]
DTYPES = ["float32", "float16", "bfloat16"]
SHAPES = {1000: (10, 100), 4099: (1, 4099)}


def design_formula_bytes(padded: int, world: int) -> float:
    """DESIGN.md: N/8 (W-1)/W (phase 1) + N/(8W) (W-1) (phase 2), without the per-peer scales."""
    return padded / 8 * (world - 1) / world + padded / (8 * world) * (world - 1)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_matches_oracle(world):
    results = run_ranks(world, collective_cases, SIZES, DTYPES, 3, SHAPES, timeout=600)[0]
    assert len(results) == len(SIZES) * len(DTYPES) * 3
    for r in results:
        where = f"W={world} {r['dtype']} n={r['n']} round={r['round']}"
        assert r["signs_exact"], where
        assert r["outputs_identical"], where
        assert r["we_err"] <= 1e-5, (where, r["we_err"])
        assert r["se_err"] <= 1e-5, (where, r["se_err"])
        assert r["out_err"] <= r["out_tol"], (where, r["out_err"])
        assert r["flips_outside_allowed"] == 0, where
        assert r["sign_flips"] <= max(1, r["n"] // 10000), where
        # Bytes on the wire: what the communicator counted is what wire_bytes() predicts, and the
        # packed-sign part is exactly DESIGN.md's formula; the rest is 48-63 bytes per peer.
        assert all(b == r["wire_bytes"] for b in r["bytes_sent"]), where
        padded = compcomm.padded_numel(r["n"], world)
        overhead = r["wire_bytes"] - design_formula_bytes(padded, world)
        assert 0 <= overhead <= (world - 1) * (32 + 16 + 15), (where, overhead)


@pytest.mark.parametrize("world", [2, 4])
def test_error_feedback_converges(world):
    errs = run_ranks(world, feedback_case, 1000, 200)[0]
    # One 1-bit call is a poor estimate; the running mean converges (error feedback).
    assert errs[1] > 0.3
    assert errs[200] < 0.05
    assert errs[200] < errs[10] < errs[1]


@pytest.mark.parametrize("world", [2, 3])
def test_cross_rank_errors(world):
    results = run_ranks(world, bad_input_cases, timeout=120)
    for rank, out in enumerate(results):
        for case, want in [
            ("numel_mismatch", "RankMismatchError"),
            ("dtype_mismatch", "RankMismatchError"),
            ("nan", "NonFiniteError"),
            ("inf_in_error", "NonFiniteError"),
        ]:
            name, msg, unchanged = out[case]
            assert name == want, (rank, case, name, msg)
            assert unchanged, (rank, case, "state changed by a failed call")
            assert f"[rank {rank}]" in msg
        assert f"rank(s) {world - 1}" in out["nan"][1]
        assert "numel=1000" in out["numel_mismatch"][1]
        # Constant inputs r+1: sigma_r = (r+1) sqrt(n/P) (the zero padding counts in the norm).
        shrink = (100 / compcomm.padded_numel(100, world)) ** 0.5
        assert out["works_after"] == pytest.approx((world + 1) / 2 * shrink, rel=1e-6)
    name, msg, unchanged = results[0]["timeout"]
    assert name == "CommTimeoutError", msg
    assert unchanged
    assert results[0]["timeout_seconds"] < 30


def test_world_of_one_needs_no_process_group():
    assert not torch.distributed.is_initialized()
    t = torch.tensor([3.0, -1.0, 0.0, -0.0, 2.0])
    we, se = compcomm.error_buffers(t)
    assert we.numel() == 8 and se.numel() == 8
    compcomm.compressed_allreduce(t, we, se)
    x = np.array([3.0, -1.0, 0.0, -0.0, 2.0, 0, 0, 0], np.float32)
    sigma = np.float32(np.sqrt(np.sum(x.astype(np.float64) ** 2))) / np.float32(np.sqrt(8))
    # At W=1 the server sees +-sigma everywhere, so tau = sigma and the output is sigma*sign(x).
    expect = sigma * np.array([1, -1, 1, 1, 1])
    np.testing.assert_allclose(t.numpy(), expect, rtol=1e-6)
    np.testing.assert_allclose(we.numpy(), x - sigma * np.where(x < 0, -1, 1), rtol=1e-6)
    assert float(se.abs().max()) <= 1e-6 * float(sigma)  # tau = sigma up to rounding


def test_all_zero_input_gives_exact_zero():
    t = torch.zeros(1003)
    we, se = compcomm.error_buffers(t)
    compcomm.compressed_allreduce(t, we, se)
    assert torch.count_nonzero(t) == 0 and torch.count_nonzero(we) == 0


def test_empty_tensor():
    t = torch.zeros(0)
    we, se = compcomm.error_buffers(t)
    assert we.numel() == 0
    assert compcomm.compressed_allreduce(t, we, se) is t


def test_accepts_any_multiple_of_8w():
    # The minimal multiple of 8*W is accepted too (DeepSpeed's backend tests use it).
    t = torch.randn(20)
    we, se = torch.zeros(24), torch.zeros(24)
    compcomm.compressed_allreduce(t, we, se)
    assert torch.all(t.abs() == t.abs()[0])
