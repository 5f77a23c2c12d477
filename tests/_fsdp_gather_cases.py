"""Rank bodies for tests/test_fsdp_gather.py (module level, so run_ranks can pickle them)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist


def _model(world: int, ag: Optional[Dict[str, Any]] = None,
           onebit: Optional[Dict[str, Any]] = None, bf16: bool = False):
    """Two resharding blocks and a root that owns the last Linear (the root is not resharded
    after forward: FSDP gathers it once a step)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import compcomm.fsdp as cf

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                                torch.nn.Tanh(), torch.nn.Linear(16, 5))
    mesh = init_device_mesh("cpu", (world,))
    for m in (model[0], model[2], model):
        fully_shard(m, mesh=mesh, mp_policy=mp)
    state = None
    if ag is not None:
        state = cf.compressed_allgather(model, **ag)
    if onebit is not None:
        state = cf.onebit(model, **{"mode": "gradient", **onebit})
    return model, state


def _batch(t: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 13, generator=torch.Generator().manual_seed(100 * t + rank))


def _train(model, opt, rank: int, steps: int):
    losses, params = [], []
    for t in range(steps):
        opt.zero_grad()
        loss = model(_batch(t, rank)).pow(2).sum()
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
        params.append([p.detach().to_local().clone() for p in model.parameters()])
    return losses, params


def _same(a: List[Any], b: List[Any]) -> bool:
    flat = lambda xs: [t for x in xs for t in (x if isinstance(x, list) else [x])]  # noqa: E731
    return all(torch.equal(x, y) for x, y in zip(flat(a), flat(b))) and len(a) == len(b)


def _run(world: int, rank: int, ag: Optional[Dict[str, Any]], steps: int = 4):
    model, state = _model(world, ag)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, params = _train(model, opt, rank, steps)
    return losses, params, state


def exactness_cases(rank: int, world: int) -> Dict[str, Any]:
    """The cache changes nothing (exact and int8 gathers); it is hit; bytes as counted."""
    steps = 4
    res: Dict[str, Any] = {}
    lp, pp, _ = _run(world, rank, None, steps)
    lc, pc, sc = _run(world, rank, dict(quantized=False, cache=True), steps)
    res["exact_cache_bitwise"] = _same(lp, lc) and _same(pp, pc)
    res["exact_counts"] = (sc.gathers, sc.hits)
    res["exact_bytes"] = (sc.bytes_sent, sc.logical_bytes)
    res["peak_cache_bytes"] = sc.peak_cache_bytes
    res["cache_empty_after_step"] = sc.cache_bytes() == 0
    # blocks of 32: this model's shards are tiny (whole blocks are sent)
    q = dict(quantized=True, block=32, exact_numel=0, rounding="nearest")
    lq, pq, sq = _run(world, rank, dict(q, cache=False), steps)
    lqc, pqc, sqc = _run(world, rank, dict(q, cache=True), steps)
    res["int8_cache_bitwise"] = _same(lq, lqc) and _same(pq, pqc)
    res["int8_counts"] = (sq.gathers, sq.hits, sqc.gathers, sqc.hits)
    res["int8_bytes"] = (sq.bytes_sent, sq.logical_bytes, sqc.bytes_sent)
    res["int8_differs"] = not _same(lp, lq)
    res["int8_loss_gap"] = max(abs(float(a) - float(b)) / abs(float(b)) for a, b in zip(lq, lp))
    return res


def weights_cases(rank: int, world: int) -> Dict[str, Any]:
    """Every rank computes with the same dequantized weights, within half an int8 step of each
    parameter's absmax of the exact ones (blocks of 128 start at each parameter's shard)."""
    model, state = _model(world, dict(quantized=True, cache=True, block=128, exact_numel=0,
                                      rounding="nearest"))
    exact = [p.full_tensor().clone() for p in model[2].parameters()]
    seen: List[List[torch.Tensor]] = []
    h = model[2].register_forward_pre_hook(
        lambda m, _: seen.append([p.detach().clone() for p in m.parameters()]))
    model(_batch(0, rank)).sum().backward()
    h.remove()
    got = seen[0]
    gathered = [torch.zeros_like(got[0]) for _ in range(world)]
    dist.all_gather(gathered, got[0].contiguous())
    from compcomm.fsdp_gather import _segments

    n = sum(p.to_local().numel() for p in model[2].parameters())  # 16 rows divide W=2; W=3 pads
    segs = _segments(model[2], 6 * 16 + 6 if world == 3 else n)  # (exact_numel 0: all int8)
    return {
        "ranks_agree": all(torch.equal(g, gathered[0]) for g in gathered),
        "segments": segs,
        # blocks start at each parameter: its own absmax bounds its error
        "within_bound": all(float((g - e).abs().max()) <= float(e.abs().max()) / 254 * 1.0001
                            for g, e in zip(got, exact)),
        "differs": any(not torch.equal(g, e) for g, e in zip(got, exact)),
        "hits": state.hits,
    }


