"""Which optimizers ZeroOptimizer can wrap, and how (the rules the DeepSpeed-config entry point
checks before it touches the model)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict, Optional

from .. import _C

__all__ = ["OneBitRules", "RULES", "onebit_kind", "onebit_inner_kwargs", "check_stage"]


@dataclasses.dataclass(frozen=True)
class OneBitRules:
    """How ZeroOptimizer runs one 1-bit optimizer."""

    #: its compressed phase averages the momentum ``b1 m + (1 - b1) g``: ZeRO's sharded form
    #: compresses the local contribution ``(1 - b1) g`` (else the gradient ``g`` itself)
    compresses_momentum: bool
    #: full-precision steps come back after compressed ones (0/1 Adam's variance steps), so the
    #: full-precision staging pool is kept
    full_steps_recur: bool
    #: after its freeze it steps locally, unsharded (:mod:`.unsharded`)
    local_phase: bool
    #: ``zero_optimization.onebit_mode`` applies (the replicated-momentum forms)
    modes: bool
    #: why it cannot run with stage 3 ("" if it can)
    no_stage3: str = ""


#: The 1-bit optimizers ZeroOptimizer knows, by :func:`onebit_kind`.
RULES: Dict[str, OneBitRules] = {
    "OneBitAdam": OneBitRules(compresses_momentum=True, full_steps_recur=False, local_phase=False,
                              modes=True),
    "ZeroOneAdam": OneBitRules(
        compresses_momentum=False, full_steps_recur=True, local_phase=True, modes=False,
        no_stage3="its local steps update every rank's full copy of the parameters, which stage 3 "
                  "does not keep"),
}


def check_stage(name: Optional[str], stage: int) -> None:
    """ValueError naming ``optimizer_class`` if 1-bit optimizer ``name`` cannot run at ``stage``."""
    rules = RULES.get(name or "")
    if rules is not None and stage == 3 and rules.no_stage3:
        raise ValueError(f"optimizer_class: {name} with ZeRO stage 3 is not supported "
                         f"({rules.no_stage3}); use stage 1 or 2, or OneBitAdam")


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
