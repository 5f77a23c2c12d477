"""Rank bodies for tests/test_fsdp_hsdp.py: the local-momentum mode on FSDP2's own 2-D (HSDP) mesh,
W=4 as 2 replicas x 2 shards (the model, batches and runner are tests/_fsdp_momentum_cases.py's:
dims 13, 7, 5, 2 do not divide by the shard dim's 2)."""

from __future__ import annotations

from typing import Any, Dict

import torch
import torch.distributed as dist

import _fsdp_momentum_cases as M

KW = M.KW
LOCAL = "local_momentum"


def _model(dtype, mode=None, shape=(2, 2), scaling="avg", **kw):
    """The test net sharded over FSDP's own 2-D mesh; ``scaling``: FSDP's default AVG, a forced
    SUM reduction ("sum"), a gradient divide factor of 8 with it ("factor"; gloo has no
    PREMUL_SUM), or a factor of the shard dim's size 2 (FSDP then reduce-scatters with AVG and
    sums the replicas: "factor_s")."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import compcomm.fsdp as cf

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    model = M._net(dtype)
    for m in (model[0], model[3], model):
        fully_shard(m, mesh=mesh)
    for m in (model[0], model[3], model):
        if scaling in ("sum", "factor"):
            m.set_force_sum_reduction_for_comms(True)
        if scaling.startswith("factor"):
            m.set_gradient_divide_factor(8.0 if scaling == "factor" else 2.0)
    state = None if mode is None else cf.onebit(model, warmup_steps=2, mode=mode, **kw)
    return model, state, mesh


class _Counter:
    """Counts torch.distributed.all_reduce calls (FSDP's own replica all-reduce is one)."""

    def __init__(self) -> None:
        self.calls = 0
        self.inner = dist.all_reduce

    def __enter__(self):
        def counted(*a, **k):
            self.calls += 1
            return self.inner(*a, **k)
        dist.all_reduce = counted
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce = self.inner


def exact_cases(rank: int, world: int, dtype_name: str, scaling: str) -> Dict[str, Any]:
    """With exact exchanges (full-precision reduce-scatter and replica all-reduce) against
    FrozenVarianceAdam(freeze_step=2) on FSDP's own HSDP gradients: warm-up bit for bit, then to
    rounding. ``fsdp_allreduces``: torch.distributed.all_reduce calls in the 1-bit steps (the
    exact test hook's one per module; FSDP's own would double them)."""
    import compcomm.fsdp as cf

    dtype = getattr(torch, dtype_name)
    ref_model, _, _ = _model(dtype, scaling=scaling)
    ref = M._run(ref_model, cf.FrozenVarianceAdam(ref_model.parameters(), freeze_step=2, **KW),
                 rank, range(6), dtype)
    model, state, _ = _model(dtype, LOCAL, scaling=scaling)
    state.momentum.exact = True
    opt = cf.FrozenVarianceAdam(model.parameters(), freeze_step=state, **KW)
    got = M._run(model, opt, rank, range(2), dtype)
    with _Counter() as count:
        got += M._run(model, opt, rank, range(2, 6), dtype)
    err = max(float((a.double() - b.double()).abs().max() / b.double().abs().max())
              for a, b in zip(got[-1], ref[-1]) if b.numel())
    return {"warmup_bitwise": all(torch.equal(a, b) for t in range(2)
                                  for a, b in zip(ref[t], got[t])),
            "err": err, "steps": sorted(set(state.steps.values())),
            "fsdp_allreduces": count.calls, "mode": state.mode,
            "moved": any(not torch.equal(a, b) for a, b in zip(got[1], got[-1]))}


def onebit_cases(rank: int, world: int, dtype_name: str, limit) -> Dict[str, Any]:
    """1 bit: each module's fp32 shard left by the shard group's reduce-scatter, and after the
    replicas' reduction in the all-reduce hook; the latter must equal tests/reference.py's
    compressed allreduce across the replicas of the former (segment by segment, errors carried),
    and be what the optimizer is handed. No torch.distributed.all_reduce in the 1-bit steps."""
    import compcomm.fsdp as cf

    dtype = getattr(torch, dtype_name)
    model, state, mesh = _model(dtype, LOCAL, segment_elements=limit)
    rep = mesh["replicate"].get_group()
    seen: Dict[str, list] = {}

    for m in (model[0], model[3], model):  # wrap the installed one: the hook holds the same
        pg = m._get_fsdp_state()._fsdp_param_group
        m.set_custom_reduce_scatter(M.RecordingReduceScatter(seen, pg._reduce_scatter_comm))
    opt = cf.FrozenVarianceAdam(model.parameters(), freeze_step=state, **KW)
    given: Dict[int, torch.Tensor] = {}
    give = state.momentum.give

    def record(p, m, r=None):
        given[id(p)] = m.detach().double().clone()
        give(p, m, r)
    state.momentum.give = record
    M._run(model, opt, rank, range(2), dtype)
    wes: Dict[str, list] = {}
    ses: Dict[str, list] = {}
    err = handed = 0.0
    calls = 0
    for t in range(2, 5):
        seen.clear()
        with _Counter() as count:
            M._run(model, opt, rank, [t], dtype)
        calls += count.calls
        err = max(err, M.replica_reference_error(state, seen, rep, wes, ses))
        for name, (_, after) in sorted(seen.items()):
            mod = {"0": model[0], "3": model[3], "<root>": model}[name]
            o = 0
            for fp in mod._get_fsdp_state()._fsdp_param_group.fsdp_params:
                loc = fp.sharded_param.to_local()
                if loc.numel():
                    got = given[id(fp.sharded_param)].reshape(-1)
                    handed = max(handed, float((got - after[o:o + loc.numel()].double())
                                               .abs().max()))
                o += M._rows_of(torch.zeros(fp.sharded_param.shape), 2).shape[1]
    sd = state.state_dict()
    return {"ar_err": err, "handed": handed, "modules": sorted(seen), "allreduces": calls,
            "replica_errors": sorted(k for k in sd["errors"] if "/replicas" in k),
            "no_replica_momentum": not any("/replicas" in k for k in sd["local_momentum"])}


def dcp_cases(rank: int, world: int, path: str, dtype_name: str) -> Dict[str, Any]:
    """torch.distributed.checkpoint of model, optimizer and state after 4 steps (warm-up 2); a
    fresh set (its own onebit on a new 2-D mesh) loaded from it runs the same 3 steps bit for
    bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import compcomm.fsdp as cf

    dtype = getattr(torch, dtype_name)
    key = f"onebit_rank{rank}"
    model, state, _ = _model(dtype, LOCAL)
    opt = cf.FrozenVarianceAdam(model.parameters(), freeze_step=state, **KW)
    M._run(model, opt, rank, range(4), dtype)
    saved = state.state_dict()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, key: saved}, checkpoint_id=path)
    cont = M._run(model, opt, rank, range(4, 7), dtype)
    model2, state2, _ = _model(dtype, LOCAL)
    opt2 = cf.FrozenVarianceAdam(model2.parameters(), freeze_step=state2, **KW)
    M._run(model2, opt2, rank, range(1), dtype)
    msd2, osd2 = get_state_dict(model2, opt2)
    sd = {"model": msd2, "optim": osd2, key: state2.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    state2.load_state_dict(sd[key])
    resumed = M._run(model2, opt2, rank, range(4, 7), dtype)
    return {"bitwise": all(torch.equal(a, b) for t in range(3)
                           for a, b in zip(cont[t], resumed[t])),
            "moved": any(not torch.equal(a, b) for a, b in zip(cont[0], cont[-1])),
            "replica_errors": any("/replicas" in k and float(v[0].abs().sum()) > 0
                                  for k, v in saved["errors"].items())}


def bad_cases(rank: int, world: int) -> Dict[str, Any]:
    """What the 2-D mesh refuses, with nothing changed: a shard dim of size 1 (the default there:
    the gradient mode), replicate_group as well, the momentum mode; the gradient mode after the
    local-momentum mode on the same model; the default (the local-momentum mode)."""
    import compcomm.fsdp as cf
    from compcomm.fsdp_hsdp import taken

    out: Dict[str, Any] = {}
    f32 = torch.float32
    model, _, mesh = _model(f32, shape=(4, 1))
    out["shard1"] = M.error_of(lambda: cf.onebit(model, warmup_steps=2, mode=LOCAL))
    out["default_shard1"] = cf.onebit(model, warmup_steps=2).mode
    model, _, mesh = _model(f32)
    import compcomm.fsdp_hsdp as H
    real = H._replicas_of
    H._replicas_of = lambda mi: None  # another torch: its 2-D mesh info not recognised
    try:  # must refuse, not take the 1-D path (the replicas would never be reduced)
        out["unrecognised"] = M.error_of(lambda: cf.onebit(model, warmup_steps=2, mode=LOCAL))
    finally:
        H._replicas_of = real
    out["both"] = M.error_of(lambda: cf.onebit(model, warmup_steps=2, mode=LOCAL,
                                           replicate_group=mesh["replicate"].get_group()))
    out["momentum"] = M.error_of(lambda: cf.onebit(model, warmup_steps=2, mode="momentum"))
    out["untouched"] = not any(taken(m) for m in (model[0], model[3], model))
    out["default"] = cf.onebit(model, warmup_steps=2).mode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mixed = M._net(f32)  # model[0] on a 1-D mesh of the world, the rest on the 2-D mesh
    fully_shard(mixed[0], mesh=init_device_mesh("cpu", (world,)))
    for m in (mixed[3], mixed):
        fully_shard(m, mesh=mesh)
    out["mixed"] = M.error_of(lambda: cf.onebit(mixed, warmup_steps=2, mode=LOCAL))
    out["mixed_untouched"] = not any(taken(m) for m in (mixed[3], mixed))
    model, _, _ = _model(f32, LOCAL)
    out["taken"] = all(taken(m) for m in (model[0], model[3], model))
    out["post_forward_mesh"] = [m._get_fsdp_state()._fsdp_param_group._use_post_forward_mesh
                                for m in (model[0], model[3])]  # as before: no extra reshard
    out["gradient_after"] = M.error_of(lambda: cf.onebit(model, warmup_steps=2, mode="gradient"))
    out["again"] = cf.onebit(model, warmup_steps=2, mode=LOCAL).replicate_group is not None
    model, state, _ = _model(f32, LOCAL)  # FSDP's HSDP accumulation idiom: the mode refuses it
    opt = cf.FrozenVarianceAdam(model.parameters(), freeze_step=state)  # bound weakly: kept
    model.set_requires_all_reduce(False)
    out["no_all_reduce"] = M.error_of(
        lambda: model(M._batch(0, rank, f32)).pow(2).sum().backward())
    del opt
    return out


def default_cases(rank: int, world: int) -> Dict[str, Any]:
    """The default mode on the 2-D mesh is the local-momentum mode; with the exact re-gather
    cache and exact exchanges it is still FrozenVarianceAdam on FSDP's own HSDP (to rounding);
    with the int8 all-gather and 1 bit it trains (finite, moved). The gradient mode there reduces
    in its planned segments (the pieces count the shard dim only), no flat fallback."""
    import compcomm.fsdp as cf

    f32 = torch.float32
    ref_model, _, _ = _model(f32)
    ref = M._run(ref_model, cf.FrozenVarianceAdam(ref_model.parameters(), freeze_step=2, **KW),
                 rank, range(5), f32)
    model, _, _ = _model(f32)
    state = cf.onebit(model, warmup_steps=2, regather_cache=True)
    state.momentum.exact = True
    opt = cf.FrozenVarianceAdam(model.parameters(), freeze_step=state, **KW)
    got = M._run(model, opt, rank, range(5), f32)
    err = max(float((a.double() - b.double()).abs().max() / b.double().abs().max())
              for a, b in zip(got[-1], ref[-1]) if b.numel())
    model, _, _ = _model(f32)
    q = cf.onebit(model, warmup_steps=2, quantized_allgather=True, regather_cache=True)
    qopt = cf.FrozenVarianceAdam(model.parameters(), freeze_step=q, **KW)
    run = M._run(model, qopt, rank, range(5), f32)
    model, _, _ = _model(f32)  # the gradient mode there: planned segments over the shard dim
    g = cf.onebit(model, warmup_steps=2, mode="gradient")
    grun = M._run(model, torch.optim.AdamW(model.parameters(), lr=1e-2), rank, range(4), f32)
    return {"mode": state.mode, "err": err, "allgather": state.allgather is not None,
            "g_keys": sorted(g.state_dict()["errors"]) == sorted(g._sizes) and bool(g._sizes),
            "g_finite": all(bool(torch.isfinite(p).all()) for p in grun[-1]),
            "q_mode": q.mode, "q_finite": all(bool(torch.isfinite(p).all()) for p in run[-1]),
            "q_moved": any(not torch.equal(a, b) for a, b in zip(run[1], run[-1]))}
