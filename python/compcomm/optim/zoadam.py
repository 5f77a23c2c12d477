"""0/1 Adam (DeepSpeed's ZeroOneAdam, ONEBIT_SPEC.md section c) as a drop-in torch optimizer."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from ..schedule import StepKind, ZeroOneSchedule, legacy_kind_name
from . import cpu_multi
from . import functional as F
from .adam import cpu_kernels_usable, frozen_denominators
from ._params import (group_chunks, group_mask, mask_, master, moments, write_back,
                      write_back_multi)
from ._validation import who, check_common, check_int
from .base import OneBitBase


class ZeroOneAdam(OneBitBase):
    r"""0/1 Adam: Adam with an adaptively frozen variance, 1-bit gradients and local steps.

    Schedule, with ``t`` the step number (1, 2, ...), identical to DeepSpeed's by user step (step 1,
    DeepSpeed's wasted initialisation call, is here a real variance-update step that does not count
    towards ``var_update_scaler``):

    * **Variance phase** (``t <= var_freeze_step``): if ``t % var_interval == 0`` the gradients are
      averaged in full precision and both moments are updated; otherwise the local gradient is
      averaged with :func:`compcomm.compressed_allreduce` and only the momentum is updated. Every
      ``var_update_scaler`` variance updates ``var_interval`` doubles.
    * **Frozen phase**: no gradient communication. Each rank steps with its local momentum and
      accumulates its update ``u``; every ``local_step_interval`` steps the ranks synchronise
      ``u`` (times ``sqrt(v)+eps``) with one compressed allreduce per bucket, roll back to the
      last synchronised parameters and apply the averaged update; the momentum becomes the
      lr-weighted average momentum. Every ``local_step_scaler`` steps the interval doubles, up to
      ``local_step_clipper``. Error buffers are zeroed once when the phase starts. A local
      step sends only a 4-byte all-reduce, so that every rank skips a step with a non-finite
      gradient on any rank (``check_finite=False`` drops it when the caller checks).

    Differences from DeepSpeed (all deliberate): the first ``step()`` is a real step; with one
    rank the momentum is updated (DeepSpeed skipped it); ``load_state_dict`` restores the schedule
    and the frozen state; ``bias_correction`` is honoured (momentum by ``1-beta1**t`` and variance by
    ``1-beta2**k``, ``k`` variance updates; both factors freeze with the variance); ``exp_avg_mask``
    is also applied with one rank; weight decay is kept out of the momentum rebuilt at a sync
    (``wd_in_momentum``).

    On the CPU a local step of fp32 tensors is one C++ pass per tensor
    (:func:`compcomm.optim.cpu_multi.zero_one_local_steps_`, the torch ops' bits), where
    :func:`~compcomm.optim.adam.cpu_kernels_usable` allows it; the other steps are torch ops.

    Parameters
    ----------
    params, lr, betas, eps, weight_decay, amsgrad, cuda_aware, comm_backend_name, process_group,
    grads_averaged, exact_resume, reduce_bucket_size, per_parameter, fused, check_finite,
    compressor, eps_inside_sqrt, max_grad_norm :
        As :class:`compcomm.optim.OneBitAdam`.
    bias_correction : bool, default False
    var_freeze_step : int, default 100000
        Last step of the variance phase.
    var_update_scaler : int, default 16
        Variance updates per ``var_interval`` before it doubles.
    local_step_scaler : int, default 32678
        Steps per ``local_step_interval`` before it doubles.
    local_step_clipper : int, default 16
        Largest ``local_step_interval``.
    wd_in_momentum : bool, default True
        DeepSpeed's sync rebuilds the momentum from the whole accumulated update, weight-decay
        term included (``m = avg(-u (sqrt(v)+eps)) / lrs`` with ``u`` holding ``-lr wd p``), so
        every sync adds ``wd p (sqrt(v)+eps)`` to the momentum and the decay is applied again
        through ``m`` at the following steps: with syncs every step about ``1/(1-beta1)`` (10x)
        the weight decay asked for. The default ``True`` keeps DeepSpeed's numerics (the spec);
        ``False`` removes that term from the rebuilt momentum (``m -= wd p_sync (sqrt(v)+eps)``,
        exact for one local step per sync), which we recommend with weight decay (the demo uses
        it). Irrelevant when ``weight_decay == 0``.
    """

    _name = "ZeroOneAdam"

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = False,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, var_freeze_step: int = 100000,
                 var_update_scaler: int = 16, local_step_scaler: int = 32678,
                 local_step_clipper: int = 16, amsgrad: bool = False, cuda_aware: bool = False,
                 comm_backend_name: str = "torch", process_group: Any = None,
                 grads_averaged: bool = False, exact_resume: bool = False,
                 reduce_bucket_size: Optional[int] = None, per_parameter: bool = False,
                 fused: Optional[bool] = None, check_finite: bool = True,
                 wd_in_momentum: bool = True, compressor: Any = None) -> None:
        n = self._who = who(self._name, comm_backend_name, process_group)
        check_common(n, lr, betas, eps, weight_decay, amsgrad)
        self.var_freeze_step = check_int(n, "var_freeze_step", var_freeze_step, 0)
        self.var_update_scaler = check_int(n, "var_update_scaler", var_update_scaler, 1)
        self.local_step_scaler = check_int(n, "local_step_scaler", local_step_scaler, 1)
        self.local_step_clipper = check_int(n, "local_step_clipper", local_step_clipper, 1)
        self.wd_in_momentum = bool(wd_in_momentum)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bool(bias_correction))
        super().__init__(params, defaults)
        self._init_common(comm_backend_name, process_group, cuda_aware, grads_averaged,
                          exact_resume, fused, reduce_bucket_size, per_parameter,
                          check_finite, compressor)
        self.schedule = ZeroOneSchedule(self.var_freeze_step, self.var_update_scaler,
                                        self.local_step_scaler, self.local_step_clipper)

    @property
    def freeze_key(self) -> bool:
        """True once the variance is frozen (local-step phase)."""
        return self.schedule.frozen

    def step_kind(self, t: Optional[int] = None) -> str:
        """What step ``t`` (default: the next) does: ``'var'`` (fp32 gradient average, variance
        update), ``'grad1bit'`` (1-bit gradient average), ``'local'`` or ``'sync'`` (frozen
        phase). Only meaningful for the next step, since the schedule evolves. The strings of
        ``self.schedule.next_kind()`` (:class:`compcomm.schedule.StepKind`), kept for callers
        written before it."""
        kind = self.schedule.next_kind() if t is None else self.schedule.kind(t)
        return legacy_kind_name(kind)

    def _step(self) -> None:
        """This optimizer's update (OneBitBase.step handles the closure and AMP skips)."""
        sched = self.schedule
        t = sched.step + 1
        kind = sched.next_kind()
        frozen = sched.frozen
        bc1_t, bc2_t = sched.bias_steps(kind)
        grads = self._grads(average=kind.averages)
        items = list(self._params())
        if kind is StepKind.LOCAL:
            # nothing else is sent: agree on skipping with one 4-byte all-reduce (a world of one
            # rank, or step_on, had its gradients checked by _grads)
            if self._local is None and self.world_size > 1:
                self._check_finite(grads.values(), agree=True)
        elif kind is StepKind.ONEBIT_GRAD:
            grads = self._compressed_average(items, lambda entries: torch._foreach_copy_(
                [out for _, _, out in entries], [grads[p] for _, p, _ in entries]))
            for group, p in items:
                mask_(grads[p], group)
        elif kind is StepKind.SYNC:
            self._sync_step(items, grads)
        for group, run in group_chunks(items) if kind is not StepKind.SYNC else ():
            ps = [p for _, p in run]
            states = [self.state[p] for p in ps]
            ms, vs = map(list, zip(*(moments(p, st) for p, st in zip(ps, states))))
            for st in states:
                st["step"] = t
            accs = None
            if frozen:
                accs = [self._accumulator(p, st) for p, st in zip(ps, states)]
                for st in states:
                    st["lrs"] += group["lr"]
            ws = [master(p, st) for p, st in zip(ps, states)]
            gs = [grads[p] for p in ps]
            if kind is StepKind.LOCAL and _kernels_fit(group, ws, ms, vs, gs, accs):
                # one C++ pass per tensor (the torch ops' bits): 32 bytes per parameter
                ds, denom = frozen_denominators(self, vs, group, bc2_t)
                cpu_multi.zero_one_local_steps_(ws, ms, ds, gs, accs, group, bc1_t, bc2_t,
                                                check=False, denom=denom)
            else:
                F.zero_one_local_multi_(ws, ms, vs, gs, group, bc1_t, bc2_t,
                                        update_variance=kind is StepKind.FULL_AVERAGE, accs=accs)
            write_back_multi(ps, states)
        sched.advance(kind)  # once per step, as DeepSpeed does per parameter
        if sched.frozen and not frozen:
            self._zero_errors()  # the buffers now serve u instead of g: restart them

    @staticmethod
    def _accumulator(p: torch.Tensor, state: Dict[str, Any]) -> torch.Tensor:
        """The update accumulated since the last sync (created at the first frozen step)."""
        if "momentum_accumulator" not in state:
            state["momentum_accumulator"] = torch.zeros_like(state["exp_avg"])
            state["lrs"] = 0.0
        return state["momentum_accumulator"]

    def _sync_step(self, items: List[Tuple[Dict[str, Any], torch.Tensor]],
                   grads: Dict[torch.Tensor, torch.Tensor]) -> None:
        """A sync step: this step's update is added to the accumulated one ``u``, ``u (sqrt(v) +
        eps)`` is 1-bit averaged, the parameters roll back to the last synchronised point and take
        the averaged update, and the momentum becomes the lr-weighted average momentum. The update
        is computed while staging, and nothing is written before the average has succeeded."""
        sched = self.schedule
        t = sched.step + 1
        pending: Dict[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = {}

        def stage(entries: List[Tuple[Dict[str, Any], torch.Tensor, torch.Tensor]]) -> None:
            for group, p, out in entries:
                state = self.state[p]
                m, v = moments(p, state)
                pending[p] = F.zero_one_sync_input(master(p, state), m, v, grads[p],
                                                   state.get("momentum_accumulator"), group,
                                                   sched.freeze_t, sched.var_updates, out)

        averaged = self._compressed_average(items, stage)
        for group, p in items:
            state = self.state[p]
            update, denom = pending[p]
            state["step"] = t
            w = master(p, state)
            acc = self._accumulator(p, state)
            state["lrs"] += group["lr"]
            F.zero_one_sync_commit_(w, state["exp_avg"], acc, averaged[p], update, denom,
                                    state["lrs"], group, sched.freeze_t, self.wd_in_momentum,
                                    mask=group_mask(group, acc))
            state["lrs"] = 0.0
            write_back(p, state)


def _kernels_fit(group: Dict[str, Any], *columns: Optional[List[torch.Tensor]]) -> bool:
    """Whether a local step's tensors (w, m, v, g, acc of each parameter) can go to the C++ pass:
    all fp32, contiguous, on the CPU, one size per parameter, and the kernels usable here."""
    if any(c is None for c in columns):
        return False
    for ts in zip(*columns):
        n = ts[0].numel()
        if not all(t.dtype == torch.float32 and t.is_cpu and t.is_contiguous() and not t.is_sparse
                   and t.numel() == n for t in ts):
            return False
    return cpu_kernels_usable(group, columns[0], frozen=True)
