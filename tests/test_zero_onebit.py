"""ZeRO stage 1/2 with OneBitAdam / ZeroOneAdam: the sharded compressed phase against a numpy
step-by-step reference (tests/reference.py's compressed-allreduce oracle, chunk r per rank), the
warm-up against unsharded OneBitAdam, wire bytes against plain ZeRO, and the rejections."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

import compcomm
from compcomm import _C
from compcomm.testing import run_ranks
from compcomm.zero import ZeroOptimizer

sys.path.insert(0, os.path.dirname(__file__))
import _zero_onebit_cases as zc  # noqa: E402
import reference  # noqa: E402

FREEZE = 2
STEPS = 5  # 2 warm-up + 3 compressed
ONEBIT_KW = {"lr": 1e-2, "freeze_step": FREEZE, "weight_decay": 0.01, "betas": (0.9, 0.999)}
ZOA_KW = {"lr": 1e-2, "var_freeze_step": 1000, "var_update_scaler": 1, "weight_decay": 0.01}
CASES = [
    {"opt": "OneBitAdam", "stage": 1, "gas": 1, "steps": STEPS, "bucket": 12, "kwargs": ONEBIT_KW},
    {"opt": "OneBitAdam", "stage": 2, "gas": 2, "steps": STEPS, "bucket": 12, "kwargs": ONEBIT_KW},
    # var steps 1, 2, 4; 1-bit gradient steps 3, 5, 6
    {"opt": "ZeroOneAdam", "stage": 2, "gas": 1, "steps": 6, "bucket": 10**6, "kwargs": ZOA_KW},
    {"opt": "Adam", "stage": 1, "gas": 1, "steps": 1, "bucket": 12, "kwargs": {"lr": 1e-2}},
    # wire bytes at a size where the headers do not dominate: 3 buckets of about 4000 elements
    {"opt": "OneBitAdam", "stage": 2, "gas": 1, "steps": 2, "bucket": 4096, "sizes": [4001, 3999, 4003],
     "kwargs": dict(ONEBIT_KW, freeze_step=1)},
    {"opt": "Adam", "stage": 2, "gas": 1, "steps": 1, "bucket": 4096, "sizes": [4001, 3999, 4003],
     "kwargs": {"lr": 1e-2}},
    # gradient clipping active in both phases (gradient norms are ~10)
    {"opt": "OneBitAdam", "stage": 1, "gas": 2, "steps": 4, "bucket": 12, "clip": 2.0, "kwargs": ONEBIT_KW},
]


@pytest.fixture(scope="module")
def results():
    return {w: run_ranks(w, zc.rank_body, CASES, ONEBIT_KW, FREEZE + 1, timeout=240)
            for w in (1, 2, 3, 4)}


def _kinds(case):
    if case["opt"] == "OneBitAdam":
        return ["var" if t <= case["kwargs"]["freeze_step"] else "1bit"
                for t in range(1, case["steps"] + 1)]
    interval, counter, kinds = 1, 0, []
    for t in range(1, case["steps"] + 1):
        kind = "var" if t % interval == 0 else "1bit"
        kinds.append(kind)
        if kind == "var" and t > 1:
            counter += 1
            if counter == case["kwargs"]["var_update_scaler"]:
                counter, interval = 0, interval * 2
    return kinds


def sharded_reference(case, world, plan):
    """Parameters after each step of ZeRO + OneBitAdam/ZeroOneAdam, simulated in numpy: the
    momentum contribution (1-b1)*g_local (OneBitAdam) or the gradient (ZeroOneAdam) of each bucket
    is 1-bit averaged with per-bucket error buffers; rank r's shard gets chunk r."""
    f32 = np.float32
    kw = case["kwargs"]
    b1, b2 = kw.get("betas", (0.9, 0.999))
    lr, wd, eps = kw["lr"], kw.get("weight_decay", 0.0), 1e-8
    buckets, tensors = plan["buckets"], plan["tensors"]
    flat_n = sum(b["padded"] for b in buckets)
    p = np.zeros(flat_n, f32)
    for t0, (n, off, _) in zip(zc.init_params(), tensors):
        p[off:off + n] = t0.numpy()
    m = np.zeros(flat_n, f32)
    v = np.zeros(flat_n, f32)
    errs = [([np.zeros(b["padded"], f32) for _ in range(world)],
             [np.zeros(b["chunk"], f32) for _ in range(world)]) for b in buckets]
    k = f32(1 - b1) if case["opt"] == "OneBitAdam" else f32(1)
    out = []
    for t, kind in enumerate(_kinds(case), start=1):
        local = []  # each rank's flat gradient, summed over micro-steps (as autograd accumulates)
        for r in range(world):
            g = np.zeros(flat_n, f32)
            for micro in range(case["gas"]):
                for i, (n, off, _) in enumerate(tensors):
                    g[off:off + n] += zc.grad(r, t, micro, i).numpy()
            local.append(g)
        clip = case.get("clip", 0.0)
        if kind == "var":
            g = np.sum(local, axis=0, dtype=f32) / f32(world * case["gas"])
            norm = np.sqrt(np.sum(g.astype(np.float64) ** 2))
            if clip and norm > clip:
                g = (g * f32(clip / (norm + 1e-6))).astype(f32)
        else:
            # clip by the mean over ranks of the squared local-gradient norms
            norm = np.sqrt(np.mean([np.sum((loc.astype(np.float64) / case["gas"]) ** 2) for loc in local]))
            coef = 1.0 / case["gas"]
            if clip and norm > clip:
                coef *= clip / (norm + 1e-6)
            g = np.zeros(flat_n, f32)
            for bi, b in enumerate(buckets):
                sl = slice(b["offset"], b["offset"] + b["padded"])
                xs = [(loc[sl] * f32(coef * k)).astype(f32) for loc in local]
                if world == 1:
                    avg = xs[0].astype(np.float64)
                else:
                    res = reference.simulate(xs, errs[bi][0], errs[bi][1])
                    errs[bi] = ([e.astype(f32) for e in res["worker_errors"]],
                                [e.astype(f32) for e in res["server_errors"]])
                    avg = res["out"]
                gb = (avg.astype(f32) / k).astype(f32)
                gb[b["numel"]:] = 0  # padding positions are masked
                g[sl] = gb
        m = (f32(b1) * m + f32(1 - b1) * g).astype(f32)
        if kind == "var":
            v = (f32(b2) * v + f32(1 - b2) * g * g).astype(f32)
        upd = m / (np.sqrt(v) + f32(eps)) + f32(wd) * p
        p = (p - f32(lr) * upd).astype(f32)
        out.append(np.concatenate([p[off:off + n] for n, off, _ in tensors]))
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("ci", [0, 1, 2, 6])
def test_compressed_phase_matches_numpy_reference(results, world, ci):
    case = CASES[ci]
    res = results[world]
    kinds = _kinds(case)
    got0 = res[0]["cases"][ci]
    assert got0["compressed"] == [k == "1bit" for k in kinds]
    for b in got0["plan"]["buckets"]:
        assert b["padded"] % (8 * world) == 0 and b["chunk"] * world == b["padded"]
    ref = sharded_reference(case, world, got0["plan"])
    for r in range(world):
        got = res[r]["cases"][ci]["params"]
        for t, (a, e) in enumerate(zip(got, ref), start=1):
            # every rank holds the same full parameters after the all-gather
            np.testing.assert_array_equal(a, got0["params"][t - 1])
            np.testing.assert_allclose(a, e, rtol=2e-5, atol=2e-6,
                                       err_msg=f"W={world} rank {r} step {t} ({kinds[t - 1]})")
    # the compressed phase moved the parameters (not a no-op)
    assert np.abs(ref[-1] - ref[kinds.index("1bit") - 1]).max() > 1e-3


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_warmup_equals_unsharded_onebit_adam(results, world):
    res = results[world]
    for r in range(world):
        plain = res[r]["unsharded"]
        zero = res[r]["cases"][0]["params"]
        for t in range(FREEZE):  # warm-up steps: same numerics as OneBitAdam's warm-up
            np.testing.assert_allclose(zero[t], plain[t], rtol=1e-6, atol=1e-7)
        if world == 1:  # no compression without peers: identical all along
            np.testing.assert_allclose(zero[FREEZE], plain[FREEZE], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("ci,freeze,plain", [(0, FREEZE, 3), (4, 1, 5)])
def test_compressed_phase_wire_bytes(results, world, ci, freeze, plain):
    """A compressed step sends, per bucket, the compressed reduce-scatter's bytes instead of a fp32
    reduce-scatter's (the norm all-reduce and the parameter all-gather are unchanged)."""
    got = results[world][0]["cases"][ci]
    plan = got["plan"]
    warm, comp = got["bytes"][freeze - 1], got["bytes"][freeze]
    assert all(b == warm for b in got["bytes"][:freeze])
    assert all(b == comp for b in got["bytes"][freeze:])
    rs = sum(b["chunk"] * 4 * (world - 1) for b in plan["buckets"])
    crs = sum(_C.zero.compressed_reduce_scatter_wire_bytes(b["padded"], world) for b in plan["buckets"])
    assert comp - warm == crs - rs
    plain_zero = results[world][0]["cases"][plain]["bytes"][0]  # plain ZeRO Adam (alignment 2)
    ag = sum(b["chunk"] * 4 * (world - 1) for b in results[world][0]["cases"][plain]["plan"]["buckets"])
    print(f"W={world} sizes={CASES[ci].get('sizes', zc.SIZES)}: plain ZeRO step {plain_zero} B "
          f"(reduce-scatter {ag} B), 1-bit warm-up {warm} B, compressed {comp} B "
          f"(reduce-scatter {crs} B)")
    if ci == 4:  # large buckets: the gradient reduction shrinks > 20x, the whole step ~2x
        assert crs * 20 < rs
        assert comp < 0.6 * plain_zero


@pytest.mark.parametrize("world", [2, 3])
def test_memory_counts_error_buffers(results, world):
    got = results[world][0]["cases"][0]
    plain = results[world][0]["cases"][3]
    per_bucket = sum(b["padded"] + b["chunk"] for b in got["plan"]["buckets"]) * 4
    assert got["memory"]["buffers"] - plain["memory"]["buffers"] == per_bucket
    assert got["memory"]["optimizer_state"] <= plain["memory"]["optimizer_state"] + 8 * 4 * 2 * 4


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zero_one_adam_local_phase_rejected(results, world):
    for r in range(world):
        msg = results[world][r]["frozen"]
        assert "local-step phase" in msg and "var_freeze_step" in msg


def test_stage3_and_onebit_lamb_rejected():
    from compcomm.optim import OneBitAdam, OneBitLamb, ZeroOneAdam

    model = torch.nn.Linear(4, 3)
    for cls in (OneBitAdam, ZeroOneAdam):
        with pytest.raises(ValueError, match="stage 3"):
            ZeroOptimizer(model.parameters(), cls, stage=3, module=model)
    with pytest.raises(ValueError, match="OneBitLamb"):
        ZeroOptimizer(model.parameters(), OneBitLamb, stage=1)
    with pytest.raises(ValueError, match="comm_backend_name"):
        ZeroOptimizer(model.parameters(), OneBitAdam, stage=1,
                      optimizer_kwargs={"comm_backend_name": "mpi"})
    cfg = {"train_micro_batch_size_per_gpu": 2,
           "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 10}},
           "zero_optimization": {"stage": 3}}
    with pytest.raises(ValueError, match="stage=3"):
        compcomm.from_config(torch.nn.Linear(4, 3), cfg)
    with pytest.raises(ValueError, match="stage=3"):
        compcomm.zero.initialize(torch.nn.Linear(4, 3), cfg["optimizer"], {"stage": 3})


@pytest.mark.parametrize("typ,stage", [("OneBitAdam", 1), ("ZeroOneAdam", 2)])
def test_from_config_accepts_onebit_with_stage_1_2(typ, stage):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    key = "freeze_step" if typ == "OneBitAdam" else "var_freeze_step"
    cfg = {"train_micro_batch_size_per_gpu": 2,
           "optimizer": {"type": typ, "params": {"lr": 1e-2, key: 1}},
           "zero_optimization": {"stage": stage}}
    setup = compcomm.from_config(model, cfg)
    opt = setup.optimizer
    assert isinstance(opt, ZeroOptimizer) and opt.onebit == typ
    x = torch.randn(2, 4)
    before = [p.detach().clone() for p in model.parameters()]
    model(x).pow(2).sum().backward()
    opt.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    opt.close()
