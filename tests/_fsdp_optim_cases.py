"""Rank bodies for tests/test_fsdp_optim.py (module level, so run_ranks can pickle them)."""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np
import torch

from _fsdp_cases import _mlp


def _model(world: int, dtype: torch.dtype = torch.float32, onebit_warmup=None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import compcomm.fsdp as cf

    mesh = init_device_mesh("cpu", (world,))
    model = _mlp().to(dtype)
    for m in (model[0], model[2], model):
        fully_shard(m, mesh=mesh)
    state = cf.onebit(model, warmup_steps=onebit_warmup, mode="gradient") \
        if onebit_warmup is not None else None
    return model, state


def _train(model, opt, rank: int, steps, dtype=torch.float32) -> List[List[torch.Tensor]]:
    out = []
    for t in steps:
        x = torch.randn(4, 13, generator=torch.Generator().manual_seed(100 * t + rank)).to(dtype)
        opt.zero_grad()
        model(x).float().pow(2).sum().backward()
        opt.step()
        out.append([p.detach().to_local().clone() for p in model.parameters()])
    return out


def _reference(p0, grads, lr, b1, b2, eps, wd, freeze):
    """float64 numpy AdamW with the variance frozen after ``freeze`` steps."""
    p, m, v = p0.astype(np.float64), np.zeros(p0.shape), np.zeros(p0.shape)
    for t, g in enumerate(grads, 1):
        g = g.astype(np.float64)
        p = p * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        if t <= freeze:
            v = b2 * v + (1 - b2) * g * g
        tv = min(t, freeze)
        p = p - lr / (1 - b1 ** t) * m / (np.sqrt(v) / np.sqrt(1 - b2 ** tv) + eps)
    return p


def optim_cases(rank: int, world: int, dtype_name: str) -> Dict[str, Any]:
    """AdamW and FrozenVarianceAdam(freeze_step=3) on the same FSDP2 model and data (FSDP's own
    reduce-scatter): steps 1-3 bit for bit; after them the variance is frozen bit for bit and
    each shard follows a float64 reference fed with the same gradients."""
    import compcomm.fsdp as cf

    dtype = getattr(torch, dtype_name)
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1)
    model_a, _ = _model(world, dtype)
    ref = _train(model_a, torch.optim.AdamW(model_a.parameters(), **kw), rank, range(5), dtype)
    model, _ = _model(world, dtype)
    opt = cf.FrozenVarianceAdam(model.parameters(), freeze_step=3, **kw)
    p0 = [p.detach().to_local().clone() for p in model.parameters()]
    grads, vs, got = [], [], []
    for t in range(6):
        x = torch.randn(4, 13, generator=torch.Generator().manual_seed(100 * t + rank)).to(dtype)
        opt.zero_grad()
        model(x).float().pow(2).sum().backward()
        grads.append([p.grad.to_local().clone() for p in model.parameters()])
        frozen_before = [opt.variance_frozen(p) for p in model.parameters()]
        opt.step()
        got.append([p.detach().to_local().clone() for p in model.parameters()])
        vs.append([opt.state[p]["exp_avg_sq"].to_local().clone() for p in model.parameters()])
        assert all(f == (t >= 3) for f in frozen_before), (t, frozen_before)
    res: Dict[str, Any] = {}
    res["warmup_bitwise"] = all(torch.equal(a, b) for t in range(3) for a, b in zip(ref[t], got[t]))
    res["then_differs"] = any(not torch.equal(a, b) for a, b in zip(ref[4], got[4]))
    res["v_frozen"] = all(torch.equal(a, b) for t in (3, 4, 5) for a, b in zip(vs[2], vs[t]))
    res["v_moved"] = any(not torch.equal(a, b) for a, b in zip(vs[0], vs[2]))
    errs = []
    for i in range(len(p0)):
        want = _reference(p0[i].float().numpy(), [g[i].float().numpy() for g in grads], 1e-2,
                          0.9, 0.99, 1e-6, 0.1, 3)
        have = got[-1][i].double().numpy()
        errs.append(float(np.abs(have - want).max() / max(np.abs(want).max(), 1e-30)))
    res["ref_err"] = max(errs)
    res["states_are_dtensors"] = all(type(opt.state[p]["exp_avg"]).__name__ == "DTensor"
                                     for p in model.parameters())
    return res


