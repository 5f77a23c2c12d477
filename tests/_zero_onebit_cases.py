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


def _loss(params, rank: int, step: int, micro: int) -> torch.Tensor:
    """The synthetic loss sum(p * G): its gradient is exactly ``grad(rank, step, micro, i)``."""
    sizes = [p.numel() for p in params]
    return sum((p * grad(rank, step, micro, i, sizes)).sum() for i, p in enumerate(params))


def _backward(params, rank: int, step: int, micro: int) -> None:
    _loss(params, rank, step, micro).backward()


def plain_run(opt: Any, params, backward, steps: int, gas: int) -> List[Any]:
    """The unsharded twin's trajectory: ``steps`` steps of ``opt``, each after ``backward(t)``
    (which accumulates ``gas`` micro-steps; the sum is divided by ``gas``, exact for 2); the flat
    parameters after every step."""
    out = []
    for t in range(1, steps + 1):
        backward(t)
        if gas > 1:
            for p in params:
                p.grad.mul_(1.0 / gas)  # exact for gas = 2
        opt.step()
        opt.zero_grad()
        out.append(_flat(params))
    return out


def _flat(params) -> Any:
    return torch.cat([p.detach().float().reshape(-1) for p in params]).numpy().copy()


def _state_tensors(opt) -> List[torch.Tensor]:
    """The optimizer's non-scalar state tensors."""
    return [v for st in opt.state.values() for v in st.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0]


class _Synthetic(torch.nn.Module):
    """The parameters as one module, so that stage 3's hooks gather them for the synthetic loss."""

    def __init__(self, params: List[torch.nn.Parameter]) -> None:
        super().__init__()
        self.n = len(params)
        for i, p in enumerate(params):
            setattr(self, f"p{i}", p)

    def forward(self, rank: int, step: int, micro: int) -> torch.Tensor:
        return _loss([getattr(self, f"p{i}") for i in range(self.n)], rank, step, micro)


def _optimizer(case: Dict[str, Any]):
    from compcomm.optim import OneBitAdam, ZeroOneAdam

    return {"OneBitAdam": OneBitAdam, "ZeroOneAdam": ZeroOneAdam,
            "Adam": torch.optim.Adam}[case["opt"]]


def run_case(rank: int, world: int, comm: Any, case: Dict[str, Any]) -> Dict[str, Any]:
    from compcomm.zero import ZeroOptimizer

    params = _params(case.get("sizes", SIZES))
    model = _Synthetic(params)  # stage 3 gathers the parameters in its forward
    z = ZeroOptimizer(params, _optimizer(case), stage=case["stage"], process_group=comm, module=model,
                      optimizer_kwargs=case["kwargs"], gradient_accumulation_steps=case["gas"],
                      gradient_clipping=case.get("clip", 0.0),
                      reduce_bucket_size=case["bucket"], overlap_comm=case.get("overlap", False),
                      # these cases test the sharded-contribution variant (onebit_mode "sharded")
                      onebit_mode="sharded" if case["opt"] == "OneBitAdam" else None)
    out: Dict[str, Any] = {"params": [], "bytes": [], "compressed": []}
    for t in range(1, case["steps"] + 1):
        out["compressed"].append(z._compressed_phase())
        comm.reset_bytes_sent()
        for micro in range(case["gas"]):
            model(rank, t, micro).backward()
        z.step()
        out["bytes"].append(comm.bytes_sent)
        z.gather_parameters()  # stage 3: released after the step
        out["params"].append(_flat(params))
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
        res.append(_flat(params))
    return res


def _zoa_backward(params, rank: int, t: int, gas: int) -> None:
    for micro in range(gas):
        _backward(params, rank, t, micro)


