"""The update rules of the 1-bit optimizers as functions over tensors, with no communication.

Each function takes the tensors it reads and writes (fp32: the parameter or its fp32 master
``w``, the moments ``m`` and ``v``, a gradient ``g``) and a parameter group's hyper-parameters
(``lr``, ``betas``, ``eps``, ``weight_decay``, ``bias_correction``); it looks nothing up and sends
nothing. The optimizers apply them to whole parameters; anything holding shards can apply them to
shards. The order of the floating-point operations is part of the contract: the trajectory tests
compare runs bit for bit, so a rewrite must keep it.

The ``*_multi`` twins apply the same operations, in the same order, to lists of tensors with
``torch._foreach_*`` ops: a handful of kernel launches per parameter group instead of a handful per
parameter (on a GPU the per-parameter launches cost more than the arithmetic: ~50 ms of a 121M-
parameter step with 4 processes sharing the device). On the CPU the foreach ops loop over the same
per-tensor ops, so results are bit-identical there; on a GPU they may differ in the last bit
(torch's CUDA ``div`` by a scalar multiplies by its reciprocal, the foreach kernel divides).
"""

from __future__ import annotations

import math
from typing import Any, List, Mapping, Optional, Sequence, Tuple

import torch

Group = Mapping[str, Any]
Tensors = Sequence[torch.Tensor]


def sqrt_bc(beta: float, t: int) -> float:
    """``sqrt(1 - beta**t)`` (1 when ``t == 0``)."""
    return math.sqrt(1.0 - beta ** t) if t > 0 else 1.0


def masked_(t: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """``t *= mask`` in place (nothing when ``mask`` is None); returns ``t``."""
    if mask is not None:
        t.mul_(mask)
    return t


# --------------------------------------------------------------------------------------------
# Adam
# --------------------------------------------------------------------------------------------
def adam_moments_(m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, group: Group) -> None:
    """Both moments from an averaged gradient ``g``: ``m = b1 m + (1-b1) g`` and
    ``v = b2 v + (1-b2) g^2``."""
    b1, b2 = group["betas"]
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)


def onebit_momentum(m: torch.Tensor, g: torch.Tensor, group: Group, out: torch.Tensor) -> None:
    """``out = b1 m + (1-b1) g`` (1-bit Adam's local momentum, the tensor it compresses); ``m``
    itself is left as it is until the average has succeeded."""
    b1 = group["betas"][0]
    torch.mul(m, b1, out=out).add_(g, alpha=1 - b1)


def adam_denom(v: torch.Tensor, group: Group, bc2_t: int) -> torch.Tensor:
    """``sqrt(v) + eps`` (eps outside the sqrt, as DeepSpeed); with the group's
    ``bias_correction``, v corrected as of step ``bc2_t``."""
    denom = v.sqrt()
    if group["bias_correction"]:
        denom.div_(sqrt_bc(group["betas"][1], bc2_t))
    return denom.add_(group["eps"])


