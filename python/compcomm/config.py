"""DeepSpeed-style JSON configs: ``compcomm.from_config(model, "ds_config.json")``.

Accepted sections: ``optimizer`` ({"type", "params"}), ``zero_optimization``, ``train_batch_size``,
``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``, ``gradient_clipping``,
``fp16``, ``bf16``. Every other key -- and every key inside those sections that compcomm does not
implement -- raises ``ValueError`` naming it: nothing is silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any, Callable, Dict, Union

import torch

from ._jsoncheck import flag as _flag
from ._jsoncheck import number as _number
from .optim.factory import optimizer_from_config

__all__ = ["from_config", "TrainingSetup", "load_config"]

_TOP_KEYS = {
    "optimizer",
    "zero_optimization",
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "fp16",
    "bf16",
}

_FP16_KEYS = {
    "enabled": False,
    "loss_scale": 0.0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 1,
    "min_loss_scale": 1.0,
    "auto_cast": False,
}
_BF16_KEYS = {"enabled": False}


@dataclasses.dataclass
class TrainingSetup:
    """What :func:`from_config` builds.

    Attributes
    ----------
    model : torch.nn.Module
        The model (cast to fp16/bf16 if enabled; wrapped in DistributedDataParallel for stage 0
        with a torch optimizer on more than one rank).
    optimizer : object
        A :class:`compcomm.zero.ZeroOptimizer` (stage >= 1), or the optimizer itself (stage 0).
    config : dict
        The validated config, every default filled in.
    train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps : int
        Consistent batch sizes: train = micro * accumulation * world size.
    """

    model: torch.nn.Module
    optimizer: Any
    config: Dict[str, Any]
    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int


def load_config(config: Union[str, os.PathLike, Dict[str, Any]]) -> Dict[str, Any]:
    """A config dict from a dict or a JSON file path (a copy; the input is not modified).

    Raises
    ------
    TypeError
        ``config`` is neither a dict nor a path, or its top level is not a JSON object.
    ValueError
        The file is not valid JSON, or the dict holds values JSON cannot represent.
    """
    if isinstance(config, Mapping):
        try:
            cfg = json.loads(json.dumps(dict(config)))
        except (TypeError, ValueError) as e:
            raise ValueError(f"config: not representable as JSON ({e})") from e
        return cfg
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(
            f"config must be a dict or a path to a JSON file, got {type(config).__name__}")
    with open(config) as f:
        try:
            cfg = json.load(f)
        except ValueError as e:
            raise ValueError(f"config: {os.fspath(config)!r} is not valid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise TypeError(f"config: the top level of {os.fspath(config)!r} must be a JSON object, "
                        f"got a JSON {type(cfg).__name__}")
    return cfg


def _dry_run(typ: str, cls: Callable[..., Any], kwargs: Dict[str, Any], comm: Any) -> None:
    """Build the optimizer on one throw-away parameter, so that its own argument checks run
    before any parameter is broadcast; errors name optimizer.params. Building sends nothing."""
    if isinstance(cls, type) and hasattr(cls, "_init_common"):  # compcomm: the group resolved
        kwargs = dict(kwargs, process_group=comm)
    try:
        cls([torch.nn.Parameter(torch.zeros(1))], **kwargs)
    except Exception as e:
        try:
            err = type(e)(f"optimizer.params ({typ}): {e}")
        except Exception:
            err = ValueError(f"optimizer.params ({typ}): {type(e).__name__}: {e}")
        raise err from e


def _clip_before_step(optimizer: torch.optim.Optimizer, clip: float) -> None:
    """Stage 0 with a torch optimizer: clip the gradients' global norm to ``clip`` before each
    step. DDP has averaged them in backward, so every rank clips the same global gradient; a
    GradScaler's ``step`` unscales before the step (and skips it, hook too, on inf/NaN)."""
    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        if params:
            torch.nn.utils.clip_grad_norm_(params, clip)

    optimizer.register_step_pre_hook(hook)


