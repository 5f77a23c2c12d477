"""Helpers of the compressors and the optimizers' bucket plans: the finiteness check of a list of
tensors and the cut of a sequence of tensors into buckets (re-exported by
:mod:`compcomm.compress`)."""

from __future__ import annotations

import math
from typing import Callable, Dict, Hashable, List, Sequence, Tuple

import torch

from . import _C
from ._buffers import DTYPES, FLOATS, buffer_of

__all__ = ["all_finite", "finite_gate", "plan_buckets"]


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every element of ``tensors`` is finite (one host synchronisation per device).

    On a GPU one multi-tensor max-norm per (device, dtype) (a few launches instead of two per
    tensor); on the CPU one C++ pass over contiguous fp32, fp16 and bf16 tensors (a 16-bit one in
    its own dtype), else each tensor's min and max (torch's CPU max-norm is ~10x slower). NaN and
    Inf propagate into both, and finite values never overflow them."""
    ts = [t for t in tensors if t.numel()]
    if all(t.is_cpu and t.dtype in FLOATS and t.is_contiguous() for t in ts):
        # the gradients' check at every CPU step: one C++ pass over raw pointers (a Buffer per
        # tensor cost ~1.3 us each, 0.13 ms of a 100-tensor step); ts keeps the memory alive
        return _C.optim.all_finite_ptrs([t.numel() for t in ts], [t.data_ptr() for t in ts],
                                        dtypes=[DTYPES[t.dtype] for t in ts])
    lists: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
    for t in ts:
        lists.setdefault((t.device, t.dtype), []).append(t)
    flags: Dict[torch.device, List[torch.Tensor]] = {}
    for (dev, dtype), ts in lists.items():
        if dev.type == "cpu" and dtype == torch.float32 and all(t.is_contiguous() for t in ts):
            if not _C.optim.all_finite([buffer_of(t) for t in ts]):
                return False
            continue
        if dev.type == "cpu":
            ends = torch.stack([torch.stack(torch.aminmax(t.reshape(-1))) for t in ts])
        else:
            ends = torch.stack(torch._foreach_norm(ts, math.inf))
        flags.setdefault(dev, []).append(ends.reshape(-1).float())
    return all(bool(torch.isfinite(torch.cat(f)).all()) for f in flags.values())


def finite_gate(tensors: Sequence[torch.Tensor], device: torch.device
                ) -> Tuple[torch.Tensor, Callable[[], bool]]:
    """:func:`all_finite` of tensors on one CUDA device, without making the host wait before it
    launches the kernels that depend on it.

    Returns ``(gate, verdict)``. ``gate`` is a 0-dim bool tensor on ``device``, True where every
    element is finite, written by work queued now on the current stream; the optimizer kernels
    that take it (``gate=`` of :mod:`compcomm.optim._fused` and ``lamb_passes.stats_``) write
    nothing where it is False. ``verdict()`` waits for a copy of the gate queued right after it
    (not for the kernels queued later) and returns it, so the step's launches overlap the check
    and the host still learns the verdict before it changes any state of its own.

    Contiguous fp32 tensors on ``device`` (the optimizers' case) take compcomm's multi-tensor
    kernel where the build has it (``_C.optim_cuda.finite_gate``: a memset and one launch per ~20M
    elements), others one ``torch._foreach_norm`` per dtype (which makes a result tensor per input
    tensor, host time that grows with the tensor count)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    ts = [t for t in tensors if t.numel()]
    k = getattr(_C, "optim_cuda", None)
    if ts and k is not None and k.built() and all(
            t.dtype is torch.float32 and t.is_cuda and t.get_device() == index
            and t.is_contiguous() for t in ts):
        gate = torch.empty((), dtype=torch.bool, device=device)
        k.finite_gate([t.numel() for t in ts], [t.data_ptr() for t in ts], gate.data_ptr(), index,
                      torch.cuda.current_stream(device).cuda_stream)
    else:
        lists: Dict[torch.dtype, List[torch.Tensor]] = {}
        for t in ts:
            lists.setdefault(t.dtype, []).append(t)
        # the max-norm of each tensor (NaN and Inf propagate; finite values cannot overflow it)
        ends = [torch.stack(torch._foreach_norm(same, math.inf)).float()
                for same in lists.values()]
        if not ends:
            gate = torch.ones((), dtype=torch.bool, device=device)
        else:  # (one dtype, the usual case: no concatenation, one launch fewer)
            gate = torch.isfinite(ends[0] if len(ends) == 1 else torch.cat(ends)).all()
    host = torch.empty((), dtype=torch.bool, pin_memory=True)
    host.copy_(gate, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(device))

    def verdict() -> bool:
        copied.synchronize()
        return bool(host)

    return gate, verdict


def plan_buckets(sizes: Sequence[Tuple[Hashable, int]], limit: int) -> List[List[int]]:
    """Cut a sequence of tensors into buckets of consecutive tensors.

    Parameters
    ----------
    sizes : sequence of (group key, numel)
        Tensors in order; tensors of different group keys never share a bucket.
    limit : int
        Most elements in a bucket; a tensor larger than ``limit`` gets a bucket of its own.
        ``0`` puts every tensor in its own bucket (per-tensor compression).

    Returns
    -------
    list of list of int
        Indices into ``sizes``, bucket by bucket.
    """
    buckets: List[List[int]] = []
    count, key = 0, object()
    for i, (k, n) in enumerate(sizes):
        if not buckets or k != key or limit == 0 or count + n > limit:
            buckets.append([])
            count, key = 0, k
        buckets[-1].append(i)
        count += n
    return buckets
