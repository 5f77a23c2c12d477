"""The gradients of a 1-bit optimizer and the group they are averaged over: the communicator
named by ``comm_backend_name``, fp32 copies of the gradients, their bucketed full-precision
average (the warm-up) and the small all-reduces that let every rank agree on skipping a step."""

from __future__ import annotations

from typing import Any, List, Optional

import torch

from .. import _C
from .._buffers import buffer_of
from .._scratch import stream_of
from .._comm import resolve
from .._defaults import DEFAULT_TIMEOUT
from .._init import available_backends
from ..compress import all_finite
from ..errors import NonFiniteError, UnsupportedError

__all__ = ["BUCKET_ELEMENTS", "resolve_comm", "fp32_grad", "average_", "all_max", "all_finite",
           "non_finite_error"]

#: Elements per full-precision allreduce bucket in the warm-up (fp32: 16 MiB).
BUCKET_ELEMENTS = 4 * 1024 * 1024


def resolve_comm(name: str, comm_backend_name: str, process_group: Any) -> Any:
    """The compcomm Communicator the optimizer talks through.

    ``'torch'`` (default): ``process_group`` (a torch ProcessGroup or compcomm Communicator;
    ``None`` = compcomm's default group). ``'mpi'`` / ``'nccl'``: the compcomm backend of that name,
    which must be available in this build and initialised with ``compcomm.init(backend=...)``.
    """
    if comm_backend_name in ("torch", "gloo"):
        return resolve(process_group)
    if comm_backend_name not in ("mpi", "nccl"):
        raise ValueError(f"{name}: argument 'comm_backend_name' must be 'torch', 'mpi' or 'nccl', "
                         f"got {comm_backend_name!r}")
    available = available_backends()
    if comm_backend_name not in available:
        raise UnsupportedError(
            f"{name}: comm_backend_name={comm_backend_name!r} is not available in this build/machine "
            f"(available: {available}); use comm_backend_name='torch'")
    if process_group is not None:
        return resolve(process_group)
    comm = resolve(None)
    if not comm.backend_name().startswith(comm_backend_name):
        raise UnsupportedError(
            f"{name}: comm_backend_name={comm_backend_name!r} needs "
            f"compcomm.init(backend={comm_backend_name!r}) first (default group is "
            f"{comm.backend_name()!r})")
    return comm


def fp32_grad(p: torch.Tensor, copy: bool = True) -> torch.Tensor:
    """The gradient of ``p`` as a contiguous fp32 tensor: a copy (the optimizer never writes
    ``p.grad``), or with ``copy=False`` the gradient itself when it already is one (read only)."""
    g = p.grad
    if g.is_sparse:
        raise UnsupportedError("compcomm optimizers do not support sparse gradients")
    if not copy and g.dtype == torch.float32 and g.is_contiguous() and not g.requires_grad:
        return g  # the common case without torch's dispatch (~3 us a tensor on a GPU step)
    if copy:
        return g.detach().to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    # not .to(memory_format=contiguous_format, copy=False): a transposed fp32 matrix counts as
    # "contiguous format" there and came back as it was, strided
    return g.detach().to(torch.float32).contiguous()


def average_(tensors: List[torch.Tensor], comm: Any, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Average fp32 ``tensors`` across ranks in place with bucketed full-precision allreduces.

    Tensors are flattened into buckets of at most :data:`BUCKET_ELEMENTS` elements (a larger tensor
    is reduced on its own); each bucket is summed with one allreduce and multiplied by ``1/W``.
    """
    world = comm.size()
    if world == 1 or not tensors:
        return
    inv = 1.0 / world
    bucket: List[torch.Tensor] = []
    count = 0

    def flush() -> None:
        if not bucket:
            return
        flat = torch.cat([t.reshape(-1) for t in bucket]) if len(bucket) > 1 else \
            bucket[0].reshape(-1).clone()
        comm.all_reduce(buffer_of(flat), _C.ReduceOp.sum, timeout, stream_of(flat))
        flat.mul_(inv)
        off = 0
        for t in bucket:
            t.copy_(flat[off:off + t.numel()].view_as(t))
            off += t.numel()
        bucket.clear()

    for t in tensors:
        if count + t.numel() > BUCKET_ELEMENTS:
            flush()
            count = 0
        bucket.append(t)
        count += t.numel()
    flush()


def all_max(flag: float, comm: Any, device: Optional[torch.device] = None) -> float:
    """The maximum of a float over the ranks (for agreeing on skipped steps); ``device``: where the
    4-byte buffer lives (the parameters' device: a native NCCL communicator needs CUDA memory)."""
    if comm.size() == 1:
        return flag
    t = torch.tensor([flag], dtype=torch.float32, device=device)
    comm.all_reduce(buffer_of(t), _C.ReduceOp.max, DEFAULT_TIMEOUT, stream_of(t))
    return float(t.item())


def non_finite_error(rank: int, name: str) -> NonFiniteError:
    """The error of a step skipped for a non-finite gradient (caught by ``step()``)."""
    return NonFiniteError(f"[rank {rank}] {name}: non-finite gradient; step skipped on every rank")
