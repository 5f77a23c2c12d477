"""Rank bodies for tests/test_zero_onebit_modes.py: ZeRO + OneBitAdam in the "exact" and
"no_allgather" modes against unsharded OneBitAdam configured to compress the same buckets."""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from _zero_onebit_cases import _flat, _state_tensors, plain_run
from _zero_onebit_cases import grad as _grad

SIZES = [50, 70, 30, 110]  # reduce_bucket_size 120: buckets [50, 70], [30], [110]
BUCKET = 120


def init_params(dtype: torch.dtype = torch.float32) -> List[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(7)
    return [torch.nn.Parameter(torch.randn(n, generator=g).to(dtype)) for n in SIZES]


class _Synthetic(torch.nn.Module):
    """loss = sum(p * G) with G quantized to quarters: sums over ranks and micro-steps are exact in
    bf16 too, so ZeRO's bf16 reduce-scatter and the unsharded fp32 average see the same gradient."""

    def __init__(self, params: List[torch.nn.Parameter]) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList(params)

    def forward(self, rank: int, step: int, micro: int) -> torch.Tensor:
        return sum((p * (_grad(rank, step, micro, i, SIZES) * 4).round().div(4).to(p.dtype)).sum()
                   for i, p in enumerate(self.ps))


def _zero(params, comm, case: Dict[str, Any], module=None, **extra):
    from compcomm.optim import OneBitAdam
    from compcomm.zero import ZeroOptimizer

    return ZeroOptimizer(params, OneBitAdam, stage=case["stage"], process_group=comm,
                         module=module if module is not None else _Synthetic(params),
                         optimizer_kwargs=dict(case["kwargs"], **extra),
                         gradient_accumulation_steps=case["gas"], reduce_bucket_size=BUCKET,
                         onebit_mode=case["mode"])


def _backward(model, rank: int, t: int, gas: int) -> None:
    for micro in range(gas):
        model(rank, t, micro).backward()


def trajectory(rank: int, world: int, comm: Any, case: Dict[str, Any]) -> Dict[str, Any]:
    """Parameters and bytes after each step, under ZeRO and unsharded (same gradients, same
    buckets: OneBitAdam's reduce_bucket_size equal to ZeRO's)."""
    from compcomm.optim import OneBitAdam

    dtype = getattr(torch, case.get("dtype", "float32"))
    params = init_params(dtype)
    model = _Synthetic(params)
    z = _zero(params, comm, case, model)
    out: Dict[str, Any] = {"zero": [], "bytes": [], "compressed": []}
    for t in range(1, case["steps"] + 1):
        out["compressed"].append(z._compressed_phase())
        comm.reset_bytes_sent()
        _backward(model, rank, t, case["gas"])
        z.step()
        out["bytes"].append(comm.bytes_sent)
        z.gather_parameters()
        out["zero"].append(_flat(params))
    out["memory"] = z.memory_bytes()
    out["plan"] = [dict(b) for b in z.groups[0].buckets]
    z.close()

    params = init_params(dtype)
    # stage 3 compresses each parameter on its own: the unsharded layout that matches
    opt = OneBitAdam(params, process_group=comm, reduce_bucket_size=BUCKET,
                     per_parameter=case["stage"] == 3, **case["kwargs"])
    model = _Synthetic(params)
    out["plain"] = plain_run(opt, params, lambda t: _backward(model, rank, t, case["gas"]),
                             case["steps"], case["gas"])
    return out


def nonfinite(rank: int, world: int, comm: Any, mode: str) -> Dict[str, Any]:
    """A NaN in one rank's gradient in a compressed step: skipped on every rank, nothing changed."""
    case = {"stage": 2, "gas": 1, "mode": mode, "kwargs": {"lr": 1e-2, "freeze_step": 1}}
    params = init_params()
    model = _Synthetic(params)
    z = _zero(params, comm, case, model)

    def snapshot():
        rep = z._replicated
        return ([p.detach().clone() for p in params]
                + [v.clone() for k in sorted(z._errors) for v in z._errors[k]]
                + [v.clone() for v in _state_tensors(z.optimizer)]
                + [t.clone() for d in (rep.m, rep.v, rep.w) for t in d.values()]
                + [torch.tensor(float(z.optimizer.sched["step"]))])

    for t in (1, 2, 3):
        _backward(model, rank, t, 1)
        z.step()
    before = snapshot()
    loss = model(rank, 4, 0)
    if rank == world - 1:
        loss = loss + params[2][0] * float("nan")
    loss.backward()
    z.step()
    after = snapshot()
    out = {"skipped": z.skipped_steps,
           "unchanged": len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))}
    _backward(model, rank, 4, 0)
    z.step()
    out["recovered"] = not torch.equal(params[0].detach(), before[0])
    z.close()
    return out


