"""Argument checks of the 1-bit optimizers' constructors: each names the optimizer and the
argument, and raises before anything is built; and what their ranks must agree on before a step
communicates (:func:`layout_fields`)."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from .._agree import Field, digest, schedule_fields
from ..compress import plan_buckets
from ..errors import UnsupportedError

__all__ = ["check_common", "check_int", "check_positive", "check_masks", "layout_fields"]


def check_common(name: str, lr: float, betas: Tuple[float, float], eps: float, weight_decay: float,
                 amsgrad: bool) -> None:
    """Raise ValueError/UnsupportedError naming the bad argument of optimizer ``name``."""
    if amsgrad:
        raise UnsupportedError(f"{name}: argument 'amsgrad' is not supported by 1-bit optimizers "
                               "(the frozen variance makes it meaningless); pass amsgrad=False")
    if not (isinstance(lr, (int, float)) and lr >= 0.0):
        raise ValueError(f"{name}: argument 'lr' must be a number >= 0, got {lr!r}")
    if not (isinstance(eps, (int, float)) and eps >= 0.0):
        raise ValueError(f"{name}: argument 'eps' must be >= 0, got {eps!r}")
    if not (isinstance(weight_decay, (int, float)) and weight_decay >= 0.0):
        raise ValueError(f"{name}: argument 'weight_decay' must be >= 0, got {weight_decay!r}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{name}: argument 'betas' must be two numbers in [0, 1), got {betas!r}")


def check_int(name: str, arg: str, value: Any, minimum: int) -> int:
    """``value`` as an int ``>= minimum`` or a ValueError naming ``arg``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: argument '{arg}' must be an integer >= {minimum}, got {value!r}")
    return value


def check_positive(name: str, arg: str, value: Any) -> float:
    """``value`` as a float ``> 0`` or a ValueError naming ``arg``."""
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
        raise ValueError(f"{name}: argument '{arg}' must be a number > 0, got {value!r}")
    return float(value)


def check_masks(name: str, param_groups: List[Dict[str, Any]]) -> None:
    """Each group's ``exp_avg_mask`` must broadcast against every parameter of the group."""
    for gi, group in enumerate(param_groups):
        mask = group.get("exp_avg_mask")
        if mask is None:
            continue
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"{name}: param group {gi}: 'exp_avg_mask' must be a torch.Tensor, "
                            f"got {type(mask).__name__}")
        for pi, p in enumerate(group["params"]):
            try:
                shape = torch.broadcast_shapes(mask.shape, p.shape)
            except RuntimeError:
                shape = None
            if shape != p.shape:
                raise ValueError(f"{name}: param group {gi}: 'exp_avg_mask' of shape "
                                 f"{tuple(mask.shape)} does not broadcast to parameter {pi} of shape "
                                 f"{tuple(p.shape)}")


def layout_fields(opt: Any) -> List[Field]:
    """What the ranks of 1-bit optimizer ``opt`` must agree on before a step communicates
    (:func:`compcomm._agree.agree_layout`'s fields): the parameters, which have gradients, the
    compressed bucket plan that gives and the schedule."""
    params = [(gi, p) for gi, g in enumerate(opt.param_groups) for p in g["params"]]
    items = list(opt._params())
    gidx = {id(g): gi for gi, g in enumerate(opt.param_groups)}
    limit = 0 if opt.per_parameter else opt.reduce_bucket_size
    plan = plan_buckets([((gidx[id(g)], p.device), p.numel()) for g, p in items], limit)
    bucket_numels = [sum(items[j][1].numel() for j in b) for b in plan]
    return [
        ("optimizer class", digest(opt._name), True),
        ("number of parameters", len(params), False),
        ("parameter shapes", digest([(gi, tuple(p.shape)) for gi, p in params]), True),
        ("parameter dtypes", digest([str(p.dtype) for _, p in params]), True),
        ("parameters with gradients", len(items), False),
        ("which parameters have gradients", digest([p.grad is not None for _, p in params]), True),
        ("elements with gradients", sum(p.numel() for _, p in items), False),
        ("reduce_bucket_size", opt.reduce_bucket_size, False),
        ("per_parameter", int(opt.per_parameter), False),
        ("compressed buckets", len(bucket_numels), False),
        ("compressed bucket sizes", digest(bucket_numels), True),
        ("grads_averaged", int(opt.grads_averaged), False),
        *schedule_fields(opt.schedule),
    ]