def onebit_dcp_cases(rank: int, world: int, path: str) -> Dict[str, Any]:
    """compcomm.fsdp.onebit (warm-up 2) + FrozenVarianceAdam(freeze_step=state): 4 steps,
    torch.distributed.checkpoint of model, optimizer and the 1-bit state, 3 more steps; a fresh
    model/optimizer/state loaded from it runs the same 3 steps bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import compcomm.fsdp as cf

    key = f"onebit_rank{rank}"
    model, state = _model(world, onebit_warmup=2)
    opt = cf.FrozenVarianceAdam(model.parameters(), lr=1e-2, freeze_step=state)
    _train(model, opt, rank, range(4))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, key: state.state_dict()}, checkpoint_id=path)
    cont = _train(model, opt, rank, range(4, 7))

    model2, state2 = _model(world, onebit_warmup=2)
    opt2 = cf.FrozenVarianceAdam(model2.parameters(), lr=1e-2, freeze_step=5)  # the saved 2 wins
    _train(model2, opt2, rank, range(1))  # (a state to load into)
    msd2, osd2 = get_state_dict(model2, opt2)
    sd = {"model": msd2, "optim": osd2, key: state2.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    state2.load_state_dict(sd[key])
    resumed = _train(model2, opt2, rank, range(4, 7))
    return {"freeze_step": opt.param_groups[0]["freeze_step"],
            "loaded_freeze_step": opt2.param_groups[0]["freeze_step"],
            "bitwise": all(torch.equal(a, b) for t in range(3) for a, b in zip(cont[t], resumed[t])),
            "moved": any(not torch.equal(a, b) for a, b in zip(cont[0], cont[-1]))}


class Recorder:
    """Wraps a module's ReduceScatter: keeps each call's input and output (copies), as pairs."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        inp = input_tensor.clone()
        work = self.inner(output_tensor, input_tensor, group, op, async_op)
        self.calls.append((inp, output_tensor.clone()))
        return work


def _wide_mlp(dtype):
    torch.manual_seed(1)  # dims that do not divide by 2 or 3; a bias, a LayerNorm
    return torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.LayerNorm(7), torch.nn.Tanh(),
                               torch.nn.Linear(7, 5, bias=False)).to(dtype)


