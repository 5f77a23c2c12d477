"""1-bit Adam's per-step update on CUDA as multi-tensor kernels: one launch per ~20M elements of
a parameter group instead of ~15 ``torch._foreach_*`` launches and ~23 passes over memory.

The functions take lists of torch tensors (contiguous, fp32, on one CUDA device; the
low-precision parameters fp16/bf16) and a parameter group's hyper-parameters, and apply the
operations of :mod:`compcomm.optim.functional` in the same order, each rounded to fp32 (the kernels
are compiled without multiply-add contraction): the result equals a float32 CPU evaluation of that
op sequence bit for bit. torch's own CUDA ops may differ from it in the last bit (they contract
``a + alpha * b`` and divide by a scalar through its reciprocal). Work is queued on the current
stream of the tensors' device.

:func:`usable` is the optimizer's test; ``COMPCOMM_FUSED_OPTIM=0`` in the environment switches the
kernels off (read at every call, for side-by-side comparisons).
"""

from __future__ import annotations

import functools
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

from .. import _C
from ..errors import UnsupportedError
from .functional import sqrt_bc

__all__ = ["available", "enabled", "supported", "usable", "onebit_momentum",
           "onebit_compressed_step_", "onebit_local_step_", "adam_warmup_step_", "ptrs", "stream",
           "require", "gate_ptr"]

_K = getattr(_C, "optim_cuda", None)
_LOWP = {torch.float16: _C.DType.float16, torch.bfloat16: _C.DType.bfloat16}
Tensors = Sequence[torch.Tensor]
OptTensors = Sequence[Optional[torch.Tensor]]


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether this build has the kernels and torch sees a CUDA device."""
    return _K is not None and bool(_K.built()) and torch.cuda.is_available()


def enabled() -> bool:
    """:func:`available` and not switched off by ``COMPCOMM_FUSED_OPTIM=0``."""
    return os.environ.get("COMPCOMM_FUSED_OPTIM", "1") != "0" and available()


def supported(*lists: OptTensors, lowp: OptTensors = ()) -> bool:
    """Whether every tensor of ``lists`` (None entries allowed) is a contiguous fp32 CUDA tensor
    and every one of ``lowp`` a contiguous fp16/bf16 one, all on one device."""
    dev = None
    for ts, ok in [(ts, (torch.float32,)) for ts in lists] + [(lowp, tuple(_LOWP))]:
        for t in ts:
            if t is None:
                continue
            if not t.is_cuda or t.dtype not in ok or not t.is_contiguous():
                return False
            d = t.get_device()
            if dev is None:
                dev = d
            elif d != dev:
                return False
    return True


def usable(group: Mapping[str, Any], *lists: OptTensors, lowp: OptTensors = ()) -> bool:
    """The optimizer's test: :func:`enabled`, the group has no ``exp_avg_mask`` (masks stay on
    the torch path) and :func:`supported`."""
    return enabled() and group.get("exp_avg_mask") is None and supported(*lists, lowp=lowp)


def _hyper(group: Mapping[str, Any], bc1_t: int, bc2_t: int) -> Dict[str, Any]:
    """The kernels' scalar arguments, as functional.adam_update derives them (in double)."""
    b1, b2 = group["betas"]
    bc = bool(group["bias_correction"])
    return dict(lr=float(group["lr"]), beta1=float(b1), beta2=float(b2), eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]), bias_correction=bc,
                bc1=(1.0 - b1 ** bc1_t) if bc else 1.0, sqrt_bc2=sqrt_bc(b2, bc2_t) if bc else 1.0)


def _device(ts: Tensors, name: str) -> int:
    """The CUDA device index of the first tensor of the list that defines the call."""
    if not ts:
        return -1
    t = ts[0]
    if not isinstance(t, torch.Tensor) or not t.is_cuda:
        raise ValueError(f"argument {name!r} must hold CUDA tensors, got "
                         f"{getattr(t, 'device', type(t).__name__)}")
    return t.get_device()


