"""1-bit LAMB (DeepSpeed's OnebitLamb, ONEBIT_SPEC.md section d) as a drop-in torch optimizer."""

from __future__ import annotations

import math
import sys
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Tuple

import torch

from .._bucketing import finite_gate
from ..collectives import padded_numel
from ..errors import NonFiniteError
from ..schedule import FreezeSchedule, StepKind
from . import lamb_passes
from . import functional as F
from ._cpu_args import torch_sqrt_mode
from ._grads import non_finite_error
from ._params import group_chunks, mask_, master, write_back
from ._validation import who, check_common, check_int, check_number, check_positive
from .adam import frozen_of
from .base import OneBitBase


# elements per run of the C++ passes: a run's m, sqrt(v) and w (3 MiB) are still in cache when the
# apply pass follows the statistics pass (one Zen 3 core, 8.4M parameters: 20.0-21.6 ms a step
# against 22.6-23.1 with 2^20 and 25.3 with one run)
_RUN_ELEMENTS = 1 << 18


class _Item(NamedTuple):
    """A parameter in the C++ passes: its state, fp32 weights, offset in the fused momentum and
    what the passes read as its variance."""
    p: torch.Tensor
    st: Dict[str, Any]
    w: torch.Tensor
    off: int
    v: torch.Tensor

    def last(self, m_last: torch.Tensor) -> torch.Tensor:
        return m_last[self.off:self.off + self.p.numel()]


