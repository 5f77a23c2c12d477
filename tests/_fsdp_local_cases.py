"""Rank bodies for tests/test_fsdp_local_momentum.py (module level, so run_ranks can pickle them).

The model, batches and recorder are the momentum mode's (tests/_fsdp_momentum_cases.py)."""

from __future__ import annotations

from typing import Any, Dict

import numpy as np
import torch
import torch.distributed as dist

import _fsdp_momentum_cases as M
from _fsdp_optim_cases import Recorder

KW = M.KW
LOCAL = "local_momentum"


def _gather(t: torch.Tensor, world: int):
    everyone = [torch.zeros_like(t) for _ in range(world)]
    dist.all_gather(everyone, t.contiguous())
    return everyone


def onebit_cases(rank: int, world: int, dtype_name: str, limit) -> Dict[str, Any]:
    """The local-momentum mode in 1 bit on a real FSDP2 backward (warm-up 2, 3 compressed steps).

    ``mom_err``: every rank's local momentum against a float64 chain ``b1 m + (1 - b1) g`` from
    the recorded hook inputs, started from the warm-up's exp_avg (gathered, cut into the rows);
    ``rs_err``: the chunk handed to the optimizer against tests/reference.py's compressed
    reduce-scatter of the ranks' momenta with their carried worker errors (the server's sum
    ``c``, before its compression); ``we_err``: the new worker errors against the reference's."""
    import compcomm.fsdp as cf
    import reference as R
    from compcomm.fsdp_local import LocalMomentumReduceScatter

    dtype = getattr(torch, dtype_name)
    model, state = M._model(world, dtype, LOCAL, limit=limit)
    mods = {"0": model[0], "3": model[3], "<root>": model}
    recs = {}
    for name, m in mods.items():
        recs[name] = Recorder(LocalMomentumReduceScatter(
            state, name, m, M._segments_of(state, name, m, limit)))
        m.set_custom_reduce_scatter(recs[name])
    opt = cf.FrozenVarianceAdam(model.parameters(), freeze_step=state, **KW)
    given: Dict[int, torch.Tensor] = {}
    give = state.momentum.give

    def record(p, m, r=None):  # what the optimizer is handed
        given[id(p)] = m.detach().double().clone()
        give(p, m, r)
    state.momentum.give = record
    M._run(model, opt, rank, range(2), dtype)
    b1 = KW["betas"][0]
    owned = {n: [fp.sharded_param for fp in m._get_fsdp_state()._fsdp_param_group.fsdp_params]
             for n, m in mods.items()}
    ref_m = {n: torch.cat([M._rows_of(opt.state[p]["exp_avg"].full_tensor(), world) for p in ps],
                          dim=1) for n, ps in owned.items()}  # float64, (W, s) per module
    mom_err = rs_err = we_err = 0.0
    for t in range(2, 5):
        before = state.state_dict()["errors"]  # this rank's worker errors (CPU copies)
        M._run(model, opt, rank, [t], dtype)
        for name, ps in owned.items():
            inp = recs[name].calls[-1][0].double()
            s = inp.numel() // world
            ref_m[name] = b1 * ref_m[name] + (1 - b1) * inp.view(world, s)
            segs, keys = state.segments_for(name, s)
            o = 0
            mine = torch.zeros(s, dtype=torch.float64)
            for n, k in zip(segs, keys):
                r = -(-n // 8) * 8
                have = state.momentum.full[k].view(world, r)
                want = ref_m[name][:, o:o + n]
                mom_err = max(mom_err, float((have[:, :n].double() - want).abs().max()
                                             / want.abs().max()))
                assert float(have[:, n:].abs().sum()) == 0.0  # row padding
                xs = [x.numpy() for x in _gather(state.momentum.full[k], world)]
                wes = [e.numpy() for e in _gather(before[k][0], world)]
                ses = [np.zeros(r, np.float32) for _ in range(world)]
                ref = R.simulate(xs, wes, ses, "fp32")
                c = ref["c"][rank]
                mine[o:o + n] = torch.from_numpy(c[:n].astype(np.float64))
                we = state.state_dict()["errors"][k][0].numpy()
                we_err = max(we_err, float(np.abs(we - ref["worker_errors"][rank]).max()
                                           / np.abs(ref["worker_errors"][rank]).max()))
                o += n
            o = 0  # the chunks handed over, parameter by parameter
            for p in ps:
                loc = p.to_local()
                piece = M._rows_of(torch.zeros(p.shape), world).shape[1]
                if loc.numel():
                    want = mine[o:o + loc.numel()]
                    got = given[id(p)].reshape(-1)
                    rs_err = max(rs_err, float((got - want).abs().max() / want.abs().max()))
                o += piece
    return {"mom_err": mom_err, "rs_err": rs_err, "we_err": we_err,
            "packed": len(state.momentum.packed.keys()),
            "keys": sorted(state.momentum.full) == sorted(state._sizes)}


def bytes_cases(rank: int, world: int) -> Dict[str, Any]:
    """Bytes this rank sends per 1-bit step (compcomm's communicator), in both momentum modes,
    and the compressed reduce-scatter's wire bytes of the local mode's segments."""
    import compcomm
    import compcomm.fsdp as cf
    from compcomm import _C

    out: Dict[str, Any] = {}
    for mode in ("momentum", LOCAL):
        model, state = M._model(world, torch.float32, mode)
        opt = cf.FrozenVarianceAdam(model.parameters(), freeze_step=state, **KW)
        M._run(model, opt, rank, range(3), torch.float32)  # warm-up, then the switch
        comm = compcomm.get_communicator(dist.group.WORLD)
        before = int(comm.bytes_sent)
        M._run(model, opt, rank, range(3, 5), torch.float32)
        out[mode] = (int(comm.bytes_sent) - before) // 2
        if mode == LOCAL:
            out["rs_wire"] = sum(int(_C.zero.compressed_reduce_scatter_wire_bytes(w, world))
                                 for w, _ in state._sizes.values())
    return out


def dcp_cases(rank: int, world: int, path: str, dtype_name: str) -> Dict[str, Any]:
    """torch.distributed.checkpoint of model, FrozenVarianceAdam and the local-momentum state
    after 4 steps (warm-up 2); a fresh set loaded from it runs the same 3 steps bit for bit. Then
    the state loaded as if saved on another world size: momenta and errors reset, and the next
    steps run (seeded again from exp_avg)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import compcomm.fsdp as cf

    dtype = getattr(torch, dtype_name)
    key = f"onebit_rank{rank}"
    model, state = M._model(world, dtype, LOCAL)
    opt = cf.FrozenVarianceAdam(model.parameters(), freeze_step=state, **KW)
    template = state.state_dict()
    M._run(model, opt, rank, range(4), dtype)
    saved = state.state_dict()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, key: saved}, checkpoint_id=path)
    cont = M._run(model, opt, rank, range(4, 7), dtype)

    def fresh():
        model2, state2 = M._model(world, dtype, LOCAL)
        opt2 = cf.FrozenVarianceAdam(model2.parameters(), freeze_step=state2, **KW)
        M._run(model2, opt2, rank, range(1), dtype)
        msd2, osd2 = get_state_dict(model2, opt2)
        sd = {"model": msd2, "optim": osd2, key: state2.state_dict()}
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(model2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        return model2, state2, opt2, sd[key]

    model2, state2, opt2, sd2 = fresh()
    state2.load_state_dict(sd2)
    resumed = M._run(model2, opt2, rank, range(4, 7), dtype)
    model3, state3, opt3, sd3 = fresh()
    sd3["world"] = world + 1
    state3.load_state_dict(sd3)
    reset = not state3.momentum.full and not state3.state_dict()["errors"] or all(
        float(b.abs().sum()) == 0 for v in state3.state_dict()["errors"].values() for b in v)
    after = M._run(model3, opt3, rank, range(4, 6), dtype)
    return {"format": saved["format"],
            "template_sized": {k: v.shape for k, v in template["local_momentum"].items()}
            == {k: v.shape for k, v in saved["local_momentum"].items()},
            "saved": all(float(v.abs().sum()) > 0 for v in saved["local_momentum"].values()),
            "bitwise": all(torch.equal(a, b) for t in range(3)
                           for a, b in zip(cont[t], resumed[t])),
            "moved": any(not torch.equal(a, b) for a, b in zip(cont[0], cont[-1])),
            "reset": reset, "reseeded": sorted(state3.momentum.full) == sorted(state3._sizes)
            and all(bool(torch.isfinite(p).all()) for p in after[-1])}


def bad_cases(rank: int, world: int) -> Dict[str, Any]:
    """What the momentum mode refuses, refused the same way; a state of another mode; a state
    without its momenta (nothing changed)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import compcomm.fsdp as cf

    out: Dict[str, Any] = {}
    f32 = torch.float32
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("rep", "shard"))
    net = M._net(f32)
    for m in (net[0], net[3], net):
        fully_shard(m, mesh=mesh)
    out["mesh2d"] = M.error_of(lambda: cf.onebit(net, warmup_steps=2, mode=LOCAL))
    model, _ = M._model(world, f32)
    out["optimizer"] = M.error_of(lambda: cf.onebit(model, warmup_steps=2, mode=LOCAL,
                                                regather_cache=True,
                                                optimizer=torch.optim.AdamW(model.parameters())))
    model, state = M._model(world, f32, LOCAL)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    out["no_optimizer"] = M.error_of(lambda: M._run(model, sgd, rank, range(1), f32))
    model, state = M._model(world, f32, LOCAL)
    out["group"] = M.error_of(lambda: cf.FrozenVarianceAdam(
        [{"params": list(model.parameters()), "freeze_step": 4}], freeze_step=state, **KW))
    # two backwards before a step in the 1-bit phase: refused before anything changes
    opt = cf.FrozenVarianceAdam(model.parameters(), freeze_step=state, **KW)
    M._run(model, opt, rank, range(3), f32)
    opt.zero_grad()
    model(M._batch(5, rank, f32)).float().pow(2).sum().backward()
    before = state.state_dict()
    out["accum"] = M.error_of(lambda: model(M._batch(6, rank, f32)).float().pow(2).sum().backward())
    after = state.state_dict()
    out["accum_unchanged"] = all(
        torch.equal(before["local_momentum"][k], after["local_momentum"][k])
        for k in before["local_momentum"]) and all(
        torch.equal(a, b) for k in before["errors"]
        for a, b in zip(before["errors"][k], after["errors"][k]))
    _, mstate = M._model(world, f32, "momentum")
    out["other_mode"] = M.error_of(lambda: state.load_state_dict(mstate.state_dict()))
    lacking = dict(before)
    lacking.pop("local_momentum")
    out["lacking"] = M.error_of(lambda: state.load_state_dict(lacking))
    out["lacking_unchanged"] = sorted(state.momentum.full) == sorted(before["local_momentum"])
    return out


