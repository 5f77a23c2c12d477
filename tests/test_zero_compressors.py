"""ZeroOptimizer takes its compressor from the wrapped optimizer (issue 15): with
``OneBitAdam(compressor=IdentityCompressor)`` (or ZeroOneAdam) every mode that communicates 1-bit
tensors -- the sharded reduce-scatter (stage 1/2, staged and overlapped), the replicated "exact"
and "no_allgather" modes, 0/1 Adam's gradient steps and local phase -- sends full-precision
tensors instead, and the trajectory is that of the same optimizer unsharded with the same
compressor (fp32 rounding: only the order of the sums differs). Checkpoints carry no error
buffers and resume exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compcomm.compress import IdentityCompressor, OneBitCompressor
from compcomm.testing import run_ranks

import _zero_compressor_cases as cc

KW = {"lr": 1e-2, "freeze_step": 4, "weight_decay": 0.01}
ZOA_KW = {"lr": 1e-2, "var_freeze_step": 1000, "var_update_scaler": 1, "weight_decay": 0.01}
LOCAL_KW = {"lr": 1e-2, "var_freeze_step": 3, "var_update_scaler": 1000, "local_step_scaler": 2,
            "local_step_clipper": 4, "weight_decay": 0.01}
STEPS = 10
CASES = [
    {"opt": "OneBitAdam", "mode": "sharded", "stage": 1, "gas": 1, "steps": STEPS, "kwargs": KW},
    {"opt": "OneBitAdam", "mode": "sharded", "stage": 2, "gas": 2, "steps": STEPS, "kwargs": KW},
    {"opt": "OneBitAdam", "mode": "sharded", "stage": 2, "gas": 1, "steps": STEPS, "kwargs": KW,
     "overlap": True},
    {"opt": "OneBitAdam", "mode": "exact", "stage": 1, "gas": 1, "steps": STEPS, "kwargs": KW},
    {"opt": "OneBitAdam", "mode": "exact", "stage": 2, "gas": 2, "steps": STEPS, "kwargs": KW,
     "partial": True},
    {"opt": "OneBitAdam", "mode": "no_allgather", "stage": 2, "gas": 1, "steps": STEPS,
     "kwargs": KW},
    # var steps 1, 2, 4, 8; 1-bit gradient steps 3, 5, 6, 7
    {"opt": "ZeroOneAdam", "stage": 2, "gas": 1, "steps": 8, "kwargs": ZOA_KW, "overlap": True},
    # into the local phase: var 1-4, then sync / local steps
    {"opt": "ZeroOneAdam", "stage": 1, "gas": 1, "steps": 10, "kwargs": LOCAL_KW},
    # the default compressor, for the wire-bytes comparison
    {"opt": "OneBitAdam", "mode": "sharded", "stage": 2, "gas": 1, "steps": 6, "kwargs": KW,
     "identity": False},
    {"opt": "OneBitAdam", "mode": "exact", "stage": 2, "gas": 1, "steps": 6, "kwargs": KW,
     "identity": False},
]
ONEBIT_OF = {"sharded": 8, "exact": 9}  # the default-compressor twin of each mode
RESUMES = [
    {"opt": "OneBitAdam", "mode": "sharded", "stage": 2, "gas": 1, "steps": 9, "save_at": [3, 6],
     "kwargs": KW, "exact_resume": True},
    {"opt": "OneBitAdam", "mode": "exact", "stage": 1, "gas": 1, "steps": 9, "save_at": [6],
     "kwargs": KW},
    {"opt": "ZeroOneAdam", "stage": 2, "gas": 1, "steps": 8, "save_at": [5], "kwargs": ZOA_KW,
     "exact_resume": True},
]
WORLDS = (2, 3)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return {w: run_ranks(w, cc.rank_body, CASES, RESUMES,
                         str(tmp_path_factory.mktemp(f"zcomp_w{w}")), timeout=600)
            for w in WORLDS}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("ci", [i for i, c in enumerate(CASES) if c.get("identity", True)])
def test_identity_trajectory_equals_unsharded(results, world, ci):
    """ZeRO with the wrapped optimizer's IdentityCompressor tracks the unsharded optimizer with
    IdentityCompressor through warm-up and compressed (or local) phases."""
    case = CASES[ci]
    first = results[world][0]["cases"][ci]
    assert first["identity"]
    assert first["errors"] == 0  # no error buffers anywhere
    if case["opt"] == "OneBitAdam":
        want = "replicated" if case["mode"] != "sharded" else "onebit"
        assert first["phase"] == ["full"] * KW["freeze_step"] + [want] * (STEPS - KW["freeze_step"])
    else:
        assert set(first["phase"]) >= ({"full", "local"} if ci == 7 else {"full", "onebit"})
    for r in range(world):
        got = results[world][r]["cases"][ci]
        for t, (a, e) in enumerate(zip(got["zero"], got["plain"]), start=1):
            if first["phase"][t - 1] != "local":  # local steps: each rank its own parameters
                np.testing.assert_array_equal(a, first["zero"][t - 1])
            np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6,
                                       err_msg=f"W={world} rank {r} step {t}")
    # the compressed phase moved the parameters
    assert np.abs(first["zero"][-1] - first["zero"][3]).max() > 1e-2


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("mode", ["sharded", "exact"])
def test_identity_sends_full_precision(results, world, mode):
    """A compressed step with IdentityCompressor sends fp32 tensors: besides the norm all-reduce
    and the parameter all-gather, an fp32 reduce-scatter of every bucket (sharded: what the
    warm-up sends) or an fp32 allreduce (exact), where the 1-bit twin sends a few bits each."""
    import compcomm

    ci = next(i for i, c in enumerate(CASES)
              if c.get("mode") == mode and c["gas"] == 1 and c.get("identity", True))
    norm = results[world][0]["norm_bytes"]
    freeze = KW["freeze_step"]
    got, onebit = results[world][0]["cases"][ci], results[world][0]["cases"][ONEBIT_OF[mode]]
    assert got["plan"] == onebit["plan"]
    padded = sum(b["padded"] for b in got["plan"])
    ag = sum(b["chunk"] * 4 * (world - 1) for b in got["plan"])  # the parameter all-gather
    rs = padded * 4 * (world - 1) // world
    comp = got["bytes"][freeze + 1:]  # after the first compressed step (exact: it gathers m)
    assert all(b == comp[0] for b in comp)
    assert got["bytes"][freeze - 1] == norm + rs + ag  # the warm-up
    assert comp[0] == norm + ag + (rs if mode == "sharded" else 2 * rs)
    onebit_bytes = onebit["bytes"][freeze + 1] - norm - ag
    if mode == "exact":
        batched = len(got["plan"]) > 1  # one batched exchange: 32 bytes per peer for the counts
        assert onebit_bytes == sum(compcomm.wire_bytes(b["numel"], world, padded=b["padded"])
                                   for b in got["plan"]) + (32 * (world - 1) if batched else 0)
    assert onebit_bytes < rs / 2


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("ri", range(len(RESUMES)))
def test_identity_checkpoint_resume_is_exact(results, world, ri):
    for r in range(world):
        got = results[world][r]["resume"][ri]
        assert not got["saved_errors"]  # None, or {} with exact_resume: nothing to save
        for s, traj in got["resumed"].items():
            for t, a in traj.items():
                np.testing.assert_array_equal(a, got["full"][t], err_msg=f"saved {s} step {t}")
        for a, b in zip(got["resumed_state"], got["state"]):
            assert torch.equal(a, b)


def test_default_compressor_is_onebit():
    """Without ``compressor=`` ZeRO keeps the 1-bit compressor (with ZeRO's timeout)."""
    from compcomm import _C
    from compcomm.optim import OneBitAdam
    from compcomm.zero import ZeroOptimizer

    p = torch.nn.Parameter(torch.ones(10))
    z = ZeroOptimizer([p], OneBitAdam, process_group=_C.LocalCommunicator(), timeout=12.0)
    assert type(z.compressor) is OneBitCompressor and z.compressor.timeout == 12.0
    z.close()
    z = ZeroOptimizer([p], OneBitAdam, process_group=_C.LocalCommunicator(),
                      optimizer_kwargs={"compressor": IdentityCompressor})
    assert type(z.compressor) is IdentityCompressor
    assert z.memory_bytes()["buffers"] >= 0
    z.close()


def test_compressor_without_reduce_scatter_is_rejected_where_needed():
    """A compressor with only ``average_`` serves the replicated modes; the sharded reduction
    needs its reduce-scatter and says so at construction."""
    from compcomm import _C
    from compcomm.optim import OneBitAdam
    from compcomm.zero import ZeroOptimizer

    class Plain:
        def __init__(self, comm):
            self.inner = IdentityCompressor(comm)

        def __getattr__(self, name):
            if name.startswith("reduce_scatter"):
                raise AttributeError(name)
            return getattr(self.inner, name)

    p = torch.nn.Parameter(torch.ones(10))
    z = ZeroOptimizer([p], OneBitAdam, process_group=_C.LocalCommunicator(),
                      optimizer_kwargs={"compressor": Plain})
    assert isinstance(z.compressor, Plain)
    z.close()
    with pytest.raises(TypeError, match="compressor.*reduce_scatter_"):
        ZeroOptimizer([p], OneBitAdam, process_group=_C.LocalCommunicator(),
                      optimizer_kwargs={"compressor": Plain}, onebit_mode="sharded")
