"""The three 1-bit optimizers at world size 2 on CUDA: their kernels (the default) against the torch
ops (``COMPCOMM_FUSED_OPTIM=0``), with real exchanges between ranks sharing the GPU(s) as emulated
NCCL hosts (their own NCCL_HOSTID, sockets over loopback) of a torch NCCL group, so the
optimizers run compcomm's native NCCL communicator where the build has it. Until now 1-bit LAMB's
CUDA passes were only checked at one rank (tests/test_cuda_lamb.py).

Per case (tests/_optim_gpu_ranks_cases.py: OneBitAdam and OneBitLamb with fp32 and bf16
parameters, ZeroOneAdam with fp32; tensors of 7, 1000, 70001 and 2^16 + 3 elements; 2-3 warm-up
steps, then compressed steps up to 8): the kernels ran in the default run and not in the other;
the ranks agree bit for bit where the average is replicated; the two runs agree within a
tolerance; and three control runs (each rank alone, no weight decay, a learning rate 2% off)
fall outside that tolerance, so it is tight enough to notice a kernel that skips the exchange,
loses the weight decay or uses the wrong learning rate.

The tolerances. The CUDA kernels give the bits of a float32 CPU evaluation of the op sequence;
torch's CUDA ops contract ``a + alpha * b`` into a multiply-add and divide through a reciprocal,
so the two runs differ by an ulp here and there in every step; the gradients do not depend on the
parameters, so those differences add up (at most an ulp of the weight a step) and are not
amplified: after 8 steps a few ulps of the weight, ~1e-6 relative. Warm-up steps (no 1-bit
exchange yet) are held to rtol 1e-5 / atol 1e-6. Once 1-bit exchanges ran, rtol 1e-4 / atol
1e-5 (~100x the accumulated rounding), except for a few elements per tensor
(``allowance``: 2 + 1 per 1000): where a compressed input is within an ulp of zero the two runs
can send opposite signs, and that element (and, for a small bucket, slightly its bucket's scale)
takes another step. A learning rate 2% off moves every weight by ~2% of its total displacement
(~0.04-0.08 here: ~1e-3), no weight decay by ~lr * wd = 1e-3 of the weight per step: both far
outside rtol 1e-4, on most elements, which the control runs check on the real numbers.
"""

from __future__ import annotations

import functools

import pytest
import torch

import _optim_gpu_ranks_cases as C
from _backends import no_cuda_kernels, no_gpu, skipif
from compcomm.testing import run_ranks

pytestmark = [pytest.mark.gpu, skipif(no_gpu() or no_cuda_kernels())]

