"""Step-by-step numpy references of the 1-bit optimizers (ONEBIT_SPEC.md sections b, c, d, with
compcomm's policy: no swallowed first step, bias_correction honoured, ZeroOneAdam N=1 fixed).

Every rank is simulated in one process. Gradients are given per step, rank and parameter (so
the references do not need a model); the references return every rank's parameters after every
step. All arithmetic is float32 as in the spec; norms are accumulated in float64.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import numpy as np
from reference import padded_numel, worker_scale

f32 = np.float32


def _sign(x: np.ndarray) -> np.ndarray:
    return np.where(x < 0, f32(-1), f32(1)).astype(f32)


def compressed_allreduce_padded(xs: List[np.ndarray], wes: List[np.ndarray],
                                ses: List[np.ndarray]) -> np.ndarray:
    """Simulated compressed allreduce (spec a.2) of W flat float32 inputs of n elements.

    ``wes``/``ses`` (float32, P and P/W elements per rank) are updated in place. Returns the
    padded output (float32, P), identical on all ranks; chunk j (P/W elements) is rank j's
    reduce-scatter result.
    """
    world = len(xs)
    n = xs[0].size
    p = wes[0].size
    chunk = p // world
    signs, weights = [], []
    inv = f32(1.0) / f32(world)
    for r in range(world):
        x = np.zeros(p, f32)
        x[:n] = xs[r].reshape(-1)
        x = (x + wes[r]).astype(f32)
        s = worker_scale(x)
        sg = _sign(x)
        wes[r][:] = (x - s * sg).astype(f32)
        signs.append(sg)
        weights.append(f32(s * inv))
    out = np.zeros(p, f32)
    for j in range(world):
        sl = slice(j * chunk, (j + 1) * chunk)
        c = np.zeros(chunk, f32)
        for i in range(world):
            c = (c + signs[i][sl] * weights[i]).astype(f32)
        c = (c + ses[j]).astype(f32)
        tau = worker_scale(c)
        sc = _sign(c)
        ses[j][:] = (c - tau * sc).astype(f32)
        out[sl] = tau * sc
    return out


def compressed_allreduce(xs: List[np.ndarray], wes: List[np.ndarray], ses: List[np.ndarray]
                         ) -> np.ndarray:
    """:func:`compressed_allreduce_padded` cut to the input's n elements."""
    return compressed_allreduce_padded(xs, wes, ses)[:xs[0].size]


def _avg(gs: Sequence[np.ndarray]) -> np.ndarray:
    acc = np.zeros_like(gs[0], dtype=f32)
    for g in gs:
        acc = (acc + g).astype(f32)
    return (acc * f32(1.0 / len(gs))).astype(f32)


