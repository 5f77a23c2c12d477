"""compcomm.fsdp.onebit(mode="local_momentum") on FSDP2's own 2-D (HSDP) mesh: the 1-bit
reduce-scatter of the local momenta over the shard dim, compressed_allreduce of the momentum
shard over the replicate dim in FSDP's all-reduce hook (FSDP's own full-precision replica
all-reduce turned off); FSDP2 over gloo, W=4 as 2 replicas x 2 shards."""

from __future__ import annotations

import pytest

import _fsdp_hsdp_cases as C
from compcomm.testing import run_ranks


@pytest.mark.parametrize("dtype,scaling", [("float32", "avg"), ("bfloat16", "avg"),
                                           ("float32", "sum"), ("float32", "factor"),
                                           ("float32", "factor_s")])
def test_exact_exchange_equals_fsdp_hsdp(dtype, scaling):
    """With exact exchanges the mode is FrozenVarianceAdam on FSDP's own HSDP gradients: the
    warm-up bit for bit, then equal to rounding (AVG; a forced SUM; divide factors, where FSDP
    sums the replicas); FSDP makes no replica all-reduce of its own."""
    for res in run_ranks(4, C.exact_cases, dtype, scaling, timeout=300):
        assert res["warmup_bitwise"] and res["moved"], res
        assert res["err"] < (1e-5 if dtype == "float32" else 2e-2), res
        assert res["steps"] == [6] and res["mode"] == "local_momentum", res
        assert res["fsdp_allreduces"] == 4 * 3, res  # the test hook's, one per module and step


@pytest.mark.parametrize("dtype,limit", [("float32", 16384), ("float32", 0), ("bfloat16", None)])
def test_onebit_equals_reference(dtype, limit):
    """1 bit: the momentum shard handed to the optimizer is tests/reference.py's compressed
    allreduce across the replicas of what the shard group's 1-bit reduce-scatter left."""
    for res in run_ranks(4, C.onebit_cases, dtype, limit, timeout=300):
        assert res["ar_err"] < 1e-5 and res["handed"] == 0.0, res
        assert res["modules"] == ["0", "3", "<root>"] and res["allreduces"] == 0, res
        assert res["replica_errors"] and res["no_replica_momentum"], res


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dcp_round_trip_continues_bitwise(tmp_path, dtype):
    for res in run_ranks(4, C.dcp_cases, str(tmp_path / "ckpt"), dtype, timeout=300):
        assert res == {"bitwise": True, "moved": True, "replica_errors": True}, res


def test_refused():
    for res in run_ranks(4, C.bad_cases, timeout=300):
        assert res["shard1"].startswith("UnsupportedError") and "size 1" in res["shard1"], res
        assert "[rank " in res["shard1"] and "'model'" in res["shard1"], res
        assert res["both"].startswith("ValueError") and "'replicate_group'" in res["both"], res
        assert res["unrecognised"].startswith("UnsupportedError"), res
        assert "no replicate group" in res["unrecognised"], res
        assert res["momentum"].startswith("UnsupportedError"), res
        assert res["untouched"] and res["default"] == "local_momentum", res
        assert res["default_shard1"] == "gradient", res
        assert res["taken"] and res["again"] and res["post_forward_mesh"] == [False, False], res
        assert res["gradient_after"].startswith("UnsupportedError"), res
        assert res["mixed"].startswith("UnsupportedError") and "'0'" in res["mixed"], res
        assert res["mixed_untouched"], res
        assert res["no_all_reduce"].startswith("UnsupportedError"), res
        assert "set_requires_all_reduce(False)" in res["no_all_reduce"], res


def test_default_with_the_allgather():
    """The default on the 2-D mesh is the local-momentum mode, with the all-gather options."""
    for res in run_ranks(4, C.default_cases, timeout=300):
        assert res["mode"] == res["q_mode"] == "local_momentum" and res["allgather"], res
        assert res["err"] < 1e-5 and res["q_finite"] and res["q_moved"], res
        assert res["g_keys"] and res["g_finite"], res
