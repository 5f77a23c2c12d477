"""The public collectives: compressed_allreduce and the helpers that size its buffers."""

from __future__ import annotations

import math
import numbers
import weakref
from typing import Optional, Tuple, Union

import torch

from . import _C
from ._arguments import (check_autograd, check_disjoint, check_flag, check_float32_vector,
                         check_input, check_timeout, reject)
from ._buffers import DTYPES
from ._comm import Group, resolve
from ._defaults import DEFAULT_TIMEOUT
from ._scratch import busy_error as _busy
from ._scratch import current_stream as _current_stream
from ._scratch import layout_total as _layout_total
from ._scratch import lock_of as _lock
from ._scratch import per_device_of as _per_device_of
from ._scratch import workspace as _workspace
from ._scratch import workspaces as _workspaces  # noqa: F401  (tests and bench read it)

__all__ = [
    "compressed_allreduce",
    "compressed_reduce_scatter",
    "workspace_bytes",
    "error_buffers",
    "padded_numel",
    "wire_bytes",
    "allreduce_wire_bytes",
    "DEFAULT_TIMEOUT",
]


def padded_numel(numel: int, world_size: int) -> int:
    """Length of the worker error buffer for ``numel`` elements on ``world_size`` ranks.

    DeepSpeed's optimizer rule (ONEBIT_SPEC.md a.1): ``numel`` rounded up to a multiple of
    ``world_size * lcm(world_size, 8)``, so numerics match DeepSpeed's optimizers. Any multiple of
    ``8 * world_size`` that is ``>= numel`` is also accepted by :func:`compressed_allreduce`.
    """
    if numel < 0 or world_size < 1:
        raise ValueError(f"padded_numel: need numel >= 0 and world_size >= 1, got {numel}, {world_size}")
    unit = world_size * (world_size * 8 // math.gcd(world_size, 8))
    return -(-numel // unit) * unit


def error_buffers(
    numel_or_tensor: Union[int, torch.Tensor],
    group: Group = None,
    *,
    device: Optional[Union[str, torch.device]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Zero-filled ``(worker_error, server_error)`` for :func:`compressed_allreduce`.

    Parameters
    ----------
    numel_or_tensor : int or torch.Tensor
        The number of elements to compress, or the tensor itself (its numel and device are used).
    group : ProcessGroup, Communicator or None
        The group the allreduce runs over (its size sets the padding); see :func:`compressed_allreduce`.
    device : torch.device, optional
        Where to allocate; defaults to the tensor's device, else the CPU.

    Returns
    -------
    worker_error : torch.Tensor
        float32, shape ``(P,)`` with ``P = padded_numel(numel, world_size)``.
    server_error : torch.Tensor
        float32, shape ``(P // world_size,)``.
    """
    if isinstance(numel_or_tensor, torch.Tensor):
        numel = numel_or_tensor.numel()
        device = numel_or_tensor.device if device is None else device
    elif isinstance(numel_or_tensor, numbers.Integral) and not isinstance(numel_or_tensor, bool):
        numel = int(numel_or_tensor)
        if numel < 0:
            raise ValueError(f"error_buffers: argument 'numel_or_tensor' must be >= 0, got {numel}")
    else:
        raise TypeError("error_buffers: argument 'numel_or_tensor' must be a torch.Tensor or an "
                        f"int, got {type(numel_or_tensor).__name__}")
    world = resolve(group).size()
    p = padded_numel(numel, world)
    return (
        torch.zeros(p, dtype=torch.float32, device=device),
        torch.zeros(p // world, dtype=torch.float32, device=device),
    )


def wire_bytes(numel: int, world_size: int, padded: Optional[int] = None) -> int:
    """Bytes one rank sends in one :func:`compressed_allreduce` of ``numel`` elements.

    About ``2 (W-1)/W * P/8`` (packed signs both ways) plus 32 bytes of header and 16 bytes of scale
    per peer; ``padded`` defaults to :func:`padded_numel`.
    """
    p = padded_numel(numel, world_size) if padded is None else padded
    return _C.compressed_allreduce_wire_bytes(p, world_size)


def allreduce_wire_bytes(numel: int, world_size: int, element_size: int = 4) -> int:
    """Bytes one rank sends in a ring allreduce of ``numel`` elements: ``2 (W-1)/W * numel * size``."""
    return 2 * (world_size - 1) * numel * element_size // world_size


def workspace_bytes(padded: int, world: int, cuda: bool) -> int:
    """Bytes of scratch one compressed call of ``padded`` elements over ``world`` ranks needs
    (host or CUDA layout): what :func:`compressed_allreduce` and :func:`compressed_reduce_scatter`
    (and the 1-bit exchanges of the optimizers and ZeRO) allocate per communicator."""
    return _layout_total(padded, world, cuda)


def compressed_allreduce(
    tensor: torch.Tensor,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    group: Group = None,
    *,
    timeout: Optional[float] = None,
    check: bool = True,
) -> torch.Tensor:
    """Average ``tensor`` across ranks with DeepSpeed's 1-bit compression and error feedback.

    Every rank sends the signs of ``tensor + worker_error`` (1 bit per element) and one scale; each
    rank reduces one chunk, compresses it again with its ``server_error``, and the result -- one
    scale per chunk times the signs -- is written into ``tensor`` on every rank (identical on all).
    About 32x fewer bytes than an fp32 allreduce. Numerics: ONEBIT_SPEC.md section a.

    Parameters
    ----------
    tensor : torch.Tensor
        float32, float16 or bfloat16, contiguous, any shape, CPU (or CUDA when built with CUDA).
        Overwritten in place with the compressed average; must have the same numel on every rank.
    worker_error : torch.Tensor
        float32, 1-D, ``P`` elements with ``P >= tensor.numel()`` a multiple of ``8 * world_size``
        (see :func:`error_buffers`). Updated in place; keep it across calls (error feedback).
    server_error : torch.Tensor
        float32, 1-D, ``P // world_size`` elements. Updated in place.
    group : torch.distributed.ProcessGroup, compcomm Communicator or None
        ``None`` is the default group: the communicator from :func:`compcomm.init`, else torch's
        default process group, else a world of one rank (no process group needed).
    timeout : float, optional
        Seconds each collective step may wait for peers (default ``DEFAULT_TIMEOUT``). For CUDA
        tensors over a torch process group, collectives are stream-ordered and the process group's
        own timeout (its watchdog) applies instead.
    check : bool, default True
        CUDA tensors only (CPU tensors are always checked; it is free there). ``True`` copies every
        rank's 32-byte header to the host and validates it before anything is written: one small
        device-to-host copy and stream synchronization per call (a few microseconds, and it stops
        the host from running ahead of the GPU). In a world of one rank (a LocalCommunicator, or
        native NCCL with one rank and the tensor on its device) there is neither copy nor sync:
        the worker kernel posts its header to mapped host memory, the call waits for that alone
        (at most ``timeout`` seconds: ``CommTimeoutError``, nothing written), and it queues the
        commit only if the check passed; it returns while the GPU still runs the rest (stream
        ordered, as any CUDA op). ``False`` never synchronizes, so the call can be
        captured in a CUDA graph: sizes are still validated on the host the first time a (group,
        numel, padded size, dtype) is seen (so make that first call outside graph capture), and
        afterwards a call in which some rank's input is not finite raises nothing but leaves
        ``tensor`` and both errors unchanged on every rank (the commit kernels skip their writes).

    Returns
    -------
    torch.Tensor
        ``tensor`` itself.

    Raises
    ------
    TypeError, ValueError
        Wrong type, dtype, device, shape, contiguity or size of an argument, two arguments that
        share memory, or a ``tensor`` that requires grad while grad mode is on (the message names
        the argument and the rank). The rank still takes part in the call's first collective with
        a record saying it rejected its arguments, so its peers raise ``RankMismatchError`` at once.
    compcomm.errors.CommError
        Another thread is running a compressed call on the same communicator (one call at a time
        per communicator; different communicators may run concurrently from different threads).
    compcomm.errors.RankMismatchError
        Ranks passed different numels, padded sizes or dtypes, or another rank rejected its own
        arguments (raised on every rank that got past its own checks).
    compcomm.errors.NonFiniteError
        ``tensor + worker_error`` holds NaN/Inf on some rank, or (CPU tensors) a rank's
        ``server_error`` does or its server sum overflows (raised on every rank). On a GPU a
        non-finite ``server_error`` is not reported: the call then leaves all three buffers
        unchanged on every rank, as with ``check=False``.
    compcomm.errors.CommTimeoutError, compcomm.errors.BackendError
        A peer did not answer in time, or the communication library failed.

    On any error, ``tensor``, ``worker_error`` and ``server_error`` are left unchanged. The write
    is an in-place write for autograd (``tensor``'s version counter is bumped), so a graph that
    saved ``tensor`` raises at backward rather than use the overwritten values.
    """
    comm = resolve(group)
    try:  # what the checks depend on; an argument that is no plain tensor fails here
        key = (comm.id, _arg_key(tensor), _arg_key(worker_error), _arg_key(server_error))
        prep = _prepared.get(key)
    except Exception:  # then the checks themselves say what is wrong
        key = prep = None
    try:
        if prep is None:
            prep = _prepare_allreduce(comm, tensor, worker_error, server_error)
            if key is not None:
                if len(_prepared) >= _PREPARED_MAX:
                    _prepared.clear()
                _prepared[key] = prep
        timeout_s = DEFAULT_TIMEOUT if timeout is None else check_timeout(
            "compressed_allreduce", prep.rank, timeout)
        check_autograd("compressed_allreduce", prep.rank, tensor)  # not part of the cached key
        checked = check_flag("compressed_allreduce", prep.rank, "check", check) or not prep.cuda
    except (TypeError, ValueError) as e:
        reject(comm, tensor, timeout, e)
        raise
    # On torch's current stream of the tensor's device (the core switches to that device itself).
    stream = _current_stream(prep.device) if prep.cuda else 0
    if not prep.lock.acquire(blocking=False):
        raise _busy(comm, "compressed_allreduce", prep.rank)
    try:
        _C.compressed_allreduce(comm, prep.tensor, prep.worker_error, prep.server_error,
                                prep.workspace_buffer(comm), timeout_s, stream, checked)
    finally:
        prep.lock.release()
    torch.autograd.graph.increment_version(tensor)  # it was written in place: autograd must know
    return tensor


def _arg_key(t: torch.Tensor) -> tuple:
    """What compressed_allreduce's checks of one tensor argument depend on (AttributeError if
    ``t`` is no tensor)."""
    return (type(t), t.data_ptr(), t.numel(), t.dim(), t.dtype, t.is_contiguous(), t.device)


# Validated compressed_allreduce calls: (communicator id, _arg_key of each tensor) -> _Prepared
# (compressed_reduce_scatter's with a given out: the same keyed by its name and out too). A
# call whose key matches skips the checks and the Buffer construction, most of a small call's host
# time. Buffers hold no tensor (the key's addresses and sizes define them), so the cache keeps no
# memory alive; cleared when full. Dict reads and writes are atomic under the GIL.
_prepared: dict = {}
_PREPARED_MAX = 1024


class _Prepared:
    """One validated (communicator, tensor, worker_error, server_error): sizes and Buffers, the
    communicator's lock, a weak reference to its workspaces, and the Buffer of the workspace last
    used."""

    __slots__ = ("world", "rank", "cuda", "device", "tensor", "worker_error", "server_error",
                 "out", "total", "lock", "per_device", "ws_ref", "ws_buffer")

    def workspace_buffer(self, comm: object) -> _C.Buffer:
        """The communicator's workspace as a Buffer (grown if needed). Call it holding ``lock``."""
        per_device = self.per_device()
        if per_device is None:  # the cache of workspaces was dropped meanwhile
            per_device = _per_device_of(comm)
            self.per_device = weakref.ref(per_device)
        ws = per_device.get(self.device)
        if ws is None or ws.numel() < self.total:
            ws = _workspace(comm, self.device, self.total)
        if self.ws_ref is None or self.ws_ref() is not ws:
            self.ws_ref = weakref.ref(ws)
            self.ws_buffer = _C.Buffer(ws.data_ptr(), ws.numel(), DTYPES[torch.uint8], ws.get_device())
        return self.ws_buffer


def _raw_buffer(t: torch.Tensor) -> _C.Buffer:
    """A Buffer of ``t``'s memory that does not hold ``t`` (see _prepared)."""
    return _C.Buffer(t.data_ptr(), t.numel(), DTYPES[t.dtype], t.get_device())


def _prepare_allreduce(comm: object, tensor: object, worker_error: object,
                       server_error: object) -> _Prepared:
    """Every check of compressed_allreduce's tensor arguments (typed errors naming the argument
    and the rank), then what a call needs."""
    world, rank = comm.size(), comm.rank()
    padded = check_input("compressed_allreduce", comm, tensor, worker_error, server_error)
    check_disjoint("compressed_allreduce", rank, tensor=tensor, worker_error=worker_error,
                   server_error=server_error)
    return _prepared_of(comm, world, rank, tensor, worker_error, server_error, padded)


def _prepared_of(comm: object, world: int, rank: int, tensor: torch.Tensor,
                 worker_error: torch.Tensor, server_error: torch.Tensor, padded: int) -> _Prepared:
    """What a call with checked arguments needs (``out``: None, set by the reduce-scatter)."""
    p = _Prepared()
    p.world, p.rank, p.cuda, p.device = world, rank, tensor.device.type == "cuda", tensor.device
    p.tensor, p.worker_error = _raw_buffer(tensor), _raw_buffer(worker_error)
    p.server_error, p.out = _raw_buffer(server_error), None
    p.total = _layout_total(padded, world, p.cuda)
    p.lock = _lock(comm)
    p.per_device = weakref.ref(_per_device_of(comm))
    p.ws_ref = p.ws_buffer = None
    return p


# The compressed allreduce stopped before its final all-gather (ZeRO's momentum shards, FSDP2's
# gradient shards): every rank sends the packed signs of ``tensor + worker_error`` (chunk j to rank
# j) and its scale; rank r reduces chunk r, adds its server error and compresses that again. Rank
# r's result ``tau_r * s(c_r)`` is exactly chunk r of what compressed_allreduce returns, with the
# same updates of both errors; it sends about half the bytes (P/8 * (W-1)/W plus a header per peer).
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
        A bad argument, two arguments sharing memory, or a ``tensor`` or ``out`` that requires
        grad while grad mode is on (the message names them and the rank); as in
        :func:`compressed_allreduce` the peers then raise ``RankMismatchError``.
    compcomm.errors.CommError
        Another thread is running a compressed call on the same communicator.
    compcomm.errors.RankMismatchError, compcomm.errors.NonFiniteError
        As :func:`compressed_allreduce`, except for a non-finite server scale (a rank's
        ``server_error`` holds NaN/Inf): not raised, as only that rank sees it (raising there
        alone would leave its peers waiting in the caller's next exchange); that rank's ``out``
        and errors are left unchanged, the other ranks' are written.
    compcomm.errors.CommTimeoutError, compcomm.errors.BackendError
        A peer did not answer in time, or the communication library failed.

    Returns
    -------
    torch.Tensor
        ``out``: this rank's chunk (C elements, padding positions included) of the compressed
        average, identical to chunk r of :func:`compcomm.compressed_allreduce`'s result.
        ``tensor`` and ``out`` are written in place for autograd (version counters bumped).
    """
    comm = resolve(group)
    call = "compressed_reduce_scatter"
    key = prep = None
    if out is not None:  # a given out: the checks are cached as compressed_allreduce's are
        try:
            key = (call, comm.id, _arg_key(tensor), _arg_key(worker_error),
                   _arg_key(server_error), _arg_key(out))
            prep = _prepared.get(key)
        except Exception:  # then the checks themselves say what is wrong
            key = None
    try:
        if prep is None:
            prep, out = _prepare_reduce_scatter(comm, tensor, worker_error, server_error, out)
            if key is not None:
                if len(_prepared) >= _PREPARED_MAX:
                    _prepared.clear()
                _prepared[key] = prep
        timeout_s = check_timeout(call, prep.rank, timeout)
        # not part of the cached key (a cached call skips _prepare_reduce_scatter's checks)
        check_autograd(call, prep.rank, tensor)
        check_autograd(call, prep.rank, out, "out")
    except (TypeError, ValueError) as e:
        reject(comm, tensor, timeout, e)
        raise
    # on the caller's current stream (FSDP calls it on its reduce-scatter stream)
    stream = _current_stream(prep.device) if prep.cuda else 0
    if not prep.lock.acquire(blocking=False):  # the workspace is the communicator's
        raise _busy(comm, call, prep.rank)
    try:
        _C.zero.compressed_reduce_scatter(comm, prep.tensor, prep.worker_error, prep.server_error,
                                          prep.out, prep.workspace_buffer(comm), timeout_s, stream)
    finally:
        prep.lock.release()
    torch.autograd.graph.increment_version(tensor)  # both written in place: autograd must know
    torch.autograd.graph.increment_version(out)
    return out


def _prepare_reduce_scatter(comm: object, tensor: object, worker_error: object,
                            server_error: object, out: Optional[torch.Tensor]
                            ) -> Tuple[_Prepared, torch.Tensor]:
    """Every check of compressed_reduce_scatter's tensor arguments (``out`` allocated if None),
    then what a call needs."""
    call = "compressed_reduce_scatter"
    world, rank = comm.size(), comm.rank()
    padded = check_input(call, comm, tensor, worker_error, server_error)
    if out is None:
        out = torch.empty(padded // world, dtype=torch.float32, device=tensor.device)
    check_float32_vector(out, "out", rank, padded // world, tensor.device, call)
    check_disjoint(call, rank, tensor=tensor, worker_error=worker_error,
                   server_error=server_error, out=out)
    p = _prepared_of(comm, world, rank, tensor, worker_error, server_error, padded)
    p.out = _raw_buffer(out)
    return p, out
