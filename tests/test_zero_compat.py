"""ZeRO checkpoints of the format ``compcomm.zero/1`` written before ZeroOptimizer was split by
concern (tests/data/zero_v1, made at commit 000a584 by ``_zero_compat_cases.make``) still load:
saved again they give the same file contents, and the runs continue as the old code
continued them, to a few ulps of CPU math (OneBitAdam sharded / exact / no_allgather with error buffers, ZeroOneAdam in its
local phase, AdamW at stage 3 with a dynamic loss scale)."""

from __future__ import annotations

import os

import _zero_compat_cases as cc
from compcomm.testing import run_ranks

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "zero_v1")


def test_old_checkpoints_load_and_continue(tmp_path):
    done = run_ranks(cc.WORLD, cc.check, DATA, str(tmp_path), timeout=600)
    assert done == [list(cc.CASES)] * cc.WORLD
