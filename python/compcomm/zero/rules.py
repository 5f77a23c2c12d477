"""Which optimizers ZeroOptimizer can wrap, and how (the rules the DeepSpeed-config entry point
checks before it touches the model)."""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
from typing import Any, Dict, Mapping, Optional

from ..compress import Compressor, OneBitCompressor
from ..schedule import StepKind

__all__ = ["MODES", "Phase", "OneBitRules", "RULES", "onebit_kind", "onebit_inner_kwargs",
           "onebit_mode", "check_stage", "build_compressor"]

#: Values of ``zero_optimization.onebit_mode`` (None: "exact").
MODES = ("exact", "no_allgather", "sharded")


class Phase(enum.Enum):
    """How the coming ``step()`` reduces the gradients (:attr:`ZeroOptimizer.phase`)."""

    #: averaged in full precision, reduce-scattered into the gradient shards (any optimizer;
    #: a 1-bit optimizer's warm-up or variance steps)
    FULL = "full"
    #: the local gradients 1-bit reduce-scattered into the shards (:mod:`.onebit_reducer`)
    ONEBIT = "onebit"
    #: OneBitAdam's replicated momentum, 1-bit allreduced (:mod:`.onebit_replicated`)
    REPLICATED = "replicated"
    #: ZeroOneAdam's local-step phase: unsharded, gradients stay local (:mod:`.unsharded`)
    LOCAL = "local"

    @property
    def compressed(self) -> bool:
        """Whether the step reduces with 1-bit compression (gradients staged until ``step()``)."""
        return self in (Phase.ONEBIT, Phase.REPLICATED)

    @staticmethod
    def compresses(kind: StepKind) -> bool:
        """Whether ZeRO reduces a step of the wrapped optimizer's ``kind`` with 1-bit compression
        (the others average in full precision, or run locally)."""
        return kind in (StepKind.ONEBIT, StepKind.ONEBIT_GRAD)


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

    def input_scale(self, group: Mapping[str, Any]) -> float:
        """What ZeRO's sharded 1-bit reduction sends, as a multiple of the local gradient:
        ``1 - beta1`` (the local momentum contribution) or 1."""
        return 1.0 - float(group["betas"][0]) if self.compresses_momentum else 1.0


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


def onebit_inner_kwargs(name: str, kwargs: Dict[str, Any], comm: Any = None) -> Dict[str, Any]:
    """Arguments for the wrapped 1-bit optimizer, built on ZeroOptimizer's group ``comm``: on the
    shards ZeroOptimizer reduces the gradients and calls its ``step_on`` (no communication), so
    the user may not pick another group or backend; ZeroOneAdam's unsharded local phase calls
    its ``step()`` on that group."""
    for key, ok in (("comm_backend_name", ("torch",)), ("grads_averaged", (False,)),
                    ("process_group", (None,))):
        if key in kwargs and kwargs[key] not in ok:
            raise ValueError(
                f"optimizer_kwargs.{key}={kwargs[key]!r} is not supported with ZeRO: ZeroOptimizer "
                "does the communication on its own process group"
            )
    if name == "OneBitAdam":  # ZeroOptimizer reduces the gradients: nothing to send in backward
        if kwargs.get("overlap_backward", False) not in (False, "auto"):
            raise ValueError("optimizer_kwargs.overlap_backward=True is not supported with ZeRO: "
                             "ZeroOptimizer does the communication (see its overlap_comm)")
        kwargs = dict(kwargs, overlap_backward=False)
    # ZeroOptimizer skips non-finite steps itself (global norm / overflow flag, on every rank)
    return dict(kwargs, comm_backend_name="torch", grads_averaged=True, check_finite=False,
                process_group=comm)


def onebit_mode(name: Optional[str], mode: Optional[str], stage: int) -> Optional[str]:
    """The compressed phase's form for OneBitAdam (None for other optimizers); ValueError naming
    ``onebit_mode`` for a value that does not apply."""
    rules = RULES.get(name or "")
    if rules is None or not rules.modes:
        if mode is not None:
            raise ValueError(f"zero_optimization.onebit_mode={mode!r} applies only to OneBitAdam, "
                             f"not to {name or 'this optimizer'}")
        return None
    mode = "exact" if mode is None else mode
    if mode not in MODES:
        raise ValueError(f"zero_optimization.onebit_mode must be one of {', '.join(map(repr, MODES))}"
                         f", got {mode!r}")
    if mode == "no_allgather" and stage == 3:
        raise ValueError("zero_optimization.onebit_mode='no_allgather' needs stage 1 or 2 (every "
                         "rank updates the whole parameters, which stage 3 does not keep)")
    return mode


_REDUCE_SCATTER = ("reduce_scatter_", "reduce_scatter_exchange", "reduce_scatter_commit")


def build_compressor(inner: Any, comm: Any, timeout: float, reduce_scatter: bool) -> Compressor:
    """The compressor of ZeRO's buckets on ZeRO's group ``comm``: built by the wrapped 1-bit
    optimizer's ``compressor_factory`` (its ``compressor=`` argument; :class:`OneBitCompressor` by
    default), given ``timeout`` when the factory takes that argument. ``reduce_scatter``: ZeRO
    will use its reduce-scatter (TypeError naming ``compressor`` if it has none)."""
    factory = getattr(inner, "compressor_factory", None) or OneBitCompressor
    try:
        takes_timeout = "timeout" in inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a callable without a signature: comm only
        takes_timeout = False
    comp = factory(comm, timeout=timeout) if takes_timeout else factory(comm)
    missing = [m for m in _REDUCE_SCATTER if not hasattr(comp, m)] if reduce_scatter else []
    if missing:
        comp.close()
        raise TypeError(f"optimizer_kwargs.compressor: {type(comp).__name__} has no "
                        f"{', '.join(missing)}, which ZeRO's sharded 1-bit reduction needs "
                        "(onebit_mode='sharded', ZeroOneAdam)")
    return comp
