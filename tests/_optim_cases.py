"""Rank bodies for tests/test_optim.py (module level, so run_ranks can pickle them)."""

from __future__ import annotations

import io
from typing import Any, Dict, List

import numpy as np
import torch

SHAPES = [(7, 5), (13,), (3, 4, 2)]
Z1 = dict(var_freeze_step=4, var_update_scaler=1, local_step_scaler=1, local_step_clipper=2)


def make_params(seed: int = 0, shapes=SHAPES) -> List[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def make_grads(steps: int, world: int, seed: int = 1, shapes=SHAPES) -> List[List[List[np.ndarray]]]:
    """grads[t][r][i]: rank-dependent, so local and averaged gradients differ."""
    rng = np.random.default_rng(seed)
    return [[[(rng.standard_normal(s) * 0.1 + 0.02 * (r + 1)).astype(np.float32) for s in shapes]
             for r in range(world)] for _ in range(steps)]


def masks_for(shapes=SHAPES) -> List[Any]:
    m = np.ones(shapes[0], np.float32)
    m[2:4] = 0
    return [m, None, None]


def run_opt(opt_cls, kw, params0, grads, rank, masks=None, dtype=torch.float32):
    """Run ``opt_cls`` with the given per-step gradients of ``rank``; parameters after each step."""
    ps = [torch.nn.Parameter(torch.tensor(p, dtype=dtype)) for p in params0]
    if masks is not None:
        groups = [{"params": [p], **({"exp_avg_mask": torch.tensor(m)} if m is not None else {})}
                  for p, m in zip(ps, masks)]
    else:
        groups = ps
    opt = opt_cls(groups, **kw)
    traj, kinds = [], []
    for gstep in grads:
        if hasattr(opt, "step_kind"):
            kinds.append(opt.step_kind())
        for p, g in zip(ps, gstep[rank]):
            p.grad = torch.tensor(g).to(dtype)
        opt.step()
        traj.append([p.detach().float().numpy().copy() for p in ps])
    return traj, kinds, opt, ps


def _max_diff(xs, ys) -> float:
    """Max |a - b| over two trajectories (``traj[t][i]`` arrays)."""
    return max(float(np.max(np.abs(a - b))) for sx, sy in zip(xs, ys) for a, b in zip(sx, sy))


def _optimizers():
    from compcomm.optim import OneBitAdam, OneBitLamb, ZeroOneAdam

    return OneBitAdam, ZeroOneAdam, OneBitLamb


def trajectories(rank: int, world: int) -> Dict[str, Any]:
    """Trajectories of the three optimizers with default numerics, for the numpy references."""
    OneBitAdam, ZeroOneAdam, OneBitLamb = _optimizers()
    p0 = make_params()
    out: Dict[str, Any] = {}
    g = make_grads(10, world)
    traj, _, opt, ps = run_opt(OneBitAdam, dict(lr=0.01, freeze_step=4, weight_decay=0.01), p0, g,
                               rank, masks=masks_for())
    out["adam"] = traj
    out["adam_m0"] = opt.state[ps[0]]["exp_avg"].numpy().copy()
    out["adam_dtype"] = str(opt.state[ps[0]]["exp_avg"].dtype)
    traj, _, _, _ = run_opt(OneBitAdam, dict(lr=0.01, freeze_step=4, fused=True), p0, g, rank)
    out["adam_fused"] = traj
    traj, _, _, _ = run_opt(OneBitAdam, dict(lr=0.01, freeze_step=4), p0, g, rank)
    out["adam_default"] = traj  # default buckets: all three tensors in one
    traj, _, _, _ = run_opt(OneBitAdam, dict(lr=0.01, freeze_step=4, reduce_bucket_size=40), p0, g,
                            rank)
    out["adam_buckets40"] = traj  # 35 | 13 + 24 elements
    traj, _, _, _ = run_opt(OneBitAdam, dict(lr=0.01, freeze_step=4, per_parameter=True), p0, g,
                            rank)
    out["adam_per_param"] = traj
    g = make_grads(14, world, seed=2)
    traj, _, _, _ = run_opt(ZeroOneAdam, dict(lr=0.01, fused=True, **Z1), p0, g, rank)
    out["zoadam_fused"] = traj
    traj, _, _, _ = run_opt(ZeroOneAdam, dict(lr=0.01, reduce_bucket_size=40, **Z1), p0, g, rank)
    out["zoadam_buckets40"] = traj
    # DeepSpeed's fp32 numerics: per-parameter compression
    traj, kinds, opt, _ = run_opt(ZeroOneAdam, dict(lr=0.01, weight_decay=0.01, per_parameter=True,
                                                    **Z1), p0, g, rank)
    out["zoadam"], out["zoadam_kinds"] = traj, kinds
    traj, _, _, _ = run_opt(ZeroOneAdam, dict(lr=0.01, weight_decay=0.01, wd_in_momentum=False,
                                              per_parameter=True, **Z1), p0, g, rank)
    out["zoadam_wd_fixed"] = traj
    g = make_grads(10, world, seed=3)
    traj, _, opt, _ = run_opt(OneBitLamb, dict(lr=0.01, freeze_step=4, weight_decay=0.01), p0, g,
                              rank)
    out["lamb"] = traj
    out["lamb_coeffs"] = opt.get_lamb_coeffs()
    return out


def adamw_equivalence(rank: int, world: int) -> float:
    """Max |OneBitAdam(bias_correction=True) - AdamW| over warm-up steps on averaged gradients."""
    OneBitAdam = _optimizers()[0]
    p0 = make_params()
    g = make_grads(8, world)
    kw = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    traj, _, _, _ = run_opt(OneBitAdam, dict(freeze_step=100, bias_correction=True, **kw), p0, g,
                            rank)
    ps = [torch.nn.Parameter(torch.tensor(p)) for p in p0]
    ref = torch.optim.AdamW(ps, **kw)
    worst = 0.0
    for t, gstep in enumerate(g):
        for i, p in enumerate(ps):
            avg = np.mean(np.stack([gstep[r][i] for r in range(world)]).astype(np.float64), axis=0)
            p.grad = torch.tensor(avg.astype(np.float32))
        ref.step()
        for i, p in enumerate(ps):
            worst = max(worst, float(np.max(np.abs(p.detach().numpy() - traj[t][i]))))
    return worst


def _state_bytes(sd: Dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(sd, buf)
    return buf.getvalue()


def _load_bytes(b: bytes) -> Dict[str, Any]:
    return torch.load(io.BytesIO(b), weights_only=False)


def checkpoints(rank: int, world: int) -> Dict[str, Any]:
    """Exact resume reproduces the uninterrupted run bit for bit; default resume resets errors."""
    OneBitAdam, ZeroOneAdam, OneBitLamb = _optimizers()
    p0 = make_params()
    g = make_grads(12, world, seed=5)
    res: Dict[str, Any] = {}
    cases = {
        "adam": (OneBitAdam, dict(lr=0.01, freeze_step=3)),
        "zoadam": (ZeroOneAdam, dict(lr=0.01, **Z1)),
        "lamb": (OneBitLamb, dict(lr=0.01, freeze_step=3, weight_decay=0.01)),
    }
    for name, (cls, kw) in cases.items():
        full, _, _, _ = run_opt(cls, dict(kw, exact_resume=True), p0, g, rank)
        half, _, opt, ps = run_opt(cls, dict(kw, exact_resume=True), p0, g[:7], rank)
        blob = _state_bytes(opt.state_dict())
        params_mid = [p.detach().numpy().copy() for p in ps]
        # resume: fresh optimizer + fresh params loaded from the checkpoint
        ps2 = [torch.nn.Parameter(torch.tensor(p)) for p in params_mid]
        opt2 = cls(ps2, **dict(kw, exact_resume=True))
        opt2.load_state_dict(_load_bytes(blob))
        traj = []
        for gstep in g[7:]:
            for p, gg in zip(ps2, gstep[rank]):
                p.grad = torch.tensor(gg)
            opt2.step()
            traj.append([p.detach().numpy().copy() for p in ps2])
        res[f"{name}_exact_maxdiff"] = _max_diff(full[7:], traj)
        # default mode: errors dropped from the state dict and reset on load
        half_d, _, optd, psd = run_opt(cls, kw, p0, g[:7], rank)
        sd = optd.state_dict()
        res[f"{name}_default_saved_errors"] = any(
            "worker_error" in s for s in sd["state"].values()) or "bucket_errors" in sd["compcomm"]
        psd2 = [torch.nn.Parameter(p.detach().clone()) for p in psd]
        optd2 = cls(psd2, **kw)
        optd2.load_state_dict(_load_bytes(_state_bytes(sd)))
        res[f"{name}_default_sched_restored"] = optd2.sched == optd.sched
        for p, gg in zip(psd2, g[7][rank]):
            p.grad = torch.tensor(gg)
        optd2.step()
        res[f"{name}_default_finite"] = all(bool(torch.isfinite(p).all()) for p in psd2)
        if rank == 0:
            res[f"{name}_exact_sd_rank0"] = blob
    # masks: the new optimizer's mask wins over the checkpoint's
    ps = [torch.nn.Parameter(torch.tensor(p)) for p in p0]
    m1 = torch.ones(SHAPES[0])
    m1[0] = 0
    opt = OneBitAdam([{"params": [ps[0]], "exp_avg_mask": m1}, {"params": ps[1:]}], freeze_step=2)
    for gstep in g[:4]:
        for p, gg in zip(ps, gstep[rank]):
            p.grad = torch.tensor(gg)
        opt.step()
    sd = _load_bytes(_state_bytes(opt.state_dict()))
    m2 = torch.ones(SHAPES[0])
    m2[1] = 0
    opt_new = OneBitAdam([{"params": [ps[0]], "exp_avg_mask": m2}, {"params": ps[1:]}],
                         freeze_step=2)
    opt_new.load_state_dict(sd)
    res["mask_new_wins"] = opt_new.param_groups[0]["exp_avg_mask"] is m2
    opt_none = OneBitAdam([{"params": [ps[0]]}, {"params": ps[1:]}], freeze_step=2)
    opt_none.load_state_dict(sd)
    res["mask_dropped"] = "exp_avg_mask" not in opt_none.param_groups[0]
    res["freeze_key_after_load"] = opt_new.adam_freeze_key
    return res


def amp_and_dtypes(rank: int, world: int) -> Dict[str, Any]:
    """GradScaler overflow skips on every rank without touching error buffers; bf16/fp16 params
    keep fp32 state and master copies."""
    OneBitAdam, ZeroOneAdam, OneBitLamb = _optimizers()
    res: Dict[str, Any] = {}
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = OneBitAdam(model.parameters(), lr=0.01, freeze_step=1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    x = torch.randn(4, 6) + rank
    for it in range(4):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        scaler.scale(loss).backward()
        if it == 2 and rank == 0:
            model.weight.grad[0, 0] = float("inf")
        before_p = [p.detach().clone() for p in model.parameters()]
        before_e = [e["worker_error"] for e in opt.compressor.state_dict().values()]
        step_before = opt.sched["step"]
        scaler.step(opt)
        scaler.update()
        if it == 2:
            res["skipped_params_same"] = all(torch.equal(a, b) for a, b in
                                             zip(before_p, model.parameters()))
            after_e = [e["worker_error"] for e in opt.compressor.state_dict().values()]
            res["skipped_errors_same"] = len(before_e) == 1 and all(
                torch.equal(a, b) for a, b in zip(before_e, after_e))
            res["skipped_step_same"] = opt.sched["step"] == step_before
        elif it == 3:
            res["next_step_ran"] = opt.sched["step"] == step_before + 1
    # unscaling by the optimizer matches a plain (unscaled) run
    p0, g = make_params(), make_grads(8, world, seed=7)
    # per-parameter buckets: with one bucket over all three tensors, one near-zero element whose
    # 1-bit sign flips under bf16 rounding of the gradient moves by ~0.19 (a property of this data,
    # not of the layout's precision)
    for cls, kw in [(OneBitAdam, dict(freeze_step=2, per_parameter=True)),
                    (ZeroOneAdam, dict(Z1, per_parameter=True)), (OneBitLamb, dict(freeze_step=2))]:
        kw = dict(kw, lr=0.01)
        ref = run_opt(cls, kw, p0, g, rank)[0]  # fp32
        for dtype in (torch.bfloat16, torch.float16):
            traj, _, opt, ps = run_opt(cls, kw, p0, g, rank, dtype=dtype)
            st = opt.state[ps[0]]
            res[f"{cls.__name__}_{dtype}_state_fp32"] = (
                st["exp_avg"].dtype == torch.float32 and st["exp_avg_sq"].dtype == torch.float32
                and st["master_param"].dtype == torch.float32
                and torch.equal(st["master_param"].to(ps[0].dtype), ps[0].detach()))
            res[f"{cls.__name__}_{dtype}_close_to_fp32"] = _max_diff(ref, traj)
    return res


def ddp_hook(rank: int, world: int) -> Dict[str, Any]:
    """DDP + compcomm.ddp_comm_hook follows the same trajectory as the optimizer averaging itself,
    and leaves local gradients in the compressed phase."""
    import compcomm
    from torch.nn.parallel import DistributedDataParallel as DDP

    OneBitAdam, ZeroOneAdam, _ = _optimizers()
    res: Dict[str, Any] = {}
    for cls, kw in [(OneBitAdam, dict(lr=0.01, freeze_step=2)), (ZeroOneAdam, dict(lr=0.01, **Z1))]:
        torch.manual_seed(0)
        base = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        plain = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        plain.load_state_dict(base.state_dict())
        ddp = DDP(base)
        opt_d = cls(ddp.parameters(), **kw)
        ddp.register_comm_hook(None, compcomm.ddp_comm_hook(opt_d))
        opt_p = cls(plain.parameters(), **kw)
        gen = torch.Generator().manual_seed(100 + rank)
        worst, local_ok = 0.0, True
        for it in range(8):
            x = torch.randn(8, 5, generator=gen)
            averaged = opt_d.next_step_averages()
            for model, opt in ((ddp, opt_d), (plain, opt_p)):
                opt.zero_grad()
                model(x).pow(2).mean().backward()
            if not averaged:  # compressed/local phase: DDP left local gradients
                local_ok &= all(torch.allclose(a.grad, b.grad, atol=1e-7)
                                for a, b in zip(ddp.parameters(), plain.parameters()))
            opt_d.step()
            opt_p.step()
            worst = max(worst, max(float((a - b).abs().max())
                                   for a, b in zip(ddp.parameters(), plain.parameters())))
        res[f"{cls.__name__}_maxdiff"] = worst
        res[f"{cls.__name__}_local_grads"] = local_ok
    return res


def all_cases(rank: int, world: int, with_extras: bool) -> Dict[str, Any]:
    out = {"traj": trajectories(rank, world), "adamw": adamw_equivalence(rank, world)}
    if with_extras:
        out["ckpt"] = checkpoints(rank, world)
        out["amp"] = amp_and_dtypes(rank, world)
        out["ddp"] = ddp_hook(rank, world)
    return out


def legacy_checkpoint(rank: int, world: int) -> Dict[str, Any]:
    """A checkpoint in the layout before buckets (per-parameter errors in each parameter's state,
    as compcomm wrote them) loads: restored bit for bit into per_parameter=True, reset with a
    warning into the default bucketed layout."""
    import warnings

    OneBitAdam = _optimizers()[0]
    p0, g = make_params(), make_grads(6, world, seed=11)
    kw = dict(lr=0.01, freeze_step=2, exact_resume=True, per_parameter=True)
    _, _, opt, ps = run_opt(OneBitAdam, kw, p0, g, rank)
    sd = opt.state_dict()
    errors = sd["compcomm"].pop("bucket_errors")
    plan = sd["compcomm"].pop("bucket_plan")
    for k, ((gi, pi),) in zip(sorted(errors), plan):  # one parameter per bucket
        sd["state"][pi].update(errors[k])
    legacy = _load_bytes(_state_bytes(sd))
    res: Dict[str, Any] = {}
    same = OneBitAdam([torch.nn.Parameter(torch.tensor(p)) for p in p0], **kw)
    same.load_state_dict(legacy)
    for gg, p in zip(g[0][rank], same.param_groups[0]["params"]):
        p.grad = torch.tensor(gg)
    same.step()  # the plan is built here, and the loaded errors taken over
    res["restored"] = {k: v["worker_error"].numel() for k, v in same.compressor.state_dict().items()}
    res["want"] = {k: v["worker_error"].numel() for k, v in errors.items()}
    other = OneBitAdam([torch.nn.Parameter(torch.tensor(p)) for p in p0],
                       **dict(kw, per_parameter=False))
    other.load_state_dict(legacy)
    for gg, p in zip(g[0][rank], other.param_groups[0]["params"]):
        p.grad = torch.tensor(gg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other.step()
    res["reset_warned"] = any("buckets differ" in str(w.message) for w in caught)
    # bit-exact continuation: the restored errors equal the saved ones before the step
    fresh = OneBitAdam([torch.nn.Parameter(torch.tensor(p)) for p in p0], **kw)
    fresh.load_state_dict(legacy)
    fresh._bucket_plan(list(fresh._params()) or [(fresh.param_groups[0], p)
                                                  for p in fresh.param_groups[0]["params"]])
    res["equal"] = all(torch.equal(fresh.compressor.state_dict()[k]["worker_error"],
                                   errors[k]["worker_error"]) for k in errors)
    return res


def _snapshot(opt, ps) -> List[torch.Tensor]:
    """Every tensor a step may write: parameters, optimizer state, error buffers."""
    out = [p.detach().clone() for p in ps]
    for st in opt.state.values():
        out += [v.clone() for _, v in sorted(st.items()) if isinstance(v, torch.Tensor)]
    for e in opt.compressor.state_dict().values():
        out += [e["worker_error"], e["server_error"]]
    return out


def nonfinite_skips(rank: int, world: int) -> Dict[str, Any]:
    """A NaN on one rank (rank 1; rank 0 alone) in each phase of each optimizer: every rank skips the step with
    parameters, state, error buffers and schedule unchanged, and the run then equals one that
    never saw the failed step."""
    import copy

    OneBitAdam, ZeroOneAdam, OneBitLamb = _optimizers()
    z1 = dict(var_freeze_step=6, var_update_scaler=1, local_step_scaler=1, local_step_clipper=2)
    cases = {  # name -> (class, kwargs, steps at which to inject, by phase)
        "adam": (OneBitAdam, dict(freeze_step=3, reduce_bucket_size=40), {"warmup": 2, "1bit": 5}),
        "zoadam": (ZeroOneAdam, dict(z1, reduce_bucket_size=40),
                   {"var": 1, "grad1bit": 2, "sync": 9, "local": 10}),
        "lamb": (OneBitLamb, dict(freeze_step=3), {"warmup": 2, "1bit": 5}),
    }
    res: Dict[str, Any] = {}
    p0 = make_params()
    for name, (cls, kw, phases) in cases.items():
        g = make_grads(12, world, seed=13)
        for phase, bad in phases.items():
            ps = [torch.nn.Parameter(torch.tensor(p)) for p in p0]
            opt = cls(ps, lr=0.01, **kw)
            kinds = []
            for t, gstep in enumerate(g):
                for p, gg in zip(ps, gstep[rank]):
                    p.grad = torch.tensor(gg)
                if t == bad:
                    kinds.append(opt.step_kind() if hasattr(opt, "step_kind") else phase)
                    if rank == min(1, world - 1):
                        ps[2].grad.view(-1)[5] = float("nan")
                    before, sched = _snapshot(opt, ps), copy.deepcopy(opt.sched)
                    opt.step()
                    after = _snapshot(opt, ps)
                    res[f"{name}_{phase}_unchanged"] = (
                        opt.skipped_steps == 1 and opt.sched == sched and len(before) == len(after)
                        and all(torch.equal(a, b) for a, b in zip(before, after)))
                    continue
                opt.step()
            clean = run_opt(cls, dict(kw, lr=0.01), p0, g[:bad] + g[bad + 1:], rank)[0]
            res[f"{name}_{phase}_then_clean"] = float(np.max(np.abs(
                clean[-1][2] - ps[2].detach().numpy())))
            res[f"{name}_{phase}_kind"] = kinds[0]
    return res


def skip_while_the_plan_changes(rank: int, world: int) -> Dict[str, Any]:
    """A step skipped (NaN on rank 1) in which a parameter has no gradient, so that its bucket
    plan differs: the plan and the error buffers stay as they were (they were reset before the
    exchange failed), and the run then equals one that never saw that step."""
    import warnings

    OneBitAdam, ZeroOneAdam, _ = _optimizers()
    res: Dict[str, Any] = {}
    cases = [("adam", OneBitAdam, dict(freeze_step=2, reduce_bucket_size=40)),
             ("zoadam", ZeroOneAdam, dict(var_freeze_step=3, var_update_scaler=1,
                                          reduce_bucket_size=40))]
    bad = 5
    p0 = make_params()
    for name, cls, kw in cases:
        g = make_grads(9, world, seed=5)
        ps = [torch.nn.Parameter(torch.tensor(p)) for p in p0]
        opt = cls(ps, lr=0.01, **kw)
        for t, gstep in enumerate(g):
            for p, gg in zip(ps, gstep[rank]):
                p.grad = torch.tensor(gg)
            if t != bad:
                opt.step()
                continue
            ps[0].grad = None
            if rank == min(1, world - 1):
                ps[2].grad.view(-1)[5] = float("nan")
            before = _snapshot(opt, ps)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the plan change's and the skip's warnings
                opt.step()
            after = _snapshot(opt, ps)
            res[f"{name}_unchanged"] = (opt.skipped_steps == 1 and len(before) == len(after)
                                        and all(torch.equal(a, b) for a, b in zip(before, after)))
        clean = run_opt(cls, dict(kw, lr=0.01), p0, g[:bad] + g[bad + 1:], rank)[0]
        res[f"{name}_then_clean"] = float(np.max(np.abs(clean[-1][2] - ps[2].detach().numpy())))
    return res


def resume_across_freeze(rank: int, world: int) -> List[float]:
    """ZeroOneAdam saved on the step before its freeze (errors of 1-bit gradients in the
    checkpoint) and resumed with exact_resume: the freeze zeroes the errors also when they are
    still waiting to be restored, so the resumed run equals the uninterrupted one."""
    ZeroOneAdam = _optimizers()[1]

    def make():
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(50))
        return p, ZeroOneAdam([p], lr=1e-2, var_freeze_step=7, var_update_scaler=1,
                              exact_resume=True)

    def grad(p, t):
        p.grad = torch.randn(50, generator=torch.Generator().manual_seed(100 * t + rank))

    p, opt = make()
    traj, blob, saved_p = {}, b"", None
    for t in range(1, 11):
        grad(p, t)
        opt.step()
        traj[t] = p.detach().clone()
        if t == 7:
            blob, saved_p = _state_bytes(opt.state_dict()), p.detach().clone()
    p2, opt2 = make()
    with torch.no_grad():
        p2.copy_(saved_p)
    opt2.load_state_dict(_load_bytes(blob))
    diffs = []
    for t in range(8, 11):
        grad(p2, t)
        opt2.step()
        diffs.append(float((p2.detach() - traj[t]).abs().max()))
    return diffs


def staging_failure(rank: int, world: int) -> Dict[str, Any]:
    """Rank 0 fails on its own while staging bucket 1 of 3: it raises that error after waiting for
    bucket 0's exchange, the peers get a typed error (timeout), nothing is committed anywhere, and
    rank 0's compressor refuses later calls instead of pairing the wrong collectives."""
    from compcomm import _comm
    from compcomm.compress import OneBitCompressor

    comp = OneBitCompressor(_comm.resolve(None), timeout=3.0)
    bufs = [torch.full((40,), float(rank + 1 + b)) for b in range(3)]
    before = [b.clone() for b in bufs]

    def stage(i):
        if rank == 0 and i == 1:
            raise MemoryError("injected")
        return bufs[i]

    res: Dict[str, Any] = {}
    try:
        comp.average_([0, 1, 2], [40, 40, 40], stage, torch.device("cpu"))
        res["raised"] = None
    except Exception as e:  # noqa: BLE001
        res["raised"] = type(e).__name__
    res["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, bufs))
    res["no_errors_kept"] = comp.keys() == []
    try:
        comp.average_([0], [40], lambda i: bufs[0], torch.device("cpu"))
        res["again"] = None
    except Exception as e:  # noqa: BLE001
        res["again"] = type(e).__name__
    return res


def lamb_resave(rank: int, world: int) -> bool:
    """OneBitLamb (exact_resume) past its freeze, saved, loaded into a new optimizer and saved
    again before a step: the second checkpoint's 'fused_pad' equals the first's."""
    from compcomm import padded_numel
    from compcomm.optim import OneBitLamb

    def make():
        ps = [torch.nn.Parameter(torch.full((5,), 1.0)), torch.nn.Parameter(torch.full((8,), 2.0))]
        return ps, OneBitLamb(ps, lr=0.01, freeze_step=2, exact_resume=True)

    ps, opt = make()
    for i in range(4):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * i + rank))
        opt.step()
    saved = opt.state_dict()
    pad = saved["compcomm"]["fused_pad"]
    assert pad.numel() == padded_numel(13, world) - 13, pad.numel()
    pad.fill_(0.25)  # as a padding may hold after compression
    _, again = make()
    again.load_state_dict(saved)
    resaved = again.state_dict()["compcomm"]
    return "fused_pad" in resaved and torch.equal(resaved["fused_pad"], pad)


def resized_error_buffers(rank: int, world: int) -> List[str]:
    """An exact checkpoint whose first bucket's error buffers have a valid shape but not the
    bucket's size: the load warns that they were reset (they used to be replaced by zeros at their
    first use, silently)."""
    import warnings

    OneBitAdam, _, _ = _optimizers()
    kw = dict(lr=0.01, freeze_step=3, exact_resume=True)
    g = make_grads(8, world, seed=5)
    _, _, opt, ps = run_opt(OneBitAdam, kw, make_params(), g[:6], rank)
    sd = opt.state_dict()
    first = next(iter(sd["compcomm"]["bucket_errors"]))
    sd["compcomm"]["bucket_errors"][first] = {"worker_error": torch.zeros(8 * world),
                                             "server_error": torch.zeros(8)}
    opt2 = OneBitAdam([torch.nn.Parameter(p.detach().clone()) for p in ps], **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt2.load_state_dict(_load_bytes(_state_bytes(sd)))
        for p, gg in zip(opt2.param_groups[0]["params"], g[6][rank]):
            p.grad = torch.tensor(gg)
        opt2.step()
    return [str(w.message) for w in caught]
