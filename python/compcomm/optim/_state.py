"""Validation of a 1-bit optimizer's state dict before :meth:`OneBitBase.load_state_dict` uses it.

Everything the load reads is checked here first -- torch's part (groups, parameter ids, moment
shapes, hyper-parameters) and the ``"compcomm"`` entry (schedule, world size, rank, error
buffers) -- so that a malformed checkpoint raises a TypeError/ValueError naming the bad entry
while the optimizer still holds its old state. Keys of the ``"compcomm"`` entry that this version
does not know are tolerated (newer checkpoints may carry more).
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, NamedTuple, Optional

import torch

from .._checkpoint import StateSpec, check_optimizer_state, need_int, need_mapping, need_tensor
from ..collectives import padded_numel

ERROR_KEYS = ("worker_error", "server_error")

#: What each 1-bit optimizer's step needs in a parameter's state (the moments are fp32 and are
#: not cast on load); by class name, so this module need not import the optimizers.
_ONEBIT_SPEC = StateSpec(float32=True)
_SPECS = {
    "ZeroOneAdam": StateSpec(float32=True, needs=(("momentum_accumulator", ("lrs",)),),
                             scalars=(("lrs", 0.0, False),)),
    "OneBitLamb": StateSpec(
        float32=True,
        needs=(("exp_avg_sq", ("exp_avg_sq_fresh", "lamb_coeff_freeze", "last_factor")),),
        scalars=(("lamb_coeff_freeze", 0.0, False), ("last_factor", 0.0, False),
                 ("scaling_coeff", 0.0, True)),
    ),
}


def state_spec(opt: Any) -> StateSpec:
    """The :class:`StateSpec` of ``opt``'s class (or of the nearest 1-bit class it derives from)."""
    for cls in type(opt).__mro__:
        if cls.__name__ in _SPECS:
            return _SPECS[cls.__name__]
    return _ONEBIT_SPEC


class LoadPlan(NamedTuple):
    """What a validated state dict will do when loaded."""

    extra: Dict[str, Any]  #: the ``"compcomm"`` entry ({} when absent)
    exact: bool  #: error buffers restored (exact resume) rather than reset
    has_errors: bool  #: the checkpoint holds error buffers


def _check_sched(where: str, sched: Any, template: Mapping) -> None:
    sched = need_mapping(where, sched)
    for key, cur in template.items():
        if key not in sched:
            raise ValueError(f"{where} lacks {key!r}")
        v = sched[key]
        if isinstance(cur, bool):
            if not isinstance(v, bool):
                raise TypeError(f"{where}[{key!r}] must be true or false, got {v!r}")
        elif isinstance(cur, int):
            need_int(f"{where}[{key!r}]", v, 1 if key.endswith("_interval") else 0)


def _check_error_pair(
    where: str, st: Mapping, world: int, exact: bool, padded: Optional[int]
) -> None:
    """Both error buffers, float32 1-D; with ``exact`` also sized for ``world`` ranks."""
    if not any(k in st for k in ERROR_KEYS):
        return
    for k in ERROR_KEYS:
        if k not in st:
            raise ValueError(f"{where} has {ERROR_KEYS[1 - ERROR_KEYS.index(k)]!r} without {k!r}")
        t = need_tensor(f"{where}[{k!r}]", st[k], dtype=torch.float32)
        if t.dim() != 1:
            raise ValueError(f"{where}[{k!r}] must be 1-D, got shape {tuple(t.shape)}")
    if not exact:
        return  # they are dropped, whatever their size
    we, se = st["worker_error"], st["server_error"]
    if padded is not None and we.numel() != padded:
        raise ValueError(
            f"{where}['worker_error'] has {we.numel()} elements, expected {padded} "
            f"for world size {world}"
        )
    if we.numel() % (8 * world) or se.numel() * world != we.numel():
        raise ValueError(
            f"{where}: error buffers of {we.numel()} and {se.numel()} elements do not "
            f"fit world size {world}"
        )