def local_phase_case(rank: int, world: int, comm: Any, case: Dict[str, Any]) -> Dict[str, Any]:
    """ZeroOneAdam through its variance and local-step phases, under ZeRO and unsharded on the
    same gradients: parameters, step kinds and bytes per step, memory in the local phase."""
    from compcomm.optim import ZeroOneAdam
    from compcomm.zero import ZeroOptimizer

    dtype = getattr(torch, case.get("dtype", "float32"))
    params = [torch.nn.Parameter(p.to(dtype)) for p in _params()]
    z = ZeroOptimizer(params, ZeroOneAdam, stage=case["stage"], process_group=comm,
                      optimizer_kwargs=case["kwargs"], gradient_accumulation_steps=case["gas"],
                      reduce_bucket_size=case["bucket"])
    out: Dict[str, Any] = {"zero": [], "kinds": [], "bytes": []}
    for t in range(1, case["steps"] + 1):
        out["kinds"].append(z.optimizer.step_kind())
        comm.reset_bytes_sent()
        _zoa_backward(params, rank, t, case["gas"])
        z.step()
        out["bytes"].append(comm.bytes_sent)
        out["zero"].append(_flat(params))
    out["memory"] = z.memory_bytes()
    out["local_phase"] = z._local_phase
    z.close()
    # the bytes of the norm all-reduce alone (what a local step may send)
    from compcomm import _C
    from compcomm._buffers import buffer_of

    scalar = torch.zeros(1, dtype=torch.float64)  # kept alive: the Buffer does not own it
    comm.reset_bytes_sent()
    comm.all_reduce(buffer_of(scalar), _C.ReduceOp.sum, 60.0)
    out["norm_bytes"] = comm.bytes_sent

    params = [torch.nn.Parameter(p.to(dtype)) for p in _params()]
    opt = ZeroOneAdam(params, process_group=comm, **case["kwargs"])
    out["plain"] = plain_run(opt, params, lambda t: _zoa_backward(params, rank, t, case["gas"]),
                             case["steps"], case["gas"])
    inner = opt.memory_bytes()
    out["plain_state_bytes"] = sum(v.numel() * v.element_size()
                                   for v in _state_tensors(opt)) + inner["error_feedback"]
    out["plain_buffer_bytes"] = inner["buffers"]
    return out


def resume_case(rank: int, world: int, comm: Any, case: Dict[str, Any],
                directory: str) -> Dict[str, Any]:
    """Checkpoints of ZeRO + ZeroOneAdam (exact_resume) in the variance phase and in the middle of a
    local-step interval, resumed into fresh optimizers and into one already in the local phase."""
    from compcomm.optim import ZeroOneAdam
    from compcomm.zero import ZeroOptimizer, consolidate, load_checkpoint, save_checkpoint

    def build():
        params = _params()
        z = ZeroOptimizer(params, ZeroOneAdam, stage=case["stage"], process_group=comm,
                          optimizer_kwargs=case["kwargs"], reduce_bucket_size=case["bucket"])
        return params, z

    def run(params, z, first, last, save_at=()):
        traj = {}
        for t in range(first, last + 1):
            _zoa_backward(params, rank, t, 1)
            z.step()
            traj[t] = _flat(params)
            if t in save_at:
                save_checkpoint(z, f"{directory}/step{t}")
        return traj

    params, z = build()
    # the files of step s are all written before any rank finishes step s+1 (a collective)
    full = run(params, z, 1, case["steps"], save_at=case["save_at"])
    out: Dict[str, Any] = {"full": full, "resumed": {}}
    for s in case["save_at"]:
        p2, z2 = build()
        load_checkpoint(z2, f"{directory}/step{s}")
        out["resumed"][("fresh", s)] = run(p2, z2, s + 1, case["steps"])
        z2.close()
    # load the variance-phase checkpoint into the optimizer that finished in the local phase
    s0 = case["save_at"][0]
    load_checkpoint(z, f"{directory}/step{s0}")
    out["resumed"][("reused", s0)] = run(params, z, s0 + 1, case["steps"])
    z.close()
    if rank == 0:
        out["consolidated"] = {}
        for s in case["save_at"]:
            full_sd = consolidate(f"{directory}/step{s}")
            out["consolidated"][s] = torch.cat([v.reshape(-1) for v in full_sd.values()]).numpy()
    return out