class OneBitLamb(OneBitBase):
    r"""LAMB whose communication drops to one fused 1-bit allreduce of the momentum per step.

    Warm-up (steps ``1 .. freeze_step``): LAMB on gradients averaged in full precision; each
    parameter's trust ratio ``clip(||p|| / ||u||, min_coeff, max_coeff)`` (1 when a norm is 0) is
    tracked in an exponential average ``lamb_coeff_freeze`` (``coeff_beta``), and the variance
    is snapshotted as ``exp_avg_sq_fresh`` at step ``freeze_step``.

    Compression stage: the momenta of all parameters live in **one** flat fp32 buffer (padded to
    :func:`compcomm.padded_numel`), scaled per parameter by ``scaling_coeff`` (computed once so
    that all parameters have the same RMS) and averaged with a single
    :func:`compcomm.compressed_allreduce` with one pair of error buffers. The variance is frozen;
    a fresh variance estimate from the reconstructed gradient
    ``(m - beta1 m_last)/(1-beta1)`` gives a per-parameter factor
    ``max((sqrt(v)+eps)/(sqrt(v_fresh)+eps))``, clipped to ``[factor_min, factor_max]`` and to
    ``last_factor * (1 +- factor_threshold)``; the step is ``lr * lamb_coeff_freeze * factor * u``.

    Differences from DeepSpeed: the first ``step()`` is a real step; a parameter whose momentum
    is exactly zero at the freeze gets ``scaling_coeff`` 1 (DeepSpeed: inf/NaN); empty parameters
    are skipped; bf16 works; ``bias_correction`` is honoured (variance factor frozen at the freeze).

    Parameters
    ----------
    params, lr, freeze_step, bias_correction, betas, eps, weight_decay, amsgrad, cuda_aware,
    comm_backend_name, process_group, grads_averaged, exact_resume, compressor, eps_inside_sqrt,
    max_grad_norm :
        As :class:`compcomm.optim.OneBitAdam`.
    max_coeff, min_coeff : float, default 10.0 and 0.01
        Bounds of the warm-up trust ratio: defaults of every param group, which may set its own
        (as in DeepSpeed).
    coeff_beta : float, default 0.9
        Smoothing of ``lamb_coeff_freeze``.
    factor_max, factor_min : float, default 4.0 and 0.5
        Bounds of the compression-stage factor.
    factor_threshold : float, default 0.1
        Largest relative change of the factor per step.
    """

    _name = "OneBitLamb"

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, freeze_step: int = 100000,
                 bias_correction: bool = False, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, max_coeff: float = 10.0, min_coeff: float = 0.01,
                 amsgrad: bool = False, cuda_aware: bool = False, comm_backend_name: str = "torch",
                 coeff_beta: float = 0.9, factor_max: float = 4.0, factor_min: float = 0.5,
                 factor_threshold: float = 0.1, process_group: Any = None,
                 grads_averaged: bool = False, exact_resume: bool = False,
                 compressor: Any = None) -> None:
        n = self._who = who(self._name, comm_backend_name, process_group)
        check_common(n, lr, betas, eps, weight_decay, amsgrad)
        self.freeze_step = check_int(n, "freeze_step", freeze_step, 0)
        self.max_coeff = check_positive(n, "max_coeff", max_coeff)
        self.min_coeff = check_positive(n, "min_coeff", min_coeff)
        if self.min_coeff > self.max_coeff:
            raise ValueError(f"{n}: argument 'min_coeff' ({min_coeff}) must be <= 'max_coeff' "
                             f"({max_coeff})")
        check_number(n, "argument 'coeff_beta'", coeff_beta)
        if not coeff_beta < 1.0:
            raise ValueError(f"{n}: argument 'coeff_beta' must be in [0, 1), got {coeff_beta!r}")
        self.coeff_beta = float(coeff_beta)
        self.factor_max = check_positive(n, "factor_max", factor_max)
        self.factor_min = check_positive(n, "factor_min", factor_min)
        if self.factor_min > self.factor_max:
            raise ValueError(f"{n}: argument 'factor_min' ({factor_min}) must be <= 'factor_max' "
                             f"({factor_max})")
        check_number(n, "argument 'factor_threshold'", factor_threshold)
        self.factor_threshold = float(factor_threshold)
        # the trust-ratio clamp is a group setting, as in DeepSpeed (a group may override it)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bool(bias_correction), max_coeff=self.max_coeff,
                        min_coeff=self.min_coeff)
        super().__init__(params, defaults)
        self._init_common(comm_backend_name, process_group, cuda_aware, grads_averaged,
                          exact_resume, compressor=compressor)
        self.schedule = FreezeSchedule(self.freeze_step)
        self._flat: Optional[torch.Tensor] = None
        self._pad_restore: Optional[torch.Tensor] = None
        self._m_last: Optional[torch.Tensor] = None  # the C++ passes' copy of the old momentum
        self.lamb_coeffs: List[float] = []

    @property
    def lamb_freeze_key(self) -> bool:
        """True once the compression stage has started (DeepSpeed's name)."""
        return self.schedule.frozen

    def get_lamb_coeffs(self) -> List[float]:
        """The per-parameter LAMB coefficients applied in the last step."""
        return list(self.lamb_coeffs)

    # -- the fused momentum buffer -----------------------------------------------------------
    def _fused_params(self) -> List[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"] if p.numel() > 0]

    def _ensure_fused(self) -> None:
        params = self._fused_params()
        flat = self._flat
        # each momentum a view of the flat buffer (a loaded or replaced one is not: rebuilt);
        # _base, not untyped_storage() (a new Python object a tensor: ~5 us each, every step)
        if flat is not None and all(
                "exp_avg" in self.state[p] and self.state[p]["exp_avg"]._base is flat
                for p in params):
            return
        total = sum(p.numel() for p in params)
        device = params[0].device if params else torch.device("cpu")
        flat = torch.zeros(padded_numel(total, self.world_size), dtype=torch.float32,
                           device=device)
        off = 0
        for p in params:
            st = self.state[p]
            view = flat[off:off + p.numel()].view(p.shape)
            if "exp_avg" in st:
                view.copy_(st["exp_avg"])
            st["exp_avg"] = view
            if "exp_avg_sq" not in st:
                st["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                st["exp_avg_sq_fresh"] = torch.zeros(p.shape, dtype=torch.float32,
                                                     device=p.device)
                st["lamb_coeff_freeze"] = 0.0
                st["last_factor"] = 1.0
                st["step"] = 0
            off += p.numel()
        if self._pad_restore is not None and self._pad_restore.numel() == flat.numel() - total:
            flat[total:].copy_(self._pad_restore)
        self._pad_restore = None
        self._flat = flat
        self._total = total

    # -- step ----------------------------------------------------------------------------------
    def _step(self) -> None:
        """This optimizer's update (OneBitBase.step handles the closure and AMP skips)."""
        kind = self.schedule.next_kind()
        t = self.schedule.step + 1
        warm = kind is StepKind.FULL_AVERAGE
        self._ensure_fused()
        # one rank on a GPU: the gradients' check gates the statistics pass on the device and
        # its verdict comes with the statistics (one host sync); else it runs here
        gated = (not warm and self.check_finite and self._flat is not None and self._flat.is_cuda
                 and (self._local is not None or self.world_size == 1))
        grads = self._grads(average=warm, check=not gated)
        self.lamb_coeffs = []
        if warm:
            self._warm_step(t, grads)
        else:
            self._compressed_step(t, grads, gated)
        self.schedule.advance(kind)

    def _warm_step(self, t: int, grads: Dict[torch.Tensor, torch.Tensor]) -> None:
        for group, p in self._params():
            st = self.state[p]
            st["step"] = t
            w = master(p, st)
            m, v = st["exp_avg"], st["exp_avg_sq"]
            F.adam_moments_(m, v, grads[p], group)
            if t == self.freeze_step:
                st["exp_avg_sq_fresh"] = v.clone()
            update = F.adam_update(m, v, w, group, t, t)
            # (a group loaded from a checkpoint of before per-group clamps has none)
            coeff = F.lamb_trust_ratio(w, update, group.get("min_coeff", self.min_coeff),
                                       group.get("max_coeff", self.max_coeff))
            if coeff != 1.0:
                st["lamb_coeff_freeze"] = (self.coeff_beta * st["lamb_coeff_freeze"]
                                           + (1 - self.coeff_beta) * coeff)
            self.lamb_coeffs.append(coeff)
            w.add_(update * (-group["lr"] * coeff))
            write_back(p, st)

    def _compressed_step(self, t: int, grads: Dict[torch.Tensor, torch.Tensor],
                         gated: bool = False) -> None:
        """``gated``: the gradients are not checked yet; the one-rank kernel step checks them on
        the device, any other path here, before anything is written."""
        params = self._fused_params()
        runs = self._kernel_runs(params, grads, t)
        local = runs is not None and (self._local is not None or self.world_size == 1)
        if gated and not local:
            self._check_finite(grads.values(), agree=False)
        # frozen once, from the momenta at the first compressed step; a parameter added later
        # (add_param_group) gets its own from the same rule over the momenta then
        fresh = [p for p in params if "scaling_coeff" not in self.state[p]]
        if fresh:
            scales = [float(self.state[p]["exp_avg"].norm()) / math.sqrt(p.numel())
                      for p in params]
            united = sum(scales) / len(scales)
            for p, s in zip(params, scales):
                if "scaling_coeff" not in self.state[p]:
                    self.state[p]["scaling_coeff"] = united / s if s > 0 and united > 0 else 1.0
        if local:  # nothing to exchange: one pass for all
            try:
                self._kernel_update(runs, None, t, grads, gated)
            except NonFiniteError:  # the gated passes wrote nothing; nor does this step
                for p in fresh:
                    self.state[p].pop("scaling_coeff", None)
                raise
            return
        if runs is None:
            m_last = self._flat.clone()
            for group, p in self._params():
                st = self.state[p]
                b1 = group["betas"][0]
                st["exp_avg"].mul_(b1).add_(grads[p], alpha=1 - b1).mul_(st["scaling_coeff"])
        else:  # the same bits in one pass, the old momentum kept in a buffer of its own
            if (self._m_last is None or self._m_last.shape != self._flat.shape
                    or self._m_last.device != self._flat.device):
                self._m_last = torch.empty_like(self._flat)
            m_last = self._m_last
            m_last[self._total:].copy_(self._flat[self._total:])
            for c, _, items in runs:
                lamb_passes.momentums_(c, [it.st["exp_avg"] for it in items],
                                       [grads[it.p] for it in items],
                                       [it.last(m_last) for it in items],
                                       [it.st["scaling_coeff"] for it in items], check=False)
        # one compressed allreduce of the whole fused momentum; if it fails (on any rank), the
        # momentum and the coefficients frozen just now are put back: the step changed nothing
        try:
            if self._local is None:  # step_on: no communication, the flat momentum stays
                self.compressor.average_(["fused"], [self._flat.numel()], lambda i: self._flat,
                                         self._flat.device)
        except Exception:
            self._flat.copy_(m_last)
            for p in fresh:
                self.state[p].pop("scaling_coeff", None)
            raise
        if runs is not None:
            self._kernel_update(runs, m_last, t)
            return
        off = 0
        offsets = {}
        for p in params:
            offsets[p] = off
            off += p.numel()
        todo = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.numel() == 0:
                    continue
                st = self.state[p]
                m = st["exp_avg"]
                if p in grads:  # else no gradient this step: its momentum was not scaled either
                    m.div_(st["scaling_coeff"])
                    todo.append((group, p))
                mask_(m, group)
        # the factors' statistics of a run of parameters are read in one host sync (a GPU step
        # paid three per parameter); a run holds its directions until then (CHUNK_ELEMENTS)
        for group, run in group_chunks(todo):
            pending = []
            for _, p in run:
                st = self.state[p]
                st["step"] = t
                last = m_last[offsets[p]:offsets[p] + p.numel()].view(p.shape)
                pending.append(F.onebit_lamb_direction(
                    master(p, st), st["exp_avg"], last, st["exp_avg_sq"],
                    st["exp_avg_sq_fresh"], group, t, self.freeze_step))
            values = torch.stack([stats for _, stats in pending]).tolist()
            for (_, p), (update, _), (ratio, u_norm, update_norm) in zip(run, pending, values):
                st = self.state[p]
                factor = F.lamb_factor(ratio, u_norm, update_norm, group, st["last_factor"],
                                       self.factor_min, self.factor_max, self.factor_threshold)
                st["last_factor"] = factor
                coeff = st["lamb_coeff_freeze"] * factor
                self.lamb_coeffs.append(coeff)
                master(p, st).add_(update * (-group["lr"] * coeff))
                write_back(p, st)

    def _kernel_runs(self, params: List[torch.Tensor], grads: Dict[torch.Tensor, torch.Tensor],
                     t: int) -> Optional[List[Tuple[Any, Dict[str, Any], List["_Item"]]]]:
        """The compressed step's work for the C++ or CUDA passes
        (:mod:`compcomm.optim.lamb_passes`), or None where they do not apply (not all fp32 on the
        CPU or one GPU, a mask, a parameter without gradient, another result than the torch ops
        on this CPU): ``[(coefficients, group, items)]`` in runs of one group of at most
        ``_RUN_ELEMENTS`` on the CPU (on a GPU one run a group: one host sync a run)."""
        if not params or any(p not in grads for p in params):
            return None
        sts = [self.state[p] for p in params]
        ws = [master(p, st) for p, st in zip(params, sts)]
        vs = [st["exp_avg_sq"] for st in sts]
        vfs = [st["exp_avg_sq_fresh"] for st in sts]
        # every tensor the passes get as a raw pointer is checked here (a loaded checkpoint may
        # hold a variance of another dtype, layout or size: that step takes the torch ops)
        if any(v.numel() != p.numel() or vf.numel() != p.numel()
               for p, v, vf in zip(params, vs, vfs)):
            return None
        if not lamb_passes.usable([self._flat] + ws + [grads[p] for p in params] + vs + vfs,
                                  self.param_groups):
            return None
        cuda = self._flat.is_cuda
        # the variance is frozen: where the CPU kernels' square root is not torch's, torch's
        # sqrt(v) is computed once and read instead (then only the factor's max may differ, by an
        # ulp); a GPU's is the correctly rounded one, as the CUDA passes'
        v_is_sqrt = not cuda and torch_sqrt_mode() is None
        if v_is_sqrt:
            vs = frozen_of(self, "_frozen_sqrts", vs, (), torch.sqrt)
        items, off = [], 0
        groups = {id(p): g for g in self.param_groups for p in g["params"]}
        for p, st, w, v in zip(params, sts, ws, vs):
            items.append((groups[id(p)], p, _Item(p, st, w, off, v)))
            off += p.numel()
        # a GPU: one run a param group, so one host sync a group (the passes hold no temporaries)
        limit, sqrt = (sys.maxsize, "ieee") if cuda else (_RUN_ELEMENTS, None)
        return [(lamb_passes.coeffs(group, t, self.freeze_step, v_is_sqrt, sqrt), group,
                 [it for _, _, it in run]) for group, run in group_chunks(items, limit)]

    def _kernel_update(self, runs: List[Tuple[Any, Dict[str, Any], List["_Item"]]],
                    m_last: Optional[torch.Tensor], t: int,
                    grads: Optional[Dict[torch.Tensor, torch.Tensor]] = None,
                    gated: bool = False) -> None:
        """The compressed step after the exchange through the passes: per run, the statistics
        pass, the factors (:func:`functional.lamb_factor`), the apply pass. ``m_last`` None: a
        world of one rank, the momentum updated from ``grads`` in the statistics pass.
        ``gated`` (a GPU, one rank): ``grads`` are checked on the device, the check gates the
        statistics pass, and its verdict is read after the first run's statistics (their host
        sync covers it) before anything else is written: NonFiniteError with nothing written."""
        local = m_last is None
        gate, verdict = None, None
        if gated:
            gate, verdict = finite_gate([grads[it.p] for _, _, items in runs for it in items],
                                        self._flat.device)
        for c, group, items in runs:
            ms = [it.st["exp_avg"] for it in items]
            vs = [it.v for it in items]
            ws = [it.w for it in items]
            stats = lamb_passes.stats_(c, ms, None if local else [it.last(m_last) for it in items],
                                    vs, [it.st["exp_avg_sq_fresh"] for it in items], ws,
                                    [it.st["scaling_coeff"] for it in items], check=False,
                                    gs=[grads[it.p] for it in items] if local else None, gate=gate)
            if verdict is not None:
                if not verdict():
                    raise non_finite_error(self.rank, self._name)
                gate, verdict = None, None  # every gradient passed: later runs need no gate
            steps = []
            for it, (ratio, u_norm, update_norm) in zip(items, stats):
                st = it.st
                st["step"] = t
                factor = F.lamb_factor(ratio, u_norm, update_norm, group, st["last_factor"],
                                       self.factor_min, self.factor_max, self.factor_threshold)
                st["last_factor"] = factor
                coeff = st["lamb_coeff_freeze"] * factor
                self.lamb_coeffs.append(coeff)
                steps.append(-group["lr"] * coeff)
            lamb_passes.applies_(c, ms, vs, ws, steps, check=False)
            for it in items:
                write_back(it.p, it.st)

    # -- checkpoints ---------------------------------------------------------------------------
    def _extra_state(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        if self._flat is not None:
            out["fused_pad"] = self._flat[self._total:].clone()
        elif self._pad_restore is not None:  # loaded, no step since: saved again as it came
            out["fused_pad"] = self._pad_restore.clone()
        return out

    def _saved_errors(self, extra: Dict[str, Any]) -> Optional[Tuple[Any, Dict[Any, Any]]]:
        # one fused momentum, one bucket (checkpoints from before buckets: group 0's errors)
        if extra.get("group_errors"):
            return None, {"fused": next(iter(extra["group_errors"].values()))}
        return super()._saved_errors(extra)

    def _load_extra_state(self, extra: Dict[str, Any], exact: bool) -> None:
        self._flat = None  # rebuilt from the loaded exp_avg at the next step
        self._m_last = None  # (on the device of the loaded state)
        self._pad_restore = None
        if exact and extra.get("fused_pad") is not None:
            self._pad_restore = extra["fused_pad"].clone()