NCCL_ENV = {"NCCL_IB_DISABLE": "1", "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1",
            "NCCL_NVLS_ENABLE": "0", "NCCL_SOCKET_IFNAME": "lo",
            "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}

WARM_TOL = dict(rtol=1e-5, atol=1e-6)  # no 1-bit exchange yet: rounding only
TOL = dict(rtol=1e-4, atol=1e-5)  # after 1-bit exchanges: rounding, plus `allowance` sign flips
LOWP_TOL = dict(rtol=1e-2, atol=1e-5)  # bf16 parameters: one bf16 ulp (<= 2^-7 relative)
# ZeroOneAdam's sync rolls each rank back by its own accumulated update (w + u - acc): the ranks
# differ by a few ulps of the weights (|w| < 5: ulp <= 5e-7; 1e-6 seen on the CPU), absolute
SYNC_RANKS_TOL = dict(rtol=1e-6, atol=1e-5)


@functools.lru_cache(maxsize=None)
def outs():
    return run_ranks(2, C.optimizer_ranks, timeout=400, env=NCCL_ENV)


def _cases():
    for rank, out in enumerate(outs()):
        for case, runs in out["cases"].items():
            yield rank, out, case, runs


def _within(a_list, b_list, tol, what, numel_allowance=False):
    """Each tensor of ``a_list`` within ``tol`` of ``b_list``'s, but for ``allowance`` elements
    where ``numel_allowance``; returns the mismatched elements."""
    total = 0
    for i, (a, b) in enumerate(zip(a_list, b_list)):
        bad = C.mismatches(a, b, **tol)
        limit = C.allowance(a.numel()) if numel_allowance else 0
        assert bad <= limit, (what, i, tuple(a.shape), bad, limit,
                              float((a.double() - b.double()).abs().max()))
        total += bad
    return total


def _fraction_outside(a_list, b_list, tol):
    n = sum(a.numel() for a in a_list)
    return sum(C.mismatches(a, b, **tol) for a, b in zip(a_list, b_list)) / n


def test_kernels_ran_by_default_and_not_when_switched_off():
    """Counted at the kernels' entry points (compcomm.optim._fused, lamb_passes, cpu_multi):
    the default run called each of its optimizer's at least once per step of the kind it serves,
    on the parameters' device, and nothing else; the COMPCOMM_FUSED_OPTIM=0 run called none."""
    for rank, out, case, runs in _cases():
        assert out["device"] != "cuda" or out["fused_available"], rank
        name = C.CASES[case][0]
        dev = out["device"]
        kernels, torch_run = runs["kernels"], runs["torch"]
        expected = {f"{m}.{f}@{dev}": sum(k in kinds for k in kernels["kinds"])
                    for m, f, kinds in C.KERNELS[dev][name]}
        assert all(n > 0 for n in expected.values()), (case, expected)  # the schedule has them
        for key, least in expected.items():
            assert kernels["calls"].get(key, 0) >= least, (rank, case, key, kernels["calls"])
        assert set(kernels["calls"]) == set(expected), (rank, case, kernels["calls"])
        assert torch_run["calls"] == {}, (rank, case, torch_run["calls"])
        for run in (kernels, torch_run):
            assert run["world"] == 2 and run["skipped"] == 0, (rank, case)
            # the NCCL group's communicator (compcomm's native one, or the torch adapter)
            assert dev != "cuda" or "nccl" in run["comm"], (rank, case, run["comm"])


def test_ranks_agree():
    """The compressed average is replicated: after every step whose average is (warm-up, 1-bit
    Adam's and LAMB's compressed steps, 0/1 Adam's 1-bit gradient steps) both ranks hold the same
    fp32 weights, bit for bit, in both runs; so do the final momenta and bf16 parameters. 0/1
    Adam's local steps use each rank's own momentum: the ranks differ there (their gradients
    differ), and agree again after the sync up to the roll-back's rounding."""
    out0, out1 = outs()
    for case in out0["cases"]:
        for which in ("kernels", "torch"):
            a, b = out0["cases"][case][which], out1["cases"][case][which]
            assert a["kinds"] == b["kinds"] and a["kinds"][-1] in C.REPLICATED + ("SYNC",), case
            for t, (kind, wa, wb) in enumerate(zip(a["kinds"], a["traj"], b["traj"]), 1):
                if kind in C.REPLICATED:
                    assert all(torch.equal(x, y) for x, y in zip(wa, wb)), (case, which, t, kind)
                elif kind == "SYNC":
                    for x, y in zip(wa, wb):
                        torch.testing.assert_close(x, y, **SYNC_RANKS_TOL)
                else:  # LOCAL
                    assert not any(torch.equal(x, y) for x, y in zip(wa, wb)), (case, which, t)
            assert all(torch.equal(x, y) for x, y in zip(a["exp_avg"], b["exp_avg"])), (case, which)
            if a["kinds"][-1] in C.REPLICATED:
                assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"])), \
                    (case, which)


def test_kernels_follow_the_torch_ops():
    """The default run (kernels) against COMPCOMM_FUSED_OPTIM=0 (torch ops), step by step: the
    warm-up steps within rounding (WARM_TOL), the steps after the first 1-bit exchange within
    TOL but for `allowance` elements a tensor; the final momenta likewise, bf16 parameters within
    one bf16 ulp. Where no kernel ran in either run (0/1 Adam on CUDA has none) the two runs took
    the same code path: the same bits."""
    flips = {}
    for rank, out, case, runs in _cases():
        a, b = runs["kernels"], runs["torch"]
        assert a["kinds"] == b["kinds"], (rank, case)
        if not a["calls"] and not b["calls"]:
            for x, y in zip(a["traj"] + [a["exp_avg"], a["params"]],
                            b["traj"] + [b["exp_avg"], b["params"]]):
                assert all(torch.equal(u, v) for u, v in zip(x, y)), (rank, case)
            continue
        exchanged = False
        flips[(rank, case)] = 0
        for t, (kind, wa, wb) in enumerate(zip(a["kinds"], a["traj"], b["traj"]), 1):
            exchanged = exchanged or kind != "FULL_AVERAGE"
            if not exchanged:
                for x, y in zip(wa, wb):
                    torch.testing.assert_close(x, y, **WARM_TOL, msg=lambda m: f"{case} {t}: {m}")
            else:
                flips[(rank, case)] += _within(wa, wb, TOL, (rank, case, t, kind), True)
        _within(a["exp_avg"], b["exp_avg"], TOL, (rank, case, "exp_avg"), True)
        _within(a["params"], b["params"], LOWP_TOL if C.CASES[case][1] != torch.float32 else TOL,
                (rank, case, "params"), True)
    # a sign flip needs an input within ~1e-7 of its scale of zero: expected well under one in
    # the whole test; a few is still fine, many means something else differs
    assert sum(flips.values()) <= 20, flips


def test_parameters_moved_and_the_controls_fail_the_tolerance():
    """The comparison above has teeth: the weights moved (nearly all elements by more than TOL
    from where they started); each rank alone (no exchange: its own gradients only), no weight
    decay and a learning rate 2% off each end outside TOL on most elements of the kernels' run,
    and the two ranks alone differ (their gradients do)."""
    out0, out1 = outs()
    for rank, out, case, runs in _cases():
        final = runs["kernels"]["final"]
        assert _fraction_outside(final, out["initial"][case], TOL) > 0.95, (rank, case)
        for control in ("alone", "no_weight_decay", "lr_off"):
            frac = _fraction_outside(runs[control]["final"], final, TOL)
            assert frac > 0.5, (rank, case, control, frac)
        assert runs["alone"]["world"] == 1 and runs["alone"]["skipped"] == 0, (rank, case)
    for case in out0["cases"]:
        a, b = out0["cases"][case]["alone"]["final"], out1["cases"][case]["alone"]["final"]
        assert _fraction_outside(a, b, TOL) > 0.5, case
