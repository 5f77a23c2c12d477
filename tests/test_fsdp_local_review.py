"""compcomm.fsdp.onebit(mode="local_momentum"): review findings on checkpoints across HSDP
splits, the server-error scratch, shard groups of one rank and a failed replica exchange (FSDP2
over gloo, W=4 or 2)."""

from __future__ import annotations

import pytest

import _fsdp_local_review_cases as C
from compcomm.testing import run_ranks


@pytest.mark.parametrize("saved,loaded", [("by_hand", "flat"), ("native", "flat"),
                                          ("flat", "by_hand"), ("flat", "native")])
def test_checkpoint_of_another_split_resets(saved, loaded):
    """Same rank and world, another split (replicas x shards): the buffers' layout differs, so
    the momenta and errors reset and training continues (before: a shape error in FSDP's
    backward, or momenta silently mixed up; from a 1-D save, the replicas' hooks in warm-up)."""
    for res in run_ranks(4, C.split_cases, saved, loaded, timeout=300):
        assert res["reset"] and res["replica_steps"] and res["step"] is True, res
        assert res["replicas"] == (1 if saved == "flat" else 2), res


def test_server_error_scratch_not_saved():
    for res in run_ranks(2, C.scratch_cases, timeout=300):
        assert res["server_max"] == 0.0 and res["worker_max"] > 0.0, res


def test_shard_group_of_one_rank_refused_at_once():
    for res in run_ranks(4, C.shard1_cases, timeout=300):
        assert res["err"].startswith("UnsupportedError") and "mode='gradient'" in res["err"], res
        assert "[rank " in res["err"], res


@pytest.mark.parametrize("kind", ["by_hand", "native"])
def test_failed_replica_exchange_changes_nothing(kind):
    for res in run_ranks(4, C.failed_hook_cases, kind, timeout=300):
        assert "boom" in res["err"] and res["steps"] and res["momenta"], res
