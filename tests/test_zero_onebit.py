"""ZeRO stage 1/2 with OneBitAdam / ZeroOneAdam: the sharded compressed phase against a numpy
step-by-step reference (tests/reference.py's compressed-allreduce oracle, chunk r per rank), the
warm-up against unsharded OneBitAdam, ZeroOneAdam's local-step phase against unsharded ZeroOneAdam,
wire bytes against plain ZeRO, exact checkpoint resume, and the rejections."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import compcomm
from compcomm import _C
from compcomm.testing import run_ranks
from compcomm.zero import ZeroOptimizer

import _zero_onebit_cases as zc
import reference
from optim_reference import zero_one_schedule

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
    # stage 2 + overlap_comm: buckets exchanged during backward, committed by step() (7 = 1, 8 = 2)
    {"opt": "OneBitAdam", "stage": 2, "gas": 2, "steps": STEPS, "bucket": 12, "kwargs": ONEBIT_KW,
     "overlap": True},
    {"opt": "ZeroOneAdam", "stage": 2, "gas": 1, "steps": 6, "bucket": 10**6, "kwargs": ZOA_KW,
     "overlap": True},
    # stage 3 (one parameter per bucket), staged (9) and overlapped during backward (10)
    {"opt": "OneBitAdam", "stage": 3, "gas": 2, "steps": STEPS, "bucket": 12, "kwargs": ONEBIT_KW,
     "overlap": False},
    {"opt": "OneBitAdam", "stage": 3, "gas": 2, "steps": STEPS, "bucket": 12, "kwargs": ONEBIT_KW,
     "overlap": True},
]


# ZeroOneAdam into its local-step phase. Variance steps only (var_update_scaler > steps) before
# the freeze, so the sharded and unsharded runs agree to fp32 rounding throughout.
LOCAL_KW = {"lr": 1e-2, "var_freeze_step": 3, "var_update_scaler": 1000, "local_step_scaler": 2,
            "local_step_clipper": 4, "weight_decay": 0.01}
LOCAL_KINDS = ["var"] * 4 + ["sync", "sync", "local", "sync", "local", "local", "local", "sync"]
LOCAL_CASES = [
    {"stage": 1, "gas": 1, "bucket": 12, "steps": 12, "kwargs": LOCAL_KW},
    {"stage": 2, "gas": 2, "bucket": 12, "steps": 12,
     "kwargs": dict(LOCAL_KW, fused=True, wd_in_momentum=False)},
    {"stage": 1, "gas": 1, "bucket": 10**6, "steps": 12, "dtype": "bfloat16", "kwargs": LOCAL_KW},
]
# the whole schedule: var 1, 2, 4; 1-bit gradients 3, 5, 6; then sync 7, 8, local 9, sync 10, local 11
RESUME = {"stage": 2, "bucket": 12, "steps": 11, "save_at": [3, 9],
          "kwargs": {"lr": 1e-2, "var_freeze_step": 5, "var_update_scaler": 1, "local_step_scaler": 1,
                     "local_step_clipper": 2, "weight_decay": 0.01, "exact_resume": True}}




def _workspaces(buckets, world: int) -> int:
    """Bytes of the 1-bit exchange workspaces a rank keeps, one per bucket (with peers: every
    bucket is exchanged before any commits, so each keeps what it received until then)."""
    if world == 1:
        return 0
    return sum(_C.compressed_allreduce_layout(b["padded"], world, False)["total"] for b in buckets)

@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return {w: run_ranks(w, zc.rank_body, CASES, ONEBIT_KW, FREEZE + 1, LOCAL_CASES, RESUME,
                         str(tmp_path_factory.mktemp(f"zoa_w{w}")), timeout=300)
            for w in (1, 2, 3, 4)}


def _kinds(case):
    if case["opt"] == "OneBitAdam":
        return ["var" if t <= case["kwargs"]["freeze_step"] else "1bit"
                for t in range(1, case["steps"] + 1)]
    # the ZeroOneAdam cases end before var_freeze_step: no local/sync steps (scalers unused)
    kw = case["kwargs"]
    kinds = zero_one_schedule(case["steps"], kw["var_freeze_step"], kw["var_update_scaler"], 1, 1)
    return ["1bit" if k == "grad1bit" else k for k in kinds]


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
@pytest.mark.parametrize("ci", [0, 1, 2, 6, 7, 8, 9, 10])
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


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("ci", [1, 7])
def test_stage2_onebit_staging_is_exact(results, world, ci):
    """Stage 2, 1-bit steps: besides the error buffers and the exchange workspaces, a rank holds
    one exact-size staging buffer per bucket -- its local gradient, once."""
    got = results[world][0]["cases"][ci]
    buckets = got["plan"]["buckets"]
    errors = sum(b["padded"] + b["chunk"] for b in buckets) * 4
    staging = sum(b["padded"] for b in buckets) * 4
    assert got["memory"]["buffers"] == errors + staging + _workspaces(buckets, world)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_estimate_memory_onebit_adam(results, world):
    """estimate_memory(onebit='OneBitAdam') against memory_bytes() of stage 2 in the compressed
    phase (three parameters of ~4000 elements): equal up to the padding of 3 buckets."""
    from compcomm.zero import estimate_memory

    got = results[world][0]["cases"][4]
    T = sum(CASES[4]["sizes"])
    est = estimate_memory(T, 2, world, param_bytes=4, onebit="OneBitAdam", onebit_mode="sharded")
    pad = sum(b["padded"] for b in got["plan"]["buckets"]) - T
    ws = _workspaces(got["plan"]["buckets"], world)  # not in the estimate (see its docstring)
    for key, extra in (("master", 0), ("optimizer_state", 0), ("buffers", ws)):
        assert est[key] <= got["memory"][key] - extra <= est[key] + 4 * 3 * pad, (key, got["memory"], est)
    assert est["buffers"] == int(4 * (T + T / world) + 4 * T)


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("ci", [0, 2])
def test_estimate_memory_zero_one_adam_local_phase(results, world, ci):
    """estimate_memory(onebit='ZeroOneAdam') is the local phase's state: measured minus the
    padding of the (one bucket's) error buffers equals the estimate."""
    from compcomm.zero import estimate_memory

    got = results[world][0]["local"][ci]
    sizes = zc.SIZES
    T = sum(sizes)
    b = 2 if LOCAL_CASES[ci].get("dtype") == "bfloat16" else 4
    est = estimate_memory(T, LOCAL_CASES[ci]["stage"], world, param_bytes=b, onebit="ZeroOneAdam")
    if world == 1:  # no compression, no error buffers with one rank
        assert got["memory"]["optimizer_state"] == est["optimizer_state"] - int(4 * (T + T / world))
        return
    padded = compcomm.padded_numel(T, world)  # the wrapped ZeroOneAdam's one bucket
    error_pad = 4 * (padded - T) + 4 * (padded // world) - int(4 * T / world)
    assert got["memory"]["optimizer_state"] == est["optimizer_state"] + error_pad


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("overlapped,staged", [(7, 1), (8, 2), (10, 9)])
def test_overlapped_compression_equals_staged(results, world, overlapped, staged):
    """Exchanging 1-bit buckets during backward and committing them in step() computes exactly what
    compressing them all in step() does."""
    for r in range(world):
        a, b = results[world][r]["cases"][overlapped], results[world][r]["cases"][staged]
        assert a["compressed"] == b["compressed"] and any(a["compressed"])
        for x, y in zip(a["params"], b["params"]):
            np.testing.assert_array_equal(x, y)
        assert a["bytes"] == b["bytes"]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_overlapped_compression_nonfinite_skips_atomically(results, world):
    for r in range(world):
        got = results[world][r]["overlap_nonfinite"]
        assert got["exchanged_in_backward"] == 3  # all three buckets went out during backward
        assert got["skipped"] == 1 and got["unchanged"] and got["recovered"]
        assert "gradient_accumulation_steps" in got["too_many"]


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
    ws = _workspaces(got["plan"]["buckets"], world)
    assert got["memory"]["buffers"] - plain["memory"]["buffers"] == per_bucket + ws
    assert got["memory"]["optimizer_state"] <= plain["memory"]["optimizer_state"] + 8 * 4 * 2 * 4


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("ci", range(len(LOCAL_CASES)))
def test_zero_one_adam_local_phase_matches_unsharded(results, world, ci):
    """Through the freeze and the local/sync steps, ZeRO + ZeroOneAdam gives unsharded ZeroOneAdam's
    parameters on every rank; ranks agree after syncs and (W > 1) diverge at local steps."""
    case = LOCAL_CASES[ci]
    bf16 = case.get("dtype") == "bfloat16"
    per_rank = [results[world][r]["local"][ci] for r in range(world)]
    for r, got in enumerate(per_rank):
        assert got["kinds"] == LOCAL_KINDS and got["local_phase"]
        for t, (a, e) in enumerate(zip(got["zero"], got["plain"]), start=1):
            np.testing.assert_allclose(a, e, rtol=1e-2 if bf16 else 2e-5, atol=1e-2 if bf16 else 2e-6,
                                       err_msg=f"W={world} rank {r} step {t} ({LOCAL_KINDS[t - 1]})")
    for t, kind in enumerate(LOCAL_KINDS):
        spread = max(np.abs(g["zero"][t] - per_rank[0]["zero"][t]).max() for g in per_rank)
        if kind in ("var", "sync"):
            # a sync rolls each rank back by subtracting its accumulated update (as DeepSpeed
            # does), which is exact only up to rounding: ranks agree to a few ulps
            assert spread <= 1e-6, f"W={world}: ranks differ by {spread} after {kind} step {t + 1}"
        elif kind == "local" and world > 1:
            assert spread > 1e-3, f"W={world}: local step {t + 1} did not run locally"
    first, last = per_rank[0]["zero"][3], per_rank[0]["zero"][-1]
    assert np.abs(last - first).max() > 1e-3  # the local phase moved the parameters


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("ci", [0, 1])
def test_zero_one_adam_local_phase_wire_bytes(results, world, ci):
    """A local step sends only the 8-byte norm all-reduce; a sync adds unsharded ZeroOneAdam's
    compressed allreduces (one per bucket: here one bucket holds every parameter)."""
    got = results[world][0]["local"][ci]
    sync_bytes = compcomm.wire_bytes(sum(zc.SIZES), world)
    for t, kind in enumerate(LOCAL_KINDS):
        if kind == "local":
            assert got["bytes"][t] == got["norm_bytes"]
        elif kind == "sync":
            assert got["bytes"][t] == got["norm_bytes"] + sync_bytes


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("ci", [0, 2])
def test_zero_one_adam_local_phase_memory(results, world, ci):
    """In the local phase a rank holds unsharded ZeroOneAdam's state (momentum, frozen variance,
    accumulated update, error buffers, fp32 masters of bf16 parameters) and its bucket staging and
    exchange workspaces, no more (ZeRO's own bucket error buffers and staging are gone)."""
    got = results[world][0]["local"][ci]
    assert got["memory"]["optimizer_state"] == got["plain_state_bytes"] > 0
    assert got["memory"]["buffers"] == got["plain_buffer_bytes"]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zero_one_adam_local_phase_nonfinite_skips(results, world):
    for r in range(world):
        got = results[world][r]["local_nonfinite"]
        assert got["local_phase"] and got["kind"] in ("local", "sync")
        assert got["skipped"] == 1 and got["unchanged"] and got["recovered"]
        assert got["kind_after"] == got["kind"]  # the schedule did not advance


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zero_one_adam_checkpoint_resume_is_exact(results, world):
    """exact_resume=True: resuming from a 1-bit-gradient step (bucket error buffers in flight) or
    from the middle of a local interval (ranks' parameters differ) continues bit for bit; a
    variance-phase checkpoint also loads into an optimizer already in the local phase.
    consolidate() gives the last synchronised parameters."""
    for r in range(world):
        res = results[world][r]["resume"]
        full = res["full"]
        for (how, s), traj in res["resumed"].items():
            for t, a in traj.items():
                np.testing.assert_array_equal(a, full[t], err_msg=f"W={world} rank {r} {how} from {s}, step {t}")
    cons = results[world][0]["resume"]["consolidated"]
    full0 = results[world][0]["resume"]["full"]
    np.testing.assert_array_equal(cons[3], full0[3])
    # step 9 is local: the last sync is step 8 (ranks agree to rounding there, see above)
    np.testing.assert_allclose(cons[9], full0[8], rtol=0, atol=1e-6)
    assert np.abs(cons[9] - full0[9]).max() > 1e-3


def test_stage3_zero_one_adam_and_onebit_lamb_rejected():
    from compcomm.optim import OneBitAdam, OneBitLamb, ZeroOneAdam

    model = torch.nn.Linear(4, 3)
    with pytest.raises(ValueError, match="ZeroOneAdam with ZeRO stage 3"):
        ZeroOptimizer(model.parameters(), ZeroOneAdam, stage=3, module=model)
    ZeroOptimizer(model.parameters(), OneBitAdam, stage=3, module=model).close()  # supported
    with pytest.raises(ValueError, match="OneBitLamb"):
        ZeroOptimizer(model.parameters(), OneBitLamb, stage=1)
    with pytest.raises(ValueError, match="comm_backend_name"):
        ZeroOptimizer(model.parameters(), OneBitAdam, stage=1,
                      optimizer_kwargs={"comm_backend_name": "mpi"})
    cfg = {"train_micro_batch_size_per_gpu": 2,
           "optimizer": {"type": "ZeroOneAdam", "params": {"lr": 1e-3, "var_freeze_step": 10}},
           "zero_optimization": {"stage": 3}}
    with pytest.raises(ValueError, match="stage=3"):
        compcomm.from_config(torch.nn.Linear(4, 3), cfg)
    with pytest.raises(ValueError, match="stage 3"):
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
