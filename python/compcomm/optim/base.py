"""The base class of the 1-bit optimizers: the communicator and compressor, gradient
averaging, the compressed average (its bucket plan: :mod:`._plan`), skipped steps (GradScaler or
non-finite values) and the state dict with its exact-resume part.

Every optimizer here follows the same life cycle (ONEBIT_SPEC.md, policy section):

* ``step()`` number ``t`` counts real steps from 1 (no swallowed initialisation call).
* Steps ``1 .. freeze_step`` are the warm-up: gradients are averaged in full precision (by the
  optimizer with a bucketed allreduce, or already by DDP / the user when ``grads_averaged``).
* Afterwards only compressed tensors (1 bit per element plus scales) cross the network: the
  parameters' tensors packed in order into buckets of at most ``reduce_bucket_size`` elements, one
  compressed allreduce and one pair of error-feedback buffers per bucket (``per_parameter=True``:
  one per parameter, DeepSpeed's fp32 layout), exchanged bucket after bucket while the next one is
  staged, and committed together (:class:`compcomm.compress.OneBitCompressor`).
* A step that meets a non-finite value on any rank changes nothing on any rank and counts in
  ``skipped_steps``.
"""

from __future__ import annotations

import copy
import warnings
import weakref
from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .._agree import LayoutCheck
from .._comm_users import join as join_comm
from ..compress import DEFAULT_BUCKET_ELEMENTS, OneBitCompressor
from ..errors import NonFiniteError
from ..schedule import FreezeSchedule, StepKind
from ._grads import all_finite, all_max, average_, fp32_grad, non_finite_error, resolve_comm
from ._params import has_grads, match_state_shapes
from ._plan import BucketPlans
from ._staging import staged_plan
from ._step_on import step_on_inputs
from .overlap import BackwardOverlap, resolve_overlap
from ._state import ERROR_KEYS, validate_state_dict
from ._validation import check_int, check_last_group, check_masks, layout_fields

__all__ = ["OneBitBase"]


