"""ZeRO + OneBitAdam in the "exact" (default) and "no_allgather" modes (issue 19): the trajectory of
unsharded OneBitAdam (same gradients, same buckets) to fp32 rounding through 20 compressed steps at
W = 1..4, stages 1/2 (and 3 for exact), fp32 and bf16; wire bytes of a compressed step; memory
against estimate_memory; non-finite skips; exact checkpoint resume; the config key; and held-out
MSE of the issue's small model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import compcomm
from compcomm.testing import run_ranks

import _zero_onebit_modes_cases as mc

KW = {"lr": 1e-2, "freeze_step": 4, "weight_decay": 0.01}
CASES = [
    {"mode": "exact", "stage": 1, "gas": 1, "steps": 24, "kwargs": KW},
    {"mode": "exact", "stage": 2, "gas": 2, "steps": 24, "kwargs": KW},
    {"mode": "exact", "stage": 3, "gas": 1, "steps": 24, "kwargs": KW},
    {"mode": "no_allgather", "stage": 1, "gas": 1, "steps": 24, "kwargs": KW},
    {"mode": "no_allgather", "stage": 2, "gas": 2, "steps": 24, "kwargs": KW},
    {"mode": "exact", "stage": 2, "gas": 1, "steps": 24, "kwargs": KW, "dtype": "bfloat16"},
    {"mode": "no_allgather", "stage": 2, "gas": 1, "steps": 24, "kwargs": KW, "dtype": "bfloat16"},
    {"mode": "exact", "stage": 1, "gas": 1, "steps": 24, "kwargs": dict(KW, bias_correction=True)},
]
RESUMES = [
    {"mode": "exact", "stage": 2, "gas": 1, "steps": 10, "save_at": [4, 7], "kwargs": KW},
    {"mode": "no_allgather", "stage": 1, "gas": 1, "steps": 10, "save_at": [7], "kwargs": KW,
     "dtype": "bfloat16"},
]
# the small model: Linear(37,53)-Tanh-Linear(53,11), lr 1e-2, 10 steps, freeze at 4
MLP = {"stage": 2, "steps": 10, "freeze": 4, "lr": 1e-2, "batch": 16}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return {w: run_ranks(w, mc.rank_body, CASES, RESUMES, MLP if w in (2, 3) else None,
                         str(tmp_path_factory.mktemp(f"modes_w{w}")), timeout=600)
            for w in (1, 2, 3, 4)}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("ci", range(len(CASES)))
def test_trajectory_equals_unsharded_onebit_adam(results, world, ci):
    case = CASES[ci]
    bf16 = case.get("dtype") == "bfloat16"
    first = results[world][0]["cases"][ci]
    assert first["compressed"] == [t > KW["freeze_step"] for t in range(1, case["steps"] + 1)]
    for r in range(world):
        got = results[world][r]["cases"][ci]
        for t, (a, e) in enumerate(zip(got["zero"], got["plain"]), start=1):
            np.testing.assert_array_equal(a, first["zero"][t - 1])  # every rank: the same params
            np.testing.assert_allclose(a, e, rtol=1e-2 if bf16 else 1e-6, atol=2e-3 if bf16 else 1e-6,
                                       err_msg=f"W={world} rank {r} step {t}")
    # the compressed phase moved the parameters (not a no-op)
    assert np.abs(first["zero"][-1] - first["zero"][KW["freeze_step"] - 1]).max() > 1e-2


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("ci", [0, 1, 3, 4, 5, 6])
def test_compressed_step_wire_bytes(results, world, ci):
    """no_allgather: a compressed step sends the compressed allreduce of each bucket and the 8-byte
    norm all-reduce, nothing else; exact adds the parameter all-gather of ZeRO's warm-up."""
    got = results[world][0]["cases"][ci]
    norm = results[world][0]["norm_bytes"]
    car = sum(compcomm.wire_bytes(b["numel"], world, padded=b["padded"]) for b in got["plan"])
    elem = 2 if CASES[ci].get("dtype") == "bfloat16" else 4
    ag = sum(b["chunk"] * elem * (world - 1) for b in got["plan"])
    # several buckets go in one batched exchange, which first all-gathers each rank's 32-byte call-count record
    count = 32 * (world - 1) if len(got["plan"]) > 1 else 0
    comp = got["bytes"][KW["freeze_step"]:]
    assert all(b == comp[1] for b in comp[1:])
    assert comp[1] == norm + car + count + (ag if CASES[ci]["mode"] == "exact" else 0)
    # the first compressed step also all-gathers, once, the shards kept in full from then on:
    # the momentum (no_allgather: and the variance, bf16: and the fp32 master)
    full = 1 if CASES[ci]["mode"] == "exact" else 2 + (elem == 2)
    assert comp[0] - comp[1] == full * sum(b["chunk"] * 4 * (world - 1) for b in got["plan"])


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("ci", [1, 3, 4, 5, 6])
def test_memory_against_estimate(results, world, ci):
    """optimizer_state holds the shards (m, v: 8 T/W) plus what the mode keeps in full: the momentum
    in its 1-bit form (P/8 bytes of signs and W fp32 scales per bucket; fp32 with one rank, where
    nothing is compressed), in no_allgather also the frozen variance and bf16's fp32 master;
    estimate_memory says the same up to padding and the scales."""
    from compcomm.zero import estimate_memory

    case = CASES[ci]
    got = results[world][0]["cases"][ci]
    flat = sum(b["padded"] for b in got["plan"])
    b16 = case.get("dtype") == "bfloat16"
    full = {"exact": 0, "no_allgather": 4 + (4 if b16 else 0)}[case["mode"]] * flat
    momentum = 4 * flat if world == 1 else flat // 8 + 4 * world * len(got["plan"])
    assert got["memory"]["optimizer_state"] == 8 * flat // world + full + momentum
    T = sum(mc.SIZES)
    est = estimate_memory(T, case["stage"], world, param_bytes=2 if b16 else 4, onebit="OneBitAdam",
                          onebit_mode=case["mode"])
    pad = flat - T
    scales = 4 * world * len(got["plan"]) if world > 1 else 0
    assert (est["optimizer_state"] <= got["memory"]["optimizer_state"]
            <= est["optimizer_state"] + 20 * pad + scales)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("mode", ["exact", "no_allgather"])
