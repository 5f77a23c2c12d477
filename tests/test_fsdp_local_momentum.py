"""compcomm.fsdp.onebit(mode="local_momentum"): each rank's fp32 local momentum reduce-scattered
with the gradient mode's 1-bit exchange (no all-gather), FrozenVarianceAdam taking the shard's
momentum; FSDP2 over gloo, W=2 and 3 (dims not divisible by W; at W=3 a 2-row weight leaves
a rank an empty shard)."""

from __future__ import annotations

import pytest

import _fsdp_local_cases as C
import _fsdp_momentum_cases as M
from compcomm.testing import run_ranks


@pytest.mark.parametrize("world,dtype,force_sum", [(2, "float32", False), (3, "float32", False),
                                                   (2, "bfloat16", False), (3, "float32", True)])
def test_exact_exchange_equals_frozen_variance_adam(world, dtype, force_sum):
    """With an exact exchange (IdentityCompressor's reduce-scatter) the mode is FrozenVarianceAdam
    on FSDP's gradients: the warm-up bit for bit, then equal to rounding (AVG, or SUM with FSDP's
    post-division)."""
    for res in run_ranks(world, M.exact_cases, dtype, force_sum, "local_momentum", timeout=300):
        assert res["warmup_bitwise"] and res["moved"], res
        assert res["err"] < (1e-5 if dtype == "float32" else 2e-2), res
        assert res["steps"] == [6], res


@pytest.mark.parametrize("world,dtype,limit", [(2, "float32", 16384), (3, "float32", 0),
                                               (3, "bfloat16", None), (2, "float32", 40)])
def test_onebit_equals_reference(world, dtype, limit):
    """1-bit: every rank's local momentum is the float64 chain b1 m + (1 - b1) g of its recorded
    hook inputs (seeded from the warm-up's exp_avg); the chunk handed to the optimizer is
    tests/reference.py's compressed reduce-scatter of the ranks' momenta with their worker errors
    (the server's sum, uncompressed); the worker errors follow the reference."""
    for res in run_ranks(world, C.onebit_cases, dtype, limit, timeout=300):
        assert res["mom_err"] < 1e-5 and res["rs_err"] < 1e-5, res
        assert res["we_err"] < 1e-5 and res["keys"] and res["packed"] == 0, res


@pytest.mark.parametrize("world", [2, 3])
def test_sends_the_reduce_scatter_only(world):
    """Per 1-bit step the mode sends exactly its segments' compressed reduce-scatter wire bytes
    (no all-gather): about half of the momentum mode's."""
    for res in run_ranks(world, C.bytes_cases, timeout=300):
        assert res["local_momentum"] == res["rs_wire"] > 0, res
        assert 1.7 < res["momentum"] / res["local_momentum"] < 2.5, res


@pytest.mark.parametrize("world,dtype", [(2, "float32"), (3, "bfloat16")])
def test_dcp_round_trip_continues_bitwise(tmp_path, world, dtype):
    for res in run_ranks(world, C.dcp_cases, str(tmp_path / "ckpt"), dtype, timeout=300):
        assert res == {"format": "compcomm.fsdp/3", "template_sized": True, "saved": True,
                       "bitwise": True, "moved": True, "reset": True, "reseeded": True}, res


def test_refused_as_the_momentum_mode():
    for res in run_ranks(2, C.bad_cases, timeout=300):
        assert res["mesh2d"].startswith("UnsupportedError") and "2-D" in res["mesh2d"], res
        assert res["optimizer"].startswith("ValueError") and "'optimizer'" in res["optimizer"]
        assert "ValueError" in res["no_optimizer"] and "[rank " in res["no_optimizer"], res
        assert "mode='local_momentum'" in res["no_optimizer"], res
        assert "group 0" in res["group"] and "warmup_steps=2" in res["group"], res
        assert "set_requires_gradient_sync" in res["accum"] and "[rank " in res["accum"], res
        assert "mode='local_momentum'" in res["accum"], res
        assert res["accum_unchanged"], res
        assert res["other_mode"].startswith("ValueError") and "mode" in res["other_mode"], res
        assert "local_momentum" in res["lacking"] and res["lacking_unchanged"], res


def test_hsdp_replicate_group():
    """HSDP by hand (W=4: 2 replicas of 2 shards): each momentum shard averaged across the
    replicas with compressed_allreduce in FSDP's all-reduce hook."""
    for res in run_ranks(4, C.hsdp_cases, timeout=300):
        assert res["warmup_bitwise"] and res["exact_err"] < 1e-5, res
        assert res["ar_err"] < 1e-5 and res["modules"] == ["0", "3", "<root>"], res
        assert res["replica_errors_saved"] and res["no_replica_momentum"], res
