"""Ranks that disagree on the layout of what they communicate get RankMismatchError on every
rank, naming what differs and which ranks, before anything is sent or changed -- not a timeout.

The 1-bit optimizers (warm-up and compressed phase), the DDP hooks, ZeroOptimizer stage 1/2 (with
torch's Adam and with OneBitAdam) and compressed_allreduce; the last rank is the one that differs
(rank bodies in tests/_mismatch_cases.py). A regression that hangs fails at run_ranks' timeout
(the bodies' own collectives wait 30 s at most)."""

from __future__ import annotations

import pytest

from _mismatch_cases import (ALLREDUCE_EXPECT, DDP_EXPECT, OPTIMIZER_EXPECT, UNBATCHED_EXPECT,
                             ZERO_EXPECT, _rank_allreduce, _rank_ddp, _rank_ddp_loaded,
                             _rank_optimizer, _rank_unbatched, _rank_zero, _rank_zero_loaded)
from compcomm.testing import run_ranks

TIMEOUT = 150  # seconds for a whole body: spawning the ranks takes most of it on a busy machine


def _check(results, expect, world):
    """Every case raised RankMismatchError on every rank, naming ``expect[case]`` and the rank
    that differs, and changed nothing."""
    odd = f"rank {world - 1}"
    for rank, res in enumerate(results):
        assert res, f"rank {rank}: no cases ran"
        for case, (name, msg, unchanged) in res.items():
            where = f"rank {rank}, case {case}: {name}: {msg}"
            assert name == "RankMismatchError", where
            assert f"[rank {rank}]" in msg and expect(case) in msg, where
            assert odd in msg or f"[{world - 1}]" in msg, where
            assert unchanged, f"{where} (state changed)"


@pytest.mark.parametrize("name,world", [("OneBitAdam", 2), ("OneBitAdam", 3), ("ZeroOneAdam", 2),
                                        ("OneBitLamb", 2)])
def test_optimizers_raise_rank_mismatch(name, world):
    results = run_ranks(world, _rank_optimizer, name, timeout=TIMEOUT)
    _check(results, OPTIMIZER_EXPECT.__getitem__, world)
    assert {"compressed_grads", "compressed_one_sided"} <= set(results[0])


def test_ddp_hooks_raise_rank_mismatch():
    _check(run_ranks(2, _rank_ddp, timeout=TIMEOUT), DDP_EXPECT.__getitem__, 2)


def test_ddp_hook_checks_the_schedule_again_after_a_load():
    """Ranks resumed at different steps: RankMismatchError from backward on both (a regression:
    one rank waits in the hook's all-reduce until run_ranks gives up)."""
    _check(run_ranks(2, _rank_ddp_loaded, timeout=90), {"hook_after_load": "step"}.__getitem__, 2)


def test_zero_raises_rank_mismatch_when_built():
    results = run_ranks(2, _rank_zero, timeout=TIMEOUT)
    _check(results, lambda case: ZERO_EXPECT[case.rsplit("_", 1)[1]], 2)
    assert len(results[0]) == 20


def test_zero_load_of_shards_from_different_steps():
    """RankMismatchError on every rank, nothing loaded (a regression: the load succeeds)."""
    results = run_ranks(2, _rank_zero_loaded, timeout=TIMEOUT)
    _check(results, lambda case: "global_steps", 2)
    assert set(results[0]) == {"stage1", "stage2"}


def test_compressed_allreduce_sizes_and_dtypes():
    _check(run_ranks(2, _rank_allreduce, timeout=TIMEOUT), ALLREDUCE_EXPECT.__getitem__, 2)


@pytest.mark.parametrize("name", ["compressor", "OneBitAdam", "ZeroOneAdam"])
def test_unbatched_exchanges_raise_rank_mismatch(name):
    """OneBitCompressor(batched=False), alone and under the optimizers: every case raises
    RankMismatchError on both ranks within seconds (a regression: CommTimeoutError after the
    bodies' 10 s, or a hang until run_ranks gives up)."""
    results = run_ranks(2, _rank_unbatched, name, timeout=90)
    _check(results, UNBATCHED_EXPECT.__getitem__, 2)
