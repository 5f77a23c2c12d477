"""The backward overlap on CUDA (tests/test_overlap.py runs the same bodies on the CPU): ranks
sharing the GPU(s) as emulated NCCL hosts (their own NCCL_HOSTID, sockets over loopback), a torch
NCCL group, so the optimizer runs compcomm's native NCCL communicator where the build has it. The
hooks stage on the backward's stream and send on a side stream; the results must equal those
without overlap bit for bit (fp32 and bf16 parameters), gradient accumulation must switch the
overlap off, and a step without backward must send every group itself. The safety fixes on
CUDA: gradients changed through ``.data`` (no version counter moves) are caught by the value
check; a backward on a user stream whose exchanges are dropped (the buffers they read were that
stream's); the default ``overlap_backward='auto'`` is on over native NCCL."""

from __future__ import annotations

import functools

import pytest

import _overlap_cases as C
from _backends import no_gpu, skipif
from compcomm.testing import run_ranks

pytestmark = [pytest.mark.gpu, skipif(no_gpu())]

NCCL_ENV = {"NCCL_IB_DISABLE": "1", "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1",
            "NCCL_NVLS_ENABLE": "0", "NCCL_SOCKET_IFNAME": "lo",
            "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # both runs' gradients: the same bits


@functools.lru_cache(maxsize=None)
def outs():
    return run_ranks(2, C.gpu_scenarios, timeout=400, env=NCCL_ENV)


def test_overlap_on_cuda_is_bit_identical():
    for rank, out in enumerate(outs()):
        for key in ("plain_float32", "plain_bfloat16", "user_stream_plain_float32"):
            run = out[key]
            assert C.identical(run), (rank, key)
            assert run[True]["overlapped"] == C.STEPS - C.FREEZE, (rank, key)
            assert run[True]["from_backward"] >= 2 * (C.STEPS - C.FREEZE), (rank, key)
            assert run[True]["enabled"] and not run[True]["warnings"], (rank, key)
        acc = out["accumulate_float32"]
        assert C.identical(acc) and acc[True]["enabled"] is False, rank
        nob = out["no_backward_float32"]
        assert C.identical(nob) and nob[True]["overlapped"] == C.STEPS - C.FREEZE, rank


def test_changes_through_data_are_caught_on_cuda():
    """Fix 1 on CUDA: ``p.grad.data.mul_`` every step (all ranks) or ``torch._foreach_mul_`` on
    ``.data`` (rank 0 only): dropped, one warning, off the second time, on every rank; once
    (bf16 parameters): that step dropped, the overlap stays on. The same bits throughout."""
    for rank, out in enumerate(outs()):
        for key in ("data_mul_float32", "foreach_data_one_rank_float32"):
            run = out[key]
            assert C.identical(run), (rank, key)
            assert run[True]["enabled"] is False and run[True]["overlapped"] == 0, (rank, key)
            assert len(run[True]["warnings"]) == 1, (rank, key, run[True]["warnings"])
        once = out["data_once_bfloat16"]
        assert C.identical(once), rank
        assert once[True]["enabled"] and once[True]["overlapped"] == C.STEPS - C.FREEZE - 1, rank


def test_user_stream_drops_are_safe():
    """Fix 4 on CUDA: the backward runs on a user stream, step() on the current one; exchanges
    dropped once (a ``.data`` change) or for good (accumulation): the same bits as without
    overlap (a buffer of a dropped exchange reused on the user stream too early would garble a
    later step's exchange)."""
    for rank, out in enumerate(outs()):
        once = out["user_stream_data_once_float32"]
        assert C.identical(once) and once[True]["enabled"], rank
        assert once[True]["overlapped"] == C.STEPS - C.FREEZE - 1, rank
        acc = out["user_stream_accumulate_float32"]
        assert C.identical(acc) and acc[True]["enabled"] is False, rank


def test_auto_is_on_over_native_nccl():
    """The default ``overlap_backward='auto'``: on for CUDA parameters over compcomm's native NCCL
    communicator (off over the torch adapter, where the build has no NCCL); bit-identical."""
    for rank, out in enumerate(outs()):
        run = out["auto_float32"]
        assert C.identical(run), rank
        expect = C.STEPS - C.FREEZE if out["native"] else 0
        assert run[True]["overlapped"] == expect, (rank, out["native"])


def test_two_optimizers_on_one_native_nccl_communicator():
    """A GAN's G and D with the default 'auto' on one process group: one cached native NCCL
    communicator, two worker threads. The overlap switches off on both (silently; the second
    made after the first one's backward sent its groups: those are drained), the same bits as
    without overlap, no hang. Also a gradient set to None and a NaN cleaned after the send."""
    for rank, out in enumerate(outs()):
        for late, run in out["two_auto"].items():
            assert run["same"] and run["shared"], (rank, late, run)
            assert run["enabled"] == [False, False] and not run["warnings"], (rank, late, run)
            if late:
                assert run["sent_late"] > 0, run
        for scenario in ("grad_none", "nan_sanitize"):
            run = out[f"{scenario}_float32"]
            assert C.identical(run) and run[True]["enabled"], (rank, scenario)
            assert run[True]["overlapped"] >= C.STEPS - C.FREEZE - 2, (rank, scenario)
