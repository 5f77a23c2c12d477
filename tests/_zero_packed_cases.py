"""Rank bodies for tests/test_zero_packed_momentum.py: the compressor's packed results, and ZeRO +
OneBitAdam keeping its replicated momentum in the 1-bit form."""

from __future__ import annotations

from typing import Any, Dict, List

import torch

import _zero_onebit_modes_cases as mc
from _zero_onebit_cases import _flat, plain_run

NUMELS = [1, 37, 1000, 4099]  # padded to a multiple of 8 W: padding in the last chunk(s)


def packed_average(rank: int, world: int, device: str = "cpu") -> Dict[str, Any]:
    """Three rounds of OneBitCompressor.packed_average (error feedback carried over): whether the
    handed-back signs and scales unpack, on both paths, to the averaged buckets bit for bit."""
    from compcomm._comm import resolve
    from compcomm.compress import OneBitCompressor
    from compcomm.zero.packed_momentum import pack, unpack, unpack_torch

    dev = torch.device(device)
    comp = OneBitCompressor(resolve(None))
    gen = torch.Generator().manual_seed(100 + rank)
    out: Dict[str, Any] = {"exact": [], "repack": [], "same_on_ranks": [], "packs": None}
    keys = [("b", i) for i in range(len(NUMELS))]
    for _ in range(3):
        xs = [torch.randn(n, generator=gen).to(dev) for n in NUMELS]
        packs = comp.packed_average(keys, NUMELS, lambda i: xs[i], dev)
        if packs is None:
            out["packs"] = None
            return out
        out["packs"] = [(s.cpu().numpy().copy(), t.cpu().numpy().copy()) for s, t in packs]
        for x, (signs, scales) in zip(xs, packs):
            n, padded = x.numel(), signs.numel() * 8
            chunk = padded // world
            got = unpack(signs, scales, chunk, n, 0, torch.empty(padded, device=dev))
            got2 = unpack_torch(signs, scales, chunk, n, 0, torch.empty(padded, device=dev))
            out["exact"].append(torch.equal(got[:n], x) and torch.equal(got2, got)
                                and bool((got[n:] == 0).all()))
            full = torch.zeros(padded, device=dev)
            full[:n] = x
            s2, t2 = pack(full, chunk)
            again = unpack(s2, t2, chunk, n, 0, torch.empty(padded, device=dev))
            out["repack"].append(torch.equal(again, got))
    comp.close()
    return out


def zero_packed(rank: int, world: int, case: Dict[str, Any]) -> Dict[str, Any]:
    """ZeRO + OneBitAdam (case's mode/stage/dtype) against unsharded OneBitAdam, and what the
    replicated momentum holds after the run."""
    from compcomm._comm import resolve
    from compcomm.optim import OneBitAdam

    comm = resolve(None)
    dtype = getattr(torch, case.get("dtype", "float32"))
    params = mc.init_params(dtype)
    model = mc._Synthetic(params)
    z = mc._zero(params, comm, case, model)
    out: Dict[str, Any] = {"zero": []}
    for t in range(1, case["steps"] + 1):
        mc._backward(model, rank, t, case["gas"])
        z.step()
        z.gather_parameters()
        out["zero"].append(_flat(params))
    rep = z._replicated
    out["fp32_momentum_groups"] = len(rep.m)
    out["packed_keys"] = sorted(rep.packed.keys())
    out["buckets"] = len(z.groups[0].buckets)
    out["packed_bytes"] = rep.packed.nbytes()
    out["flat"] = sum(b.padded for b in z.groups[0].buckets)
    # the shards hold exactly the unpacked momentum (what a checkpoint saves)
    st = z.optimizer.state[z.groups[0].master]
    ok = True
    for bi, b in enumerate(z.groups[0].buckets):
        if (0, bi) in rep.packed:
            chunk = torch.empty(b.chunk)
            rep.packed.unpack_((0, bi), chunk, begin=rank * b.chunk)
            ok = ok and torch.equal(chunk, b.shard_of(st["exp_avg"]))
    out["shards_match"] = ok
    z.close()
    params = mc.init_params(dtype)
    opt = OneBitAdam(params, process_group=comm, reduce_bucket_size=mc.BUCKET,
                     per_parameter=case["stage"] == 3, **case["kwargs"])
    model = mc._Synthetic(params)
    out["plain"] = plain_run(opt, params, lambda t: mc._backward(model, rank, t, case["gas"]),
                             case["steps"], case["gas"])
    return out


def rank_body(rank: int, world: int, cases: List[Dict[str, Any]], resumes: List[Dict[str, Any]],
              directory: str, device: str = "cpu") -> Dict[str, Any]:
    from compcomm._comm import resolve

    out = {"avg": packed_average(rank, world, device),
           "cases": [zero_packed(rank, world, c) for c in cases]}
    comm = resolve(None)
    out["resume"] = [mc.resume(rank, world, comm, c, f"{directory}/r{i}")
                     for i, c in enumerate(resumes)]
    return out
