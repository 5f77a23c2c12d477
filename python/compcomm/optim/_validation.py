"""Argument checks of the 1-bit optimizers' constructors: each names the optimizer and the
argument, and raises before anything is built; and what their ranks must agree on before a step
communicates (:func:`layout_fields`)."""

from __future__ import annotations

import difflib
import math
import numbers
from typing import Any, Dict, List, Tuple

import torch

from .._agree import Field, digest, schedule_fields
from ..compress import plan_buckets
from ..errors import UnsupportedError
from ._grads import resolve_comm

__all__ = ["who", "check_common", "check_group", "check_last_group", "check_number", "check_int",
           "check_positive", "check_masks", "layout_fields"]


def check_number(who: str, arg: str, value: Any) -> None:
    """``value`` is a finite real number >= 0, else a TypeError/ValueError naming ``arg``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{who}: {arg} must be a number, got {value!r}")
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"{who}: {arg} must be a finite number >= 0, got {value!r}")


def _check_betas(who: str, arg: str, betas: Any) -> None:
    try:
        pair = tuple(betas)
    except TypeError:
        raise TypeError(f"{who}: {arg} must be a pair of numbers in [0, 1), "
                        f"got {betas!r}") from None
    if len(pair) != 2 or not all(isinstance(b, numbers.Real) and not isinstance(b, bool)
                                 and 0.0 <= b < 1.0 for b in pair):
        raise ValueError(f"{who}: {arg} must be two numbers in [0, 1), got {betas!r}")


def check_common(who: str, lr: float, betas: Tuple[float, float], eps: float, weight_decay: float,
                 amsgrad: bool) -> None:
    """Raise TypeError/ValueError/UnsupportedError naming the bad argument (``who``: the
    optimizer, and the rank, as messages start)."""
    if amsgrad:
        raise UnsupportedError(f"{who}: argument 'amsgrad' is not supported by 1-bit optimizers "
                               "(the frozen variance makes it meaningless); pass amsgrad=False")
    for arg, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        check_number(who, f"argument '{arg}'", value)
    _check_betas(who, "argument 'betas'", betas)


_PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def who(name: str, comm_backend_name: str, process_group: Any) -> str:
    """``"[rank r] Name"``, how an optimizer constructor's errors start: the rank in the group it
    will run on (the bare name if that group does not resolve; the constructor then says why)."""
    try:
        return f"[rank {resolve_comm(name, comm_backend_name, process_group).rank()}] {name}"
    except Exception:  # noqa: BLE001 -- raised again, with its own message, by _init_common
        return name


def check_last_group(opt: Any) -> None:
    """:func:`check_group` of ``opt``'s last param group (just added); a bad one is removed
    again before the error propagates."""
    try:
        who = getattr(opt, "_who", opt._name)
        check_group(who, len(opt.param_groups) - 1, opt.param_groups[-1], opt.defaults)
        check_masks(who, opt.param_groups)
    except Exception:
        opt.param_groups.pop()
        raise


def check_group(who: str, index: int, group: Dict[str, Any], defaults: Dict[str, Any]) -> None:
    """One param group (defaults filled in): valid ``lr``/``eps``/``weight_decay``/``betas``, no
    key that looks like a misspelt setting (``weight_decy``: other extra keys, such as a layer
    decay's ``lr_scale``, are the caller's, as torch allows), and parameters of float32, float16
    or bfloat16 on the CPU or a GPU (the update's kernels and the fp32 master copies take those);
    TypeError/ValueError naming the group, the key or the parameter."""
    where = f"param group {index}"
    for key in sorted(set(group) - set(defaults)):
        near = difflib.get_close_matches(key, list(defaults), n=1, cutoff=0.8)
        if near:
            raise ValueError(f"{who}: {where} has key '{key}': did you mean '{near[0]}'? (the "
                             f"settings are {sorted(defaults)})")
    for key in ("lr", "eps", "weight_decay"):
        check_number(who, f"{where}: '{key}'", group[key])
    _check_betas(who, f"{where}: 'betas'", group["betas"])
    if "max_coeff" in defaults:  # OneBitLamb's trust-ratio clamp, per group as in DeepSpeed
        lo = check_positive(who, f"{where}: 'min_coeff'", group["min_coeff"])
        if lo > check_positive(who, f"{where}: 'max_coeff'", group["max_coeff"]):
            raise ValueError(f"{who}: {where}: 'min_coeff' ({group['min_coeff']}) must be <= "
                             f"'max_coeff' ({group['max_coeff']})")
    for pi, p in enumerate(group["params"]):
        if p.dtype not in _PARAM_DTYPES:
            raise TypeError(f"{who}: {where}: parameter {pi} is {p.dtype}; 1-bit optimizers take "
                            "float32, float16 or bfloat16 parameters")
        if p.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{who}: {where}: parameter {pi} is on {p.device}; 1-bit optimizers "
                             "take parameters on the CPU or a CUDA device")


def check_int(name: str, arg: str, value: Any, minimum: int) -> int:
    """``value`` as an int ``>= minimum`` or a ValueError naming ``arg``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: argument '{arg}' must be an integer >= {minimum}, got {value!r}")
    return value


def check_positive(name: str, arg: str, value: Any) -> float:
    """``value`` as a float ``> 0`` or a ValueError naming ``arg``."""
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
            and math.isfinite(value)):
        raise ValueError(f"{name}: argument '{arg}' must be a finite number > 0, got {value!r}")
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
