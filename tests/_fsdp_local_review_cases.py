"""Rank bodies for tests/test_fsdp_local_review.py: the local-momentum mode's checkpoints across
HSDP splits, its server-error scratch, a shard group of one rank, a failed replica exchange."""

from __future__ import annotations

from typing import Any, Dict

import torch

import _fsdp_hsdp_cases as H
import _fsdp_local_cases as C
import _fsdp_momentum_cases as M

KW = M.KW
LOCAL = "local_momentum"
F32 = torch.float32


def _trained(kind: str, world: int, rank: int, steps: int = 4):
    """A local-momentum model, state and optimizer after ``steps`` steps (warm-up 2): ``kind``
    "flat" (1-D mesh of the world), "by_hand" (2x2, replicate_group) or "native" (2x2 mesh)."""
    import compcomm.fsdp as cf

    if kind == "flat":
        model, state = M._model(world, F32, LOCAL)
    elif kind == "by_hand":
        model, state, _ = C._hsdp_model(LOCAL)
    else:
        model, state, _ = H._model(F32, LOCAL)
    opt = cf.FrozenVarianceAdam(model.parameters(), freeze_step=state, **KW)
    M._run(model, opt, rank, range(steps), F32)
    return model, state, opt


def split_cases(rank: int, world: int, saved: str, loaded: str) -> Dict[str, Any]:
    """A state saved under one split of the 4 ranks loaded into another (same rank and world):
    the momenta and errors reset (seeded again from exp_avg), the replicas' step counts there,
    and the next steps run."""
    _, sd_state, _ = _trained(saved, world, rank)
    sd = sd_state.state_dict()
    model, state, opt = _trained(loaded, world, rank)
    out: Dict[str, Any] = {"replicas": sd.get("replicas")}
    state.load_state_dict(sd)
    out["reset"] = not state.momentum.full
    out["replica_steps"] = state.replicate_group is None or all(
        state.steps.get(n + "/replicas") == state.steps[n] for n in ("0", "3", "<root>"))
    try:
        run = M._run(model, opt, rank, range(4, 6), F32)
        out["step"] = all(bool(torch.isfinite(p).all()) for p in run[-1])
    except Exception as e:  # noqa: BLE001 - the test reads it
        out["step"] = f"{type(e).__name__}: {e}"
    return out


def scratch_cases(rank: int, world: int) -> Dict[str, Any]:
    """The reduce-scatter's server-error buffers are scratch: zeros in the checkpoint."""
    _, state, _ = _trained("flat", world, rank)
    errs = state.state_dict()["errors"]
    return {"server_max": max(float(v[1].abs().max()) for v in errs.values()),
            "worker_max": max(float(v[0].abs().max()) for v in errs.values())}


def shard1_cases(rank: int, world: int) -> Dict[str, Any]:
    """replicate_group with a shard group of one rank: refused by onebit itself."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import compcomm.fsdp as cf

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("rep", "shard"))
    model = M._net(F32)
    for m in (model[0], model[3], model):
        fully_shard(m, mesh=mesh["shard"])
    return {"err": M.error_of(lambda: cf.onebit(model, warmup_steps=2, mode=LOCAL,
                                              replicate_group=mesh["rep"].get_group()))}


def failed_hook_cases(rank: int, world: int, kind: str) -> Dict[str, Any]:
    """The replicas' compressed allreduce raises in a 1-bit step: the local momenta and the step
    counts stay as they were."""
    import compcomm.fsdp_local as FL

    model, state, opt = _trained(kind, world, rank, steps=3)
    before = {k: v.clone() for k, v in state.momentum.full.items()}
    steps = dict(state.steps)
    inner = FL.compressed_allreduce

    def boom(*a, **k):
        raise RuntimeError("boom")
    FL.compressed_allreduce = boom
    try:
        err = M.error_of(lambda: M._run(model, opt, rank, [3], F32))
    finally:
        FL.compressed_allreduce = inner
    return {"err": err, "steps": state.steps == steps,
            "momenta": sorted(before) == sorted(state.momentum.full) and all(
                torch.equal(before[k], state.momentum.full[k]) for k in before)}
