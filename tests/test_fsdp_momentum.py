"""compcomm.fsdp.onebit(mode="momentum"): DeepSpeed's 1-bit Adam on FSDP2's shards (the local
momentum averaged with the full compressed allreduce, kept replicated in 1-bit form) with
FrozenVarianceAdam taking its momentum; FSDP2 over gloo, W=2 and 3."""

from __future__ import annotations

import pytest

import _fsdp_momentum_cases as C
from compcomm.testing import run_ranks


@pytest.mark.parametrize("world,dtype,force_sum", [(2, "float32", False), (3, "float32", False),
                                                   (2, "bfloat16", False), (3, "float32", True)])
def test_exact_exchange_equals_frozen_variance_adam(world, dtype, force_sum):
    """With an exact exchange the momentum mode is FrozenVarianceAdam on FSDP's gradients: the
    warm-up bit for bit, then equal to rounding (AVG, or SUM with FSDP's post-division)."""
    for res in run_ranks(world, C.exact_cases, dtype, force_sum, timeout=300):
        assert res["warmup_bitwise"] and res["moved"], res
        assert res["err"] < (1e-5 if dtype == "float32" else 2e-2), res
        assert res["steps"] == [6], res


@pytest.mark.parametrize("world,dtype,limit", [(2, "float32", 16384), (3, "float32", 0),
                                               (3, "bfloat16", None), (2, "float32", 40)])
def test_onebit_momentum_equals_deepspeed_reference(world, dtype, limit):
    """1-bit: the replicated momentum equals the numpy reference of DeepSpeed's algorithm on the
    same local momenta (errors carried, the switch seeded from the warm-up's exp_avg in FSDP's
    rows), identical on every rank; each update follows from this rank's chunk of it."""
    for res in run_ranks(world, C.onebit_cases, dtype, limit, timeout=300):
        assert res["err"] < 1e-5 and res["agree"] and res["packed"], res
        assert res["upd_err"] < (1e-5 if dtype == "float32" else 2e-2), res


@pytest.mark.parametrize("world,dtype", [(2, "float32"), (3, "bfloat16")])
def test_dcp_round_trip_continues_bitwise(tmp_path, world, dtype):
    for res in run_ranks(world, C.dcp_cases, str(tmp_path / "ckpt"), dtype, timeout=300):
        assert res == {"format": "compcomm.fsdp/3", "template_sized": True,
                       "errors_saved": True, "bitwise": True, "moved": True}


def test_bad_arguments():
    for res in run_ranks(2, C.bad_cases, timeout=300):
        assert res["mode"].startswith("ValueError") and "'mode'" in res["mode"], res
        assert res["default_mode"] == "momentum", res
        assert res["beta1"].startswith("ValueError") and "'beta1'" in res["beta1"], res
        assert res["hsdp"].startswith("UnsupportedError") and "replicate_group" in res["hsdp"]
        assert res["betas"].startswith("ValueError") and "'betas'" in res["betas"], res
        assert "ValueError" in res["no_optimizer"] and "[rank " in res["no_optimizer"], res
        assert "freeze_step" in res["no_optimizer"], res
        assert res["old_into_momentum"].startswith("ValueError") and "mode" in res["old_into_momentum"]


@pytest.mark.parametrize("world", [2, 3])
def test_equals_unsharded_onebitadam_where_layouts_coincide(world):
    for res in run_ranks(world, C.unsharded_cases, timeout=300):
        assert res["keys"] == ["<root>#0", "<root>#1"], res
        assert max(res["errs"]) < 1e-5, res