class _Errors:
    """Per-(rank, tensor) error buffers, created lazily as zeros."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.we: Dict[int, List[np.ndarray]] = {}
        self.se: Dict[int, List[np.ndarray]] = {}

    def reduce(self, key: int, xs: List[np.ndarray]) -> np.ndarray:
        if self.world == 1:
            return xs[0].copy()
        if key not in self.we:
            p = padded_numel(xs[0].size, self.world)
            self.we[key] = [np.zeros(p, f32) for _ in range(self.world)]
            self.se[key] = [np.zeros(p // self.world, f32) for _ in range(self.world)]
        return compressed_allreduce(xs, self.we[key], self.se[key]).reshape(xs[0].shape)

    def zero(self) -> None:
        for lst in list(self.we.values()) + list(self.se.values()):
            for a in lst:
                a[:] = 0


def onebit_adam(params: List[np.ndarray], grads: List[List[List[np.ndarray]]], *, lr: float,
                freeze_step: int, betas=(0.9, 0.999), eps: float = 1e-8, wd: float = 0.0,
                bias_correction: bool = False, masks: Optional[List[Optional[np.ndarray]]] = None,
                fused: bool = False, buckets: Optional[List[List[int]]] = None
                ) -> List[List[List[np.ndarray]]]:
    """1-bit Adam. ``grads[t][r][i]``: gradient of parameter i on rank r at step t+1 (local).
    ``buckets``: lists of parameter indices compressed as one concatenated tensor each (None: one
    compressed allreduce per parameter); ``fused``: all parameters in one bucket.

    Returns ``out[t][r][i]``: parameters after step t+1 (identical across ranks)."""
    world = len(grads[0])
    b1, b2 = f32(betas[0]), f32(betas[1])
    ps = [p.astype(f32).copy() for p in params]
    ms = [np.zeros_like(p) for p in ps]
    vs = [np.zeros_like(p) for p in ps]
    errs = _Errors(world)
    out = []
    for k, gstep in enumerate(grads):
        t = k + 1
        warm = t <= freeze_step
        if fused:
            buckets = [list(range(len(ps)))]
        if buckets is not None and not warm:
            locs = [[(b1 * ms[i] + (f32(1) - b1) * gstep[r][i]).astype(f32) for i in range(len(ps))]
                    for r in range(world)]
            fused_m = _reduce_many(errs, locs, buckets)
        for i in range(len(ps)):
            if buckets is not None and not warm:
                ms[i] = fused_m[i].copy()
                if masks is not None and masks[i] is not None:
                    ms[i] = (ms[i] * masks[i]).astype(f32)
            elif warm:
                g = _avg([gstep[r][i] for r in range(world)])
                ms[i] = (b1 * ms[i] + (f32(1) - b1) * g).astype(f32)
                vs[i] = (b2 * vs[i] + (f32(1) - b2) * g * g).astype(f32)
            else:
                local = [(b1 * ms[i] + (f32(1) - b1) * gstep[r][i]).astype(f32)
                         for r in range(world)]
                ms[i] = errs.reduce(i, local)
                if masks is not None and masks[i] is not None:
                    ms[i] = (ms[i] * masks[i]).astype(f32)
            denom = np.sqrt(vs[i]).astype(f32)
            if bias_correction:
                denom = (denom / f32(math.sqrt(1 - betas[1] ** min(t, freeze_step)))
                         if min(t, freeze_step) > 0 else denom)
            denom = (denom + f32(eps)).astype(f32)
            u = (ms[i] / denom).astype(f32)
            if bias_correction:
                u = (u / f32(1 - betas[0] ** t)).astype(f32)
            if wd > 0:
                u = (u + f32(wd) * ps[i]).astype(f32)
            ps[i] = (ps[i] - f32(lr) * u).astype(f32)
        out.append([[p.copy() for p in ps] for _ in range(world)])
    return out


def zero_one_schedule(steps: int, var_freeze_step: int, var_update_scaler: int,
                      local_step_scaler: int, local_step_clipper: int) -> List[str]:
    """Kind of each step 1..steps: 'var', 'grad1bit', 'local' or 'sync' (spec c, DeepSpeed's user
    step numbering; step 1 -- DeepSpeed's init call -- is an uncounted variance step)."""
    kinds = []
    var_interval, var_counter = 1, 0
    lsi, lsc = 1, 0
    frozen = False
    for t in range(1, steps + 1):
        if not frozen:
            kind = "var" if t % var_interval == 0 else "grad1bit"
            if kind == "var" and t > 1:
                var_counter += 1
                if var_counter == var_update_scaler:
                    var_counter, var_interval = 0, var_interval * 2
        else:
            kind = "sync" if t % lsi == 0 else "local"
            lsc += 1
            if lsc == local_step_scaler:
                lsc, lsi = 0, min(local_step_clipper, 2 * lsi)
        kinds.append(kind)
        if not frozen and t > var_freeze_step:
            frozen = True
    return kinds


def _reduce_many(errs: "_Errors", per_rank: List[List[np.ndarray]],
                 buckets: Optional[List[List[int]]]) -> List[np.ndarray]:
    """1-bit average of several tensors: one compressed allreduce each (``buckets`` None), or one
    per bucket over the concatenation of its tensors, with one pair of error buffers each."""
    n = len(per_rank[0])
    if buckets is None:
        return [errs.reduce(i, [per_rank[r][i] for r in range(len(per_rank))]) for i in range(n)]
    out: List[np.ndarray] = [None] * n  # type: ignore[list-item]
    for k, idx in enumerate(buckets):
        shapes = [per_rank[0][i].shape for i in idx]
        flat = errs.reduce(("bucket", k),
                           [np.concatenate([xs[i].reshape(-1) for i in idx]) for xs in per_rank])
        offs = np.cumsum([0] + [int(np.prod(s)) for s in shapes])
        for j, i in enumerate(idx):
            out[i] = flat[offs[j]:offs[j + 1]].reshape(shapes[j])
    return out


def zero_one_adam(params: List[np.ndarray], grads: List[List[List[np.ndarray]]], *, lr: float,
                  var_freeze_step: int, var_update_scaler: int, local_step_scaler: int,
                  local_step_clipper: int, betas=(0.9, 0.999), eps: float = 1e-8,
                  wd: float = 0.0, masks: Optional[List[Optional[np.ndarray]]] = None,
                  fused: bool = False, wd_in_momentum: bool = True,
                  buckets: Optional[List[List[int]]] = None):
    """0/1 Adam (no bias correction). Returns (``out[t][r][i]`` per-rank parameters, kinds).
    ``fused``: one compressed allreduce over all parameters (one group) per communication;
    ``buckets``: one per bucket of parameter indices (None: one per parameter).
    ``wd_in_momentum``: True is the spec (DeepSpeed: the momentum rebuilt at a sync keeps the
    weight-decay part of the accumulated update); False is compcomm's default, which subtracts
    ``wd * p_sync * (sqrt(v)+eps)`` (masked) from it."""
    world = len(grads[0])
    kinds = zero_one_schedule(len(grads), var_freeze_step, var_update_scaler, local_step_scaler,
                              local_step_clipper)
    b1, b2 = f32(betas[0]), f32(betas[1])
    n = len(params)
    ps = [[p.astype(f32).copy() for p in params] for _ in range(world)]
    ms = [[np.zeros_like(p, dtype=f32) for p in params] for _ in range(world)]
    vs = [np.zeros_like(p, dtype=f32) for p in params]
    us = [[np.zeros_like(p, dtype=f32) for p in params] for _ in range(world)]
    lrs = 0.0
    errs = _Errors(world)
    out = []
    was_frozen = False
    if fused:
        buckets = [list(range(n))]

    def masked(a: np.ndarray, i: int) -> np.ndarray:
        if masks is not None and masks[i] is not None:
            return (a * masks[i]).astype(f32)
        return a

    for k, gstep in enumerate(grads):
        kind = kinds[k]
        frozen = kind in ("local", "sync")
        if frozen and not was_frozen:
            errs.zero()
            was_frozen = True
        if frozen:
            lrs += lr
        if kind == "grad1bit":
            red = _reduce_many(errs, [[g.astype(f32) for g in gstep[r]] for r in range(world)],
                               buckets)
            gcomm = [masked(red[i], i) for i in range(n)]
        denoms = []
        for i in range(n):
            if kind == "var":
                g = _avg([gstep[r][i] for r in range(world)])
                vs[i] = (b2 * vs[i] + (f32(1) - b2) * g * g).astype(f32)
                gl = [g] * world
            elif kind == "grad1bit":
                gl = [gcomm[i]] * world
            else:
                gl = [gstep[r][i] for r in range(world)]
            denom = (np.sqrt(vs[i]) + f32(eps)).astype(f32)
            denoms.append(denom)
            for r in range(world):
                ms[r][i] = (b1 * ms[r][i] + (f32(1) - b1) * gl[r]).astype(f32)
                u = (ms[r][i] / denom).astype(f32)
                if wd > 0:
                    u = (u + f32(wd) * ps[r][i]).astype(f32)
                u = (u * f32(-lr)).astype(f32)
                ps[r][i] = (ps[r][i] + u).astype(f32)
                if frozen:
                    us[r][i] = (us[r][i] + u).astype(f32)
                if kind == "sync":
                    ps[r][i] = (ps[r][i] - us[r][i]).astype(f32)
                    us[r][i] = (us[r][i] * denom).astype(f32)
        if kind == "sync":
            red = _reduce_many(errs, [list(us[r]) for r in range(world)], buckets)
            for i in range(n):
                ri = masked(red[i], i)
                for r in range(world):
                    ms[r][i] = (ri / f32(-lrs)).astype(f32)
                    if wd > 0 and not wd_in_momentum:  # ps[r][i] is the rolled-back point
                        corr = masked((ps[r][i] * denoms[i] * f32(wd)).astype(f32), i)
                        ms[r][i] = (ms[r][i] - corr).astype(f32)
                    ps[r][i] = (ps[r][i] + ri / denoms[i]).astype(f32)
                    us[r][i] = np.zeros_like(us[r][i])
            lrs = 0.0
        out.append([[p.copy() for p in ps[r]] for r in range(world)])
    return out, kinds


def onebit_lamb(params: List[np.ndarray], grads: List[List[List[np.ndarray]]], *, lr: float,
                freeze_step: int, betas=(0.9, 0.999), eps: float = 1e-8, wd: float = 0.0,
                max_coeff: float = 10.0, min_coeff: float = 0.01, coeff_beta: float = 0.9,
                factor_max: float = 4.0, factor_min: float = 0.5, factor_threshold: float = 0.1):
    """1-bit LAMB (no bias correction, no masks). Returns ``out[t][r][i]``."""
    world = len(grads[0])
    b1, b2 = f32(betas[0]), f32(betas[1])
    n = len(params)
    sizes = [p.size for p in params]
    total = sum(sizes)
    ptot = padded_numel(total, world)
    ps = [p.astype(f32).copy() for p in params]
    flat = np.zeros(ptot, f32)  # fused momentum (pad region persists, as DeepSpeed)
    offs = np.cumsum([0] + sizes)

    def m_of(i: int) -> np.ndarray:
        return flat[offs[i]:offs[i + 1]].reshape(params[i].shape)

    vs = [np.zeros_like(p, dtype=f32) for p in params]
    vf = [np.zeros_like(p, dtype=f32) for p in params]
    lcf = [0.0] * n
    last = [1.0] * n
    sc: Optional[List[float]] = None
    we = [np.zeros(ptot, f32) for _ in range(world)]
    se = [np.zeros(ptot // world, f32) for _ in range(world)]
    out = []
    for k, gstep in enumerate(grads):
        t = k + 1
        if t <= freeze_step:
            for i in range(n):
                g = _avg([gstep[r][i] for r in range(world)])
                m = (b1 * m_of(i) + (f32(1) - b1) * g).astype(f32)
                flat[offs[i]:offs[i + 1]] = m.reshape(-1)
                vs[i] = (b2 * vs[i] + (f32(1) - b2) * g * g).astype(f32)
                if t == freeze_step:
                    vf[i] = vs[i].copy()
                u = (m / (np.sqrt(vs[i]) + f32(eps)).astype(f32)).astype(f32)
                if wd > 0:
                    u = (u + f32(wd) * ps[i]).astype(f32)
                wn = float(np.sqrt(np.sum(ps[i].astype(np.float64) ** 2)))
                un = float(np.sqrt(np.sum(u.astype(np.float64) ** 2)))
                coeff = 1.0
                if wn != 0 and un != 0:
                    coeff = min(max(wn / un, min_coeff), max_coeff)
                if coeff != 1.0:
                    lcf[i] = coeff_beta * lcf[i] + (1 - coeff_beta) * coeff
                ps[i] = (ps[i] + u * f32(-lr * coeff)).astype(f32)
        else:
            if sc is None:
                scales = [float(np.sqrt(np.sum(m_of(i).astype(np.float64) ** 2)))
                          / math.sqrt(sizes[i]) for i in range(n)]
                united = sum(scales) / n
                sc = [united / s if s > 0 and united > 0 else 1.0 for s in scales]
            m_last = flat.copy()
            locals_ = []
            for r in range(world):
                fr = flat.copy()
                for i in range(n):
                    m = (b1 * m_of(i) + (f32(1) - b1) * gstep[r][i]).astype(f32)
                    fr[offs[i]:offs[i + 1]] = (m * f32(sc[i])).astype(f32).reshape(-1)
                locals_.append(fr)
            if world > 1:
                flat[:] = compressed_allreduce(locals_, we, se)
            else:
                flat[:] = locals_[0]
            for i in range(n):
                m = (m_of(i) / f32(sc[i])).astype(f32)
                flat[offs[i]:offs[i + 1]] = m.reshape(-1)
                ml = m_last[offs[i]:offs[i + 1]].reshape(params[i].shape)
                gh = ((m - ml * b1) / (f32(1) - b1)).astype(f32)
                vf[i] = (b2 * vf[i] + (f32(1) - b2) * gh * gh).astype(f32)
                denom = (np.sqrt(vs[i]) + f32(eps)).astype(f32)
                dreal = (np.sqrt(vf[i]) + f32(eps)).astype(f32)
                factor = float(np.max(denom / dreal))
                upre = (m / denom).astype(f32)
                if wd > 0:
                    u = (upre + f32(wd) * ps[i]).astype(f32)
                    un = float(np.sqrt(np.sum(u.astype(np.float64) ** 2)))
                    ratio = min(1.0, float(np.sqrt(np.sum(upre.astype(np.float64) ** 2))) / un) \
                        if un > 0 else 1.0
                    factor = factor * ratio + (1 - ratio)
                else:
                    u = upre
                factor = min(max(factor, factor_min), factor_max)
                factor = min(factor, last[i] * (1 + factor_threshold))
                factor = max(factor, last[i] * (1 - factor_threshold))
                last[i] = factor
                ps[i] = (ps[i] + u * f32(-lr * lcf[i] * factor)).astype(f32)
        out.append([[p.copy() for p in ps] for _ in range(world)])
    return out