def test_nonfinite_skips_on_every_rank(results, world, mode):
    for r in range(world):
        got = results[world][r]["nonfinite"][mode]
        assert got == {"skipped": 1, "unchanged": True, "recovered": True}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("ri", range(len(RESUMES)))
def test_checkpoint_resume_is_exact(results, world, ri):
    """exact_resume: from the last warm-up step (the momentum gathered after the load) or a
    compressed step (error buffers, shards of the replicated momentum), bit for bit."""
    for r in range(world):
        res = results[world][r]["resume"][ri]
        for s, traj in res["resumed"].items():
            for t, a in traj.items():
                np.testing.assert_array_equal(a, res["full"][t], err_msg=f"W={world} rank {r} from {s}")


@pytest.mark.parametrize("world", [2, 3])
def test_small_mlp_heldout_matches_unsharded(results, world):
    got = results[world][0]["mlp"]
    print(f"W={world} held-out MSE: {got}")
    for mode in ("exact", "no_allgather"):
        assert abs(got[mode] / got["plain"] - 1) < 0.02, (mode, got)


def test_onebit_mode_config():
    from compcomm.optim import OneBitAdam, ZeroOneAdam
    from compcomm.zero import ZeroOptimizer

    model = torch.nn.Linear(4, 3)
    z = ZeroOptimizer(model.parameters(), OneBitAdam, stage=2)
    assert z.onebit_mode == "exact"
    z.close()
    cfg = {"train_micro_batch_size_per_gpu": 2,
           "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 1}},
           "zero_optimization": {"stage": 1, "onebit_mode": "no_allgather"}}
    setup = compcomm.from_config(torch.nn.Linear(4, 3), cfg)
    assert setup.optimizer.onebit_mode == "no_allgather"
    setup.optimizer.close()
    with pytest.raises(ValueError, match="onebit_mode"):
        compcomm.from_config(torch.nn.Linear(4, 3), dict(cfg, zero_optimization={
            "stage": 1, "onebit_mode": "fast"}))
    with pytest.raises(ValueError, match="no_allgather.*stage 1 or 2"):
        ZeroOptimizer(model.parameters(), OneBitAdam, stage=3, module=model, onebit_mode="no_allgather")
    with pytest.raises(ValueError, match="only to OneBitAdam"):
        ZeroOptimizer(model.parameters(), ZeroOneAdam, stage=1, onebit_mode="exact")
    with pytest.raises(ValueError, match="only to OneBitAdam"):
        ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=1, onebit_mode="no_allgather")