def overlap_nonfinite(rank: int, world: int, comm: Any) -> Dict[str, Any]:
    """Stage 2 + overlap_comm, 1-bit steps: a NaN in one rank's gradient skips the step on every rank
    with nothing changed (the buckets exchanged before the bad one are not committed); one backward
    pass too many raises and zero_grad() recovers."""
    from compcomm.optim import OneBitAdam
    from compcomm.zero import ZeroOptimizer

    params = _params()
    z = ZeroOptimizer(params, OneBitAdam, stage=2, process_group=comm, reduce_bucket_size=12,
                      overlap_comm=True, optimizer_kwargs={"lr": 1e-2, "freeze_step": 1},
                      onebit_mode="sharded")

    def snapshot():
        return ([p.detach().clone() for p in params],
                {k: (we.clone(), se.clone()) for k, (we, se) in z._errors.items()},
                [v.clone() for v in _state_tensors(z.optimizer)])

    def same(a, b):
        return (all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and a[1].keys() == b[1].keys()
                and all(torch.equal(a[1][k][i], b[1][k][i]) for k in a[1] for i in (0, 1))
                and all(torch.equal(x, y) for x, y in zip(a[2], b[2])))

    for t in (1, 2):
        _backward(params, rank, t, 0)
        z.step()
    before = snapshot()
    out: Dict[str, Any] = {"exchanged_in_backward": None}
    loss = _loss(params, rank, 3, 0)
    if rank == world - 1:
        loss = loss + params[2][0] * float("nan")  # bucket 1 of 3
    loss.backward()
    out["exchanged_in_backward"] = len(z._exchanges)
    z.step()
    out["skipped"] = z.skipped_steps
    out["unchanged"] = same(before, snapshot())
    _backward(params, rank, 4, 0)
    try:
        _backward(params, rank, 4, 1)  # one micro-step too many
        out["too_many"] = ""
    except RuntimeError as e:
        out["too_many"] = str(e)
    z.zero_grad()
    _backward(params, rank, 4, 0)
    z.step()
    out["recovered"] = not same(before, snapshot())
    z.close()
    return out


def local_nonfinite(rank: int, world: int, comm: Any) -> Dict[str, Any]:
    """ZeroOneAdam's local phase under ZeRO: a NaN in one rank's gradient skips the step on every
    rank (the norm all-reduce sees it) with parameters and optimizer state unchanged."""
    from compcomm.optim import ZeroOneAdam
    from compcomm.zero import ZeroOptimizer

    params = _params()
    z = ZeroOptimizer(params, ZeroOneAdam, stage=2, process_group=comm, reduce_bucket_size=12,
                      optimizer_kwargs={"lr": 1e-2, "var_freeze_step": 1, "local_step_scaler": 1,
                                        "local_step_clipper": 4})
    for t in (1, 2, 3):
        _backward(params, rank, t, 0)
        z.step()

    def snapshot():
        return ([p.detach().clone() for p in params]
                + [v.clone() for v in _state_tensors(z.optimizer)])

    before = snapshot()
    kind = z.optimizer.step_kind()
    loss = _loss(params, rank, 4, 0)
    if rank == world - 1:
        loss = loss + params[1][0] * float("inf")
    loss.backward()
    z.step()
    after = snapshot()
    out = {"local_phase": z._local_phase, "kind": kind, "skipped": z.skipped_steps,
           "unchanged": all(torch.equal(a, b) for a, b in zip(before, after)) and len(before) == len(after),
           "kind_after": z.optimizer.step_kind()}
    _backward(params, rank, 4, 0)
    z.step()
    out["recovered"] = not torch.equal(params[0].detach(), before[0])
    z.close()
    return out


def rank_body(rank: int, world: int, cases: List[Dict[str, Any]], warm_kwargs: Dict[str, Any],
              warm_steps: int, local_cases: List[Dict[str, Any]], resume: Dict[str, Any],
              directory: str) -> Dict[str, Any]:
    from compcomm._comm import resolve

    comm = resolve(None)
    return {
        "cases": [run_case(rank, world, comm, c) for c in cases],
        "unsharded": unsharded(rank, world, comm, warm_steps, warm_kwargs),
        "local": [local_phase_case(rank, world, comm, c) for c in local_cases],
        "resume": resume_case(rank, world, comm, resume, directory),
        "overlap_nonfinite": overlap_nonfinite(rank, world, comm) if world > 1 else None,
        "local_nonfinite": local_nonfinite(rank, world, comm),
    }
