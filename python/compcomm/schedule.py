"""When a 1-bit optimizer communicates what: the step kinds and the schedules that choose them.

A schedule is the only thing that decides what the next step of an optimizer does; the optimizer
(and ZeroOptimizer around it) asks :meth:`next_kind` instead of reading counters or strings, and
tells the schedule with :meth:`advance` once the step has been applied. A step that is skipped
(non-finite values, a failed exchange) never calls :meth:`advance`, so the schedule is unchanged.

The state dicts are exactly the ``state_dict()["compcomm"]["sched"]`` entries the optimizers have
always written, so old checkpoints load and new ones load into older versions.
"""

from __future__ import annotations

import enum
from typing import Any, Dict, Mapping, Tuple

__all__ = ["StepKind", "FreezeSchedule", "ZeroOneSchedule", "legacy_kind_name"]


class StepKind(enum.Enum):
    """What one optimizer step communicates and updates."""

    #: Gradients averaged in full precision; both moments updated (warm-up, or 0/1 Adam's
    #: variance-update steps).
    FULL_AVERAGE = "full_average"
    #: The momentum is averaged with 1-bit compression; the variance is frozen (1-bit Adam/LAMB).
    ONEBIT = "onebit"
    #: The gradient is averaged with 1-bit compression; the variance is not updated (0/1 Adam).
    ONEBIT_GRAD = "onebit_grad"
    #: Nothing is communicated: each rank steps with its own momentum (0/1 Adam, frozen phase).
    LOCAL = "local"
    #: The update accumulated since the last sync is averaged with 1-bit compression (0/1 Adam).
    SYNC = "sync"

    @property
    def averages(self) -> bool:
        """Whether the step needs the gradients averaged in full precision."""
        return self is StepKind.FULL_AVERAGE