def zero_run(rank: int, gas: int, directory: str, params, model, z, first: int, last: int,
             save_at=()) -> Dict[int, Any]:
    """ZeroOptimizer ``z``'s steps ``first..last``: the flat parameters after each, a checkpoint
    in ``directory/step<t>`` after the steps in ``save_at``."""
    from compcomm.zero import save_checkpoint

    traj = {}
    for t in range(first, last + 1):
        _backward(model, rank, t, gas)
        z.step()
        traj[t] = _flat(params)
        if t in save_at:
            save_checkpoint(z, f"{directory}/step{t}")
    return traj


def resume(rank: int, world: int, comm: Any, case: Dict[str, Any], directory: str) -> Dict[str, Any]:
    """exact_resume checkpoints in the compressed phase, resumed into a fresh optimizer."""
    from compcomm.zero import load_checkpoint

    dtype = getattr(torch, case.get("dtype", "float32"))

    def run(params, model, z, first, last, save_at=()):
        return zero_run(rank, case["gas"], directory, params, model, z, first, last, save_at)

    params = init_params(dtype)
    model = _Synthetic(params)
    z = _zero(params, comm, case, model, exact_resume=True)
    full = run(params, model, z, 1, case["steps"], save_at=case["save_at"])
    z.close()
    out = {"full": full, "resumed": {}}
    for s in case["save_at"]:
        params = init_params(dtype)
        model = _Synthetic(params)
        z = _zero(params, comm, case, model, exact_resume=True)
        load_checkpoint(z, f"{directory}/step{s}")
        out["resumed"][s] = run(params, model, z, s + 1, case["steps"])
        z.close()
    return out


def mlp_heldout(rank: int, world: int, comm: Any, cfg: Dict[str, Any]) -> Dict[str, float]:
    """The issue's small model (Linear(37,53)-Tanh-Linear(53,11)) on a regression task: held-out
    MSE after training with unsharded OneBitAdam and with ZeRO + OneBitAdam in each mode."""
    from compcomm.optim import OneBitAdam
    from compcomm.zero import ZeroOptimizer

    g = torch.Generator().manual_seed(3)
    teacher = torch.randn(37, 11, generator=g) / 6
    xs = torch.randn(world * cfg["batch"] * cfg["steps"] + 256, 37, generator=g)
    ys = torch.tanh(xs @ teacher) + 0.05 * torch.randn(xs.shape[0], 11, generator=g)
    test_x, test_y = xs[-256:], ys[-256:]

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(37, 53), torch.nn.Tanh(), torch.nn.Linear(53, 11))

    kw = {"lr": cfg["lr"], "freeze_step": cfg["freeze"]}
    out = {}
    for name in ("plain", "exact", "no_allgather", "sharded"):
        net = model()
        if name == "plain":
            opt = OneBitAdam(net.parameters(), process_group=comm, reduce_bucket_size=BUCKET, **kw)
        else:
            opt = ZeroOptimizer(net.parameters(), OneBitAdam, stage=cfg["stage"], process_group=comm,
                                optimizer_kwargs=kw, reduce_bucket_size=BUCKET, onebit_mode=name)
        for t in range(cfg["steps"]):
            i = (t * world + rank) * cfg["batch"]
            loss = torch.nn.functional.mse_loss(net(xs[i:i + cfg["batch"]]), ys[i:i + cfg["batch"]])
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            out[name] = float(torch.nn.functional.mse_loss(net(test_x), test_y))
        if name != "plain":
            opt.close()
    return out


def rank_body(rank: int, world: int, cases, resumes, mlp, directory: str) -> Dict[str, Any]:
    from compcomm import _C
    from compcomm._buffers import buffer_of
    from compcomm._comm import resolve

    comm = resolve(None)
    out: Dict[str, Any] = {"cases": [trajectory(rank, world, comm, c) for c in cases]}
    scalar = torch.zeros(1, dtype=torch.float64)
    comm.reset_bytes_sent()
    comm.all_reduce(buffer_of(scalar), _C.ReduceOp.sum, 60.0)
    out["norm_bytes"] = comm.bytes_sent
    out["nonfinite"] = {m: nonfinite(rank, world, comm, m) for m in ("exact", "no_allgather")}
    out["resume"] = [resume(rank, world, comm, c, f"{directory}/r{i}") for i, c in enumerate(resumes)]
    out["mlp"] = mlp_heldout(rank, world, comm, mlp) if mlp else None
    return out