def _section(cfg: Dict[str, Any], name: str, known: Dict[str, Any]) -> Dict[str, Any]:
    sec = cfg.get(name, {}) or {}
    if not isinstance(sec, dict):
        raise ValueError(f"{name} must be an object, got {type(sec).__name__}")
    for k in sec:
        if k not in known:
            raise ValueError(f"{name}.{k}: unknown or unsupported key (known: {', '.join(sorted(known))})")
    out = dict(known, **sec)
    for k, default in known.items():  # each value has its default's type
        where, v = f"{name}.{k}", out[k]
        if isinstance(default, bool):
            _flag(where, v)
        elif isinstance(default, int):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{where} must be a whole number >= 0, got {v!r}")
        elif isinstance(default, float):
            _number(where, v)
    return out


def _batch_sizes(cfg: Dict[str, Any], world: int) -> tuple:
    tb = cfg.get("train_batch_size")
    mb = cfg.get("train_micro_batch_size_per_gpu")
    ga = cfg.get("gradient_accumulation_steps")
    for k, v in (("train_batch_size", tb), ("train_micro_batch_size_per_gpu", mb),
                 ("gradient_accumulation_steps", ga)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{k} must be a positive integer, got {v!r}")
    if tb is None and mb is None:
        raise ValueError("train_batch_size or train_micro_batch_size_per_gpu must be given")
    if tb is not None and mb is not None and ga is not None:
        if tb != mb * ga * world:
            raise ValueError(
                f"train_batch_size={tb} != train_micro_batch_size_per_gpu={mb} * "
                f"gradient_accumulation_steps={ga} * world_size={world}"
            )
    elif tb is not None and mb is not None:
        if tb % (mb * world):
            raise ValueError(f"train_batch_size={tb} is not a multiple of micro batch {mb} * world {world}")
        ga = tb // (mb * world)
    elif tb is not None:
        ga = ga or 1
        if tb % (ga * world):
            raise ValueError(f"train_batch_size={tb} is not a multiple of accumulation {ga} * world {world}")
        mb = tb // (ga * world)
    else:
        ga = ga or 1
        tb = mb * ga * world
    return tb, mb, ga


def from_config(
    model: torch.nn.Module,
    config: Union[str, os.PathLike, Dict[str, Any]],
    process_group: Any = None,
) -> TrainingSetup:
    """Build the optimizer (and ZeRO partitioning) a DeepSpeed JSON config describes.

    Parameters
    ----------
    model : torch.nn.Module
        The model, on CPU (as on every rank).
    config : str, path or dict
        The DeepSpeed-style config (see the module docstring for the accepted keys).
    process_group : optional
        The data-parallel group (default: compcomm's default).

    Returns
    -------
    TrainingSetup

    Raises
    ------
    TypeError, ValueError
        For an unknown or unsupported key or a value of the wrong type or range (named in the
        message, with the value), inconsistent batch sizes, or a combination compcomm does not
        implement. Everything is checked before any communication (the parameter broadcast) and
        before the model is cast or wrapped.
    """
    from ._comm import resolve
    from .zero import ZeroOptimizer
    from .zero.config import validate_zero_config

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    cfg = load_config(config)
    for k in cfg:
        if k not in _TOP_KEYS:
            raise ValueError(f"{k}: unknown or unsupported config key (known: {', '.join(sorted(_TOP_KEYS))})")
    comm = resolve(process_group)
    world = comm.size()
    tb, mb, ga = _batch_sizes(cfg, world)
    clip = cfg.get("gradient_clipping", 0.0)
    if (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip >= 0
            or math.isinf(clip)):  # `not >=` also refuses NaN
        raise ValueError(f"gradient_clipping must be a number >= 0 (finite), got {clip!r}")
    fp16 = _section(cfg, "fp16", _FP16_KEYS)
    bf16 = _section(cfg, "bf16", _BF16_KEYS)
    if fp16["enabled"] and bf16["enabled"]:
        raise ValueError("fp16.enabled and bf16.enabled are both true; pick one")
    if fp16["hysteresis"] != 1:
        raise ValueError("fp16.hysteresis: only 1 is supported (the scale halves at the first overflow)")
    if fp16["auto_cast"]:
        raise ValueError("fp16.auto_cast=true is not supported")
    if fp16["loss_scale_window"] < 1:  # the scale doubles every loss_scale_window finite steps
        raise ValueError(f"fp16.loss_scale_window must be >= 1, got {fp16['loss_scale_window']!r}")
    _number("fp16.min_loss_scale", fp16["min_loss_scale"], strict=True)
    zero_cfg = cfg.get("zero_optimization", {}) or {}
    if not isinstance(zero_cfg, dict):
        raise ValueError(f"zero_optimization must be an object, got {type(zero_cfg).__name__}")
    zero = validate_zero_config(zero_cfg)
    if "optimizer" not in cfg:
        raise ValueError("optimizer: the config needs an optimizer section")
    opt_cls, opt_kw, onebit = optimizer_from_config(cfg["optimizer"])
    stage = zero["stage"]
    if stage >= 1 and onebit:
        from .zero.rules import onebit_inner_kwargs, onebit_kind

        try:  # OneBitLamb cannot be sharded, ZeRO owns the group: say so before the broadcast
            onebit_kind(opt_cls)
            onebit_inner_kwargs(opt_cls.__name__, opt_kw, comm)
        except ValueError as e:
            raise ValueError(f"optimizer.type={cfg['optimizer']['type']!r} with "
                             f"zero_optimization.stage={stage}: {e}") from e
    _dry_run(cfg["optimizer"]["type"], opt_cls, opt_kw, comm)
    if cfg["optimizer"]["type"].lower() == "zerooneadam" and stage == 3:
        raise ValueError(
            "optimizer.type='ZeroOneAdam' with zero_optimization.stage=3 is not supported: its "
            "local steps update every rank's full copy of the parameters, which stage 3 does not "
            "keep (use stage 1 or 2, or OneBitAdam)"
        )
    dtype = torch.float16 if fp16["enabled"] else torch.bfloat16 if bf16["enabled"] else None
    if dtype is not None:
        if stage == 0:
            raise ValueError("fp16/bf16 need zero_optimization.stage >= 1 (fp32 master weights live there)")
        model = model.to(dtype)
    if stage == 0 and clip > 0 and onebit:
        # the 1-bit optimizer's step exchanges compressed momenta, not gradients: no rank holds
        # the global gradient whose norm gradient_clipping bounds
        raise ValueError(
            f"gradient_clipping={clip!r} with optimizer.type={cfg['optimizer']['type']!r} needs "
            "zero_optimization.stage >= 1 (at stage 0 nothing would clip); or set it to 0 and "
            "call torch.nn.utils.clip_grad_norm_ yourself")
    normalized = dict(cfg, zero_optimization=zero, fp16=fp16, bf16=bf16, train_batch_size=tb,
                      train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=ga,
                      gradient_clipping=float(clip))
    if stage == 0:
        if onebit:
            kw = dict(opt_kw)
            if process_group is not None:
                kw.setdefault("process_group", process_group)
            optimizer = opt_cls(model.parameters(), **kw)
        else:
            if world > 1:
                model = torch.nn.parallel.DistributedDataParallel(model, process_group=process_group)
            optimizer = opt_cls(model.parameters(), **opt_kw)
            if clip > 0:
                _clip_before_step(optimizer, float(clip))
        return TrainingSetup(model, optimizer, normalized, tb, mb, ga)
    zkw = {k: v for k, v in zero.items() if k != "stage"}
    optimizer = ZeroOptimizer(
        [p for p in model.parameters() if p.requires_grad],  # frozen ones stay as they are
        opt_cls,
        stage=stage,
        process_group=process_group,
        module=model,
        optimizer_kwargs=opt_kw,
        gradient_accumulation_steps=ga,
        gradient_clipping=float(clip),
        loss_scale=float(fp16["loss_scale"]) if fp16["enabled"] else 1.0,
        initial_scale_power=int(fp16["initial_scale_power"]),
        loss_scale_window=int(fp16["loss_scale_window"]),
        min_loss_scale=float(fp16["min_loss_scale"]),
        **zkw,
    )
    return TrainingSetup(model, optimizer, normalized, tb, mb, ga)
