"""The backward overlap of the 1-bit optimizers (OneBitAdam, W=2, gloo) where the ranks differ in
which parameters have gradients, and where a step is skipped (from a review of optim/overlap.py):

- a parameter that gets a gradient on one rank only: every rank raises RankMismatchError and
  nothing changes, as without the overlap (a rank whose layout had been agreed committed the
  exchanges it sent from the backward and stepped alone);
- a step skipped for a non-finite value in which a parameter had no gradient leaves the error
  buffers as they were, and overlap on and off end in the same bits (the overlap's arming
  re-planned the buckets from the skipped step, which reset the error buffers);
- parameters on two devices (simulated): a step skipped for a value on the second leaves the
  first device's error buffers as they were (each device's average had committed its own);
- DDP with compcomm.ddp_comm_hook: the check of DDP's rebuilt buckets no longer meets the
  overlap's exchanges on the same group in another order."""

from __future__ import annotations

import pytest

import _overlap_edge_cases as C
from compcomm.testing import run_ranks


@pytest.mark.parametrize("overlap", [False, True])
def test_gradient_on_one_rank_only_raises_everywhere(overlap):
    out = run_ranks(2, C.rank_extra_gradient_on_one_rank, overlap, timeout=240)
    for events in out:
        assert events[:4] == [(t, "ok", True) for t in range(1, 5)], out
        assert events[4] == (5, "RankMismatchError", False), out


def test_skipped_step_without_a_gradient_keeps_the_errors():
    for res in run_ranks(2, C.rank_skip_without_a_gradient, timeout=240):
        assert res == {"skipped": (1, 1), "off_unchanged": True, "on_unchanged": True,
                       "same_params": True, "same_errors": True}, res


def test_skip_on_a_later_device_keeps_the_first_devices_errors():
    """Without the overlap too: a step whose compressed average is one call per device."""
    for res in run_ranks(2, C.rank_two_devices_skip, timeout=240):
        assert res == {"skipped": 1, "errors": True, "params": True, "devices": 2}, res


@pytest.mark.parametrize("attempt", range(2))  # a race: more than one try
def test_ddp_hook_checks_new_buckets_without_meeting_the_overlap(attempt):
    """The bucket check of compcomm.ddp_comm_hook and the exchanges the overlap sent from the
    same backward used one gloo group from two threads, in an order that differed between ranks
    (gloo aborted on a collective mismatch, or the ranks hung): the check now waits for and
    drops what the backward sent. The replicas stay equal and later steps overlap."""
    out = run_ranks(2, C.rank_ddp_hook_new_buckets, timeout=120)
    assert out[0][1] == out[1][1]
    assert all(steps >= 1 for steps, _ in out), out
