"""compressed_allreduce: error feedback, cross-rank errors and one-process edge cases.

Its comparison with the numpy oracle at W = 1..4 (sizes 0..2^20+3, fp32/fp16/bf16, wire bytes)
runs on every backend in tests/conformance."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import compcomm
from compcomm.testing import run_ranks

from _allreduce_cases import bad_input_cases, feedback_case


@pytest.mark.parametrize("world", [2, 4])
def test_error_feedback_converges(world):
    """The running mean of repeated calls on the same input converges to the true mean."""
    errs = run_ranks(world, feedback_case, 1000, 200)[0]
    # One 1-bit call is a poor estimate; the running mean converges (error feedback).
    assert errs[1] > 0.3
    assert errs[200] < 0.05
    assert errs[200] < errs[10] < errs[1]


@pytest.mark.parametrize("world", [2, 3])
def test_cross_rank_errors(world):
    """Size/dtype mismatches and NaN/Inf on one rank: the same typed error everywhere, nothing
    changed, the group usable afterwards; a rank calling alone times out."""
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
    """Without torch.distributed, W=1: the output is sigma*sign(x), worked out by hand."""
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
    """All-zero input: exact zero output and zero error."""
    t = torch.zeros(1003)
    we, se = compcomm.error_buffers(t)
    compcomm.compressed_allreduce(t, we, se)
    assert torch.count_nonzero(t) == 0 and torch.count_nonzero(we) == 0


def test_empty_tensor():
    """An empty tensor: empty error buffers, the tensor returned."""
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


def test_server_overflow_writes_nothing():
    """Finite inputs whose server sum overflows (a huge server error): the commit is guarded by
    the server scale on every backend (as on NCCL), so nothing is written; on the CPU the call
    then raises NonFiniteError (it used to return as if it had averaged)."""
    t = torch.full((16,), 5e37)
    t[::2] *= -1  # sigma = 5e37, finite
    we, se = compcomm.error_buffers(t)
    se.fill_(3.3e38)  # c = +-5e37 + 3.3e38 overflows float32 (the unguarded commit wrote inf, NaN)
    before = [x.clone() for x in (t, we, se)]
    with pytest.raises(compcomm.errors.NonFiniteError, match="server scale.*overflows"):
        compcomm.compressed_allreduce(t, we, se)
    for got, want in zip((t, we, se), before):
        assert torch.equal(got, want)
