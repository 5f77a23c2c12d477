"""``compcomm.zero.initialize``: a ZeroOptimizer from DeepSpeed-style ``optimizer`` and
``zero_optimization`` sections."""

from __future__ import annotations

from typing import Any, Dict

import torch

from ..optim.factory import optimizer_from_config
from .config import validate_zero_config
from .optimizer import ZeroOptimizer

__all__ = ["initialize"]


def initialize(
    model: torch.nn.Module,
    optimizer_config: Dict[str, Any],
    zero_config: Dict[str, Any],
    process_group: Any = None,
    **kwargs: Any,
) -> ZeroOptimizer:
    """A ZeroOptimizer for ``model`` from DeepSpeed-style sections.

    Parameters
    ----------
    model : torch.nn.Module
        The model (its parameters; stage 3 also installs module hooks).
    optimizer_config : dict
        DeepSpeed's ``optimizer`` section, e.g. ``{"type": "AdamW", "params": {"lr": 1e-3}}``.
    zero_config : dict
        DeepSpeed's ``zero_optimization`` section; ``stage`` must be 1, 2 or 3.
    process_group : optional
        The data-parallel group.
    **kwargs
        Further ZeroOptimizer arguments (``gradient_accumulation_steps``, ``gradient_clipping``,
        ``loss_scale``, ``timeout``).
    """
    zero = validate_zero_config(zero_config)
    if zero["stage"] not in (1, 2, 3):
        raise ValueError(f"zero_config.stage must be 1, 2 or 3, got {zero['stage']!r}")
    cls, kw, _ = optimizer_from_config(optimizer_config)
    trainable = [p for p in model.parameters() if p.requires_grad]  # frozen ones stay as they are
    return ZeroOptimizer(trainable, cls, process_group=process_group, module=model,
                         optimizer_kwargs=kw, **kwargs, **zero)