def validate_state_dict(
    opt: Any,
    state_dict: Any,
    params: Optional[List[List[torch.Tensor]]] = None,
    world_size: Optional[int] = None,
    rank: Optional[int] = None,
    where: Optional[str] = None,
) -> LoadPlan:
    """Check a state dict for ``opt`` (a OneBitBase) without changing anything.

    Parameters
    ----------
    opt : OneBitBase
        The optimizer it will be loaded into.
    state_dict : object
        The candidate, as produced by ``opt.state_dict()`` (or a DeepSpeed-style one).
    params, world_size, rank : optional
        The parameters per group, world size and rank ``opt`` will have when it loads (defaults:
        its current ones; ZeroOptimizer switches them when it changes phase).
    where : str, optional
        How messages name the state dict (default ``"<Optimizer>.load_state_dict: state_dict"``).

    Returns
    -------
    LoadPlan

    Raises
    ------
    TypeError, ValueError
        Naming the argument and the bad entry.
    """
    where = where or f"{opt._name}.load_state_dict: state_dict"
    params = [list(g["params"]) for g in opt.param_groups] if params is None else params
    world = opt.world_size if world_size is None else world_size
    rank = opt.rank if rank is None else rank
    id_map = check_optimizer_state(where, state_dict, params, opt.param_groups,
                                   [state_spec(opt)] * len(params))
    ew = f"{where}['compcomm']"
    extra = state_dict.get("compcomm")
    extra = {} if extra is None else dict(need_mapping(ew, extra))
    if "world_size" in extra:
        need_int(f"{ew}['world_size']", extra["world_size"], 1)
    if "rank" in extra:
        need_int(f"{ew}['rank']", extra["rank"], 0)
        if "world_size" in extra and extra["rank"] >= extra["world_size"]:
            raise ValueError(
                f"{ew}['rank']={extra['rank']} is not below its world_size {extra['world_size']}"
            )
    if "skipped_steps" in extra:
        need_int(f"{ew}['skipped_steps']", extra["skipped_steps"], 0)
    if "exact" in extra and not isinstance(extra["exact"], bool):
        raise TypeError(f"{ew}['exact'] must be true or false, got {extra['exact']!r}")
    if "sched" in extra:
        _check_sched(f"{ew}['sched']", extra["sched"], opt.sched)
    if extra.get("fused_pad") is not None:
        need_tensor(f"{ew}['fused_pad']", extra["fused_pad"], dtype=torch.float32)
    group_errors = extra.get("group_errors")
    if group_errors is not None:
        need_mapping(f"{ew}['group_errors']", group_errors)
    bucket_errors = extra.get("bucket_errors")
    if bucket_errors is not None:
        need_mapping(f"{ew}['bucket_errors']", bucket_errors)
    layout = extra.get("bucket_plan")
    if layout is not None:
        _check_layout(f"{ew}['bucket_plan']", layout, params)
    has_errors = bool(group_errors) or bool(bucket_errors) or any(
        isinstance(st, Mapping) and any(k in st for k in ERROR_KEYS)
        for st in state_dict["state"].values()
    )
    exact = (
        opt.exact_resume
        and extra.get("exact") is True
        and has_errors
        and extra.get("world_size") == world
        and extra.get("rank") == rank
    )
    for pid, st in state_dict["state"].items():
        p = id_map[pid]
        _check_error_pair(
            f"{where}['state'][{pid!r}]", st, world, exact, padded_numel(p.numel(), world)
        )
    for gi, errs in (group_errors or {}).items():
        gw = f"{ew}['group_errors'][{gi!r}]"
        need_int(f"{ew}['group_errors'] key", gi, 0)
        errs = need_mapping(gw, errs)
        if not all(k in errs for k in ERROR_KEYS):
            raise ValueError(f"{gw} must hold 'worker_error' and 'server_error'")
        _check_error_pair(gw, errs, world, exact, None)
    for key, errs in (bucket_errors or {}).items():
        bw = f"{ew}['bucket_errors'][{key!r}]"
        errs = need_mapping(bw, errs)
        if not all(k in errs for k in ERROR_KEYS):
            raise ValueError(f"{bw} must hold 'worker_error' and 'server_error'")
        _check_error_pair(bw, errs, world, exact, None)
    return LoadPlan(extra, exact, has_errors)


def _check_layout(where: str, layout: Any, params: List[List[torch.Tensor]]) -> None:
    """A bucket layout: buckets of (group index, index in group) pairs naming real parameters."""
    if not isinstance(layout, (list, tuple)):
        raise TypeError(f"{where} must be a list of buckets, got {type(layout).__name__}")
    for bi, bucket in enumerate(layout):
        if not isinstance(bucket, (list, tuple)):
            raise TypeError(f"{where}[{bi}] must be a list of (group, index) pairs")
        for pair in bucket:
            ok = (isinstance(pair, (list, tuple)) and len(pair) == 2
                  and all(isinstance(x, int) and not isinstance(x, bool) for x in pair)
                  and 0 <= pair[0] < len(params) and 0 <= pair[1] < len(params[pair[0]]))
            if not ok:
                raise ValueError(f"{where}[{bi}] has {pair!r}, not a (group, index) pair of this "
                                 "optimizer's parameters")