class OneBitBase(BucketPlans, torch.optim.Optimizer):
    """Shared machinery of OneBitAdam, ZeroOneAdam and OneBitLamb (not for direct use)."""

    #: GradScaler hands us the scale and the overflow flag instead of unscaling itself, so all
    #: ranks can agree on skipping a step (see :meth:`_amp_skip`).
    _step_supports_amp_scaling = True
    _name = "OneBitBase"
    #: ``make_fill(grads)``: the compressed phase's staging over ``{p: fp32 gradient}`` (the
    #: optimizers that can send it from the backward set it)
    _momentum_fill: Optional[Callable[..., Any]] = None

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        check_last_group(self)  # a bad group (dtype, lr, betas, mask, unknown key) raises, not added
        if hasattr(self, "_user_masks"):  # added after construction: load_state_dict restores it
            self._user_masks.append(self.param_groups[-1].get("exp_avg_mask"))
        if getattr(getattr(self, "schedule", None), "frozen", False):
            warnings.warn(f"{self._name}: param group added after the variance froze: its "
                          "parameters have no variance (zeros, as in DeepSpeed), so their updates "
                          "are lr * m / eps (OneBitLamb: a frozen coefficient of 0, no update); "
                          "add them before the freeze or start a new optimizer",
                          RuntimeWarning, stacklevel=2)

    def _init_common(self, comm_backend_name: str, process_group: Any, cuda_aware: bool,
                     grads_averaged: bool, exact_resume: bool, fused: Optional[bool] = None,
                     reduce_bucket_size: Optional[int] = None, per_parameter: bool = False,
                     check_finite: bool = True, compressor: Any = None,
                     overlap_backward: Any = False) -> None:
        if compressor is None:
            compressor = OneBitCompressor
        if not callable(compressor):
            raise TypeError(f"{self._name}: argument 'compressor' must be a compressor class or a "
                            f"callable comm -> compressor, got {type(compressor).__name__}")
        #: builds the compressor for a communicator (again when ZeroOptimizer changes it)
        self.compressor_factory = compressor
        self.comm = resolve_comm(self._name, comm_backend_name, process_group)
        self.process_group = process_group
        self.world_size = self.comm.size()
        self.rank = self.comm.rank()
        self.comm_backend_name = comm_backend_name
        self.cuda_aware = bool(cuda_aware)
        self.grads_averaged = bool(grads_averaged)
        self.exact_resume = bool(exact_resume)
        self.check_finite = bool(check_finite)
        if reduce_bucket_size is None:
            reduce_bucket_size = DEFAULT_BUCKET_ELEMENTS
        if isinstance(reduce_bucket_size, float) and reduce_bucket_size.is_integer():
            reduce_bucket_size = int(reduce_bucket_size)  # DeepSpeed configs write 5e8
        self.reduce_bucket_size = check_int(self._name, "reduce_bucket_size", reduce_bucket_size, 1)
        self.per_parameter = bool(per_parameter)
        if fused is not None:  # the earlier switch: True = one bucket per group, False = per parameter
            self.per_parameter = not fused
            if fused:
                self.reduce_bucket_size = 1 << 62
        self.compressor = compressor(self.comm)
        join_comm(self.comm, self.compressor)  # its worker thread: no overlap shares the comm
        #: steps skipped because some rank met a non-finite value (nothing changed in them)
        self.skipped_steps = 0
        self._plan_key: Optional[Tuple[Any, ...]] = None
        self._buckets: List[List[int]] = []
        self._plan_desc: List[List[Tuple[int, int]]] = []
        self._staging: Dict[int, torch.Tensor] = {}
        self._loaded_errors: Optional[Tuple[List[List[Tuple[int, int]]], Dict[Any, Any]]] = None
        self._hook_averaged = False  # mark_grads_averaged(), for the coming step only
        self._user_masks = [g.get("exp_avg_mask") for g in self.param_groups]
        check_masks(self._name, self.param_groups)
        #: what each step does (compcomm.schedule); subclasses replace it with their own
        self.schedule: Any = FreezeSchedule(0)
        #: during step_on: the given parameters' fp32 gradients (None otherwise)
        self._local: Optional[Dict[torch.Tensor, torch.Tensor]] = None
        #: step() checks that the ranks agree on the parameters and buckets (docs/errors.md);
        #: False where the caller did (ZeroOptimizer, when it is built)
        self.check_layout = True
        self._layout_check = LayoutCheck()
        #: load_state_dict calls so far (compcomm.ddp_comm_hook agrees on the schedule after each)
        self.state_loads = 0
        # 'auto' needs the communicator: on for CUDA parameters over native NCCL only
        self.overlap_backward = on = resolve_overlap(self._name, overlap_backward,
                                                     self.param_groups, self.comm)
        #: sends the compressed phase's groups of buckets from the backward (compcomm.optim.overlap)
        params = [p for g in self.param_groups for p in g["params"]]
        self._overlap = (BackwardOverlap(self._name, params, self.compressor, self.comm,
                                         overlap_backward is True) if on and self.world_size > 1
                         and hasattr(self.compressor, "launch_") else None)

    # -- phase queries ---------------------------------------------------------------------
    @property
    def sched(self) -> Dict[str, Any]:
        """The step counter and schedule state (a copy; what ``state_dict()["compcomm"]["sched"]``
        holds)."""
        return self.schedule.state_dict()

    def next_step_averages(self) -> bool:
        """Whether the next ``step()`` needs gradients averaged in full precision (warm-up)."""
        return self.schedule.next_kind().averages

    def mark_grads_averaged(self, averaged: bool = True) -> None:
        """Say that the gradients of the coming ``step()`` are (or are not) already averaged
        across ranks, for that step only (what :func:`compcomm.ddp_comm_hook` calls)."""
        self._hook_averaged = bool(averaged)

    def expect_grad_copy(self, params: Iterable[torch.Tensor]) -> None:
        """Say that DDP will write each of ``params``' gradients once more in this backward,
        unchanged (what :func:`compcomm.ddp_comm_hook` calls in the compressed phase), so that
        ``overlap_backward`` does not take that copy for a change of the gradients."""
        if self._overlap is not None:
            self._overlap.expect_copy(params)

    def _params(self) -> Iterable[Tuple[Dict[str, Any], torch.Tensor]]:
        local = self._local
        for group in self.param_groups:
            for p in group["params"]:
                has_grad = p.grad is not None if local is None else p in local
                if has_grad and p.numel() > 0:
                    yield group, p

    def _compressed_average(self, items: List[Tuple[Dict[str, Any], torch.Tensor]],
                            fill: Callable[[List[Tuple[Dict[str, Any], torch.Tensor,
                                                       torch.Tensor]]], None]
                            ) -> Dict[torch.Tensor, torch.Tensor]:
        """1-bit average across ranks of one fp32 tensor per parameter of ``items``.

        ``fill(entries)`` writes, for each ``(group, p, out)`` of ``entries``, the tensor to
        average for ``p`` into ``out`` (fp32, shaped like ``p``); it is called once per bucket
        (with that bucket's parameters), each bucket while the previous one is on the wire.
        Returns ``{p: averaged tensor}`` (views into staging buffers, valid until the next call).
        All or nothing: on an exception nothing outside the staging buffers was written, on any
        rank. One rank: the filled tensors themselves (no compression without peers).
        """
        if not items:
            return {}
        if self.world_size == 1 or self._local is not None:
            # nothing is sent (one rank, or step_on): no buckets, no staging kept between steps
            # (ZeroOptimizer steps on shards: a kept buffer would cost a shard-sized fp32 copy)
            views = {p: p.new_empty(p.shape, dtype=torch.float32) for _, p in items}
            fill([(group, p, views[p]) for group, p in items])
            return views
        key = self._plan_key_of(items)  # once a step: the plan and its undo both compare it
        undo = self._plan_undo(key)
        try:
            buckets = self._bucket_plan(items, key)
            # views, entries and buffers are worked out once per plan (not per bucket per step)
            plan = self._staged = staged_plan(getattr(self, "_staged", None), self._plan_key,
                                              items, buckets, self._staging)
            ov = self._overlap  # the groups sent from the backward, if they are this plan's
            # GradScaler drives this step (found_inf is set whether or not unscale_() already
            # ran: unscale_ divides the gradients in place without bumping their version counters)
            scaled = getattr(self, "found_inf", None) is not None
            if ov is not None and ov.complete(plan, scaled):
                return dict(plan.views)
            ahead = bool(getattr(self.compressor, "stages_ahead", False))
            # buckets of one device at a time (a model may keep groups on several devices); each
            # device's call commits its errors: kept, to be put back if a later device's fails
            if undo is None and len(plan.by_device) > 1:
                errors = self.compressor.state_dict()
                undo = lambda: self.compressor.load_state_dict(errors)  # noqa: E731
            for dev, idx, numels, entries in plan.by_device:
                self.compressor.average_(idx, numels, plan.stage_fn(idx, entries, fill, ahead),
                                         dev)
        except BaseException:
            if undo is not None:
                undo()
            raise
        return dict(plan.views)

    def _zero_errors(self) -> None:
        self.compressor.zero_()
        self._loaded_errors = None  # errors loaded but not yet in use would come back later

    def memory_bytes(self) -> Dict[str, int]:
        """Bytes of communication state this rank holds beyond ``self.state``:
        ``error_feedback`` (worker and server error buffers of every bucket) and ``buffers``
        (the buckets' fp32 staging and exchange workspaces)."""
        errors, workspaces = self.compressor.nbytes()
        staging = sum(t.numel() * t.element_size() for t in self._staging.values())
        return {"error_feedback": errors, "buffers": staging + workspaces}

    def _grads(self, average: bool, check: bool = True) -> Dict[torch.Tensor, torch.Tensor]:
        """fp32 gradients of every parameter that has one, averaged across ranks if ``average``
        (and not already averaged by DDP's hook or the user); ``check=False``: unchecked."""
        # the general paths all start here, before any write
        match_state_shapes(self.state, self.param_groups, f"[rank {self.rank}] {self._name}.step")
        if self._local is not None:  # step_on: the caller reduced them; a world of one
            if check:
                self._check_finite(self._local.values(), agree=False)
            return dict(self._local)
        # a copy only where the gradient is written (scaled, averaged) or not fp32 and contiguous
        scale = getattr(self, "_grad_scale", None)
        copy = scale is not None or (average and not (self.grads_averaged or self._hook_averaged))
        grads = {p: fp32_grad(p, copy) for _, p in self._params()}
        if scale is not None:
            inv = 1.0 / float(self._grad_scale)
            for g in grads.values():
                g.mul_(inv)
        if average and not (self.grads_averaged or self._hook_averaged):
            average_(list(grads.values()), self.comm)
        if check and (average or self.world_size == 1):
            # averaged gradients are the same on every rank, so are their checks; the compressed
            # average checks its inputs itself, on every rank
            self._check_finite(grads.values(), agree=False)
        return grads

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """One optimizer step (collective: every rank of the group must call it).

        If any rank meets a non-finite gradient (or compressed value), every rank skips the step:
        parameters, moments, error buffers and schedule stay as they were, and
        ``skipped_steps`` grows by one.

        Parameters
        ----------
        closure : callable, optional
            Re-evaluates the model and returns the loss.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        key = None  # which parameters have gradients: made once, where something reads it
        if self._overlap is not None:  # before any other collective: the exchanges go first
            key = has_grads(self.param_groups)
            self._overlap.settle(self._device(), key)
        self._agree_layout(key)
        if self._amp_skip():
            self.skipped_steps += 1
        else:
            try:
                self._step()
                self._nonfinite_run = 0
            except NonFiniteError as e:
                self.skipped_steps += 1
                self._nonfinite_run = getattr(self, "_nonfinite_run", 0) + 1
                if self._nonfinite_run in (1, 10, 100, 1000):  # not silent, not a flood
                    warnings.warn(f"{self._name}: step skipped on every rank ({self._nonfinite_run} "
                                  f"in a row, {self.skipped_steps} in all): {e}", RuntimeWarning,
                                  stacklevel=2)
        self._finish_step()
        return loss

    @torch.no_grad()
    def step_on(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                kind: StepKind) -> None:
        """Apply the update rule of one step of ``kind`` to ``params``, with no communication.

        The step a world of one rank would take: every average the kind communicates (the
        full-precision or compressed gradient average, 0/1 Adam's compressed sync) is taken to
        be the rank's own value, because the caller has reduced ``grads`` already (ZeroOptimizer
        steps its wrapped optimizer on the shards this way). Moments, error-feedback state
        (0/1 Adam zeroes its buffers at the freeze) and the schedule advance as in :meth:`step`;
        ``p.grad`` is not read, nor the GradScaler attributes.

        Parameters
        ----------
        params : sequence of Tensor
            Parameters of this optimizer (each at most once); the others are left as they are,
            as :meth:`step` leaves parameters without gradient.
        grads : sequence of Tensor
            ``grads[i]`` is the gradient for ``params[i]``: same shape and device, floating point.
        kind : compcomm.schedule.StepKind
            Must be ``self.schedule.next_kind()``: the caller says which step it prepared the
            gradients for, the schedule checks that it is the coming one.

        Raises
        ------
        TypeError, ValueError
            Naming the argument (``kind``, ``params[i]``, ``grads[i]``) and the rank.
        NonFiniteError
            With ``check_finite``, a gradient holds Inf/NaN (this rank only: nothing is sent).
            After any of these errors nothing has changed.
        """
        local = step_on_inputs(self, params, grads, kind)
        self._local = local
        try:
            self._step()
        finally:
            self._local = None

    def _device(self) -> torch.device:
        """The parameters' device (of the first parameter; the CPU if there is none)."""
        return next((p.device for g in self.param_groups for p in g["params"]), torch.device("cpu"))

    def _agree_layout(self, key: Optional[Tuple[bool, ...]] = None) -> None:
        """Raise RankMismatchError on every rank, before anything is sent or changed, if the
        ranks' parameters (shapes, dtypes, which have gradients), bucket plans or schedules
        differ (:mod:`compcomm._agree`): one small all-gather the first time a set of parameters
        with gradients is seen, nothing afterwards."""
        if self.world_size == 1 or not self.check_layout:
            return
        key = has_grads(self.param_groups) if key is None else key
        self._layout_check.agree(self.comm, f"{self._name}.step", key,
                                 lambda: layout_fields(self), self._device())

    def _check_finite(self, tensors: Iterable[torch.Tensor], agree: bool) -> None:
        """Raise NonFiniteError (a skipped step) if ``tensors`` hold Inf/NaN -- on this rank, or
        with ``agree`` on any rank (one small all-reduce; needed where nothing else is sent)."""
        if not self.check_finite:
            return
        bad = 0.0 if all_finite(tensors) else 1.0
        if agree and self._local is None:  # step_on never communicates
            bad = all_max(bad, self.comm, self._device())
        if bad:
            raise non_finite_error(self.rank, self._name)

    def _step(self) -> None:
        """The optimizer's own update; subclasses implement it. Everything that can fail (the
        checks, the communication) runs before the first write of any state."""
        raise NotImplementedError

    def _amp_skip(self) -> bool:
        """GradScaler integration: True if any rank found Inf/NaN gradients (then every rank skips
        the step, leaving parameters, moments and error buffers untouched)."""
        self._grad_scale = getattr(self, "grad_scale", None)
        found = getattr(self, "found_inf", None)
        if found is None:
            return False
        return all_max(float(found), self.comm, self._device()) > 0

    def _finish_step(self) -> None:
        self._hook_averaged = False
        ov = self._overlap
        if ov is None:
            return
        ov.discard()  # what a skipped step did not use
        if ov.enabled and self._momentum_fill is not None and not self.next_step_averages():
            items = list(self._params())  # the coming step's, if the same parameters get gradients
            # a new plan resets the error buffers: made here only where there are none to lose
            # (after a skipped step the items may differ from the plan the errors belong to)
            keep = (self._plan_key_of(items) == self._plan_key
                    or (not self.compressor.keys() and self._loaded_errors is None))
            if items and keep:
                self._bucket_plan(items)
                self._staged = staged_plan(getattr(self, "_staged", None), self._plan_key, items,
                                           self._buckets, self._staging)
                # a weak reference: the hooks must not keep an abandoned optimizer alive
                fill = self._momentum_fill
                ov.arm(self._staged, weakref.WeakMethod(fill) if hasattr(fill, "__self__")
                       else (lambda: fill))  # (a plain function put there by a test)

    # -- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """torch's optimizer state dict plus ``"compcomm"``: the step counter and schedule, and --
        with ``exact_resume=True`` -- this rank's error buffers and the bucket layout they belong to
        (save one file per rank then)."""
        sd = super().state_dict()
        extra: Dict[str, Any] = {"sched": self.schedule.state_dict(), "world_size": self.world_size,
                                 "rank": self.rank, "exact": self.exact_resume,
                                 "skipped_steps": self.skipped_steps}
        if self.exact_resume:
            if self._loaded_errors is not None:  # loaded, not used yet: pass it on unchanged
                extra["bucket_plan"], extra["bucket_errors"] = self._loaded_errors
            elif self.compressor.keys():  # no plan: a layout of the optimizer's own (OneBitLamb)
                extra["bucket_plan"] = self._plan_desc if self._plan_key is not None else None
                extra["bucket_errors"] = self.compressor.state_dict()
        extra.update(self._extra_state())
        sd["compcomm"] = extra
        return sd

    def _extra_state(self) -> Dict[str, Any]:
        return {}

    def _load_extra_state(self, extra: Dict[str, Any], exact: bool) -> None:
        pass

    def _saved_errors(self, extra: Dict[str, Any]) -> Optional[Tuple[Any, Dict[Any, Any]]]:
        """(bucket plan, errors) of a checkpoint, also of the layouts before buckets: per-parameter
        errors in the parameters' state, or ``fused`` errors per group. None if it has none."""
        if extra.get("bucket_errors"):
            return extra.get("bucket_plan"), extra["bucket_errors"]
        if extra.get("group_errors"):
            plan = [[(gi, pi) for pi, p in enumerate(self.param_groups[gi]["params"])
                     if p.numel() > 0] for gi in sorted(extra["group_errors"])]
            return plan, dict(enumerate(extra["group_errors"][gi]
                                        for gi in sorted(extra["group_errors"])))
        plan, errors = [], {}
        for gi, g in enumerate(self.param_groups):
            for pi, p in enumerate(g["params"]):
                st = self.state.get(p, {})
                if all(k in st for k in ERROR_KEYS):
                    errors[len(plan)] = {k: st[k] for k in ERROR_KEYS}
                    plan.append([(gi, pi)])
        return (plan, errors) if errors else None

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` (or a DeepSpeed-style one without schedule).

        The parameter groups' ``exp_avg_mask`` stay the ones given to this optimizer (a
        checkpoint's mask is ignored). Error buffers are reset to zero, as DeepSpeed does, unless
        this optimizer was built with ``exact_resume=True`` and the checkpoint was written by the
        same rank of a world of the same size with ``exact_resume=True`` and the same bucket layout
        (checkpoints of the per-parameter layout, from before bucketing, need
        ``per_parameter=True``); otherwise, if the checkpoint holds error buffers, a warning says
        they were reset.

        The whole state dict is validated first
        (:func:`compcomm.optim.checkpoint.validate_state_dict`): a malformed one raises
        TypeError/ValueError naming the bad entry and leaves this optimizer unchanged. Loading is
        local (no communication).
        """
        plan = validate_state_dict(self, state_dict)
        if self._overlap is not None:  # what the backward sent belongs to the old state
            self._overlap.cancel()
        # Validated: nothing below raises, so the optimizer is never left half-loaded.
        extra, exact = plan.extra, plan.exact
        if plan.has_errors and not exact and self.exact_resume:
            warnings.warn(
                f"{self._name}: checkpoint from rank {extra.get('rank')} of world size "
                f"{extra.get('world_size')} loaded on rank {self.rank} of {self.world_size}: "
                "compression error buffers reset to zero (trajectory will differ slightly)",
                RuntimeWarning, stacklevel=2)
        groups = [{k: v for k, v in g.items() if k != "exp_avg_mask"}
                  for g in state_dict["param_groups"]]
        self._load_torch_state({"state": state_dict["state"], "param_groups": groups})
        for g, mask in zip(self.param_groups, self._user_masks):
            if mask is not None:
                g["exp_avg_mask"] = mask
        saved = self._saved_errors(extra)
        for st in self.state.values():  # per-parameter errors of old checkpoints: now in `saved`
            for k in ERROR_KEYS:
                st.pop(k, None)
        self.compressor.reset()
        self._plan_key = None
        self._layout_check.forget()  # a step or schedule loaded: agree on them again
        self.state_loads += 1
        self._loaded_errors = None
        if exact and saved is not None:
            layout, errors = saved
            errors = {k: {kk: vv.detach().clone() for kk, vv in v.items()}
                      for k, v in errors.items()}
            if layout is None:  # a layout of the optimizer's own (OneBitLamb's fused momentum)
                self.compressor.load_state_dict(errors)
            else:  # restored when the next step builds the same buckets
                self._loaded_errors = ([[tuple(x) for x in b] for b in layout], errors)
        self.schedule.load_state_dict(extra["sched"] if "sched" in extra
                                      else self._schedule_at(self._sched_from_state()["step"]))
        self.skipped_steps = int(extra.get("skipped_steps", 0))
        self._load_extra_state(extra, exact)

    def _load_torch_state(self, state_dict: Dict[str, Any]) -> None:
        """torch's load_state_dict without its cast of the state to the parameters' dtype (the
        state stays fp32 for fp16/bf16 parameters). ``state_dict`` was validated; the new state
        and groups are built completely before either replaces the old."""
        saved = state_dict["param_groups"]
        id_map = {old: p for s, g in zip(saved, self.param_groups)
                  for old, p in zip(s["params"], g["params"])}
        state: Dict[Any, Dict[str, Any]] = defaultdict(dict)
        for k, v in state_dict["state"].items():
            p = id_map[k]
            state[p] = {kk: (vv.detach().to(p.device).clone() if isinstance(vv, torch.Tensor)
                             else copy.deepcopy(vv)) for kk, vv in v.items()}
        new_groups = []
        for s, g in zip(saved, self.param_groups):
            ng = {k: copy.deepcopy(v) for k, v in s.items() if k != "params"}
            ng["params"] = g["params"]
            new_groups.append(ng)
        self.state = state
        self.param_groups = new_groups

    def _schedule_at(self, step: int) -> Dict[str, Any]:
        """The schedule's state after ``step`` steps, for a checkpoint without one (DeepSpeed
        style): each schedule depends only on the step number and the optimizer's arguments, so
        replaying it from the start gives it exactly (only the step counter was restored before:
        0/1 Adam then went back to variance steps)."""
        sched = copy.copy(self.schedule)
        sched.load_state_dict(sched.fresh())
        for _ in range(step):
            sched.advance(sched.next_kind())
        return sched.state_dict()

    def _sched_from_state(self) -> Dict[str, Any]:
        for s in self.state.values():
            if "step" in s:
                return {"step": int(s["step"])}
        return {"step": 0}