def ptrs(ts: OptTensors, name: str, numels: List[int], device: int, check: bool,
          optional: bool = False, dtypes: Sequence[torch.dtype] = (torch.float32,)) -> List[int]:
    """The data pointers of a list (0 for None where ``optional``), checked when ``check``:
    one per element count, dtype, device, contiguity, size."""
    if len(ts) != len(numels):
        raise ValueError(f"argument {name!r} must hold {len(numels)} tensors, got {len(ts)}")
    if not check:
        return [0 if t is None else t.data_ptr() for t in ts]
    out = []
    for i, t in enumerate(ts):
        if t is None:
            if not optional:
                raise ValueError(f"argument {name!r}: entry {i} is None")
            out.append(0)
            continue
        if t.dtype not in dtypes:
            raise TypeError(f"argument {name!r}: entry {i} must be "
                            f"{' or '.join(map(str, dtypes))}, got {t.dtype}")
        if not t.is_cuda or t.get_device() != device:
            raise ValueError(f"argument {name!r}: entry {i} must be on cuda:{device}, "
                             f"got {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"argument {name!r}: entry {i} must be contiguous")
        if t.numel() != numels[i]:
            raise ValueError(f"argument {name!r}: entry {i} has {t.numel()} elements, "
                             f"expected {numels[i]}")
        out.append(t.data_ptr())
    return out


def stream(device: int) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def require() -> Any:
    if _K is None or not _K.built():
        raise UnsupportedError("compcomm was built without CUDA kernels (no fused optimizer)")
    return _K


def onebit_momentum(ms: OptTensors, gs: Tensors, group: Mapping[str, Any], outs: Tensors,
                    check: bool = True) -> None:
    """:func:`~compcomm.optim.functional.onebit_momentum_multi` in one kernel per ~20M elements:
    ``outs[i] = ms[i] * b1 + (1-b1) * gs[i]``.

    Parameters
    ----------
    ms : list of fp32 CUDA tensors or None
        The momenta (read only); None is a zero momentum; ``ms[i]`` may be ``outs[i]`` itself.
    gs : list of fp32 CUDA tensors
        The local gradients.
    group : dict
        The parameter group (``betas``).
    outs : list of fp32 CUDA tensors
        Written; shaped (numel) like ``gs``.
    check : bool, default True
        Validate dtypes, devices, contiguity and sizes (False: the caller has, e.g. with
        :func:`supported`).
    """
    k = require()
    dev = _device(gs, "gs")
    numels = [g.numel() for g in gs]
    k.onebit_momentum(numels, ptrs(outs, "outs", numels, dev, check),
                      ptrs(ms, "ms", numels, dev, check, optional=True),
                      ptrs(gs, "gs", numels, dev, check), float(group["betas"][0]), dev,
                      stream(dev) if numels else 0)


def gate_ptr(gate: Optional[torch.Tensor], device: int) -> int:
    """The device address of a finiteness gate (``_bucketing.finite_gate``; 0 for None): a bool
    or uint8 CUDA tensor on the kernels' device whose first byte, where 0, makes them write
    nothing."""
    if gate is None:
        return 0
    if (not isinstance(gate, torch.Tensor) or gate.dtype not in (torch.bool, torch.uint8)
            or not gate.is_cuda or gate.get_device() != device or gate.numel() < 1):
        raise ValueError(f"argument 'gate' must be a bool or uint8 tensor on cuda:{device}, got "
                         f"{getattr(gate, 'dtype', type(gate).__name__)} on "
                         f"{getattr(gate, 'device', '-')}")
    return gate.data_ptr()


def _step(fn: str, ws: Tensors, ms: Tensors, vs: Tensors, xs: Tensors, x_name: str,
          group: Mapping[str, Any], bc1_t: int, bc2_t: int, lowps: Optional[OptTensors],
          check: bool, gate: Optional[torch.Tensor] = None) -> None:
    k = require()
    dev = _device(ws, "ws")
    numels = [w.numel() for w in ws]
    lp: List[int] = []
    types: List[Any] = []
    if lowps is not None and any(t is not None for t in lowps):
        lp = ptrs(lowps, "lowps", numels, dev, check, optional=True, dtypes=tuple(_LOWP))
        types = [_C.DType.float32 if t is None else _LOWP[t.dtype] for t in lowps]
    getattr(k, fn)(numels, ptrs(xs, x_name, numels, dev, check),
                   ptrs(ms, "ms", numels, dev, check), ptrs(vs, "vs", numels, dev, check),
                   ptrs(ws, "ws", numels, dev, check), lp, types, **_hyper(group, bc1_t, bc2_t),
                   device=dev, stream=stream(dev) if numels else 0, gate=gate_ptr(gate, dev))


def onebit_compressed_step_(ws: Tensors, ms: Tensors, vs: Tensors, avgs: Tensors,
                            group: Mapping[str, Any], bc1_t: int, bc2_t: int,
                            lowps: Optional[OptTensors] = None, check: bool = True,
                            gate: Optional[torch.Tensor] = None) -> None:
    """1-bit Adam's compressed-phase commit and step in one pass: ``ms[i] = avgs[i]``, then
    :func:`~compcomm.optim.functional.adam_step_multi_` (``vs`` read only), then each
    ``lowps[i]`` (if not None) = ``ws[i]`` rounded to its dtype (round to nearest even).

    Parameters
    ----------
    ws, ms, vs, avgs : lists of fp32 CUDA tensors of one device
        fp32 parameters (or master copies), momenta, frozen variances, averaged momenta.
    group : dict
        ``lr``, ``betas``, ``eps``, ``weight_decay``, ``bias_correction``.
    bc1_t, bc2_t : int
        The steps of the bias corrections (as for ``adam_step_multi_``).
    lowps : list of fp16/bf16 CUDA tensors or None, optional
        Low-precision parameters to write (None entries: fp32 parameters).
    check : bool, default True
        Validate the tensors (see :func:`onebit_momentum`).
    gate : 0-dim bool CUDA tensor, optional
        The inputs' finiteness verdict on the device (``compcomm._bucketing.finite_gate``):
        where False, the kernels write nothing. The host need not wait for it to launch.
    """
    _step("onebit_compressed_step", ws, ms, vs, avgs, "avgs", group, bc1_t, bc2_t, lowps, check,
          gate)


def onebit_local_step_(ws: Tensors, ms: Tensors, vs: Tensors, gs: Tensors,
                       group: Mapping[str, Any], bc1_t: int, bc2_t: int,
                       lowps: Optional[OptTensors] = None, check: bool = True,
                       gate: Optional[torch.Tensor] = None) -> None:
    """The compressed-phase step where nothing is exchanged (one rank, ``step_on``), in one pass:
    ``ms[i] = ms[i] * b1 + (1-b1) * gs[i]`` (:func:`onebit_momentum`), then the step and
    write-back of :func:`onebit_compressed_step_` with that momentum as the average: the bits
    of the two kernels, without the staging buffer (24 bytes of memory traffic per fp32
    parameter instead of 32). Arguments as :func:`onebit_compressed_step_`, ``gs`` the
    gradients."""
    _step("onebit_local_step", ws, ms, vs, gs, "gs", group, bc1_t, bc2_t, lowps, check, gate)


def adam_warmup_step_(ws: Tensors, ms: Tensors, vs: Tensors, gs: Tensors, group: Mapping[str, Any],
                      bc1_t: int, bc2_t: int, lowps: Optional[OptTensors] = None,
                      check: bool = True, gate: Optional[torch.Tensor] = None) -> None:
    """The warm-up Adam step in one pass: :func:`~compcomm.optim.functional.adam_moments_multi_`
    with the averaged gradients ``gs``, then the step and write-back of
    :func:`onebit_compressed_step_`. Arguments as there."""
    _step("adam_warmup_step", ws, ms, vs, gs, "gs", group, bc1_t, bc2_t, lowps, check, gate)
