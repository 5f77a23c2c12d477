"""Rank bodies for tests/test_zero_onebit.py: ZeroOptimizer with OneBitAdam / ZeroOneAdam on
synthetic gradients (loss = sum(p * G), so the gradient is exactly G), one spawn per world size."""

from __future__ import annotations

from typing import Any, Dict, List

import torch

SIZES = [5, 7, 3, 11]  # none a multiple of 8, buckets of reduce_bucket_size=12 split them unevenly


def init_params(sizes: List[int] = SIZES) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(n, generator=g) for n in sizes]


def grad(rank: int, step: int, micro: int, i: int, sizes: List[int] = SIZES) -> torch.Tensor:
    """Rank ``rank``'s gradient of parameter i in micro-step ``micro`` of step ``step``."""
    g = torch.Generator().manual_seed(100000 * step + 1000 * micro + 10 * i + rank)
    return torch.randn(sizes[i], generator=g) * (0.5 + i)


def _params(sizes: List[int] = SIZES) -> List[torch.nn.Parameter]:
    return [torch.nn.Parameter(t.clone()) for t in init_params(sizes)]


def _backward(params, rank: int, step: int, micro: int) -> None:
    sizes = [p.numel() for p in params]
    loss = sum((p * grad(rank, step, micro, i, sizes)).sum() for i, p in enumerate(params))
    loss.backward()


def _optimizer(case: Dict[str, Any]):
    from compcomm.optim import OneBitAdam, ZeroOneAdam

    return {"OneBitAdam": OneBitAdam, "ZeroOneAdam": ZeroOneAdam,
            "Adam": torch.optim.Adam}[case["opt"]]


def run_case(rank: int, world: int, comm: Any, case: Dict[str, Any]) -> Dict[str, Any]:
    from compcomm.zero import ZeroOptimizer

    params = _params(case.get("sizes", SIZES))
    z = ZeroOptimizer(params, _optimizer(case), stage=case["stage"], process_group=comm,
                      optimizer_kwargs=case["kwargs"], gradient_accumulation_steps=case["gas"],
                      gradient_clipping=case.get("clip", 0.0),
                      reduce_bucket_size=case["bucket"])
    out: Dict[str, Any] = {"params": [], "bytes": [], "compressed": []}
    for t in range(1, case["steps"] + 1):
        out["compressed"].append(z._compressed_phase())
        comm.reset_bytes_sent()
        for micro in range(case["gas"]):
            _backward(params, rank, t, micro)
        z.step()
        out["bytes"].append(comm.bytes_sent)
        out["params"].append(torch.cat([p.detach().reshape(-1) for p in params]).numpy().copy())
    grp = z.groups[0]
    out["plan"] = {"buckets": [dict(b) for b in grp.buckets],
                   "tensors": [tuple(x) for x in grp.tensors]}
    out["memory"] = z.memory_bytes()
    z.close()
    return out


def unsharded(rank: int, world: int, comm: Any, steps: int, kwargs: Dict[str, Any]) -> List[Any]:
    """Plain (unsharded) OneBitAdam on the same gradients: parameters after each step."""
    from compcomm.optim import OneBitAdam

    params = _params()
    opt = OneBitAdam(params, process_group=comm, **kwargs)
    res = []
    for t in range(1, steps + 1):
        _backward(params, rank, t, 0)
        opt.step()
        opt.zero_grad()
        res.append(torch.cat([p.detach().reshape(-1) for p in params]).numpy().copy())
    return res


def frozen_rejected(rank: int, world: int, comm: Any) -> str:
    """ZeroOneAdam under ZeRO reaching its local-step phase: the error message."""
    from compcomm.errors import UnsupportedError
    from compcomm.optim import ZeroOneAdam
    from compcomm.zero import ZeroOptimizer

    params = _params()
    z = ZeroOptimizer(params, ZeroOneAdam, stage=1, process_group=comm,
                      optimizer_kwargs={"lr": 1e-2, "var_freeze_step": 1})
    msg = ""
    try:
        for t in range(1, 4):
            _backward(params, rank, t, 0)
            z.step()
    except UnsupportedError as e:
        msg = str(e)
    z.close()
    return msg


def rank_body(rank: int, world: int, cases: List[Dict[str, Any]], warm_kwargs: Dict[str, Any],
              warm_steps: int) -> Dict[str, Any]:
    from compcomm._comm import resolve

    comm = resolve(None)
    return {
        "cases": [run_case(rank, world, comm, c) for c in cases],
        "unsharded": unsharded(rank, world, comm, warm_steps, warm_kwargs),
        "frozen": frozen_rejected(rank, world, comm),
    }
