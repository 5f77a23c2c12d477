"""What the CPU Adam kernels' Python entry points share (:mod:`compcomm.optim.cpu_adam` and its
list forms, :mod:`compcomm.optim.cpu_multi`): argument checks, thread count and the square-root
mode torch computes on this machine."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Tuple

import torch

from .. import _C
from .._buffers import buffer_of

__all__ = ["Group", "K", "F32", "FLOATS", "torch_sqrt_mode", "sqrt_mode", "check", "threads",
           "state_args"]

Group = Mapping[str, Any]

K = _C.optim
F32 = (torch.float32,)
FLOATS = (torch.float32, torch.float16, torch.bfloat16)

_torch_sqrt: Optional[Tuple[Optional[str]]] = None


def torch_sqrt_mode() -> Optional[str]:
    """Which square root torch's CPU ``Tensor.sqrt()`` computes on this machine, as a kernel
    ``sqrt`` mode: ``'ieee'`` (correctly rounded), ``'rsqrt14'`` (MKL's on AVX-512: see
    ``cpp/kernels/cpu_adam.h``), or None if it is neither (the kernels then use ``'ieee'`` and
    cannot be bit-identical to torch's CPU ops). Probed once, on values that tell them apart."""
    global _torch_sqrt
    if _torch_sqrt is None:
        gen = torch.Generator().manual_seed(0)
        scale = torch.pow(4.0, torch.arange(-70, 60, dtype=torch.float64)).to(torch.float32)
        x = (1.0 + 3.0 * torch.rand(64, scale.numel(), generator=gen)) * scale
        x = torch.cat([x.flatten(), torch.tensor([0.0, -0.0, 1.0, 2.0, float("inf"), 1e-45])])
        # the first multi-threaded sqrt of a process sometimes gives other bits near the
        # subnormal range in its second half (torch's pool starting up, seen on the 2-core VM):
        # probe on a later call
        x.sqrt()
        want = x.sqrt()
        found = None
        for mode in ("ieee", "rsqrt14"):
            out = torch.empty_like(x)
            K.sqrt(buffer_of(x), buffer_of(out), mode)
            if torch.equal(out, want):
                found = mode
                break
        _torch_sqrt = (found,)
    return _torch_sqrt[0]


def sqrt_mode(sqrt: Optional[str]) -> str:
    """The kernels' ``sqrt`` argument: ``sqrt`` checked, or torch's own mode where None."""
    if sqrt is None:
        return torch_sqrt_mode() or "ieee"
    if sqrt not in ("ieee", "rsqrt14"):
        raise ValueError(f"sqrt must be None, 'ieee' or 'rsqrt14', got {sqrt!r}")
    return sqrt


def check(fn: str, name: str, t: Any, dtypes: Tuple[torch.dtype, ...],
          numel: Optional[int]) -> torch.Tensor:
    """``t`` if it is a contiguous CPU tensor of one of ``dtypes`` with ``numel`` elements, else a
    TypeError (not a tensor, wrong dtype) or ValueError (device, layout, size) naming ``name``.
    (Runs for every tensor of every step: the common case is a few attribute reads.)"""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_cpu:
        raise ValueError(f"{fn}: {name} must be a CPU tensor, got device {t.device}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{fn}: {name} must be {names}, got {str(t.dtype).replace('torch.', '')}")
    if t.is_sparse or not t.is_contiguous():
        raise ValueError(f"{fn}: {name} must be a contiguous (dense) tensor")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{fn}: {name} has {t.numel()} elements, w has {numel}")
    return t


def threads(num_threads: Optional[int]) -> int:
    """``num_threads``, or torch's intra-op thread count where None."""
    return torch.get_num_threads() if num_threads is None else int(num_threads)


def state_args(fn: str, w: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
               param_out: Optional[torch.Tensor]):
    """``w``'s size after checking ``w``, ``m``, ``v`` (fp32, same size) and the Buffer of
    ``param_out`` (None where none)."""
    n = check(fn, "w", w, F32, None).numel()
    check(fn, "m", m, F32, n)
    check(fn, "v", v, F32, n)
    out = None if param_out is None else buffer_of(check(fn, "param_out", param_out, FLOATS, n))
    return n, out
