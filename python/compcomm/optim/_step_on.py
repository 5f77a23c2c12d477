"""The argument checks of the 1-bit optimizers' ``step_on`` (OneBitBase.step_on)."""

from __future__ import annotations

from typing import Any, Dict, Sequence

import torch

from ..schedule import StepKind

__all__ = ["step_on_inputs"]


def step_on_inputs(opt: Any, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                   kind: Any) -> Dict[torch.Tensor, torch.Tensor]:
    """The checks of ``opt.step_on(params, grads, kind)`` (before anything changes); returns
    ``{p: fp32 gradient}``."""
    where = f"[rank {opt.rank}] {opt._name}.step_on"
    if not isinstance(kind, StepKind):
        raise TypeError(f"{where}: argument 'kind' must be a compcomm.schedule.StepKind, got "
                        f"{type(kind).__name__} {kind!r}")
    coming = opt.schedule.next_kind()
    if kind is not coming:
        raise ValueError(f"{where}: argument 'kind' is {kind}, but step "
                         f"{opt.schedule.step + 1} of this optimizer's schedule is {coming}")
    for name, seq in (("params", params), ("grads", grads)):
        if isinstance(seq, torch.Tensor) or not isinstance(seq, (list, tuple)):
            raise TypeError(f"{where}: argument '{name}' must be a list or tuple of tensors, "
                            f"got {type(seq).__name__}")
    if len(params) != len(grads):
        raise ValueError(f"{where}: argument 'grads' has {len(grads)} tensors for "
                         f"{len(params)} params")
    own = {id(p) for g in opt.param_groups for p in g["params"]}
    local: Dict[torch.Tensor, torch.Tensor] = {}
    for i, (p, g) in enumerate(zip(params, grads)):
        if not isinstance(p, torch.Tensor) or id(p) not in own:
            raise ValueError(f"{where}: argument 'params[{i}]' is not a parameter of this "
                             "optimizer")
        if p in local:
            raise ValueError(f"{where}: argument 'params[{i}]' appears twice")
        if not isinstance(g, torch.Tensor) or g.is_sparse or not g.is_floating_point():
            raise TypeError(f"{where}: argument 'grads[{i}]' must be a dense floating-point "
                            f"tensor, got {getattr(g, 'dtype', type(g).__name__)}")
        if g.shape != p.shape or g.device != p.device:
            raise ValueError(f"{where}: argument 'grads[{i}]' has shape {tuple(g.shape)} on "
                             f"{g.device}, its parameter {tuple(p.shape)} on {p.device}")
        # as step() reads p.grad: the tensor itself when it is fp32 and contiguous
        local[p] = g.detach().to(torch.float32, memory_format=torch.contiguous_format)
    return local