def invalidation_cases(rank: int, world: int) -> Dict[str, Any]:
    """What drops the cache: any optimizer's step (global hook), or only the optimizers passed;
    load_state_dict; invalidate()."""
    res: Dict[str, Any] = {}
    model, st = _model(world, dict(quantized=True, cache=True, exact_numel=0))
    x = _batch(0, rank)
    model.load_state_dict(model.state_dict())  # a post hook on each of the 3 FSDP modules
    res["load_state_dict"] = st.generation
    loss = model(x).sum()  # forward: 3 gathers, 2 entries
    st.invalidate()
    loss.backward()  # the 2 re-gathers miss
    res["invalidate"] = (st.gathers, st.hits, st.generation)
    model(x).sum()  # forward without backward: 2 entries kept
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    other.zero_grad()
    other.step()  # the global hook: any optimizer
    res["global_hook"] = (st.generation, st.cache_bytes())
    st.remove()
    res["removed"] = st.generation
    other.step()
    res["removed_hooks"] = st.generation  # no hook left
    model2, st2 = _model(world, None)
    import compcomm.fsdp as cf

    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    try:
        cf.compressed_allgather(model2, optimizer=[opt2, "x"])
        res["bad_optimizer"] = "no error"
    except TypeError as e:
        res["bad_optimizer"] = str(e)
    st2 = cf.compressed_allgather(model2, optimizer=opt2)
    loss = model2(x).sum()
    other.step()  # not the passed optimizer: the cache stays
    loss.backward()
    res["scoped_hits"] = st2.hits
    opt2.step()
    res["scoped_step"] = st2.generation
    with torch.no_grad():  # an eval forward (weights may be swapped in for it) keeps nothing
        model2(x)
    res["eval_forward"] = (st2.cache_bytes(), st2.storing)
    loss = model2(x).sum()  # a training forward keeps its re-gathers again
    res["train_forward_kept"] = st2.cache_bytes() > 0
    loss.backward()
    res["train_hits"] = st2.hits
    return res


