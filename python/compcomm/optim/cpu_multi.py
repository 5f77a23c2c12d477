"""The 1-bit Adam CPU updates of :mod:`compcomm.optim.cpu_adam` over lists of tensors: one
crossing into C++ per list (data pointers), not one per tensor, with the same bits. A step of many
small tensors (or one-tensor buckets) paid ~10 us of Python per tensor and call for the single
forms' Buffers and checks; here the checks are a few attribute reads per tensor, and
``check=False`` skips them where the caller has checked.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple

import torch

from .._buffers import DTYPES
from ._cpu_args import F32 as _F32
from ._cpu_args import FLOATS as _FLOATS
from ._cpu_args import K as _K
from ._cpu_args import Group
from ._cpu_args import check as _check
from ._cpu_args import sqrt_mode as _sqrt_mode
from ._cpu_args import state_args as _state_args
from ._cpu_args import threads as _threads

__all__ = ["onebit_warmup_steps_", "onebit_compressed_steps_", "zero_one_local_steps_",
           "onebit_momentums_", "steps_"]


def onebit_warmup_steps_(ws: Sequence[torch.Tensor], ms: Sequence[torch.Tensor],
                         vs: Sequence[torch.Tensor], gs: Sequence[torch.Tensor], group: Group,
                         bc1_t: int, bc2_t: int,
                         param_outs: Optional[Sequence[Optional[torch.Tensor]]] = None,
                         num_threads: Optional[int] = None, sqrt: Optional[str] = None,
                         check: bool = True) -> None:
    """:func:`onebit_warmup_step_` over lists of fp32 tensors (``gs``: the averaged gradients,
    fp32, fp16 or bf16) in one call; arguments as :func:`onebit_local_steps_`."""
    steps_("onebit_warmup_steps_", _K.onebit_warmup_steps, ws, ms, vs, gs, group, bc1_t, bc2_t,
           param_outs, num_threads, sqrt, check)


def onebit_compressed_steps_(ws: Sequence[torch.Tensor], ms: Sequence[torch.Tensor],
                             vs: Sequence[torch.Tensor], averaged: Sequence[torch.Tensor],
                             group: Group, bc1_t: int, bc2_t: int,
                             param_outs: Optional[Sequence[Optional[torch.Tensor]]] = None,
                             num_threads: Optional[int] = None, sqrt: Optional[str] = None,
                             check: bool = True, denom: bool = False) -> None:
    """:func:`onebit_compressed_step_` (no mask) over lists of fp32 tensors in one call; arguments
    as :func:`onebit_local_steps_`, ``averaged[i]`` the averaged momentum of tensor ``i`` (it may
    be ``ms[i]``); ``denom``: ``vs`` hold the frozen denominators, not the variances."""
    steps_("onebit_compressed_steps_", _K.onebit_compressed_steps, ws, ms, vs, averaged, group,
           bc1_t, bc2_t, param_outs, num_threads, sqrt, check, denom)


def zero_one_local_steps_(ws: Sequence[torch.Tensor], ms: Sequence[torch.Tensor],
                          vs: Sequence[torch.Tensor], gs: Sequence[torch.Tensor],
                          accs: Sequence[torch.Tensor], group: Group, bc1_t: int, bc2_t: int,
                          num_threads: Optional[int] = None, sqrt: Optional[str] = None,
                          check: bool = True, denom: bool = False) -> None:
    """0/1 Adam's local step (``functional.zero_one_local_multi_`` with the variance frozen and
    accumulators ``accs``) over lists of tensors in one call, the same bits: ``m = b1 m + (1-b1)
    g``; ``s = -lr * update``; ``w += s``; ``accs[i] += s``. Arguments as
    :func:`onebit_local_steps_` (no parameter copies); ``accs``: fp32, one per tensor."""
    fn = "zero_one_local_steps_"
    if len(accs) != len(ws):
        raise ValueError(f"{fn}: accs must hold {len(ws)} tensors, got {len(accs)}")
    if check:
        for i, (a, w) in enumerate(zip(accs, ws)):
            n = w.numel() if isinstance(w, torch.Tensor) else -1
            _check(f"{fn}[{i}]", "acc", a, _F32, n)
            if any(a.data_ptr() == t.data_ptr() for t in (w, ms[i], vs[i], gs[i])):
                raise ValueError(f"{fn}[{i}]: acc must not share memory with w, m, v or g")
    steps_(fn, _K.zero_one_local_steps, ws, ms, vs, gs, group, bc1_t, bc2_t, None, num_threads,
           sqrt, check, denom, accs=[a.data_ptr() for a in accs])


def steps_(fn: str, kernel: Callable[..., None], ws: Sequence[torch.Tensor],
           ms: Sequence[torch.Tensor], vs: Sequence[torch.Tensor], gs: Sequence[torch.Tensor],
           group: Group, bc1_t: int, bc2_t: int,
           param_outs: Optional[Sequence[Optional[torch.Tensor]]], num_threads: Optional[int],
           sqrt: Optional[str], check: bool, denom: bool = False,
           accs: Sequence[int] = ()) -> None:
    """The list forms' common body: validate (``check``), then ``kernel`` (a ``_C.optim`` list
    entry point) over the tensors' data pointers; ``fn`` names the caller in errors, ``denom``:
    ``vs`` hold frozen denominators (the compressed-phase rules); ``accs``: the accumulators'
    pointers (0/1 Adam's local step only)."""
    k = len(ws)
    if not (len(ms) == len(vs) == len(gs) == k):
        raise ValueError(f"{fn}: ws, ms, vs and gs must have one length, got {k}, {len(ms)}, "
                         f"{len(vs)}, {len(gs)}")
    outs = list(param_outs) if param_outs is not None else []
    if outs and len(outs) != k:
        raise ValueError(f"{fn}: param_outs must hold {k} entries, got {len(outs)}")
    # a gradient may be fp16/bf16 (read as is, converted exactly in registers); the compressed
    # rule's averaged momentum is fp32
    g_ok = _F32 if kernel is _K.onebit_compressed_steps else _FLOATS
    if check:
        for i in range(k):
            w = ws[i]
            n = w.numel() if isinstance(w, torch.Tensor) else -1
            o = outs[i] if outs else None
            if not (_ok(w, n) and _ok(ms[i], n) and _ok(vs[i], n) and _ok(gs[i], n, g_ok)
                    and (o is None or _ok(o, n, _FLOATS))):  # then say which
                _state_args(f"{fn}[{i}]", w, ms[i], vs[i], o)
                _check(f"{fn}[{i}]", "g", gs[i], g_ok, n)
    if any(o is not None for o in outs):
        out_ptrs = [0 if o is None else o.data_ptr() for o in outs]
        out_types = [DTYPES[torch.float32 if o is None else o.dtype] for o in outs]
    else:
        out_ptrs, out_types = [], []
    f32 = torch.float32
    g_types = [] if all(g.dtype == f32 for g in gs) else [DTYPES[g.dtype] for g in gs]
    b1, b2 = group["betas"]
    kernel([w.numel() for w in ws], [w.data_ptr() for w in ws], [m.data_ptr() for m in ms],
           [v.data_ptr() for v in vs], [g.data_ptr() for g in gs], out_ptrs, out_types,
           float(group["lr"]), float(b1), float(b2), float(group["eps"]),
           float(group["weight_decay"]), bool(group["bias_correction"]), int(bc1_t), int(bc2_t),
           _threads(num_threads), sqrt=_sqrt_mode(sqrt), g_types=g_types, v_is_denom=bool(denom),
           accs=list(accs))


def onebit_momentums_(ms: Sequence[torch.Tensor], gs: Sequence[torch.Tensor], group: Group,
                      outs: Sequence[torch.Tensor], num_threads: Optional[int] = None,
                      check: bool = True) -> None:
    """:func:`onebit_momentum_` over lists of tensors in one call; ``check`` as
    :func:`onebit_local_steps_`."""
    fn = "onebit_momentums_"
    if not len(ms) == len(gs) == len(outs):
        raise ValueError(f"{fn}: ms, gs and outs must have one length, got {len(ms)}, {len(gs)}, "
                         f"{len(outs)}")
    if check:
        for i, (m, g, out) in enumerate(zip(ms, gs, outs)):
            n = m.numel() if isinstance(m, torch.Tensor) else -1
            if not (_ok(m, n) and _ok(g, n) and _ok(out, n)):  # then say which
                n = _check(f"{fn}[{i}]", "m", m, _F32, None).numel()
                _check(f"{fn}[{i}]", "g", g, _F32, n)
                _check(f"{fn}[{i}]", "out", out, _F32, n)
    _K.onebit_momentums([m.numel() for m in ms], [m.data_ptr() for m in ms],
                        [g.data_ptr() for g in gs], [o.data_ptr() for o in outs],
                        float(group["betas"][0]), _threads(num_threads))


def _ok(t: Any, n: int, dtypes: Tuple[torch.dtype, ...] = _F32) -> bool:
    """What :func:`_check` accepts, as a bool without building messages (the list forms' fast
    path; :func:`_check` then names what failed)."""
    return (isinstance(t, torch.Tensor) and t.is_cpu and t.dtype in dtypes and not t.is_sparse
            and t.is_contiguous() and t.numel() == n)