class _CounterSchedule:
    """A schedule whose state is a flat dict of counters (the checkpoint format)."""

    def __init__(self) -> None:
        self._s: Dict[str, Any] = self.fresh()

    @staticmethod
    def fresh() -> Dict[str, Any]:
        """The state of a schedule before its first step."""
        return {"step": 0}

    @property
    def step(self) -> int:
        """Steps applied so far (the next step is ``step + 1``)."""
        return int(self._s["step"])

    def next_kind(self) -> StepKind:
        """The kind of the coming step."""
        return self.kind(self.step + 1)

    def kind(self, t: int) -> StepKind:
        """The kind of step ``t`` given the current state (only the next step is certain)."""
        raise NotImplementedError

    def advance(self, kind: StepKind) -> None:
        """Record that a step of ``kind`` (the one :meth:`next_kind` gave) was applied."""
        raise NotImplementedError

    def state_dict(self) -> Dict[str, Any]:
        """A copy of the counters (what checkpoints store as ``["compcomm"]["sched"]``)."""
        return dict(self._s)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take over ``state`` (validated by the caller); missing counters start fresh and
        unknown ones are kept, so they survive the next save."""
        s = self.fresh()
        s.update(state)
        self._s = s


class FreezeSchedule(_CounterSchedule):
    """OneBitAdam and OneBitLamb: full-precision warm-up for ``freeze_step`` steps, then 1-bit.

    Parameters
    ----------
    freeze_step : int
        Last warm-up step; compression starts at step ``freeze_step + 1``.
    """

    def __init__(self, freeze_step: int) -> None:
        super().__init__()
        self.freeze_step = int(freeze_step)

    @property
    def frozen(self) -> bool:
        """True once the warm-up is over (DeepSpeed's ``adam_freeze_key``)."""
        return self.step >= self.freeze_step

    def kind(self, t: int) -> StepKind:
        return StepKind.FULL_AVERAGE if t <= self.freeze_step else StepKind.ONEBIT

    def advance(self, kind: StepKind) -> None:
        self._s["step"] = self.step + 1


class ZeroOneSchedule(_CounterSchedule):
    """0/1 Adam: variance updates at growing intervals, then local steps with growing syncs.

    With ``t`` the step number (1, 2, ...), DeepSpeed's rules by user step (step 1, DeepSpeed's
    uncounted initialisation call, is a real variance step that does not count towards
    ``var_update_scaler``):

    * variance phase (``t <= var_freeze_step + 1``): ``FULL_AVERAGE`` when ``t % var_interval ==
      0``, else ``ONEBIT_GRAD``; every ``var_update_scaler`` variance updates the interval doubles;
    * frozen phase: ``SYNC`` when ``t % local_step_interval == 0``, else ``LOCAL``; every
      ``local_step_scaler`` steps the interval doubles, up to ``local_step_clipper``.

    Parameters
    ----------
    var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper : int
        As :class:`compcomm.optim.ZeroOneAdam`.
    """

    def __init__(self, var_freeze_step: int, var_update_scaler: int, local_step_scaler: int,
                 local_step_clipper: int) -> None:
        super().__init__()
        self.var_freeze_step = int(var_freeze_step)
        self.var_update_scaler = int(var_update_scaler)
        self.local_step_scaler = int(local_step_scaler)
        self.local_step_clipper = int(local_step_clipper)

    @staticmethod
    def fresh() -> Dict[str, Any]:
        # the key order of the checkpoints written before this class existed
        return {"step": 0, "var_interval": 1, "var_counter": 0, "local_step_interval": 1,
                "local_step_counter": 0, "freeze_key": False, "var_updates": 0, "freeze_t": 0}

    @property
    def frozen(self) -> bool:
        """True once the variance is frozen (local-step phase; DeepSpeed's ``freeze_key``)."""
        return bool(self._s["freeze_key"])

    @property
    def var_updates(self) -> int:
        """Variance updates so far (the variance's bias-correction step)."""
        return int(self._s["var_updates"])

    @property
    def freeze_t(self) -> int:
        """The step at which the variance froze (0 before; the momentum's frozen correction)."""
        return int(self._s["freeze_t"])

    def kind(self, t: int) -> StepKind:
        s = self._s
        if not s["freeze_key"]:
            return StepKind.FULL_AVERAGE if t % s["var_interval"] == 0 else StepKind.ONEBIT_GRAD
        return StepKind.SYNC if t % s["local_step_interval"] == 0 else StepKind.LOCAL

    def bias_steps(self, kind: StepKind) -> Tuple[int, int]:
        """(momentum, variance) bias-correction steps of the coming step of ``kind``: the
        variance counts this step's update already; both freeze with the variance."""
        t = self.step + 1
        var_updates = self.var_updates + (1 if kind is StepKind.FULL_AVERAGE else 0)
        return (self.freeze_t if self.frozen else t), var_updates

    def advance(self, kind: StepKind) -> None:
        s = self._s
        t = self.step + 1
        if not s["freeze_key"]:
            if kind is StepKind.FULL_AVERAGE:
                s["var_updates"] += 1
                if t > 1:  # step 1 stands for DeepSpeed's uncounted init call
                    s["var_counter"] += 1
                    if s["var_counter"] == self.var_update_scaler:
                        s["var_counter"] = 0
                        s["var_interval"] *= 2
        else:
            s["local_step_counter"] += 1
            if s["local_step_counter"] == self.local_step_scaler:
                s["local_step_counter"] = 0
                s["local_step_interval"] = min(self.local_step_clipper,
                                               2 * s["local_step_interval"])
        s["step"] = t
        if not s["freeze_key"] and t > self.var_freeze_step:
            s["freeze_key"] = True
            s["freeze_t"] = t


def legacy_kind_name(kind: StepKind) -> str:
    """ZeroOneAdam's step-kind strings from before :class:`StepKind` (``step_kind()`` keeps
    them)."""
    return _LEGACY[kind]


_LEGACY = {StepKind.FULL_AVERAGE: "var", StepKind.ONEBIT_GRAD: "grad1bit",
           StepKind.LOCAL: "local", StepKind.SYNC: "sync", StepKind.ONEBIT: "onebit"}

