"""Per-communicator scratch of the 1-bit calls: the cached workspaces, the one-call-at-a-time lock,
the workspace layout sizes and torch's current CUDA stream (used by collectives; compress keeps
its own workspaces per bucket).
"""

from __future__ import annotations

import threading
import weakref

import torch

from . import _C
from .errors import CommError


class PerDevice(dict):
    """device -> uint8 scratch of one communicator: a dict that can be weakly referenced (the
    validation cache of compressed_allreduce must not keep a dropped communicator's scratch)."""

    __slots__ = ("__weakref__",)


# communicator -> PerDevice {device: uint8 scratch}. Per communicator, not per device: the scratch
# holds the call's headers and signs while it runs, so two communicators used from two threads at
# once must not share it. Weak keys: a dropped communicator takes its scratch with it.
workspaces: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# communicator -> Lock held for the duration of one compressed call on it (see lock_of).
locks: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
registry = threading.Lock()  # guards the two dicts above (WeakKeyDictionary is not thread-safe)


def workspace(comm: object, device: torch.device, nbytes: int) -> torch.Tensor:
    """``comm``'s cached uint8 scratch tensor on ``device``, grown on demand (torch's allocator).

    Zero-filled when allocated: the GPU norm kernels need a zeroed scratch on first use and leave it
    zeroed. Growing it replaces the tensor, so it must not happen while a CUDA graph is being captured
    (run one eager call of the largest size first). Call it only holding
    :func:`lock_of` ``(comm)``: the lock is what keeps two calls from sharing the scratch.
    """
    ws = per_device_of(comm).get(device)
    if ws is None or ws.numel() < nbytes:
        ws = torch.zeros(max(nbytes, 1), dtype=torch.uint8, device=device)
        per_device_of(comm)[device] = ws
    return ws


def per_device_of(comm: object) -> PerDevice:
    """``comm``'s workspaces by device (made on first use)."""
    with registry:
        return workspaces.setdefault(comm, PerDevice())


def lock_of(comm: object) -> threading.Lock:
    """``comm``'s lock, held for one compressed call (made on first use); a call that finds it held
    raises :func:`busy_error` at once.

    The rule: a communicator runs one compressed call at a time. Waiting would be no fix: two
    threads' calls on one communicator can reach the ranks in different orders and pair the wrong
    messages (wrong results or a hang), so a second concurrent call is refused, not queued.
    Different communicators may be used from different threads at the same time.
    """
    with registry:
        lock = locks.get(comm)
        if lock is None:
            lock = locks[comm] = threading.Lock()
    return lock


def busy_error(comm: object, call: str, rank: int) -> CommError:
    """The error of a call on a communicator another thread is using (see lock_of)."""
    name = comm.backend_name() if hasattr(comm, "backend_name") else type(comm).__name__
    return CommError(
        f"[rank {rank}] {call}: the communicator ({name}) is in use by another thread; a "
        "communicator runs one compressed call at a time (give each thread its own process "
        "group or communicator)",
        call,
        name,
        0,
        rank,
    )


# torch's raw current-stream getter (an int, no Stream object) where this torch build has it.
raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(device: torch.device) -> int:
    """The handle of torch's current CUDA stream on ``device``."""
    if raw_stream is not None and device.index is not None:
        return raw_stream(device.index)
    return torch.cuda.current_stream(device).cuda_stream


def stream_of(t: torch.Tensor) -> int:
    """The ``stream`` argument of a collective on ``t``: torch's current stream of its device
    (the work that made ``t`` and the work that reads the result are ordered on it), 0 on the
    host."""
    return current_stream(t.device) if t.is_cuda else 0


layouts: dict = {}  # (padded, world, cuda) -> workspace bytes


def layout_total(padded: int, world: int, cuda: bool) -> int:
    """Workspace bytes of one compressed call (``_C.compressed_allreduce_layout``'s total), cached."""
    key = (padded, world, cuda)
    total = layouts.get(key)
    if total is None:
        total = _C.compressed_allreduce_layout(padded, world, cuda)["total"]
        layouts[key] = total
    return total
