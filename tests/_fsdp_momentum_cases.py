"""Rank bodies for tests/test_fsdp_momentum.py (module level, so run_ranks can pickle them)."""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np
import torch
import torch.distributed as dist

from _fsdp_optim_cases import Recorder

KW = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1)


def _net(dtype):
    torch.manual_seed(1)  # dims that do not divide by 2 or 3; a bias, a LayerNorm, a short weight
    return torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.LayerNorm(7), torch.nn.Tanh(),
                               torch.nn.Linear(7, 5, bias=False), torch.nn.Linear(5, 2)).to(dtype)


def _model(world, dtype, mode=None, warmup=2, limit=16384, force_sum=False, **kw):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import compcomm.fsdp as cf

    mesh = init_device_mesh("cpu", (world,))
    model = _net(dtype)
    for m in (model[0], model[3], model):
        fully_shard(m, mesh=mesh)
    if force_sum:
        model.set_force_sum_reduction_for_comms(True)
    state = None if mode is None else cf.onebit(model, warmup_steps=warmup, mode=mode,
                                                segment_elements=limit, **kw)
    return model, state


def _batch(t, rank, dtype):
    return torch.randn(4, 13, generator=torch.Generator().manual_seed(100 * t + rank)).to(dtype)


def _run(model, opt, rank, steps, dtype, before=None) -> List[List[torch.Tensor]]:
    out = []
    for t in steps:
        if before is not None:
            before(t)
        opt.zero_grad()
        model(_batch(t, rank, dtype)).float().pow(2).sum().backward()
        opt.step()
        out.append([p.detach().to_local().clone() for p in model.parameters()])
    return out


def exact_cases(rank: int, world: int, dtype_name: str, force_sum: bool,
                mode: str = "momentum") -> Dict[str, Any]:
    """The momentum mode with an exact exchange (IdentityCompressor) against FSDP's own
    reduce-scatter + FrozenVarianceAdam(freeze_step=2): the same optimizer on the same gradients,
    so warm-up bit for bit and then equal to rounding (the momentum is averaged, not lerped)."""
    import compcomm.fsdp as cf

    dtype = getattr(torch, dtype_name)
    ref_model, _ = _model(world, dtype)
    ref = _run(ref_model, cf.FrozenVarianceAdam(ref_model.parameters(), freeze_step=2, **KW),
               rank, range(6), dtype)
    model, state = _model(world, dtype, mode, force_sum=force_sum)
    state.momentum.exact = True
    opt = cf.FrozenVarianceAdam(model.parameters(), freeze_step=state, **KW)
    got = _run(model, opt, rank, range(6), dtype)
    err = max(float((a.double() - b.double()).abs().max() / b.double().abs().max())
              for a, b in zip(got[-1], ref[-1]) if b.numel())
    return {"warmup_bitwise": all(torch.equal(a, b) for t in range(2)
                                  for a, b in zip(ref[t], got[t])),
            "err": err, "steps": sorted(set(state.steps.values())),
            "moved": any(not torch.equal(a, b) for a, b in zip(got[1], got[-1]))}


