"""Rank bodies for the ZeRO tests (module-level so run_ranks can pickle them)."""

from __future__ import annotations

import copy
from typing import Any, Dict, List

import torch


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(
        torch.nn.Linear(8, 24),
        torch.nn.LayerNorm(24),
        torch.nn.ReLU(),
        torch.nn.Linear(24, 24),
        torch.nn.Tanh(),
        torch.nn.Linear(24, 3),
    )
    return m.to(dtype)


def batch(rank: int, step: int, micro: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    x = torch.randn(5, 8, generator=g).to(dtype)
    y = torch.randn(5, 3, generator=g).to(dtype)
    return x, y


def loss_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x).float() - y.float()) ** 2).mean()


def reference_train(world: int, steps: int, gas: int, opt_cls, opt_kwargs, clip: float = 0.0,
                    dtype=torch.float32) -> List[torch.Tensor]:
    """Unsharded training on one process: the average gradient over all ranks' micro-batches."""
    model = make_model(dtype=torch.float32)
    opt = opt_cls(model.parameters(), **opt_kwargs)
    for s in range(steps):
        for k in range(gas):
            for r in range(world):
                x, y = batch(r, s, k, dtype)
                if dtype != torch.float32:  # same input rounding as the low-precision model
                    loss_fn(model, x.float(), y.float()).backward()
                else:
                    loss_fn(model, x, y).backward()
        for p in model.parameters():
            p.grad /= world * gas
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def train_equivalence(rank: int, world: int, cases: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    from compcomm.zero import ZeroOptimizer

    results = []
    for case in cases:
        stage, gas, steps = case["stage"], case.get("gas", 1), case.get("steps", 3)
        opt_cls = getattr(torch.optim, case.get("opt", "Adam"))
        kw = case.get("opt_kwargs", {"lr": 1e-2})
        clip = case.get("clip", 0.0)
        model = make_model()
        zopt = ZeroOptimizer(
            model.parameters(), opt_cls, stage=stage, module=model, optimizer_kwargs=kw,
            gradient_accumulation_steps=gas, gradient_clipping=clip, **case.get("zero", {}),
        )
        for s in range(steps):
            for k in range(gas):
                x, y = batch(rank, s, k)
                loss_fn(model, x, y).backward()
            zopt.step()
        if stage == 3:
            results_extra = {"peak_live": zopt._stage3.peak_live}
        else:
            results_extra = {}
        if stage == 3:
            zopt.gather_parameters()
        got = [p.detach().clone() for p in model.parameters()]
        zopt.close()
        ref = reference_train(world, steps, gas, opt_cls, kw, clip)
        err = max(float((a - b).abs().max()) for a, b in zip(got, ref))
        moved = max(float((a - b).abs().max()) for a, b in zip(ref, [q.detach() for q in make_model().parameters()]))
        results.append(dict(results_extra, case=case, err=err, moved=moved))
    return results


def memory_and_checkpoint(rank: int, world: int, ckpt_dir: str) -> Dict[str, Any]:
    """Per-rank measured bytes per stage (after a backward, before its step), and a checkpoint
    round trip + consolidation for each stage."""
    import os

    from compcomm.zero import ZeroOptimizer, consolidate, load_checkpoint, save_checkpoint

    out: Dict[str, Any] = {"mem": {}, "ckpt": {}}
    for stage in (1, 2, 3):
        model = make_model()
        zopt = ZeroOptimizer(
            model.parameters(), torch.optim.Adam, stage=stage, module=model,
            optimizer_kwargs={"lr": 1e-2}, reduce_bucket_size=200,
            stage3_param_persistence_threshold=0,
        )
        for s in range(2):
            x, y = batch(rank, s, 0)
            loss_fn(model, x, y).backward()
            if s == 0:
                zopt.step()
        mem = zopt.memory_bytes()
        out["mem"][stage] = {"measured": mem, "shard_numel": sum(g.plan.shard_numel for g in zopt.groups),
                             "num_buckets": sum(g.plan.num_buckets for g in zopt.groups)}
        zopt.step()
        d = os.path.join(ckpt_dir, f"stage{stage}")
        save_checkpoint(zopt, d, module=model)
        # expected full weights: the model's own (stage 3: gathered)
        zopt.gather_parameters()
        full = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        state_before = {k: v.clone() for k, v in zopt.optimizer.state[zopt.groups[0].master].items()}
        # perturb, then load: must restore masters, optimizer state and parameters
        x, y = batch(rank, 7, 0)
        loss_fn(model, x, y).backward()
        zopt.step()
        load_checkpoint(zopt, d)
        zopt.gather_parameters()
        restored = max(float((p.detach().float() - full[n]).abs().max()) for n, p in model.named_parameters())
        st = zopt.optimizer.state[zopt.groups[0].master]
        state_ok = all(torch.equal(st[k], state_before[k]) for k in state_before)
        torch.distributed.barrier()
        cons_err = None
        if rank == 0:
            cons = consolidate(d)
            cons_err = max(float((cons[n] - full[n]).abs().max()) for n in full)
            assert set(cons) == set(full), (sorted(cons), sorted(full))
        out["ckpt"][stage] = {"restored_err": restored, "state_ok": state_ok, "cons_err": cons_err}
        zopt.close()
    return out


def bucketed_collectives(rank: int, world: int) -> Dict[str, Any]:
    """Sync and async bucketed reduce-scatter / all-gather against torch on awkward sizes."""
    from compcomm import _C
    from compcomm._buffers import buffer_of
    from compcomm._comm import resolve

    comm = resolve(None)
    out: Dict[str, Any] = {"ok": [], "bytes": []}
    for sizes, bucket, align, max_ag, dtype in [
        ([0, 1, 7, 1000, 4099], 1024, 2, 0, torch.float32),
        ([3, 5, 2, 11], 8, 1, 6, torch.float32),
        ([4099, 1], 0, 2, 100, torch.bfloat16),
        ([7, 7, 7], 100, 4, 0, torch.float16),
    ]:
        plan = _C.zero.plan_buckets(sizes, bucket, world, align)
        g = torch.Generator().manual_seed(rank)
        flat = torch.randn(plan.flat_numel, generator=g).to(dtype)
        total = flat.float().clone()
        torch.distributed.all_reduce(total)
        shard = torch.empty(plan.shard_numel, dtype=dtype)
        comm.reset_bytes_sent()
        a = _C.zero.AsyncComm(comm)
        a.bucketed_reduce_scatter(plan, buffer_of(flat), buffer_of(shard)).wait(60)
        expect = torch.cat([total[b["offset"] + rank * b["chunk"]: b["offset"] + (rank + 1) * b["chunk"]]
                            for b in plan.buckets]) if plan.buckets else torch.empty(0)
        tol = 1e-5 if dtype == torch.float32 else 0.1
        ok_rs = bool(torch.allclose(shard.float(), expect, atol=tol * world, rtol=tol))
        gathered = torch.empty(plan.flat_numel, dtype=dtype)
        staging = torch.empty(max_ag, dtype=dtype)
        a.bucketed_all_gather(plan, buffer_of(shard), buffer_of(gathered), 0, -1, max_ag,
                              buffer_of(staging)).wait(60)
        full = torch.empty(plan.flat_numel, dtype=dtype)
        _C.zero.bucketed_all_gather(comm, plan, buffer_of(shard), buffer_of(full), 0, -1, max_ag,
                                    buffer_of(staging))
        ok_ag = bool(torch.equal(gathered, full)) and bool(
            torch.allclose(gathered.float(), total, atol=tol * world, rtol=tol))
        a.close()
        out["ok"].append((ok_rs, ok_ag))
        out["bytes"].append(comm.bytes_sent)
    # an error inside the worker surfaces from wait() with the rank and call named
    a = _C.zero.AsyncComm(comm)
    send, recv = torch.zeros(3), torch.zeros(2)  # 3 != 2 * world for every world
    bad = a.reduce_scatter(buffer_of(send), buffer_of(recv))
    try:
        bad.wait(10)
        out["error"] = None
    except ValueError as e:
        out["error"] = str(e)
    a.close()
    return out


def mixed_precision(rank: int, world: int) -> Dict[str, Any]:
    """bf16 parameters with fp32 master shards: every stage lands near fp32 training."""
    from compcomm.zero import ZeroOptimizer

    res = {}
    ref = reference_train(world, 3, 1, torch.optim.Adam, {"lr": 1e-2}, dtype=torch.bfloat16)
    for stage in (1, 2, 3):
        model = make_model(dtype=torch.bfloat16)
        z = ZeroOptimizer(model.parameters(), torch.optim.Adam, stage=stage, module=model,
                          optimizer_kwargs={"lr": 1e-2}, reduce_bucket_size=300)
        for s in range(3):
            x, y = batch(rank, s, 0, torch.bfloat16)
            loss_fn(model, x, y).backward()
            z.step()
        z.gather_parameters()
        res[stage] = {
            "err": max(float((p.detach().float() - r).abs().max()) for p, r in zip(model.parameters(), ref)),
            "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "master": str(z.groups[0].master.dtype),
        }
        z.close()
    return res


def rank_body(rank: int, world: int, ckpt_dir: str, cases: List[Dict[str, Any]],
              with_mixed: bool) -> Dict[str, Any]:
    """Everything the multi-rank tests check, in one spawn per world size."""
    return {
        "collectives": bucketed_collectives(rank, world),
        "equivalence": train_equivalence(rank, world, cases),
        "memory_ckpt": memory_and_checkpoint(rank, world, ckpt_dir),
        "mixed": mixed_precision(rank, world) if with_mixed else None,
        "compressed": compressed_rs(rank, world),
        "bucket_sizes": bucket_sizes(rank, world),
    }


def _split_reduce_scatter(m: torch.Tensor, we: torch.Tensor, se: torch.Tensor) -> torch.Tensor:
    """compressed_reduce_scatter as ZeroOptimizer's overlapped path runs it: the exchange queued on
    an AsyncComm, then the commit."""
    from compcomm import _C
    from compcomm._buffers import buffer_of
    from compcomm._comm import resolve
    from compcomm.collectives import _layout_total

    comm = resolve(None)
    out = torch.empty(we.numel() // comm.size())
    ws = torch.zeros(_layout_total(we.numel(), comm.size(), False), dtype=torch.uint8)
    bufs = [buffer_of(t) for t in (m, we, se, out, ws)]
    a = _C.zero.AsyncComm(comm)
    a.compressed_reduce_scatter_exchange(*bufs, timeout_s=60.0).wait(60.0)
    a.close()
    _C.zero.compressed_reduce_scatter_commit(comm, *bufs)
    return out


def compressed_rs(rank: int, world: int) -> Dict[str, Any]:
    """compressed_reduce_scatter vs compressed_allreduce (same call sequence) and vs a numpy oracle."""
    import numpy as np

    import compcomm
    from compcomm.zero import compressed_reduce_scatter

    out: Dict[str, Any] = {"cases": []}
    for n, dtype in [(1, torch.float32), (7, torch.float32), (1000, torch.float32), (4099, torch.bfloat16),
                     (515, torch.float16)]:
        P = compcomm.padded_numel(n, world)
        g = torch.Generator().manual_seed(100 + rank)
        we, se = compcomm.error_buffers(n)
        we.copy_(torch.randn(P, generator=g) * 0.1)
        se.copy_(torch.randn(P // world, generator=g) * 0.1)
        we2, se2 = we.clone(), se.clone()
        we3, se3 = we.clone(), se.clone()
        inputs, outs = [], []
        for it in range(2):  # two calls: error feedback carries over
            m = torch.randn(n, generator=g).to(dtype)
            inputs.append(m.float().numpy().copy())
            m_rs, m_ar, m_split = m.clone(), m.clone(), m.clone()
            o = compressed_reduce_scatter(m_rs, we, se)
            compcomm.compressed_allreduce(m_ar, we2, se2)
            o_split = _split_reduce_scatter(m_split, we3, se3)
            C = P // world
            full = torch.zeros(P)
            full[:n] = m_ar.float()
            # chunk positions beyond n are not in m_ar: compare those against the oracle only
            lim = max(0, min(C, n - rank * C))
            same_chunk = bool(torch.equal(o[:lim].to(dtype).float(), full[rank * C: rank * C + lim]))
            mask = torch.zeros(n, dtype=torch.bool)
            mask[rank * C: rank * C + lim] = True
            tensor_ok = bool(torch.equal(m_rs.float()[mask], m_ar.float()[mask])) and bool(
                (m_rs.float()[~mask] == 0).all())
            outs.append(o.numpy().copy())
            out["cases"].append({"n": n, "it": it, "same_chunk": same_chunk, "tensor_ok": tensor_ok,
                                 "errors_equal": bool(torch.equal(we, we2) and torch.equal(se, se2)),
                                 # the exchange/commit halves (ZeRO's overlapped path) == one call
                                 "split_equal": bool(torch.equal(o_split, o) and torch.equal(m_split, m_rs)
                                                     and torch.equal(we3, we) and torch.equal(se3, se))})
        out.setdefault("oracle", []).append({"n": n, "inputs": inputs, "outs": outs,
                                             "we": we.numpy().copy(), "se": se.numpy().copy()})
    return out


def bucket_sizes(rank: int, world: int) -> Dict[str, Any]:
    """Sizes of the collectives ZeroOptimizer issues (through a recording communicator)."""
    from compcomm._comm import TorchCommunicator
    from compcomm.zero import ZeroOptimizer

    class Recorder(TorchCommunicator):
        def __init__(self):
            super().__init__()
            self.calls: List[tuple] = []

        def do_reduce_scatter(self, send, recv, op, opts):
            self.calls.append(("rs", send.count))
            super().do_reduce_scatter(send, recv, op, opts)

        def do_all_gather(self, send, recv, opts):
            self.calls.append(("ag", recv.count))
            super().do_all_gather(send, recv, opts)

    out = {}
    for stage, zcfg in [(1, {"reduce_bucket_size": 100, "allgather_bucket_size": 64}),
                        (2, {"reduce_bucket_size": 100, "allgather_bucket_size": 64, "overlap_comm": True}),
                        (3, {"stage3_prefetch_bucket_size": 300, "stage3_max_live_parameters": 700,
                             "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0})]:
        comm = Recorder()
        model = make_model()
        z = ZeroOptimizer(model.parameters(), torch.optim.Adam, stage=stage, process_group=comm,
                          module=model, **zcfg)
        comm.calls.clear()
        for s in range(3):
            x, y = batch(rank, s, 0)
            loss_fn(model, x, y).backward()
            z.step()
        st = z._stage3
        out[stage] = {
            "rs": [n for k, n in comm.calls if k == "rs"],
            "ag": [n for k, n in comm.calls if k == "ag"],
            "largest": max(p.numel() if stage < 3 else p._zero_numel for p in model.parameters()),
            "peak_live": st.peak_live if st else None,
            "prefetched": st.prefetched if st else None,
        }
        z.close()
    return out


def save_filled(rank: int, world: int, directory: str, value: float) -> None:
    """Save a ZeRO checkpoint of a Linear whose weights are all ``value``."""
    from compcomm.zero import ZeroOptimizer, save_checkpoint

    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    z = ZeroOptimizer(model.parameters(), torch.optim.SGD, stage=1, optimizer_kwargs={"lr": 0.1})
    save_checkpoint(z, directory, module=model)
    z.close()
