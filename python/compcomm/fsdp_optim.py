"""An AdamW for FSDP2's DTensor shards whose variance is frozen from a chosen step: the optimizer
half of the 1-bit Adam recipe, for :func:`compcomm.fsdp.onebit`'s 1-bit reduce-scatter.

Why: after :func:`compcomm.fsdp.onebit` switches to 1-bit, every element of a reduced gradient
chunk has the magnitude of that chunk's scale. Plain AdamW keeps feeding those values into its
variance ``v``, which drifts towards ``scale**2`` and loses the per-element adaptivity the warm-up
learnt. 1-bit Adam freezes ``v`` at the switch; :class:`FrozenVarianceAdam` does the same here, while
the momentum keeps following the (1-bit averaged) gradient.

The rule, for each parameter shard, at step ``t`` (1-based):

* ``t <= freeze_step`` (the warm-up): ``torch.optim.AdamW``'s step, computed by torch's own
  functional ``torch.optim.adam.adam`` on the local shards with the same arguments -- the same
  operations in the same order, so the warm-up is AdamW bit for bit (tested on the CPU; on a GPU
  both take torch's foreach path).
* ``t > freeze_step``: ``p *= 1 - lr*wd`` (decoupled weight decay, as AdamW and compcomm's
  OneBitAdam), ``m = lerp(m, g, 1-b1)``, ``v`` unchanged, and
  ``p -= lr / (1 - b1**t) * m / (sqrt(v) / sqrt(1 - b2**freeze_step) + eps)``: the variance and its
  bias correction are frozen at the switch (ONEBIT_SPEC.md, OneBitAdam with ``bias_correction``),
  the momentum's correction keeps counting. The operations are those of torch's single-tensor
  AdamW with ``v`` and its correction held fixed.

compcomm's own update rules (:mod:`compcomm.optim.functional`) follow DeepSpeed's operation order
(``m*b1 + (1-b1)*g``, weight decay added to the direction), which agrees with AdamW only to
rounding; here the warm-up must be AdamW's bits, so the operations are torch's.

Nothing is communicated: each rank updates its own shards (``p.to_local()``), as torch's AdamW does
on DTensors. The state is torch's AdamW state (``step``, ``exp_avg``, ``exp_avg_sq`` as DTensors
like the parameters), so ``torch.distributed.checkpoint`` saves and loads it as it does AdamW's.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.optim.adam import adam as _torch_adam

__all__ = ["FrozenVarianceAdam"]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view of its storage), else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _check_float(name: str, value: Any, low: float, high: Optional[float] = None,
                 high_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"FrozenVarianceAdam: argument '{name}' must be a finite number, "
                        f"got {value!r}")
    if value < low or (high is not None and (value >= high if high_open else value > high)):
        bound = f"[{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"FrozenVarianceAdam: argument '{name}' must be in {bound}, got {value!r}")
    return float(value)


def _freeze_step_of(freeze_step: Any) -> int:
    """An int >= 1, or the ``warmup_steps`` of a :class:`compcomm.fsdp.OneBitFSDP`."""
    if hasattr(freeze_step, "warmup_steps") and not isinstance(freeze_step, int):
        freeze_step = freeze_step.warmup_steps
    if isinstance(freeze_step, bool) or not isinstance(freeze_step, int):
        raise TypeError("FrozenVarianceAdam: argument 'freeze_step' must be an int or the state "
                        f"compcomm.fsdp.onebit returned, got {type(freeze_step).__name__}")
    if freeze_step < 1:
        raise ValueError("FrozenVarianceAdam: argument 'freeze_step' must be >= 1 (the variance "
                         f"needs at least one exact step), got {freeze_step}")
    return freeze_step


class FrozenVarianceAdam(torch.optim.Optimizer):
    """AdamW on (DTensor) parameter shards whose variance is frozen after ``freeze_step`` steps.

    Parameters
    ----------
    params : iterable of parameters or param groups
        FSDP2's DTensor parameters (``model.parameters()`` after ``fully_shard``) or plain tensors;
        float32/float16/bfloat16 (the state has the parameter's dtype, as AdamW's).
    lr : float, default 1e-3
    betas : (float, float), default (0.9, 0.999)
    eps : float, default 1e-8
        Added to ``sqrt(v)`` after its bias correction (as AdamW).
    weight_decay : float, default 1e-2
        Decoupled, as AdamW: ``p *= 1 - lr * weight_decay`` every step.
    freeze_step : int or OneBitFSDP
        Steps with a full AdamW update (variance updated); from step ``freeze_step + 1`` on the
        variance is frozen. Pass the state :func:`compcomm.fsdp.onebit` returned to take its
        ``warmup_steps`` (the 1-bit reduce-scatter starts at that step). Must be >= 1. Each param
        group may carry its own ``freeze_step`` (an int).
    foreach : bool, optional
        Passed to torch's AdamW step in the warm-up (default: torch's choice); the frozen phase
        uses foreach ops for CUDA shards and per-tensor ops on the CPU.

    Raises
    ------
    TypeError, ValueError
        A bad argument (the message names it).

    Notes
    -----
    Gradient accumulation: the freeze counts optimizer steps, ``onebit`` counts reductions; with
    ``set_requires_gradient_sync(False)`` on the micro-batches they are the same (one reduction
    per step). ``state_dict()``/``load_state_dict()`` are torch's (the group's ``freeze_step`` is
    saved with the other hyper-parameters); ``get_state_dict``/``set_state_dict`` and
    ``torch.distributed.checkpoint`` work as with AdamW.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, freeze_step: Any,
                 foreach: Optional[bool] = None) -> None:
        _check_float("lr", lr, 0.0)
        _check_float("eps", eps, 0.0)
        _check_float("weight_decay", weight_decay, 0.0)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise TypeError(f"FrozenVarianceAdam: argument 'betas' must be a pair, got {betas!r}")
        _check_float("betas[0]", betas[0], 0.0, 1.0, high_open=True)
        _check_float("betas[1]", betas[1], 0.0, 1.0, high_open=True)
        if foreach is not None and not isinstance(foreach, bool):
            raise TypeError(f"FrozenVarianceAdam: argument 'foreach' must be a bool or None, "
                            f"got {foreach!r}")
        defaults = dict(lr=float(lr), betas=(float(betas[0]), float(betas[1])), eps=float(eps),
                        weight_decay=float(weight_decay), freeze_step=_freeze_step_of(freeze_step),
                        foreach=foreach)
        super().__init__(params, defaults)
        # compcomm.fsdp.onebit(mode="momentum"): the 1-bit phase's momentum comes from its hook
        self._momentum = getattr(freeze_step, "momentum", None)
        if self._momentum is not None:
            b1s = {g["betas"][0] for g in self.param_groups}
            if len(b1s) != 1:
                mode = getattr(self._momentum, "mode", "momentum")
                raise ValueError("FrozenVarianceAdam: argument 'params': with compcomm.fsdp.onebit"
                                 f"(mode={mode!r}) every group needs the same b1, got {b1s}")
        if self._momentum is not None:  # bound only once every check passed
            self._check_group_freeze(self.param_groups, freeze_step.warmup_steps)
            self._momentum.bind(self, b1s.pop())
        self._warmup_steps = getattr(freeze_step, "warmup_steps", None)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """torch's, after checking the group (a bad one raises and is not added): real
        floating-point dense parameters, ``freeze_step`` an int >= 1 or a OneBitFSDP and, in
        momentum mode, the other groups' ``b1`` and ``freeze_step``."""
        group = dict(param_group)
        params = group["params"]
        group["params"] = [params] if isinstance(params, torch.Tensor) else list(params)
        if "freeze_step" in group:
            group["freeze_step"] = _freeze_step_of(group["freeze_step"])
        for p in group["params"]:
            if p.is_sparse or p.is_complex() or not p.is_floating_point():
                raise TypeError("FrozenVarianceAdam: argument 'params' must hold real "
                                f"floating-point dense tensors, got {p.dtype} "
                                f"(sparse={p.is_sparse})")
        momentum = getattr(self, "_momentum", None)  # None while __init__ adds the first groups
        if momentum is not None:
            b1 = group.get("betas", self.defaults["betas"])[0]
            if b1 != self.param_groups[0]["betas"][0]:
                raise ValueError("FrozenVarianceAdam.add_param_group: with compcomm.fsdp.onebit"
                                 f"'s momentum mode every group needs the same b1 "
                                 f"({self.param_groups[0]['betas'][0]}), got {b1}")
            self._check_group_freeze([group], self._warmup_steps, first=len(self.param_groups))
        super().add_param_group(group)

    @staticmethod
    def _check_group_freeze(groups: List[Dict[str, Any]], warmup_steps: int,
                            first: int = 0) -> None:
        """The momentum mode switches every parameter at ``warmup_steps``: a group's own
        ``freeze_step`` must be that step (its variance would freeze at another one)."""
        for i, g in enumerate(groups, first):
            if "freeze_step" in g and g["freeze_step"] != warmup_steps:
                raise ValueError(f"FrozenVarianceAdam: param group {i} has freeze_step="
                                 f"{g['freeze_step']}, but compcomm.fsdp.onebit's momentum modes "
                                 f"switch at warmup_steps={warmup_steps}; they must be equal")

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """torch's, after checking (momentum mode) that the groups' ``freeze_step`` is the
        state's ``warmup_steps``."""
        if self._momentum is not None and self._warmup_steps is not None:
            self._check_group_freeze(state_dict.get("param_groups", []), self._warmup_steps)
        super().load_state_dict(state_dict)

    def variance_frozen(self, p: torch.Tensor) -> bool:
        """Whether parameter ``p``'s variance is frozen (its next step is past ``freeze_step``)."""
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                st = self.state.get(p, {})
                return "step" in st and int(st["step"]) >= group["freeze_step"]
        raise ValueError("FrozenVarianceAdam.variance_frozen: argument 'p' is not a parameter of "
                         "this optimizer")

    def _init_state(self, p: torch.Tensor) -> Dict[str, Any]:
        st = self.state[p]
        if not st:  # as torch's AdamW: a float32 CPU step, moments like the parameter
            st["step"] = torch.tensor(0.0, dtype=torch.float32)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return st

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """One step on every parameter with a gradient (see the class docstring). Every group is
        checked, and in momentum mode every momentum taken, before any is written: a step that
        raises changes no parameter."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plans = []  # per group: (group, warm lists, frozen lists, the frozen ones' parameters)
        for group in self.param_groups:
            warm: Tuple[List[torch.Tensor], ...] = ([], [], [], [], [])
            frozen: Tuple[List[torch.Tensor], ...] = ([], [], [], [], [])
            owners: List[torch.Tensor] = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise TypeError("FrozenVarianceAdam: sparse gradients are not supported")
                st = self._init_state(p)
                # the momentum modes switch a module at once: a parameter that missed a warm-up
                # step (no gradient) is frozen with the others once it is handed a momentum
                given = self._momentum is not None and self._momentum.holds(p)
                lists = warm if int(st["step"]) < group["freeze_step"] and not given else frozen
                for lst, t in zip(lists, (p, p.grad, st["exp_avg"], st["exp_avg_sq"])):
                    lst.append(_local(t))
                lists[4].append(st["step"])
                if lists is frozen:
                    owners.append(p)
            plans.append((group, warm, frozen, owners))
        momenta: List[Optional[List[torch.Tensor]]] = [None] * len(plans)
        if self._momentum is not None:  # all taken before anything is written
            for i, (_, _, _, owners) in enumerate(plans):
                momenta[i] = [self._momentum.take(p) for p in owners]
            missing = [(gi, j) for gi, ms in enumerate(momenta) for j, m in enumerate(ms or [])
                       if m is None]
            if missing:
                for (_, _, _, owners), ms in zip(plans, momenta):  # nothing changed: put back
                    for p, m in zip(owners, ms or []):
                        if m is not None:
                            self._momentum.give(p, m)
                if dist.is_initialized() and dist.get_world_size() == 1:
                    # FSDP reduces nothing with one rank (no hook runs): each parameter's own
                    # momentum, as the 1-bit optimizers' compressed phase takes on one rank
                    momenta = [None] * len(plans)
                else:
                    gi, j = missing[0]
                    group, owner = plans[gi][0], plans[gi][3][j]
                    i = next(k for k, q in enumerate(group["params"]) if q is owner)
                    raise RuntimeError(
                        f"FrozenVarianceAdam: frozen parameter {i} of param group {gi} has no "
                        "momentum from compcomm.fsdp.onebit's momentum "
                        "mode for this step (its reduce-scatter did not run since the last step, "
                        "or FSDP does not manage it: ignored_params); nothing was updated")
        for (group, warm, frozen, _), ms in zip(plans, momenta):
            b1, b2 = group["betas"]
            if warm[0]:
                _torch_adam(warm[0], warm[1], warm[2], warm[3], [], warm[4],
                            foreach=group["foreach"], capturable=False, differentiable=False,
                            fused=None, grad_scale=None, found_inf=None, has_complex=False,
                            decoupled_weight_decay=True, amsgrad=False, beta1=b1, beta2=b2,
                            lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                            maximize=False)
            if frozen[0]:
                _frozen_step(*frozen, group, ms)
        return loss


def _frozen_step(ps: List[torch.Tensor], gs: List[torch.Tensor], ms: List[torch.Tensor],
                 vs: List[torch.Tensor], steps: List[torch.Tensor], group: Dict[str, Any],
                 given: Optional[List[torch.Tensor]] = None) -> None:
    """The frozen-variance AdamW step over local shards (torch's single-tensor AdamW operations
    with ``v`` and its bias correction held at ``freeze_step``). ``given``: the new momentum
    (fp32, from the momentum mode's hook) instead of ``lerp(m, g, 1 - b1)``; ``m`` keeps a copy
    (in its dtype) for checkpoints, the update uses the fp32 values."""
    b1, b2 = group["betas"]
    lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
    bc2_sqrt = (1 - b2 ** group["freeze_step"]) ** 0.5
    for s in steps:
        s += 1
    # every parameter of a group has taken the same steps unless some lacked gradients: group by t
    by_t: Dict[float, List[int]] = {}
    for i, s in enumerate(steps):
        by_t.setdefault(float(s), []).append(i)
    for t, idx in by_t.items():
        step_size = lr / (1 - b1 ** t)
        sub = [[lst[i] for i in idx] for lst in (ps, gs, ms, vs)]
        if given is not None:
            new = [given[i] for i in idx]
            torch._foreach_copy_(sub[2], new)
            sub[2] = new  # the fp32 momentum drives the update
            sub[3] = [v if v.dtype == torch.float32 else v.float() for v in sub[3]]
        if sub[0][0].is_cuda and all(p.dtype == m.dtype for p, m in zip(sub[0], sub[2])):
            p_, g_, m_, v_ = sub
            if wd != 0:
                torch._foreach_mul_(p_, 1 - lr * wd)
            if given is None:
                torch._foreach_lerp_(m_, g_, 1 - b1)
            denom = torch._foreach_sqrt(v_)
            torch._foreach_div_(denom, bc2_sqrt)
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(p_, m_, denom, value=-step_size)
            continue
        for p, g, m, v in zip(*sub):
            if wd != 0:
                p.mul_(1 - lr * wd)
            if given is None:
                m.lerp_(g, 1 - b1)
            denom = (v.sqrt() / bc2_sqrt).add_(eps)
            p.addcdiv_(m, denom, value=-step_size)
