"""The ``optimizer`` section of a DeepSpeed config: which optimizer class, with which arguments.

Shared by :func:`compcomm.from_config` and :func:`compcomm.zero.initialize` (both read the same
section), so it lives below both of them.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Dict, Tuple

import torch

from .._jsoncheck import flag, number
from .adam import OneBitAdam
from .lamb import OneBitLamb
from .zoadam import ZeroOneAdam

__all__ = ["optimizer_from_config", "check_common_params"]

# optimizer type -> (accepted params with their DeepSpeed defaults)
_ADAM_PARAMS = {
    "lr": 1e-3,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 0.0,
    "amsgrad": False,
    "adam_w_mode": True,
    "torch_adam": False,
    "bias_correction": True,
}
_ONEBIT = {"onebitadam": OneBitAdam, "zerooneadam": ZeroOneAdam, "onebitlamb": OneBitLamb}


def check_common_params(typ: str, params: Dict[str, Any]) -> None:
    """The hyper-parameters every optimizer type shares, checked by name before anything runs."""
    for k in ("lr", "eps", "weight_decay"):
        if k in params:
            number(f"optimizer.params.{k}", params[k])
    if "betas" in params:
        b = params["betas"]
        if not (isinstance(b, (list, tuple)) and len(b) == 2):
            raise ValueError(f"optimizer.params.betas must be two numbers, got {b!r}")
        for i, x in enumerate(b):
            number(f"optimizer.params.betas[{i}]", x)
            if not x < 1.0:
                raise ValueError(f"optimizer.params.betas[{i}] must be < 1, got {x!r}")
    for k in ("amsgrad", "adam_w_mode", "torch_adam", "bias_correction"):
        if k in params:
            flag(f"optimizer.params.{k}", params[k])


def _check_typed(where: str, annotation: Any, v: Any) -> None:
    """A 1-bit optimizer's argument against its annotation: the constructors take ``bool(v)``
    of flags (the string "false" would turn one on) and ``float(v)`` of numbers, so the config
    path checks them first; integers and the rest are the constructors' to check."""
    ann = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    if ann == "bool" or (ann == "Optional[bool]" and v is not None):
        flag(where, v)
    elif ann == "float":
        if isinstance(v, float) and math.isnan(v):
            raise ValueError(f"{where} must be a finite number, got {v!r}")
        number(where, v, minimum=-math.inf)  # the type here; each range is the constructor's
        if not math.isfinite(v):
            raise ValueError(f"{where} must be a finite number, got {v!r}")


def optimizer_from_config(opt_cfg: Dict[str, Any]) -> Tuple[Any, Dict[str, Any], bool]:
    """The optimizer a DeepSpeed config's ``optimizer`` section names, and its arguments.

    Parameters
    ----------
    opt_cfg : dict
        ``{"type": ..., "params": {...}}``: Adam, AdamW (torch's), OneBitAdam, ZeroOneAdam or
        OneBitLamb (case-insensitive).

    Returns
    -------
    (class, dict, bool)
        The optimizer class, its keyword arguments, and whether it is a compcomm 1-bit optimizer.

    Raises
    ------
    TypeError, ValueError
        An unknown type or key, or a value of the wrong type or range (named).
    """
    if not isinstance(opt_cfg, dict) or "type" not in opt_cfg:
        raise ValueError("optimizer must be an object with a 'type' (Adam, AdamW, OneBitAdam, ...)")
    for k in opt_cfg:
        if k not in ("type", "params"):
            raise ValueError(f"optimizer.{k}: unknown key (expected 'type' and 'params')")
    typ = opt_cfg["type"]
    if not isinstance(typ, str):
        raise TypeError(f"optimizer.type must be a string, got {typ!r}")
    params = opt_cfg.get("params", {}) or {}
    if not isinstance(params, dict):
        raise TypeError(f"optimizer.params must be an object, got {type(params).__name__}")
    params = dict(params)
    low = typ.lower()
    if low in ("adam", "adamw") or low in _ONEBIT:
        check_common_params(typ, params)
    if low in ("adam", "adamw"):
        for k in params:
            if k not in _ADAM_PARAMS:
                raise ValueError(
                    f"optimizer.params.{k}: not a parameter of {typ} "
                    f"(known: {', '.join(sorted(_ADAM_PARAMS))}; use gradient_clipping, not max_grad_norm)"
                )
        full = dict(_ADAM_PARAMS, **params)
        if full["bias_correction"] is not True:
            raise ValueError("optimizer.params.bias_correction=false is not supported for Adam/AdamW")
        # DeepSpeed's Adam is AdamW unless adam_w_mode is false; AdamW is always decoupled.
        decoupled = low == "adamw" or full["adam_w_mode"]
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        kw = {k: full[k] for k in ("lr", "eps", "weight_decay", "amsgrad")}
        kw["betas"] = tuple(full["betas"])
        return cls, kw, False
    if low in _ONEBIT:
        cls = _ONEBIT[low]
        known = inspect.signature(cls.__init__).parameters
        for k in params:
            if k not in known or k in ("self", "params"):
                raise ValueError(f"optimizer.params.{k}: not a parameter of {typ}")
            _check_typed(f"optimizer.params.{k}", known[k].annotation, params[k])
        return cls, params, True
    raise ValueError(
        f"optimizer.type={typ!r} is not supported (Adam, AdamW, OneBitAdam, ZeroOneAdam, OneBitLamb)"
    )
