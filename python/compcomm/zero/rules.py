"""Which optimizers ZeroOptimizer can wrap, and how (the rules the DeepSpeed-config entry point
checks before it touches the model)."""

from __future__ import annotations

import functools
from typing import Any, Dict, Optional

from .. import _C

__all__ = ["onebit_kind", "onebit_inner_kwargs"]


def onebit_kind(optimizer_class: Any) -> Optional[str]:
    """'OneBitAdam' / 'ZeroOneAdam' for those compcomm optimizers (or partials of them), None for
    any other optimizer; ValueError for OneBitLamb (its trust ratio is per tensor, not per shard)."""
    cls = optimizer_class
    while isinstance(cls, functools.partial):
        cls = cls.func
    if not isinstance(cls, type):
        return None
    from ..optim import OneBitAdam, OneBitLamb, ZeroOneAdam

    if issubclass(cls, OneBitLamb):
        raise ValueError(
            "optimizer_class: OneBitLamb cannot be wrapped by ZeroOptimizer (LAMB's trust ratio is "
            "per parameter, a shard is not one); use it with ZeRO stage 0"
        )
    if issubclass(cls, ZeroOneAdam):
        return "ZeroOneAdam"
    if issubclass(cls, OneBitAdam):
        return "OneBitAdam"
    return None


def onebit_inner_kwargs(name: str, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Arguments for the wrapped 1-bit optimizer: it runs on this rank's shards alone (a world of
    one rank, gradients already reduced by ZeroOptimizer), so it never communicates itself (until
    ZeroOneAdam's local-step phase, when ZeroOptimizer hands it its own group)."""
    for key, ok in (("comm_backend_name", ("torch",)), ("grads_averaged", (False,)),
                    ("process_group", (None,))):
        if key in kwargs and kwargs[key] not in ok:
            raise ValueError(
                f"optimizer_kwargs.{key}={kwargs[key]!r} is not supported with ZeRO: ZeroOptimizer "
                "does the communication on its own process group"
            )
    # ZeroOptimizer skips non-finite steps itself (global norm / overflow flag, on every rank)
    return dict(kwargs, comm_backend_name="torch", grads_averaged=True, check_finite=False,
                process_group=_C.LocalCommunicator())