def segment_cases(rank: int, world: int, dtype_name: str, limit) -> Dict[str, Any]:
    """compcomm.fsdp.onebit(warmup 0, segment_elements=limit) on a real FSDP2 backward, twice:
    every rank's output shard equals a numpy reference of the segmented 1-bit reduce-scatter
    (each segment's rank pieces in rows of ceil(S/8)*8, its own errors carried over both calls),
    and each segment of the output carries one scale."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import compcomm.fsdp as cf
    import reference as R

    dtype = getattr(torch, dtype_name)
    mesh = init_device_mesh("cpu", (world,))
    recs = []
    for batched in (True, False):  # one batched exchange, or one per segment: the same bits
        model = _wide_mlp(dtype)
        fully_shard(model, mesh=mesh)
        state = cf.onebit(model, warmup_steps=0, segment_elements=limit, mode="gradient")
        state.batch_segments = batched
        rec = Recorder(cf.OneBitReduceScatter(state, "<root>"))
        model.set_custom_reduce_scatter(rec)
        for t in range(2):
            x = torch.randn(4, 13, generator=torch.Generator().manual_seed(10 * t + rank)).to(dtype)
            model.zero_grad()
            model(x).float().pow(2).sum().backward()
        recs.append(rec)
    same = all(torch.equal(a[1], b[1]) for a, b in zip(recs[0].calls, recs[1].calls))
    rec = recs[0]
    segs = state.segments["<root>"]
    wes = {k: [np.zeros(world * (-(-n // 8) * 8), np.float32) for _ in range(world)]
           for k, n in enumerate(segs)}
    ses = {k: [np.zeros(-(-n // 8) * 8, np.float32) for _ in range(world)]
           for k, n in enumerate(segs)}
    err, scales_per_segment = 0.0, []
    for inp, out in rec.calls:
        everyone = [torch.zeros_like(inp) for _ in range(world)]
        dist.all_gather(everyone, inp)
        s = out.numel()
        o = 0
        for k, n in enumerate(segs):
            r8 = -(-n // 8) * 8
            xs = []
            for r in range(world):
                rows = np.zeros((world, r8), np.float32)
                rows[:, :n] = everyone[r].float().view(world, s)[:, o:o + n].numpy()
                xs.append(rows.reshape(-1))
            ref = R.compressed_allreduce_padded(xs, wes[k], ses[k], "fp32")
            want = torch.from_numpy(ref[rank * r8: rank * r8 + n].copy()).to(dtype).float()
            have = out[o:o + n].float()
            err = max(err, float((have - want).abs().max() / want.abs().max()))
            scales_per_segment.append(len(set(have.abs().tolist())))
            o += n
        assert o == s
    return {"segments": segs, "err": err, "one_scale_each": set(scales_per_segment) == {1},
            "batched_equals_unbatched": same and len(recs[1].calls) == 2,
            "keys": sorted(state.state_dict()["errors"])}


def replica_cases(rank: int, world: int) -> Dict[str, Any]:
    """HSDP by hand (compcomm.fsdp.onebit's replicate_group): FSDP over a 1-rank shard mesh, two
    replicas. Step 1 (warm-up): each gradient is the replicas' exact average; step 2 (1-bit):
    each segment (one per parameter here) equals the numpy reference of the compressed
    allreduce of the replicas' local gradients, segment by segment."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import compcomm.fsdp as cf
    import reference as R

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("rep", "shard"))
    model, plain = _wide_mlp(torch.float32), _wide_mlp(torch.float32)
    fully_shard(model, mesh=mesh["shard"])
    state = cf.onebit(model, warmup_steps=1, replicate_group=mesh["rep"].get_group(),
                      segment_elements=0)
    segs = state.segments["<root>/replicas"]
    wes = [[np.zeros(R.padded_numel(n, world), np.float32) for _ in range(world)] for n in segs]
    ses = [[np.zeros(R.padded_numel(n, world) // world, np.float32) for _ in range(world)]
           for n in segs]
    errs = []
    for t in range(2):
        x = torch.randn(4, 13, generator=torch.Generator().manual_seed(10 * t + rank))
        for m in (model, plain):
            m.zero_grad()
            m(x).pow(2).sum().backward()
        mine = torch.cat([p.grad.reshape(-1) for p in plain.parameters()])
        everyone = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine)
        got = torch.cat([p.grad.to_local().reshape(-1) for p in model.parameters()])
        if t == 0:
            want = (everyone[0] + everyone[1]) / 2
        else:
            parts, o = [], 0
            for k, n in enumerate(segs):
                xs = [e[o:o + n].numpy() for e in everyone]
                parts.append(torch.from_numpy(R.compressed_allreduce(xs, wes[k], ses[k], "fp32")))
                o += n
            want = torch.cat(parts)
        errs.append(float((got - want).abs().max() / want.abs().max()))
    return {"segments": len(segs), "warmup_err": errs[0], "onebit_err": errs[1],
            "steps": dict(state.steps)}


def batch_rs_cases(rank: int, world: int, device: str = "cpu") -> Dict[str, Any]:
    """compcomm's batched 1-bit reduce-scatter exchange (_C.zero.compressed_reduce_scatter_exchange_many
    + one compressed_reduce_scatter_commit per call) against compcomm.compressed_reduce_scatter per
    call, twice (errors carried): the same bits, sizes that do not divide, an empty call included;
    then ranks passing different numbers of calls raise RankMismatchError on every rank and write
    nothing (world > 1). ``device``: where the tensors live; "outs" holds the results on the CPU."""
    import compcomm
    from compcomm import _C
    from compcomm._buffers import buffer_of
    from compcomm.collectives import compressed_reduce_scatter, workspace_bytes
    from compcomm.errors import RankMismatchError

    comm = compcomm.get_communicator(None)
    sizes = [8 * world * k for k in (1, 5, 0, 13)]  # padded sizes (multiples of 8 W)
    gen = torch.Generator().manual_seed(7 + rank)
    xs = [[torch.randn(p, generator=gen).to(device) for p in sizes] for _ in range(2)]

    def fresh():
        return ([torch.zeros(p, device=device) for p in sizes],
                [torch.zeros(p // world, device=device) for p in sizes])

    we1, se1 = fresh()
    single = []
    for x in xs:
        single.append([compressed_reduce_scatter(t.clone(), w, s) for t, w, s in zip(x, we1, se1)])
    we2, se2 = fresh()
    cuda = device == "cuda"
    wss = [torch.zeros(workspace_bytes(p, world, cuda), dtype=torch.uint8, device=device) for p in sizes]
    staging = torch.empty(_C.zero.compressed_allreduce_batch_bytes(sizes, world), dtype=torch.uint8,
                          device=device)
    batched = []
    for x in xs:
        ts = [t.clone() for t in x]
        outs = [torch.empty(p // world, device=device) for p in sizes]
        args = [[buffer_of(t) for t in lst] for lst in (ts, we2, se2, outs, wss)]
        _C.zero.compressed_reduce_scatter_exchange_many(comm, *args, buffer_of(staging))
        for call in zip(*args):
            _C.zero.compressed_reduce_scatter_commit(comm, *call)
        batched.append(outs)
    same = all(torch.equal(a, b) for t in range(2) for a, b in zip(single[t], batched[t]))
    same = same and all(torch.equal(a, b) for a, b in zip(we1 + se1, we2 + se2))
    outs = [t.cpu() for t in batched[-1] + we2 + se2]
    if world == 1:
        return {"same": same, "outs": outs}
    n = 2 if rank == 0 else 1  # a count that differs
    before = [w.clone() for w in we2[:n]]
    args = [[buffer_of(t) for t in lst[:n]] for lst in
            ([t.clone() for t in xs[0]], we2, se2,
             [torch.empty(p // world, device=device) for p in sizes], wss)]
    try:
        _C.zero.compressed_reduce_scatter_exchange_many(comm, *args, buffer_of(staging))
        mismatch = "no error"
    except RankMismatchError as e:
        mismatch = "numbers of calls" in str(e) or "batch of" in str(e)
    untouched = all(torch.equal(a, b) for a, b in zip(before, we2[:n]))
    return {"same": same, "mismatch": mismatch, "untouched": untouched}


class _Poison:
    """Wraps a module's ReduceScatter: while ``on``, rank 0's input holds inf at ``col`` (FSDP's
    rank-major input: column ``col`` of row 0, a real element of rank 0's piece)."""

    def __init__(self, inner, col: int) -> None:
        self.inner, self.col, self.on = inner, col, False

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if self.on and group.rank() == 0:
            input_tensor.view(group.size(), -1)[0, self.col] = float("inf")
        return self.inner(output_tensor, input_tensor, group, op, async_op)


def nonfinite_cases(rank: int, world: int) -> Dict[str, Any]:
    """The gradient mode's 1-bit phase meets a non-finite gradient: the loss times inf (a
    GradScaler overflow), or inf in the last segment only (batched, and one exchange per segment,
    whose first segments commit before the last raises). backward() returns with non-finite
    gradients on every rank (as FSDP's own reduce-scatter gives them), the error buffers and step
    counts are unchanged, and the next backward is finite."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import compcomm.fsdp as cf

    mesh = init_device_mesh("cpu", (world,))
    out: Dict[str, Any] = {}
    for case in ("overflow", "last_batched", "last_unbatched"):
        model = _wide_mlp(torch.float32)
        fully_shard(model, mesh=mesh)
        state = cf.onebit(model, warmup_steps=1, segment_elements=0, mode="gradient")
        state.batch_segments = case != "last_unbatched"
        last = sum(state.segments["<root>"][:-1])  # the last segment's first column
        poison = _Poison(cf.OneBitReduceScatter(state, "<root>"), last)
        model.set_custom_reduce_scatter(poison)

        def back(t: int, scale: float = 1.0) -> bool:
            x = torch.randn(4, 13, generator=torch.Generator().manual_seed(10 * t + rank))
            model.zero_grad()
            (model(x).pow(2).sum() * scale).backward()
            return all(bool(torch.isfinite(p.grad.to_local()).all()) for p in model.parameters())

        back(0), back(1)  # the warm-up, then a 1-bit step: the errors are not zero
        before, steps = state.state_dict()["errors"], dict(state.steps)
        poison.on = case != "overflow"
        try:
            finite = back(2, float("inf") if case == "overflow" else 1.0)
        except Exception as e:  # noqa: BLE001 - the test reads it
            finite = f"{type(e).__name__}: {e}"
        poison.on = False
        after = state.state_dict()["errors"]
        out[case] = {"finite": finite, "steps": state.steps == steps,
                     "errors": sorted(before) == sorted(after) and all(
                         torch.equal(a, b) for k in before for a, b in zip(before[k], after[k])),
                     "moved": any(float(v[0].abs().max()) > 0 for v in after.values()),
                     "next": back(3)}
    return out


def one_rank_momentum_cases(rank: int, world: int) -> Dict[str, Any]:
    """World size 1, onebit's momentum modes: FSDP runs no reduce-scatter (no hook hands a
    momentum over), so each parameter's own momentum drives the frozen phase: the same bits as
    FrozenVarianceAdam with an int freeze_step (it raised at every step after the freeze)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import compcomm.fsdp as cf

    out: Dict[str, Any] = {}
    runs = {}
    for mode in (None, "local_momentum", "plain"):
        torch.manual_seed(0)
        model = _mlp()
        for m in (model[0], model[2], model):
            fully_shard(m, mesh=init_device_mesh("cpu", (1,)))
        freeze: Any = 2
        if mode != "plain":
            freeze = cf.onebit(model, warmup_steps=2, mode=mode)
        opt = cf.FrozenVarianceAdam(model.parameters(), lr=1e-2, freeze_step=freeze)
        runs[mode] = _train(model, opt, rank, range(5))
    for mode in (None, "local_momentum"):
        out[str(mode)] = all(torch.equal(a, b) for x, y in zip(runs[mode], runs["plain"])
                             for a, b in zip(x, y))
    return out


def shard_dim1_cases(rank: int, world: int) -> Dict[str, Any]:
    """A parameter sharded on dim 1 (``shard_placement_fn``): the planned pieces are FSDP's
    (padded on that dim). The gradient mode then uses its planned segment (it fell back to one
    flat segment of another size), and the momentum mode, its average exact, follows
    FrozenVarianceAdam on FSDP's own reduce-scatter (it failed at the switch)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    import compcomm.fsdp as cf
    from compcomm.fsdp_layout import shard_params

    def build():
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(12, 7, bias=False), torch.nn.Tanh(),
                                    torch.nn.Linear(7, 4, bias=False))
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)),
                    shard_placement_fn=lambda p: Shard(1) if p.shape[1] == 12 else None)
        return model

    def train(model, opt):
        for t in range(4):
            opt.zero_grad()
            x = torch.randn(4, 12, generator=torch.Generator().manual_seed(10 * t + rank))
            model(x).pow(2).sum().backward()
            opt.step()
        return [p.detach().to_local().clone() for p in model.parameters()]

    model = build()
    st = cf.onebit(model, warmup_steps=1, mode="gradient")
    train(model, torch.optim.SGD(model.parameters(), lr=0.1))
    keys = sorted(st.state_dict()["errors"])
    ref_model = build()
    ref = train(ref_model, cf.FrozenVarianceAdam(ref_model.parameters(), lr=1e-2, freeze_step=1))
    model = build()
    st = cf.onebit(model, warmup_steps=1, mode="momentum")
    st.momentum.exact = True  # full-precision average: FSDP's own, to rounding
    got = train(model, cf.FrozenVarianceAdam(model.parameters(), lr=1e-2, freeze_step=st))
    err = max(float((a - b).abs().max()) for a, b in zip(got, ref))
    return {"keys": keys, "pieces": [pc for _, pc, _ in shard_params(model)], "err": err}