def _rows_of(full: torch.Tensor, world: int) -> torch.Tensor:
    """A whole parameter (its full tensor) as FSDP's reduce-scatter rows: dim 0 padded to a
    multiple of W, rank r's piece in row r."""
    dim0 = full.shape[0]
    rest = full.numel() // dim0
    pad = -(-dim0 // world) * world
    flat = torch.zeros(pad * rest, dtype=torch.float64)
    flat[: full.numel()] = full.reshape(-1).double()
    return flat.view(world, -1)


def onebit_cases(rank: int, world: int, dtype_name: str, limit) -> Dict[str, Any]:
    """The momentum mode in 1 bit on a real FSDP2 backward (warm-up 2, 3 compressed steps): the
    replicated momentum after every step equals a numpy reference of DeepSpeed's algorithm
    (tests/reference.py's compressed allreduce, errors carried) fed with the same local gradients
    (the hook's recorded inputs) and, at the switch, the warm-up's momentum (the optimizer's
    exp_avg, gathered with DTensor.full_tensor and cut as FSDP pads); each parameter's update
    follows from its chunk of that momentum (float64 frozen-variance rule)."""
    import compcomm.fsdp as cf
    import reference as R
    from compcomm.fsdp_momentum import MomentumReduceScatter, row_elements

    dtype = getattr(torch, dtype_name)
    model, state = _model(world, dtype, "momentum", limit=limit)
    recs = {}
    for name, m in (("0", model[0]), ("3", model[3]), ("<root>", model)):
        recs[name] = Recorder(MomentumReduceScatter(state, name, m,
                                                    _segments_of(state, name, m, limit)))
        m.set_custom_reduce_scatter(recs[name])
    opt = cf.FrozenVarianceAdam(model.parameters(), freeze_step=state, **KW)
    _run(model, opt, rank, range(2), dtype)
    b1, b2 = KW["betas"]
    # the warm-up's momentum in FSDP's rows, per module: params in FSDP order
    mods = {"0": model[0], "3": model[3], "<root>": model}
    owned = {n: [fp.sharded_param for fp in m._get_fsdp_state()._fsdp_param_group.fsdp_params]
             for n, m in mods.items()}
    m_rows = {n: torch.cat([_rows_of(opt.state[p]["exp_avg"].full_tensor(), world) for p in ps],
                           dim=1) for n, ps in owned.items()}
    wes: Dict[Any, list] = {}
    ses: Dict[Any, list] = {}
    err, agree, upd_err = 0.0, True, 0.0
    for t in range(2, 5):
        before = [p.detach().to_local().double().clone() for p in model.parameters()]
        _run(model, opt, rank, [t], dtype)
        for name in mods:
            inp = recs[name].calls[-1][0]
            everyone = [torch.zeros_like(inp) for _ in range(world)]
            dist.all_gather(everyone, inp)
            s = inp.numel() // world
            segs, keys = state.segments_for(name, s)
            o, new_rows = 0, torch.zeros(world, s, dtype=torch.float64)
            for n, k in zip(segs, keys):
                r = row_elements(n, world)
                xs = []
                for q in range(world):
                    x = torch.zeros(world, r)  # the hook's fp32 operations
                    x[:, :n] = torch.mul(m_rows[name][:, o:o + n].float(), b1).add_(
                        everyone[q].float().view(world, s)[:, o:o + n], alpha=1 - b1)
                    xs.append(x.reshape(-1).numpy())
                wes.setdefault(k, [np.zeros(world * r, np.float32) for _ in range(world)])
                ses.setdefault(k, [np.zeros(r, np.float32) for _ in range(world)])
                want = R.compressed_allreduce_padded(xs, wes[k], ses[k], "fp32").reshape(world, r)
                have = state.momentum.packed.unpack_(k, torch.empty(world * r)).view(world, r)
                err = max(err, float(np.abs(have[:, :n].numpy() - want[:, :n]).max()
                                     / np.abs(want[:, :n]).max()))
                signs = state.momentum.packed.get(k)[0]
                gathered = [torch.zeros_like(signs) for _ in range(world)]
                dist.all_gather(gathered, signs)
                agree = agree and all(torch.equal(g, signs) for g in gathered)
                new_rows[:, o:o + n] = have[:, :n].double()
                o += n
            m_rows[name] = new_rows
        # the update of every parameter from its chunk of the new momentum
        after = [p.detach().to_local().double() for p in model.parameters()]
        for name, ps in owned.items():
            o = 0
            for p in ps:
                loc = p.to_local()
                piece = _rows_of(torch.zeros(p.shape), world).shape[1]
                mm = m_rows[name][rank, o:o + loc.numel()].view(loc.shape)
                v = opt.state[p]["exp_avg_sq"].to_local().double()
                i = [q is p for q in model.parameters()].index(True)
                lr, wd, eps = KW["lr"], KW["weight_decay"], KW["eps"]
                want = before[i] * (1 - lr * wd) - lr / (1 - b1 ** (t + 1)) * mm / (
                    v.sqrt() / np.sqrt(1 - b2 ** 2) + eps)
                if loc.numel():
                    upd_err = max(upd_err, float((after[i] - want).abs().max()
                                                 / want.abs().max()))
                o += piece
    return {"err": err, "agree": agree, "upd_err": upd_err,
            "packed": sorted(state.momentum.packed.keys()) == sorted(state._packed_sizes)}


def _segments_of(state, name, m, limit):
    """The hook's segments as onebit() builds them (re-installing a recorder around a new hook)."""
    from compcomm.fsdp_layout import plan_indices, shard_params

    params = shard_params(m)
    plan = plan_indices([(pc, padded) for _, pc, padded in params], limit)
    return [[params[i][:2] for i in b] for b in plan]


def dcp_cases(rank: int, world: int, path: str, dtype_name: str) -> Dict[str, Any]:
    """torch.distributed.checkpoint of model, FrozenVarianceAdam and the momentum mode's state
    (packed momentum + error buffers) after 4 steps (warm-up 2); a fresh model/optimizer/state
    loaded from it runs the same 3 steps bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import compcomm.fsdp as cf

    dtype = getattr(torch, dtype_name)
    key = f"onebit_rank{rank}"
    model, state = _model(world, dtype, "momentum")
    opt = cf.FrozenVarianceAdam(model.parameters(), freeze_step=state, **KW)
    template = state.state_dict()
    _run(model, opt, rank, range(4), dtype)
    saved = state.state_dict()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, key: saved}, checkpoint_id=path)
    cont = _run(model, opt, rank, range(4, 7), dtype)

    model2, state2 = _model(world, dtype, "momentum")
    opt2 = cf.FrozenVarianceAdam(model2.parameters(), freeze_step=state2, **KW)
    _run(model2, opt2, rank, range(1), dtype)
    msd2, osd2 = get_state_dict(model2, opt2)
    sd = {"model": msd2, "optim": osd2, key: state2.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    state2.load_state_dict(sd[key])
    resumed = _run(model2, opt2, rank, range(4, 7), dtype)
    sizes = all(template["momentum"][k]["signs"].shape == saved["momentum"][k]["signs"].shape
                for k in saved["momentum"])
    return {"format": saved["format"], "template_sized": sizes and
            set(template["momentum"]) == set(saved["momentum"]),
            "errors_saved": any(float(b.abs().sum()) > 0 for v in saved["errors"].values()
                                for b in v),
            "bitwise": all(torch.equal(a, b) for t in range(3) for a, b in zip(cont[t], resumed[t])),
            "moved": any(not torch.equal(a, b) for a, b in zip(cont[0], cont[-1]))}


def bad_cases(rank: int, world: int) -> Dict[str, Any]:
    """Typed errors naming the argument (and the rank where a step raises)."""
    import compcomm.fsdp as cf

    out: Dict[str, Any] = {}

    def catch(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"
        return "no error"

    out["mode"] = catch(lambda: _model(world, torch.float32, "both"))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    net = _net(torch.float32)
    fully_shard(net, mesh=init_device_mesh("cpu", (world,)))
    out["default_mode"] = cf.onebit(net, warmup_steps=2).mode
    out["beta1"] = catch(lambda: _model(world, torch.float32, "momentum", beta1=1.5))
    out["hsdp"] = catch(lambda: _model(world, torch.float32, "momentum",
                                       replicate_group=dist.group.WORLD))
    model, state = _model(world, torch.float32, "momentum", beta1=0.8)
    out["betas"] = catch(lambda: cf.FrozenVarianceAdam(model.parameters(), freeze_step=state,
                                                       **KW))
    # no optimizer bound at the switch: the first 1-bit backward raises on every rank
    model, state = _model(world, torch.float32, "momentum", warmup=1, beta1=0.9)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    out["no_optimizer"] = catch(lambda: _run(model, sgd, rank, range(2), torch.float32))
    # a gradient-mode state (format 2) loads into a gradient-mode state, not a momentum one
    _, g = _model(world, torch.float32, "gradient")
    old = g.state_dict()
    old["format"] = "compcomm.fsdp/2"
    old.pop("mode")
    g.load_state_dict(old)
    _, mstate = _model(world, torch.float32, "momentum")
    out["old_into_momentum"] = catch(lambda: mstate.load_state_dict(old))
    return out


class _Linear(torch.nn.Module):
    """Two weights whose gradients are the inputs (loss linear in them): every rank's local
    gradient is known, whatever the parameters."""

    def __init__(self, shape1, shape2) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.w1 = torch.nn.Parameter(torch.randn(shape1))
        self.w2 = torch.nn.Parameter(torch.randn(shape2))

    def forward(self, x1, x2):
        return (self.w1 * x1).sum() + (self.w2 * x2).sum()


def unsharded_cases(rank: int, world: int) -> Dict[str, Any]:
    """Where the layouts coincide -- one segment per parameter, every dim-0 piece a multiple of
    lcm(W, 8), so a segment's rows are the flattened parameter -- the momentum mode equals
    compcomm's unsharded OneBitAdam (per_parameter, bias_correction=True, no weight decay) fed
    the same local gradients, step by step (to rounding: the warm-ups differ in operation order)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import compcomm.fsdp as cf
    from compcomm.optim import OneBitAdam

    unit = world * 8 // np.gcd(world, 8)
    s1, s2 = (world, unit), (2 * world, unit // 2 * 3)
    model = _Linear(s1, s2)
    ref_ps = [p.detach().clone() for p in model.parameters()]
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    state = cf.onebit(model, warmup_steps=2, mode="momentum", segment_elements=0)
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6)
    opt = cf.FrozenVarianceAdam(model.parameters(), freeze_step=state, weight_decay=0.0, **kw)
    ref = OneBitAdam(ref_ps, freeze_step=2, bias_correction=True, per_parameter=True, **kw)
    errs = []
    for t in range(6):
        g = torch.Generator().manual_seed(10 * t + rank)
        xs = [torch.randn(s1, generator=g), torch.randn(s2, generator=g)]
        opt.zero_grad()
        model(*xs).backward()
        opt.step()
        for p, x in zip(ref_ps, xs):
            p.grad = x.clone()
        ref.step()
        errs.append(max(float((p.full_tensor() - q).abs().max() / q.abs().max())
                        for p, q in zip(model.parameters(), ref_ps)))
    return {"errs": errs, "keys": sorted(state.momentum.packed.keys())}


def _err(got, ref) -> float:
    return max(float((a.double() - b.double()).abs().max() / b.double().abs().max())
               for a, b in zip(got, ref) if b.numel())


def review_cases(rank: int, world: int) -> Dict[str, Any]:
    """Issue 16: two optimizers splitting the parameters, one missing a parameter, gradient
    accumulation with FSDP's default sync, a group's own freeze_step."""
    import compcomm.fsdp as cf

    out: Dict[str, Any] = {}
    dtype = torch.float32

    def two(model, fs):
        ps = list(model.parameters())
        return [cf.FrozenVarianceAdam(ps[:3], freeze_step=fs, **KW),
                cf.FrozenVarianceAdam(ps[3:], freeze_step=fs, **KW)]

    def run(model, opts, steps):
        got = []
        for t in steps:
            for o in opts:
                o.zero_grad()
            model(_batch(t, rank, dtype)).float().pow(2).sum().backward()
            for o in opts:
                o.step()
            got.append([p.detach().to_local().clone() for p in model.parameters()])
        return got

    ref_model, _ = _model(world, dtype)
    ref = run(ref_model, two(ref_model, 2), range(4))
    model, state = _model(world, dtype, "momentum")
    state.momentum.exact = True
    got = run(model, two(model, state), range(4))
    out["two_err"] = _err(got[-1], ref[-1])
    # a parameter in no bound optimizer: an error at the switch, never zeros
    model, state = _model(world, dtype, "momentum")
    opt = cf.FrozenVarianceAdam(list(model.parameters())[:3], freeze_step=state, **KW)
    try:
        run(model, [opt], range(3))
        out["missing"] = "no error"
    except ValueError as e:
        out["missing"] = f"ValueError: {e}"
    # two backwards before a step in the 1-bit phase: refused before the momentum changes
    model, state = _model(world, dtype, "momentum")
    opt = cf.FrozenVarianceAdam(model.parameters(), freeze_step=state, **KW)
    run(model, [opt], range(3))
    opt.zero_grad()
    model(_batch(5, rank, dtype)).float().pow(2).sum().backward()
    before = (state.momentum.packed.state_dict(), state.momentum.errors())
    try:
        model(_batch(6, rank, dtype)).float().pow(2).sum().backward()
        out["accum"] = "no error"
    except RuntimeError as e:
        out["accum"] = f"{type(e).__name__}: {e}"
    after = (state.momentum.packed.state_dict(), state.momentum.errors())
    out["accum_unchanged"] = bool(before[0]) and all(
        before[0][k].keys() == after[0][k].keys()
        and all(torch.equal(before[0][k][n], after[0][k][n]) for n in before[0][k])
        for k in before[0]) and before[1].keys() == after[1].keys() and all(
        torch.equal(a, b) for k in before[1] for a, b in zip(before[1][k], after[1][k]))
    # a group's own freeze_step must be the switch step
    ps = list(model.parameters())
    try:
        cf.FrozenVarianceAdam([{"params": ps[:3], "freeze_step": 4}, {"params": ps[3:]}],
                              freeze_step=state, **KW)
        out["group"] = "no error"
    except ValueError as e:
        out["group"] = f"ValueError: {e}"
    sd = opt.state_dict()
    sd["param_groups"][0]["freeze_step"] = 3
    try:
        opt.load_state_dict(sd)
        out["group_load"] = "no error"
    except ValueError as e:
        out["group_load"] = f"ValueError: {e}"
    return out


def default_mode_cases(rank: int, world: int) -> Dict[str, Any]:
    """Issue 16: the default (momentum) mode without FrozenVarianceAdam fails at the first
    warm-up reduction; onebit(optimizer=AdamW) fails at once; a 2-D (HSDP) mesh takes the
    gradient mode by default and refuses mode='momentum'."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import compcomm.fsdp as cf

    out: Dict[str, Any] = {}

    def catch(key, fn):
        try:
            fn()
            out[key] = "no error"
        except Exception as e:  # noqa: BLE001 - the test reads the type and message
            out[key] = f"{type(e).__name__}: {e}"

    model, _ = _model(world, torch.float32)
    state = cf.onebit(model, warmup_steps=2)
    opt = torch.optim.AdamW(model.parameters(), **KW)
    catch("adamw", lambda: _run(model, opt, rank, range(1), torch.float32))
    out["steps"] = dict(state.steps)
    model, _ = _model(world, torch.float32)
    catch("optimizer", lambda: cf.onebit(model, warmup_steps=2, regather_cache=True,
                                         optimizer=torch.optim.AdamW(model.parameters())))
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("rep", "shard"))
    net = _net(torch.float32)
    for m in (net[0], net[3], net):
        fully_shard(m, mesh=mesh)
    out["hsdp_mode"] = cf.onebit(net, warmup_steps=2).mode
    catch("hsdp_momentum", lambda: cf.onebit(net, warmup_steps=2, mode="momentum"))
    return out


class RecordingReduceScatter:
    """Wraps a local-momentum reduce-scatter and records, per module, the shard it leaves for the
    all-reduce hook: ``seen[name] = [a copy taken right after the call, the live tensor]`` (the
    hook may change the live one in place)."""

    def __init__(self, seen: Dict[str, list], rs: Any) -> None:
        self.seen, self.rs = seen, rs

    def allocate(self, size, *, dtype, device):  # type: ignore
        return self.rs.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # type: ignore
        w = self.rs(output_tensor, input_tensor, group, op, async_op)
        if self.rs.pending is not None:
            self.seen[self.rs.name] = [self.rs.pending[0].clone(), self.rs.pending[0]]
        return w


def replica_reference_error(state: Any, seen: Dict[str, list], rep: Any, wes: Dict[str, list],
                            ses: Dict[str, list]) -> float:
    """The largest relative difference, over the modules in ``seen`` (name -> [shard before, after
    the replicas' reduction]), between the hook's result and tests/reference.py's compressed
    allreduce across the two replicas of the shards before, per segment of ``"<name>/replicas"``
    (error buffers ``wes``/``ses`` carried across calls)."""
    import reference as R

    err = 0.0
    for name, (before, after) in sorted(seen.items()):
        everyone = [torch.zeros_like(before) for _ in range(2)]
        dist.all_gather(everyone, before, group=rep)
        segs, keys = state.segments_for(name + "/replicas", before.numel())
        o = 0
        for n, k in zip(segs, keys):
            pn = R.padded_numel(n, 2)
            wes.setdefault(k, [np.zeros(pn, np.float32) for _ in range(2)])
            ses.setdefault(k, [np.zeros(pn // 2, np.float32) for _ in range(2)])
            want = R.compressed_allreduce([e[o:o + n].numpy() for e in everyone], wes[k], ses[k],
                                          "fp32")
            if n:
                err = max(err, float(np.abs(after[o:o + n].numpy() - want).max()
                                     / max(np.abs(want).max(), 1e-30)))
            o += n
    return err


def error_of(fn) -> str:  # type: ignore[no-untyped-def]
    """``"Type: message"`` of what ``fn()`` raises, or ``"no error"`` (the tests read both)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads the type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def rank0_load_cases(rank: int, world: int, mode: str) -> Dict[str, Any]:
    """One rank's state lacks 'errors': every rank raises ValueError, nothing changed. Then every
    rank loads rank 0's state (one checkpoint file): rank 0 alone matches it, yet every rank
    resets its buffers (and momentum), so the next step takes the same collectives on all."""
    import compcomm.fsdp as cf

    f32 = torch.float32
    model, state = _model(world, f32, mode, warmup=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2) if mode == "gradient" else \
        cf.FrozenVarianceAdam(model.parameters(), freeze_step=state, **KW)
    _run(model, opt, rank, range(3), f32)
    sd = [state.state_dict()]
    dist.broadcast_object_list(sd, src=0)
    bad = {k: v for k, v in sd[0].items() if k != "errors" or rank == 0}
    steps = dict(state.steps)
    out = {"bad": error_of(lambda: state.load_state_dict(bad))}
    out["bad_unchanged"] = state.steps == steps and bool(
        state._errors if mode == "gradient" else
        state.momentum.full or state.momentum.packed.state_dict())
    state.load_state_dict(sd[0])
    out["reset"] = not (state._errors if mode == "gradient" else
                        state.momentum.full or state.momentum.packed.state_dict())
    out["step"] = error_of(lambda: _run(model, opt, rank, [5], f32))
    out["finite"] = all(bool(torch.isfinite(p.to_local()).all()) for p in model.parameters())
    return out


class _Branch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a, self.b = torch.nn.Linear(13, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.b(h) if use_b else h


def skipped_warmup_cases(rank: int, world: int, mode: str) -> List[Any]:
    """``b`` has no gradient in the first warm-up step, so its step count lags its module's
    reduction count by one. At the switch it is frozen with the module: it takes the momentum
    handed over (``exp_avg`` becomes it; its gradient carries the same values), and nothing is
    left untaken. (It was stepped as warm: AdamW on that momentum as a gradient, and the next
    backward raised "a second gradient reduction".) Per step: (b's exp_avg equals its gradient,
    any momentum left untaken)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import compcomm.fsdp as cf

    model = _Branch()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    st = cf.onebit(model, warmup_steps=2, mode=mode)
    opt = cf.FrozenVarianceAdam(model.parameters(), freeze_step=st)
    out = []
    for t, use_b in enumerate([False, True, True, True, True]):
        opt.zero_grad()
        model(_batch(t, rank, torch.float32), use_b).pow(2).sum().backward()
        opt.step()
        b = [model.b.weight, model.b.bias]
        took = use_b and all(torch.equal(opt.state[p]["exp_avg"].to_local(), p.grad.to_local())
                             for p in b)
        out.append((took, any(st.momentum.holds(p) for p in model.parameters())))
    return out