def _hsdp_model(mode, warmup=2, **kw):
    """HSDP by hand on 4 ranks: FSDP over 2-rank shard groups, 2 replicas (replicate_group)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import compcomm.fsdp as cf

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    model = M._net(torch.float32)
    for m in (model[0], model[3], model):
        fully_shard(m, mesh=mesh["shard"])
    state = cf.onebit(model, warmup_steps=warmup, mode=mode,
                      replicate_group=mesh["rep"].get_group(), **kw)
    return model, state, mesh


def hsdp_cases(rank: int, world: int) -> Dict[str, Any]:
    """The local-momentum mode with replicate_group (W=4: 2 replicas of 2 shards).

    ``exact_err``: with exact exchanges, against FrozenVarianceAdam(freeze_step=2) on the gradient
    mode's HSDP (full-precision replica all-reduce for the whole run: warm-up 100): the warm-up
    bit for bit, then to rounding. ``ar_err``: in 1 bit, the momentum shard handed over equals
    tests/reference.py's compressed allreduce across the replicas of the shards the reduce-
    scatter left (segment by segment, errors carried)."""
    import compcomm.fsdp as cf
    from compcomm.fsdp import _all_reduce_hook
    from compcomm.fsdp_local import LocalMomentumReduceScatter, replica_hook

    out: Dict[str, Any] = {}
    f32 = torch.float32
    ref_model, ref_state, _ = _hsdp_model("gradient", warmup=100)
    ref = M._run(ref_model, cf.FrozenVarianceAdam(ref_model.parameters(), freeze_step=2, **KW),
                 rank, range(5), f32)
    model, state, _ = _hsdp_model(LOCAL)
    state.momentum.exact = True
    got = M._run(model, cf.FrozenVarianceAdam(model.parameters(), freeze_step=state, **KW),
                 rank, range(5), f32)
    out["warmup_bitwise"] = all(torch.equal(a, b) for t in range(2) for a, b in zip(ref[t], got[t]))
    out["exact_err"] = M._err(got[-1], ref[-1])
    # 1 bit: record each module's shard before and after the replicas' average
    model, state, mesh = _hsdp_model(LOCAL, segment_elements=0)
    rep = mesh["rep"].get_group()
    seen: Dict[str, list] = {}

    for name, m in (("0", model[0]), ("3", model[3]), ("<root>", model)):
        rs = LocalMomentumReduceScatter(state, name, m, M._segments_of(state, name, m, 0))
        m.set_custom_reduce_scatter(M.RecordingReduceScatter(seen, rs))
        m.set_all_reduce_hook(replica_hook(state, rs, _all_reduce_hook(state, name)))
    opt = cf.FrozenVarianceAdam(model.parameters(), freeze_step=state, **KW)
    M._run(model, opt, rank, range(2), f32)
    wes: Dict[str, list] = {}
    ses: Dict[str, list] = {}
    err = 0.0
    for t in range(2, 5):
        seen.clear()
        M._run(model, opt, rank, [t], f32)
        err = max(err, M.replica_reference_error(state, seen, rep, wes, ses))
    out["ar_err"] = err
    out["modules"] = sorted(seen)
    sd = state.state_dict()
    out["replica_errors_saved"] = any(k.startswith("<root>/replicas") for k in sd["errors"])
    out["no_replica_momentum"] = not any("/replicas" in k for k in sd["local_momentum"])
    return out
