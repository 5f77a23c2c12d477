"""The int8 all-gather, made lossless, changes nothing in the 1-bit phase: FSDP2 at W=2, 3, 4
over gloo, parameters set to the blockwise int8 code's fixed points; the losses, the sharded
gradients (the 1-bit reduce-scatter's output), its error buffers, AdamW's moments and the updated
parameters are bit for bit those of FSDP's exact all-gather, without and with the re-gather
cache, with small parameters sent exactly and with stochastic rounding, across the switch from
the warm-up to 1-bit."""

from __future__ import annotations

import pytest

import _fsdp_lossless_cases as C
from compcomm.testing import run_ranks

PARTS = {"loss": True, "grads": True, "errors": True, "moments": True, "params": True}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_lossless_int8_allgather_is_bitwise_exact_under_onebit(world):
    for res in run_ranks(world, C.lossless_cases, timeout=600):
        for lr in (0.0, 0.01):
            for tag in C.VARIANTS:
                assert res[f"{tag}_lr{lr}"] == PARTS, (tag, lr, res)
            assert res[f"errors_nonzero_lr{lr}"]
        # 3 FSDP modules: the root once a step, the 2 blocks twice (cache: once, one hit each)
        assert res["int8_lr0.0_counts"] == (5 * 4, 0)
        assert res["int8_cache_lr0.0_counts"] == (3 * 4, 2 * 4)
        assert res["int8_stochastic_lr0.0_counts"] == (5 * 4, 0)