def onebit_cases(rank: int, world: int) -> Dict[str, Any]:
    """compcomm.fsdp.onebit's keywords: the 1-bit reduce-scatter and the int8 all-gather with
    the cache, trained a few steps; the exact cache under onebit is bitwise."""
    model, state = _model(world, onebit=dict(warmup_steps=1, quantized_allgather=True,
                                             regather_cache=True, allgather_exact_numel=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, _ = _train(model, opt, rank, 4)
    model2, state2 = _model(world, onebit=dict(warmup_steps=1))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    l2, p2 = _train(model2, opt2, rank, 4)
    model3, state3 = _model(world, onebit=dict(warmup_steps=1, regather_cache=True,
                                               optimizer=None))
    opt3 = torch.optim.AdamW(model3.parameters(), lr=1e-2)
    l3, p3 = _train(model3, opt3, rank, 4)
    state.invalidate()
    state2.invalidate()  # no all-gather installed: nothing to do
    return {"finite": all(bool(torch.isfinite(v)) for v in losses),
            "counts": (state.allgather.gathers, state.allgather.hits),
            "none": state2.allgather is None,
            "exact_cache_bitwise": _same(l2, l3) and _same(p2, p3),
            "steps": dict(state.steps)}


def exact_small_cases(rank: int, world: int) -> Dict[str, Any]:
    """exact_numel=16: the biases (16 and 5 elements) arrive exactly, the weights (13*16=208,
    256, 80) int8; every rank computes with the same weights; the payload is the weight's int8
    blocks plus the bias's bytes. Stochastic rounding: the cache changes nothing (a re-gather
    without it draws the same numbers as the forward's gather)."""
    model, state = _model(world, dict(quantized=True, cache=False, block=32, exact_numel=16,
                                      rounding="nearest"))
    exact = [p.full_tensor().clone() for p in model[2].parameters()]
    seen: List[List[torch.Tensor]] = []
    h = model[2].register_forward_pre_hook(
        lambda m, _: seen.append([p.detach().clone() for p in m.parameters()]))
    model(_batch(0, rank)).sum().backward()
    h.remove()
    w, b = seen[0]
    gathered = [torch.zeros_like(w) for _ in range(world)]
    dist.all_gather(gathered, w.contiguous())
    from compcomm.quantize import payload_bytes

    r16, r5 = -(-16 // world), -(-5 // world)
    per = lambda w, b: payload_bytes(w, 32, [w]) + 4 * b  # noqa: E731 - fp32 bias, 4-aligned
    # one forward and backward without the cache: the blocks twice each, the root once
    want = (world - 1) * (2 * per(r16 * 13, r16) + 2 * per(r16 * 16, r16) + per(r5 * 16, r5))
    res: Dict[str, Any] = {
        "bias_exact": torch.equal(b, exact[1]),
        "weight_quantized": not torch.equal(w, exact[0]),
        "ranks_agree": all(torch.equal(g, gathered[0]) for g in gathered),
        "bytes": state.bytes_sent == want,
    }
    sr = dict(quantized=True, block=32, exact_numel=0, rounding="stochastic")
    lq, pq, _ = _run(world, rank, dict(sr, cache=False), 3)
    lqc, pqc, sqc = _run(world, rank, dict(sr, cache=True), 3)
    ln, _, _ = _run(world, rank, dict(sr, cache=True, rounding="nearest"), 3)
    d, dx = _model(world, {})[1], _model(world, dict(quantized=False))[1]
    res["defaults"] = (d.rounding, d.exact_numel, d.block, dx.rounding)
    res["stochastic_cache_bitwise"] = _same(lq, lqc) and _same(pq, pqc)
    res["stochastic_differs"] = not _same(lqc, ln)
    res["stochastic_hits"] = sqc.hits
    return res


def bf16_master_cases(rank: int, world: int) -> Dict[str, Any]:
    """bf16 parameters (MixedPrecisionPolicy): a bias of 1 + 2**-9 in the fp32 master (a quarter
    of a bf16 step above 1) reaches the forward as 1.0 every time by FSDP's cast; with
    rounding='stochastic' as 1.0 or 1 + 2**-7, the latter about a quarter of the time (unbiased),
    exact or int8 (exact_numel) alike; every rank computes with the same weights."""
    res: Dict[str, Any] = {}
    for tag, ag in (("fsdp", None), ("cast", dict(quantized=False, cache=False,
                                                  rounding="stochastic")),
                    ("int8", dict(quantized=True, cache=True, exact_numel=16,
                                  rounding="stochastic"))):
        model, st = _model(world, ag, bf16=True)
        with torch.no_grad():
            model[2].bias.to_local().fill_(1 + 2 ** -9)
        seen: List[torch.Tensor] = []
        h = model[2].register_forward_pre_hook(
            lambda m, _: seen.append(m.bias.detach().float().clone()))
        for t in range(20):
            model(_batch(t, rank)).sum().backward()
            if st is not None:
                st.invalidate()  # a new step's draws (as an optimizer step would)
        h.remove()
        vals = torch.stack(seen)
        gathered = [torch.zeros_like(vals) for _ in range(world)]
        dist.all_gather(gathered, vals)
        res[tag] = {"values": sorted(set(vals.flatten().tolist())),
                    "up": float((vals > 1).float().mean()),
                    "ranks_agree": all(torch.equal(g, gathered[0]) for g in gathered)}
    return res


def multigroup_cases(rank: int, world: int) -> Dict[str, Any]:
    """A module of two FSDP parameter groups (a per-parameter mesh from shard_placement_fn), after
    a module of one: onebit and compressed_allgather raise ValueError naming it before they
    install anything (before, FSDP's setter raised halfway, the earlier module kept compcomm's
    hooks, and the message did not name the module)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import (FSDPMeshInfo,
                                                                   ShardPlacementResult)
    from torch.distributed.tensor import Shard
    from torch.optim.optimizer import _global_optimizer_post_hooks

    import compcomm.fsdp as cf
    from _fsdp_momentum_cases import error_of

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.Tanh(), torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)))
    mesh = init_device_mesh("cpu", (world,))
    other = FSDPMeshInfo(mesh=DeviceMesh.from_group(dist.new_group(list(range(world))), "cpu"),
                         shard_mesh_dim=0)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh, shard_placement_fn=lambda p: ShardPlacementResult(
        Shard(0), other) if p.shape == (4, 8) else None)
    fully_shard(model, mesh=mesh)
    hooks = len(_global_optimizer_post_hooks)
    out: Dict[str, Any] = {}
    for name, call in (("gradient", lambda: cf.onebit(model, warmup_steps=0, mode="gradient")),
                       ("momentum", lambda: cf.onebit(model, warmup_steps=0)),
                       ("cache", lambda: cf.onebit(model, warmup_steps=0, mode="gradient",
                                                   regather_cache=True)),
                       ("allgather", lambda: cf.compressed_allgather(model))):
        out[name] = error_of(call)
    pg = model[0]._get_fsdp_state()._fsdp_param_groups[0]
    out["installed"] = [type(pg._reduce_scatter_comm).__name__,
                        type(pg._all_gather_comm).__name__,
                        len(_global_optimizer_post_hooks) - hooks]
    return out
