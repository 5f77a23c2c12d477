"""The 1-bit compressed reduce-scatter used to reduce momentum shards under ZeRO.

It is the compressed allreduce (ONEBIT_SPEC.md section a) stopped before its final all-gather:
every rank sends the packed signs of ``tensor + worker_error`` (chunk j to rank j) and its scale;
rank r reduces chunk r, adds its server error, and compresses that again. Rank r's result is
``tau_r * s(c_r)``, which is exactly chunk r of what :func:`compcomm.compressed_allreduce` returns,
with the same updates of ``worker_error`` (all P elements) and ``server_error`` (chunk r). It sends
about half the bytes of the compressed allreduce: P/8 * (W-1)/W plus a 32-byte header per peer.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _C
from .._buffers import buffer_of
from .._comm import Group, resolve
from ..collectives import (
    _check_disjoint,
    _check_float32_vector,
    _check_timeout,
    _exclusive,
    _layout_total,
    _workspace,
)

__all__ = ["compressed_reduce_scatter"]


def compressed_reduce_scatter(
    tensor: torch.Tensor,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    group: Group = None,
    *,
    timeout: Optional[float] = None,
) -> torch.Tensor:
    """1-bit compressed reduce-scatter with error feedback (CPU or CUDA tensors).

    Parameters
    ----------
    tensor : torch.Tensor
        float32/float16/bfloat16, contiguous, on the CPU or a GPU (with a communicator that takes
        device buffers), same numel n on every rank. On return it
        holds this rank's chunk of the compressed average at positions ``[r*C, (r+1)*C)`` and +0
        elsewhere (C = P / world_size).
    worker_error : torch.Tensor
        float32, P elements, P >= n a multiple of ``8 * world_size`` (``compcomm.error_buffers``),
        on ``tensor``'s device.
    server_error : torch.Tensor
        float32, P / world_size elements.
    out : torch.Tensor, optional
        float32, C elements; allocated if not given.
    group : optional
        Process group or Communicator (default: compcomm's default).
    timeout : float, optional
        Seconds each collective step may wait.

    Raises
    ------
    TypeError, ValueError
        A bad argument, or two arguments sharing memory (the message names them and the rank).
    compcomm.errors.CommError
        Another thread is running a compressed call on the same communicator.

    Returns
    -------
    torch.Tensor
        ``out``: this rank's chunk (C elements, padding positions included) of the compressed
        average, identical to chunk r of :func:`compcomm.compressed_allreduce`'s result.
    """
    comm = resolve(group)
    world, rank = comm.size(), comm.rank()
    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in (
        torch.float32, torch.float16, torch.bfloat16
    ):
        raise TypeError(f"[rank {rank}] compressed_reduce_scatter: argument 'tensor' must be a "
                        "float32/float16/bfloat16 torch.Tensor")
    if tensor.device.type not in ("cpu", "cuda") or not tensor.is_contiguous():
        raise ValueError(f"[rank {rank}] compressed_reduce_scatter: argument 'tensor' must be a "
                         f"contiguous CPU or CUDA tensor (got {tensor.device}, contiguous="
                         f"{tensor.is_contiguous()})")
    if not isinstance(worker_error, torch.Tensor):
        raise TypeError(f"[rank {rank}] compressed_reduce_scatter: argument 'worker_error' must be a tensor")
    padded = worker_error.numel()
    if padded < tensor.numel() or padded % (8 * world):
        raise ValueError(
            f"[rank {rank}] compressed_reduce_scatter: argument 'worker_error' has {padded} elements; "
            f"it needs a multiple of 8*world_size={8 * world} that is >= tensor.numel()={tensor.numel()}"
        )
    _check_float32_vector(worker_error, "worker_error", rank, padded, tensor.device)
    _check_float32_vector(server_error, "server_error", rank, padded // world, tensor.device)
    if out is None:
        out = torch.empty(padded // world, dtype=torch.float32, device=tensor.device)
    _check_float32_vector(out, "out", rank, padded // world, tensor.device)
    call = "compressed_reduce_scatter"
    _check_disjoint(call, rank, tensor=tensor, worker_error=worker_error,
                    server_error=server_error, out=out)
    timeout_s = _check_timeout(call, rank, timeout)
    with _exclusive(comm, call, rank):  # the workspace is the communicator's: one call at a time
        total = _layout_total(padded, world, tensor.device.type == "cuda")
        ws = _workspace(comm, tensor.device, total)
        # on the caller's current stream (FSDP calls it on its reduce-scatter stream)
        stream = torch.cuda.current_stream(tensor.device).cuda_stream if tensor.is_cuda else 0
        _C.zero.compressed_reduce_scatter(
            comm, buffer_of(tensor), buffer_of(worker_error), buffer_of(server_error),
            buffer_of(out), buffer_of(ws), timeout_s, stream,
        )
    return out
