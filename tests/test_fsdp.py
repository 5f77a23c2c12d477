"""1-bit compression for PyTorch's own data parallelism: FSDP2's reduce-scatter
(compcomm.fsdp.onebit) and DDP with any optimizer (compcomm.ddp.onebit_hook), on gloo, W=2 and 3."""

from __future__ import annotations

import functools

import pytest
import torch.distributed as dist

import _fsdp_cases as C
from compcomm.errors import UnsupportedError
from compcomm.fsdp import _scale_of
from compcomm.testing import run_ranks


@functools.lru_cache(maxsize=None)
def fsdp(world):
    return run_ranks(world, C.fsdp_cases, timeout=300)


@functools.lru_cache(maxsize=None)
def ddp(world):
    return run_ranks(world, C.ddp_cases, timeout=300)


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_warmup_is_fsdps_own_then_onebit(world):
    for res in fsdp(world):
        assert res["warmup_bitwise"] and res["onebit_differs"]
        assert res["onebit_close"] < 1.5  # 1-bit: one step is coarse, not garbage
        assert res["steps"] == {"0": 3, "2": 3}  # the two modules with parameters


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_error_feedback_converges_to_the_average(world):
    for res in fsdp(world):
        assert res["ef_mean"] < 0.5 * res["ef_single"], res


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_sum_op_with_post_division_equals_avg(world):
    for res in fsdp(world):
        assert res["sum_vs_avg"] < 1e-6


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_state_resumes_bitwise(world):
    for res in fsdp(world):
        assert res["resume_bitwise"]


def test_scale_of_ops():
    assert _scale_of(dist.ReduceOp.AVG, 4) == 1.0
    assert _scale_of(dist.ReduceOp.SUM, 4) == 4.0
    assert _scale_of(dist.ReduceOp.PREMUL_SUM(0.5), 4) == 2.0
    with pytest.raises(UnsupportedError, match="MAX"):
        _scale_of(dist.ReduceOp.MAX, 4)


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_onebit_hook(world):
    """Warm-up equal to DDP's default (to rounding); then 1-bit with error buffers, ranks
    identical."""
    for res in ddp(world):
        assert res["warmup_diff"] <= (0.0 if world == 2 else 1e-6) and res["onebit_differs"]
        assert res["has_errors"] and res["ranks_agree"] and res["resume_state_step"]


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_onebit_hook_converges_with_sgd_and_adamw(world):
    """Loss over the last 20 of 120 steps: plain DDP vs the hook (warm-up 20), same data. With
    AdamW the hook ends within 15% of plain DDP; with SGD-momentum 1-bit *gradients* barely train
    (measured 0.536 vs 0.147 at W=2, 0.495 vs 0.151 at W=3: docs/fsdp.md) -- asserted only not to
    diverge."""
    for res in ddp(world):
        plain, hooked, first = res["adamw_final"]
        assert hooked < 1.15 * plain + 1e-3, res["adamw_final"]
        plain, hooked, first = res["sgd_final"]
        assert hooked < first, res["sgd_final"]


def test_fsdp_dcp_checkpoint_resumes_bitwise(tmp_path):
    """torch.distributed.checkpoint save/load of an FSDP2 model, its AdamW state and compcomm's
    1-bit state (error buffers under a key per rank) in the 1-bit phase, W=2 over gloo: the
    resumed run's parameters equal the uninterrupted run's, bit for bit, for 3 more steps."""
    for res in run_ranks(2, C.dcp_cases, str(tmp_path / "ckpt"), timeout=300):
        assert res == {"template_sized": True, "errors_saved": True, "state_loaded": True,
                       "bitwise": True, "moved": True}
