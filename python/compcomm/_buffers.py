"""torch tensors <-> the core's Buffer views (no copies)."""

from __future__ import annotations

import numpy as np
import torch

from . import _C

DTYPES = {
    torch.float32: _C.DType.float32,
    torch.float16: _C.DType.float16,
    torch.bfloat16: _C.DType.bfloat16,
    torch.uint8: _C.DType.uint8,
    torch.int32: _C.DType.int32,
    torch.int64: _C.DType.int64,
    torch.float64: _C.DType.float64,
}

#: The floating-point dtypes the kernels take (fp32; fp16 and bf16 where an input may be 16-bit).
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def buffer_of(t: torch.Tensor) -> _C.Buffer:
    """A Buffer viewing a contiguous tensor's memory.

    The Buffer object holds the tensor (``owner``), so ``f(buffer_of(torch.ones(3)))`` is safe. Work
    queued on another thread (``AsyncComm``) copies the view, not the owner: keep such tensors alive
    until the work has been waited on.
    """
    # get_device() is -1 for CPU tensors and the index for CUDA ones (and cheaper than t.device,
    # which matters on the GPU path where this runs 4 times per call).
    b = _C.Buffer(t.data_ptr(), t.numel(), DTYPES[t.dtype], t.get_device())
    b.owner = t
    return b


def tensor_of(buf: _C.Buffer) -> torch.Tensor:
    """A 1-D tensor viewing a Buffer's memory."""
    if buf.device < 0:
        t = torch.from_numpy(np.asarray(buf))
    else:
        t = torch.as_tensor(buf, device=f"cuda:{buf.device}")
    if buf.dtype == _C.DType.bfloat16:  # carried as raw 16-bit words
        t = t.view(torch.bfloat16)
    return t
