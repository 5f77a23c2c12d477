"""ZeRO when the ranks' backward passes reach different parameters: the buckets leave in one fixed
order on every rank and the end of each backward launches the rest (zeros for parameters without
a gradient), so the collectives pair up. Launched as they completed, they paired one rank's bucket
with another bucket of its peer: gloo aborted on the size mismatch, or the sums were wrong."""

from __future__ import annotations

import pytest
import torch

from compcomm.testing import run_ranks

import _zero_unused_cases as zu

FULL = [dict(stage=st, gas=gas, overlap=ov, steps=3)
        for st in (2, 3) for gas in (1, 2) for ov in (False, True)]
FULL.append(dict(stage=2, gas=2, overlap=True, steps=3, bucket=200))  # several tensors a bucket


@pytest.mark.parametrize("world", [2, 3])
def test_rank_dependent_branch_full_precision(world: int) -> None:
    results = run_ranks(world, zu.train, FULL, timeout=240)
    for case_i, case in enumerate(FULL):
        want = zu.reference(world, case["steps"], case["gas"])
        for r in range(world):
            got = results[r][case_i]["params"]
            err = max(float((a - b).abs().max()) for a, b in zip(got, want))
            assert err < 1e-5, f"rank {r}, {case}: {err}"


def test_rank_dependent_branch_onebit_overlap() -> None:
    """OneBitAdam (sharded mode) through its compressed phase: exchanging the buckets during
    backward gives, bit for bit, what exchanging them all in step() gives, on every rank."""
    cases = [dict(stage=2, gas=gas, overlap=ov, steps=5, onebit=True)
             for gas in (1, 2) for ov in (False, True)]
    results = run_ranks(3, zu.train, cases, timeout=240)
    for r in range(3):
        by = {(c["case"]["gas"], c["case"]["overlap"]): c["params"] for c in results[r]}
        mine = {(c["case"]["gas"], c["case"]["overlap"]): c["params"] for c in results[0]}
        for key, params in by.items():
            assert all(torch.isfinite(p).all() for p in params), (r, key)
            assert all(torch.equal(a, b) for a, b in zip(params, mine[key])), \
                f"ranks 0 and {r} differ: {key}"
        for gas in (1, 2):
            assert all(torch.equal(a, b) for a, b in zip(by[(gas, False)], by[(gas, True)])), \
                f"rank {r}, gas {gas}: overlapped exchanges differ from step()'s"


NONE = [dict(stage=st, gas=gas, overlap=ov, steps=2, none=True)
        for st in (2, 3) for gas in (1, 2) for ov in (False, True)]


def test_a_backward_that_reaches_no_parameter() -> None:
    """Rank 1's first micro-step reaches none of the ZeroOptimizer's parameters (its loss uses
    another one): it used to issue one round of reduce-scatters fewer than its peer, and gloo
    aborted on the next mismatched collective. Every rank now issues gradient_accumulation_steps
    rounds a step (the missing ones as zeros)."""
    results = run_ranks(2, zu.train, NONE, timeout=240)
    for case_i, case in enumerate(NONE):
        want = zu.reference(2, case["steps"], case["gas"], case)
        for r in range(2):
            got = results[r][case_i]["params"]
            err = max(float((a - b).abs().max()) for a, b in zip(got, want))
            assert err < 1e-5, f"rank {r}, {case}: {err}"


def test_reentrant_activation_checkpointing() -> None:
    """The head under torch.utils.checkpoint(use_reentrant=True): its gradients arrive in a
    backward nested in the user's, whose end used to count as the end of the user's backward (the
    1-bit exchanges then started mid-backward and the next gradient raised). Full precision
    matches Adam; the overlapped 1-bit steps match those exchanged in step(), bit for bit."""
    full = [dict(stage=2, gas=gas, overlap=True, steps=3, reentrant=True) for gas in (1, 2)]
    onebit = [dict(stage=2, gas=gas, overlap=ov, steps=5, onebit=True, reentrant=True)
              for gas in (1, 2) for ov in (False, True)]
    results = run_ranks(2, zu.train, full + onebit, timeout=240)
    for r in range(2):
        for case_i, case in enumerate(full):
            want = zu.reference(2, case["steps"], case["gas"])
            got = results[r][case_i]["params"]
            err = max(float((a - b).abs().max()) for a, b in zip(got, want))
            assert err < 1e-5, f"rank {r}, {case}: {err}"
        by = {(c["case"]["gas"], c["case"]["overlap"]): c["params"] for c in results[r][2:]}
        for gas in (1, 2):
            assert all(torch.isfinite(p).all() for p in by[(gas, True)])
            assert all(torch.equal(a, b) for a, b in zip(by[(gas, False)], by[(gas, True)])), \
                f"rank {r}, gas {gas}: overlapped exchanges differ from step()'s"