def adam_update(m: torch.Tensor, v: torch.Tensor, w: torch.Tensor, group: Group,
                bc1_t: int, bc2_t: int, denom: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The Adam direction ``m / (sqrt(v) + eps) (+ wd * w)``, a new tensor; with the group's
    ``bias_correction``, m and v are corrected as of steps ``bc1_t`` and ``bc2_t``. ``denom``:
    :func:`adam_denom` already computed by the caller."""
    if denom is None:
        denom = adam_denom(v, group, bc2_t)
    update = m / denom
    if group["bias_correction"]:
        update.div_(1.0 - group["betas"][0] ** bc1_t)
    if group["weight_decay"] > 0:
        update.add_(w, alpha=group["weight_decay"])
    return update


def adam_step_(w: torch.Tensor, m: torch.Tensor, v: torch.Tensor, group: Group, bc1_t: int,
               bc2_t: int) -> None:
    """``w -= lr * adam_update(...)`` (1-bit Adam, warm-up and compressed phase alike: after the
    freeze the caller passes the frozen ``bc2_t``)."""
    w.add_(adam_update(m, v, w, group, bc1_t, bc2_t), alpha=-group["lr"])


def adam_moments_multi_(ms: Tensors, vs: Tensors, gs: Tensors, group: Group) -> None:
    """:func:`adam_moments_` over lists."""
    b1, b2 = group["betas"]
    torch._foreach_mul_(ms, b1)
    torch._foreach_add_(ms, gs, alpha=1 - b1)
    torch._foreach_mul_(vs, b2)
    torch._foreach_addcmul_(vs, gs, gs, value=1 - b2)


def onebit_momentum_multi(ms: Tensors, gs: Tensors, group: Group, outs: Tensors) -> None:
    """:func:`onebit_momentum` over lists (``ms[i]`` may be ``outs[i]`` itself)."""
    b1 = group["betas"][0]
    if outs and outs[0].is_cpu:  # no launches to save: the two-pass form, one pass less
        for m, g, out in zip(ms, gs, outs):
            onebit_momentum(m, g, group, out)
        return
    torch._foreach_copy_(outs, ms)
    torch._foreach_mul_(outs, b1)
    torch._foreach_add_(outs, gs, alpha=1 - b1)


def adam_update_multi(ms: Tensors, vs: Tensors, ws: Tensors, group: Group, bc1_t: int,
                      bc2_t: int) -> List[torch.Tensor]:
    """:func:`adam_update` over lists: new tensors."""
    denom = torch._foreach_sqrt(vs)
    if group["bias_correction"]:
        torch._foreach_div_(denom, sqrt_bc(group["betas"][1], bc2_t))
    torch._foreach_add_(denom, group["eps"])
    update = torch._foreach_div(ms, denom)
    del denom
    if group["bias_correction"]:
        torch._foreach_div_(update, 1.0 - group["betas"][0] ** bc1_t)
    if group["weight_decay"] > 0:
        torch._foreach_add_(update, ws, alpha=group["weight_decay"])
    return update


def adam_step_multi_(ws: Tensors, ms: Tensors, vs: Tensors, group: Group, bc1_t: int,
                     bc2_t: int) -> None:
    """:func:`adam_step_` over lists."""
    torch._foreach_add_(ws, adam_update_multi(ms, vs, ws, group, bc1_t, bc2_t),
                        alpha=-group["lr"])


# --------------------------------------------------------------------------------------------
# 0/1 Adam
# --------------------------------------------------------------------------------------------
def zero_one_local_(w: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    group: Group, bc1_t: int, bc2_t: int, update_variance: bool,
                    acc: Optional[torch.Tensor] = None) -> None:
    """One 0/1 Adam step that sends nothing more: variance (if ``update_variance``), momentum,
    ``w += u`` with ``u = -lr adam_update``; in the frozen phase ``u`` is also added to the
    accumulated update ``acc``."""
    b1, b2 = group["betas"]
    if update_variance:
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
    m.mul_(b1).add_(g, alpha=1 - b1)
    update = adam_update(m, v, w, group, bc1_t, bc2_t)
    update.mul_(-group["lr"])
    w.add_(update)
    if acc is not None:
        acc.add_(update)


def zero_one_local_multi_(ws: Tensors, ms: Tensors, vs: Tensors, gs: Tensors, group: Group,
                          bc1_t: int, bc2_t: int, update_variance: bool,
                          accs: Optional[Tensors] = None) -> None:
    """:func:`zero_one_local_` over lists."""
    b1, b2 = group["betas"]
    if update_variance:
        torch._foreach_mul_(vs, b2)
        torch._foreach_addcmul_(vs, gs, gs, value=1 - b2)
    torch._foreach_mul_(ms, b1)
    torch._foreach_add_(ms, gs, alpha=1 - b1)
    update = adam_update_multi(ms, vs, ws, group, bc1_t, bc2_t)
    torch._foreach_mul_(update, -group["lr"])
    torch._foreach_add_(ws, update)
    if accs is not None:
        torch._foreach_add_(accs, update)


def zero_one_sync_input(w: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        acc: Optional[torch.Tensor], group: Group, bc1_t: int, bc2_t: int,
                        out: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The tensor a sync step averages, written to ``out``: ``(acc + u) (sqrt(v) + eps)`` with
    ``u`` this step's update. Nothing else is written. Returns ``(u, denom)`` for
    :func:`zero_one_sync_commit_`."""
    b1 = group["betas"][0]
    m_new = torch.mul(m, b1).add_(g, alpha=1 - b1)
    denom = adam_denom(v, group, bc2_t)
    update = adam_update(m_new, v, w, group, bc1_t, bc2_t, denom=denom).mul_(-group["lr"])
    (torch.add(acc, update, out=out) if acc is not None else out.copy_(update)).mul_(denom)
    return update, denom


def zero_one_sync_commit_(w: torch.Tensor, m: torch.Tensor, acc: torch.Tensor,
                          averaged: torch.Tensor, update: torch.Tensor, denom: torch.Tensor,
                          lrs: float, group: Group, bc1_t: int, wd_in_momentum: bool,
                          mask: Optional[torch.Tensor] = None) -> None:
    """Apply a sync with the ranks' average ``averaged`` of :func:`zero_one_sync_input`: roll ``w``
    back to the last synchronised point, take the averaged update, rebuild the momentum as the
    lr-weighted average momentum (``lrs``: the lrs summed since the last sync, this step's
    included) and clear ``acc``."""
    w.add_(update)
    acc.add_(update)
    w.sub_(acc)  # roll back to the last synchronised parameters
    acc.copy_(averaged)
    masked_(acc, mask)
    torch.div(acc, -lrs, out=m)
    wd = group["weight_decay"]
    if wd > 0 and not wd_in_momentum:
        # acc also holds -sum(lr*wd*w)*denom (the decoupled weight decay of the local steps);
        # keep it out of the rebuilt momentum (else wd is re-applied through m at every later
        # step: ~1/(1-beta1) times the asked-for weight decay)
        corr = w * denom
        corr.mul_(wd)
        masked_(corr, mask)
        m.sub_(corr)
    if group["bias_correction"]:
        m.mul_(1.0 - group["betas"][0] ** bc1_t)
    w.add_(acc / denom)
    acc.zero_()


# --------------------------------------------------------------------------------------------
# LAMB
# --------------------------------------------------------------------------------------------
def lamb_trust_ratio(w: torch.Tensor, update: torch.Tensor, min_coeff: float,
                     max_coeff: float) -> float:
    """``clip(||w|| / ||update||, min_coeff, max_coeff)``, 1 when either norm is 0."""
    wn = float(w.norm())
    un = float(update.norm())
    if wn != 0 and un != 0:
        return min(max(wn / un, min_coeff), max_coeff)
    return 1.0


def onebit_lamb_update(w: torch.Tensor, m: torch.Tensor, m_last: torch.Tensor, v: torch.Tensor,
                       v_fresh: torch.Tensor, group: Group, t: int, freeze_step: int,
                       last_factor: float, factor_min: float, factor_max: float,
                       factor_threshold: float) -> Tuple[torch.Tensor, float]:
    """1-bit LAMB's compressed-stage direction and factor for one parameter:
    :func:`onebit_lamb_direction`, then :func:`lamb_factor` (one host sync).

    Returns
    -------
    (torch.Tensor, float)
        The direction (``w`` moves by ``-lr * lamb_coeff_freeze * factor`` times it) and the factor.
    """
    update, stats = onebit_lamb_direction(w, m, m_last, v, v_fresh, group, t, freeze_step)
    max_ratio, u_norm, update_norm = stats.tolist()
    return update, lamb_factor(max_ratio, u_norm, update_norm, group, last_factor, factor_min,
                               factor_max, factor_threshold)


def onebit_lamb_direction(w: torch.Tensor, m: torch.Tensor, m_last: torch.Tensor,
                          v: torch.Tensor, v_fresh: torch.Tensor, group: Group, t: int,
                          freeze_step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """1-bit LAMB's compressed-stage direction for one parameter, and what its factor needs, with
    no host sync (a caller reads the statistics of many parameters at once).

    The gradient reconstructed from the averaged momentum ``m`` and the previous one ``m_last``
    updates the fresh variance ``v_fresh`` (in place). Returns the direction ``u`` (plus
    ``weight_decay * w``) and an fp32 tensor of three on ``m``'s device: ``max((sqrt(v)+eps) /
    (sqrt(v_fresh)+eps))``, ``||u||`` and ``||u + weight_decay * w||`` (the norms 0 without weight
    decay: :func:`lamb_factor` does not read them then).
    """
    b1, b2 = group["betas"]
    ghat = (m - m_last * b1) / (1 - b1)
    v_fresh.mul_(b2).addcmul_(ghat, ghat, value=1 - b2)
    denom = v.sqrt().add_(group["eps"])
    denom_real = v_fresh.sqrt().add_(group["eps"])
    max_ratio = (denom / denom_real).max()
    if group["bias_correction"]:
        bc2 = sqrt_bc(b2, freeze_step)
        u_pre = m / (v.sqrt().div_(bc2).add_(group["eps"]))
        u_pre.div_(1.0 - b1 ** t)
    else:
        u_pre = m / denom
    if group["weight_decay"] > 0:
        update = u_pre + group["weight_decay"] * w
        return update, torch.stack([max_ratio, u_pre.norm(), update.norm()])
    zero = max_ratio.new_zeros(())
    return u_pre, torch.stack([max_ratio, zero, zero])


def lamb_factor(max_ratio: float, u_norm: float, update_norm: float, group: Group,
                last_factor: float, factor_min: float, factor_max: float,
                factor_threshold: float) -> float:
    """1-bit LAMB's factor from ``max((sqrt(v)+eps) / (sqrt(v_fresh)+eps))`` and the norms of the
    direction without and with weight decay (the norms are read only when ``weight_decay > 0``):
    pulled towards 1 by the weight decay's share, clipped to ``[factor_min, factor_max]`` and to
    ``last_factor (1 +- factor_threshold)``."""
    factor = max_ratio
    if group["weight_decay"] > 0:
        ratio = min(1.0, u_norm / update_norm) if update_norm > 0 else 1.0
        factor = factor * ratio + (1.0 - ratio)
    factor = min(max(factor, factor_min), factor_max)
    factor = min(factor, last_factor * (1.0 + factor_threshold))
    factor = max(factor, last_factor * (1.0 - factor_threshold))
    return factor
