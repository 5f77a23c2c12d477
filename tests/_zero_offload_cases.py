"""Rank bodies for the ZeRO-Offload tests (module-level so run_ranks can pickle them)."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import torch

import _zero_bodies as zb

OFF = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
OFF_PARAM = dict(OFF, offload_param={"device": "cpu", "pin_memory": True})
BUCKETS = {"reduce_bucket_size": 100, "allgather_bucket_size": 64}


def _build(model: torch.nn.Module, stage: int, zero: Dict[str, Any], opt: str = "AdamW",
           opt_kwargs: Optional[Dict[str, Any]] = None, **kw: Any):
    from compcomm.zero import ZeroOptimizer

    if opt in ("OneBitAdam",):
        import compcomm.optim as co
        cls = getattr(co, opt)
    else:
        cls = getattr(torch.optim, opt)
    return ZeroOptimizer(model.parameters(), cls, stage=stage, module=model,
                         optimizer_kwargs=opt_kwargs or {"lr": 1e-2, "weight_decay": 0.05},
                         **kw, **zero)


def _train(z: Any, model: torch.nn.Module, rank: int, steps: List[int], gas: int = 1,
           dtype: torch.dtype = torch.float32, nan_at: Optional[int] = None) -> None:
    for s in steps:
        for k in range(gas):
            x, y = zb.batch(rank, s, k, dtype)
            loss = zb.loss_fn(model, x, y)
            if s == nan_at:
                loss = loss * float("nan")
            loss.backward()
        z.step()


def _params(z: Any, model: torch.nn.Module) -> List[torch.Tensor]:
    z.gather_parameters()
    return [p.detach().float().clone() for p in model.parameters()]


def _diff(a: List[torch.Tensor], b: List[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def trajectory(rank: int, case: Dict[str, Any]) -> Dict[str, Any]:
    """The same training with and without offload: the largest parameter difference."""
    dtype = getattr(torch, case.get("dtype", "float32"))
    stage, steps, gas = case["stage"], case.get("steps", 4), case.get("gas", 1)
    got, info = [], {}
    for off in (None, case.get("offload", OFF)):
        model = zb.make_model(dtype=dtype)
        zero = dict(case.get("zero", BUCKETS), **(off or {}))
        z = _build(model, stage, zero, case.get("opt", "AdamW"), case.get("opt_kwargs"),
                   gradient_accumulation_steps=gas, gradient_clipping=case.get("clip", 0.0))
        _train(z, model, rank, list(range(steps)), gas, dtype, case.get("nan_at"))
        got.append(_params(z, model))
        if off is not None:
            info.update(kernel_steps=z.offload.kernel_steps, skipped=z.skipped_steps,
                        master_device=str(z.groups[0].master.device), phase=z.phase.value)
        else:
            info["skipped_ref"] = z.skipped_steps
        z.close()
    start = [p.detach().float() for p in zb.make_model(dtype=dtype).parameters()]
    return dict(info, case=case, err=_diff(*got), moved=_diff(got[0], start))


def memory(rank: int, world: int) -> Dict[str, Any]:
    """memory_bytes() after a backward (before its step), with the layout's shard sizes."""
    out = {}
    for stage, off in ((1, OFF), (2, OFF), (3, OFF), (3, OFF_PARAM)):
        model = zb.make_model()
        z = _build(model, stage, dict(BUCKETS, stage3_param_persistence_threshold=0, **off))
        _train(z, model, rank, [0])
        x, y = zb.batch(rank, 1, 0)
        zb.loss_fn(model, x, y).backward()
        z.wait()
        out[(stage, "offload_param" in off)] = {
            "measured": z.memory_bytes(), "shard_numel": sum(g.plan.shard_numel for g in z.groups)}
        z.close()
    return out


def checkpoints(rank: int, world: int, d: str) -> Dict[str, Any]:
    """Save with offload and load without (and the other way round): the continued trajectory
    against the one that never stopped."""
    from compcomm.zero import load_checkpoint, save_checkpoint

    out = {}
    for stage in (1, 2, 3):
        for src, dst in ((OFF, {}), ({}, OFF)):
            model = zb.make_model()
            z = _build(model, stage, dict(BUCKETS, **src))
            _train(z, model, rank, [0, 1])
            path = os.path.join(d, f"s{stage}_{bool(src)}")
            save_checkpoint(z, path, module=model)
            _train(z, model, rank, [2, 3])
            want = _params(z, model)
            z.close()
            model = zb.make_model(seed=5)  # other values: all must come from the checkpoint
            z = _build(model, stage, dict(BUCKETS, **dst))
            load_checkpoint(z, path)
            _train(z, model, rank, [2, 3])
            out[(stage, bool(src))] = _diff(_params(z, model), want)
            z.close()
    return out


def rank_body(rank: int, world: int, d: str, cases: List[Dict[str, Any]]) -> Dict[str, Any]:
    return {"trajectories": [trajectory(rank, c) for c in cases],
            "memory": memory(rank, world), "checkpoints": checkpoints(rank, world, d)}


class _NoTalk:
    """The inner optimizer's communicator during the offloaded 1-bit steps: any use but the
    rank/size queries raises (ZeRO reduces the gradients; the update rule must send nothing)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        if name in ("rank", "size", "backend_name"):
            return getattr(self._inner, name)
        raise RuntimeError(f"the wrapped optimizer used its communicator ({name})")


def onebit_offload_silent(rank: int, world: int) -> Dict[str, Any]:
    """OneBitAdam "exact" warm-up steps with offload: equal to the same steps without offload,
    while the wrapped optimizer's communicator and its own step() raise if used."""
    kw = {"lr": 1e-2, "freeze_step": 3}
    got = []
    for off in (None, OFF):
        model = zb.make_model()
        z = _build(model, 2, dict(BUCKETS, **(off or {})), "OneBitAdam", kw)
        if off is not None:
            z.optimizer.comm = _NoTalk(z.optimizer.comm)

            def refuse(*a: Any, **k: Any) -> None:
                raise RuntimeError("the wrapped optimizer's step() ran")

            z.optimizer.step = refuse
        _train(z, model, rank, [0, 1])
        got.append(_params(z, model))
        z.close()
    start = [p.detach().float() for p in zb.make_model().parameters()]
    return {"err": _diff(*got), "moved": _diff(got[0], start)}


def onebit_placements(rank: int, world: int, stage: int) -> Dict[str, Any]:
    """OneBitAdam ("exact") through warm-up and the compressed phase without offload, with
    offload and the 1-bit work on the device (the momentum chunk crosses as signs + scale), and
    with ``onebit_placement="host"``: the largest parameter differences to the first."""
    kw = {"lr": 1e-2, "freeze_step": 2}
    got, info = [], {}
    for name, zero in (("none", {}), ("device", OFF), ("host", dict(OFF, onebit_placement="host"))):
        model = zb.make_model()
        z = _build(model, stage, dict(BUCKETS, **zero), "OneBitAdam", kw)
        _train(z, model, rank, list(range(5)))
        got.append(_params(z, model))
        if z._replicated is not None:
            info[name] = {"phase": z.phase.value, "where": str(z._replicated.where),
                          "packed": len(z._replicated.packed.keys())}
        z.close()
    return dict(info, device_err=_diff(got[0], got[1]), host_err=_diff(got[1], got[2]),
                moved=_diff(got[0], [p.detach().float() for p in zb.make_model().parameters()]))
