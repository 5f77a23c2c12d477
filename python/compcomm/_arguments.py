"""The argument checks of compcomm's compressed collectives (compressed_allreduce,
compressed_reduce_scatter): typed errors naming the argument, the call and the rank; and
:func:`reject`, which tells the peers of a rank whose arguments failed them."""

from __future__ import annotations

import numbers
from typing import Optional

import torch

from . import _C
from ._agree import reject_exchange
from ._defaults import DEFAULT_TIMEOUT
from ._scratch import lock_of as _lock

__all__ = ["fail", "check_timeout", "check_float32_vector", "check_input", "check_placement",
           "check_flag", "check_autograd", "check_disjoint", "reject", "FLOATS"]

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_CUDA_BUILT = bool(_C.build_info().get("cuda"))


def fail(cls: type, rank: int, arg: str, problem: str,
         call: str = "compressed_allreduce") -> Exception:
    return cls(f"[rank {rank}] {call}: argument '{arg}' {problem}")


def check_timeout(call: str, rank: int, timeout: object) -> float:
    """``timeout`` in seconds (``None``: the default) or a TypeError/ValueError naming it."""
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"[rank {rank}] {call}: argument 'timeout' must be a number of seconds, "
                        f"got {type(timeout).__name__}")
    if not timeout > 0:  # also rejects NaN
        raise ValueError(
            f"[rank {rank}] {call}: argument 'timeout' must be positive, got {timeout}")
    return float(timeout)


def check_float32_vector(t: object, name: str, rank: int, numel: int, device: torch.device,
                         call: str = "compressed_allreduce") -> None:
    if not isinstance(t, torch.Tensor):
        raise fail(TypeError, rank, name, f"must be a torch.Tensor, got {type(t).__name__}", call)
    if t.dtype != torch.float32:
        raise fail(TypeError, rank, name, f"must be torch.float32, got {t.dtype}", call)
    if t.device != device:
        raise fail(ValueError, rank, name, f"is on {t.device} but tensor is on {device}", call)
    if t.dim() != 1:
        raise fail(ValueError, rank, name, f"must be 1-D, got shape {tuple(t.shape)} "
                   "(allocate it with compcomm.error_buffers)", call)
    if not t.is_contiguous():
        raise fail(ValueError, rank, name, "must be contiguous", call)
    if t.numel() != numel:
        raise fail(ValueError, rank, name, f"has {t.numel()} elements, expected {numel} "
                   "(allocate it with compcomm.error_buffers)", call)


def check_input(call: str, comm: object, tensor: object, worker_error: object,
                server_error: object) -> int:
    """The checks compressed_allreduce and compressed_reduce_scatter share; returns P."""
    world, rank = comm.size(), comm.rank()
    if not isinstance(tensor, torch.Tensor):
        raise fail(TypeError, rank, "tensor",
                   f"must be a torch.Tensor, got {type(tensor).__name__}", call)
    if tensor.dtype not in FLOATS:
        raise fail(TypeError, rank, "tensor",
                   f"must be float32, float16 or bfloat16, got {tensor.dtype}", call)
    if not tensor.is_contiguous():
        raise fail(ValueError, rank, "tensor", "must be contiguous (call .contiguous() first)",
                   call)
    if tensor.device.type not in ("cpu", "cuda"):
        raise fail(ValueError, rank, "tensor",
                   f"must be on the CPU or a CUDA device, not {tensor.device}", call)
    if not isinstance(worker_error, torch.Tensor):
        raise fail(TypeError, rank, "worker_error",
                   f"must be a torch.Tensor, got {type(worker_error).__name__}", call)
    padded = worker_error.numel()
    if padded < tensor.numel() or padded % (8 * world):
        raise fail(ValueError, rank, "worker_error",
                   f"has {padded} elements; it needs a multiple of 8*world_size={8 * world} that "
                   f"is >= tensor.numel()={tensor.numel()} (allocate it with "
                   "compcomm.error_buffers)", call)
    check_float32_vector(worker_error, "worker_error", rank, padded, tensor.device, call)
    check_float32_vector(server_error, "server_error", rank, padded // world, tensor.device, call)
    check_placement(call, rank, comm, tensor)
    check_autograd(call, rank, tensor)
    return padded


def check_placement(call: str, rank: int, comm: object, tensor: torch.Tensor) -> None:
    """ValueError if ``comm`` cannot move ``tensor``'s memory (checked here, where the peers can
    still be told, rather than by the core or torch once the call has started)."""
    name = comm.backend_name()
    if tensor.is_cuda and not _CUDA_BUILT:
        raise fail(ValueError, rank, "tensor", f"is on {tensor.device} but this build of compcomm "
                   "has no CUDA kernels", call)
    if name == "nccl" and tensor.device != torch.device("cuda", comm.device):
        raise fail(ValueError, rank, "tensor", f"is on {tensor.device} but the NCCL communicator "
                   f"is on cuda:{comm.device}", call)
    if name == "torch:nccl" and not tensor.is_cuda:
        raise fail(ValueError, rank, "tensor", f"is on {tensor.device} but the process group's "
                   "backend is NCCL (CUDA tensors only)", call)


def check_flag(call: str, rank: int, name: str, value: object) -> bool:
    """``bool(value)``, or a TypeError naming the argument where that fails (a tensor of several
    elements, say)."""
    try:
        return bool(value)
    except Exception:  # noqa: BLE001 -- whatever __bool__ raised
        raise fail(TypeError, rank, name, f"must be true or false, got {type(value).__name__}",
                   call) from None


def check_autograd(call: str, rank: int, tensor: torch.Tensor, name: str = "tensor") -> None:
    """ValueError if argument ``name`` (``tensor``) requires grad while grad mode is on: the call
    overwrites it in place, which autograd could not follow (torch itself refuses in-place ops on
    such leaves)."""
    if tensor.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"[rank {rank}] {call}: argument '{name}' requires grad; it is "
                         f"overwritten in place, so pass {name}.detach() (or a gradient) or call "
                         "it under torch.no_grad()")


def check_disjoint(call: str, rank: int, **tensors: Optional[torch.Tensor]) -> None:
    """ValueError naming two arguments whose memory overlaps (all are contiguous tensors).

    The call reads and writes every buffer, so shared memory would be read after it was written.
    """
    spans = []
    for name, t in tensors.items():
        if t is None or t.numel() == 0:
            continue
        lo = t.data_ptr()
        spans.append((name, t.device, lo, lo + t.numel() * t.element_size()))
    for i, (a, dev_a, lo_a, hi_a) in enumerate(spans):
        for b, dev_b, lo_b, hi_b in spans[i + 1 :]:
            if dev_a == dev_b and lo_a < hi_b and lo_b < hi_a:
                raise ValueError(
                    f"[rank {rank}] {call}: arguments '{a}' and '{b}' overlap in memory; they must "
                    "be distinct buffers (allocate the errors with compcomm.error_buffers)"
                )


def _reject_device(comm: object, tensor: object) -> Optional[torch.device]:
    """Where the rejecting rank's record goes: where its peers' headers are (their tensors'
    device, which a rejected ``tensor`` may not share): the NCCL communicator's GPU; else the
    tensor's device where it is a CPU or CUDA tensor (a CUDA device for a torch NCCL group)."""
    name = comm.backend_name()
    if name == "nccl":
        return torch.device("cuda", comm.device)
    nccl_group = name == "torch:nccl"
    if isinstance(tensor, torch.Tensor) and tensor.device.type in ("cpu", "cuda"):
        if tensor.is_cuda or not nccl_group:
            return tensor.device
    return torch.device("cuda", torch.cuda.current_device()) if nccl_group else None


def reject(comm: object, tensor: object, timeout: object, error: Exception) -> None:
    """This rank rejected its arguments (``error``): say so in the call's first collective, so
    that peers raise RankMismatchError at once rather than wait for this rank or pair with its
    next call (:func:`compcomm._agree.reject_exchange`). Not while another thread of this rank
    runs a call on ``comm`` (its collectives would be interleaved). If the exchange fails,
    ``error`` is still what the caller raises (with a note)."""
    if comm.size() == 1:
        return
    lock = _lock(comm)
    if not lock.acquire(blocking=False):
        return
    try:
        try:
            seconds = check_timeout("", 0, timeout)
        except (TypeError, ValueError):
            seconds = DEFAULT_TIMEOUT
        reject_exchange(comm, _reject_device(comm, tensor), seconds)
    except Exception as e:  # noqa: BLE001 -- the argument error is the one to raise
        if hasattr(error, "add_note"):
            error.add_note(f"(telling the other ranks failed too: {e!r})")
    finally:
        lock.release()
