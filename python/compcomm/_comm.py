"""Communicators: the torch.distributed adapter and how a ``group`` argument picks one."""

from __future__ import annotations

import atexit
import datetime
import os
import warnings
from typing import Any, Callable, List, NoReturn, Optional, Tuple, Union

import torch.distributed as dist

from . import _C, _nccl
from ._buffers import tensor_of
from .errors import BackendError, CommTimeoutError, UnsupportedError

# torch 2.13 renamed the tensor forms of all_gather/reduce_scatter; older releases have only these.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_OPS = {
    _C.ReduceOp.sum: dist.ReduceOp.SUM,
    _C.ReduceOp.max: dist.ReduceOp.MAX,
    _C.ReduceOp.min: dist.ReduceOp.MIN,
}


# Words of the transport's failures (gloo/NCCL/the store): a peer or connection is gone.
_TRANSPORT_WORDS = ("imed out", "imeout", "onnection", "peer", "closed", "reset", "roken pipe",
                    "abort", "eof", "unreachable")


def _transport_failure(e: Exception) -> bool:
    """Whether ``e``, raised while starting a collective, says the group's transport failed (as
    opposed to the backend refusing this call's arguments)."""
    if isinstance(e, getattr(dist, "DistError", ())):  # DistBackendError, DistNetworkError, ...
        return True
    text = str(e).lower()
    return any(w.lower() in text for w in _TRANSPORT_WORDS)


class TorchCommunicator(_C.Communicator):
    """Any ``torch.distributed`` process group (gloo on CPU, nccl on GPU) as a compcomm Communicator.

    The C++ algorithms call back into this class for each collective; every call runs
    asynchronously and is waited on with the call's timeout, so a dead peer raises
    :class:`~compcomm.errors.CommTimeoutError` instead of hanging.

    Parameters
    ----------
    group : torch.distributed.ProcessGroup, optional
        The group to communicate over; ``None`` is the default (world) group.
    """

    def __init__(self, group: Optional[Any] = None) -> None:
        _C.Communicator.__init__(self)
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("TorchCommunicator needs torch.distributed.init_process_group() first")
        # The group object itself, not None: after destroy_process_group() and a new world, this
        # communicator must refuse (its rank and size are the old world's), not use the new one.
        self.group = process_group(group, "TorchCommunicator")
        self._rank = dist.get_rank(self.group)
        self._size = dist.get_world_size(self.group)
        self._name = f"torch:{dist.get_backend(self.group)}"
        # The first failed collective's error type and text: the group is then unusable (a peer is
        # gone, or an op is left half-run on some ranks), and every later call raises at once.
        self._failed: Optional[Tuple[type, str]] = None

    @property
    def broken(self) -> Optional[str]:
        """Why this communicator's process group is unusable (a collective over it failed or timed
        out, or its transport failed while one started), or None while it works. The backend
        refusing a call's arguments (dtype, size) raises but leaves it usable. Once set, every
        call raises at once."""
        return None if self._failed is None else self._failed[1]

    def _ensure_usable(self, call: str) -> None:
        if self._failed is None and not _is_live(self.group):
            self._failed = (BackendError, "its process group was destroyed "
                            "(torch.distributed.destroy_process_group)")
        if self._failed is not None:
            cls, text = self._failed
            raise cls(
                f"[rank {self._rank}] {call} over {self._name}: the process group failed in an "
                f"earlier call ({text}); it cannot be used again: create a new process group",
                call,
                self._name,
                0,
                self._rank,
            )

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def backend_name(self) -> str:
        return self._name

    def _run(self, call: str, opts: _C.CallOptions, device: bool, start: Callable[[], Any]) -> None:
        """Start one collective (``start()`` returns its work) and wait for it, mapping a failure
        of either to a typed error. A failed wait, or a transport failure at the start, marks
        this communicator broken; the backend refusing the arguments does not."""
        self._ensure_usable(call)
        # timedelta holds at most ~8.6e13 s (not inf): longer is forever; converted before the
        # collective starts, so that no conversion error can leave it unwaited
        wait = datetime.timedelta(seconds=min(opts.timeout_s, _FOREVER_S))
        try:
            work = start()
        except (TypeError, ValueError):  # a rejected argument: the group itself is still fine
            raise
        except Exception as e:
            # e.g. gloo refusing to start on a pair a dead peer closed: the group is gone; a
            # local refusal (a dtype or op the backend lacks) leaves it usable
            self._failed_with(call, e, broken=_transport_failure(e))
        try:
            if device:
                # CUDA buffers: make the caller's (current) stream wait for the collective, without
                # blocking the host -- with a timeout, ProcessGroupNCCL's wait() would spin on the
                # host until completion. The process group's own timeout (watchdog) still applies.
                work.wait()
            else:
                work.wait(timeout=wait)
        except Exception as e:  # torch raises RuntimeError (or DistBackendError) for both cases
            self._failed_with(call, e)

    def _failed_with(self, call: str, e: Exception, broken: bool = True) -> NoReturn:
        """Raise ``e`` as a typed error; the first such failure with ``broken`` marks the group
        unusable."""
        text = str(e)
        cls = CommTimeoutError if "imed out" in text or "imeout" in text else BackendError
        if broken and self._failed is None:
            self._failed = (cls, f"{call}: {text.splitlines()[0] if text else type(e).__name__}")
        raise cls(
            f"[rank {self._rank}] {call} over {self._name} failed: {text}",
            call,
            self._name,
            0,
            self._rank,
        ) from e

    def do_all_to_all(self, send: _C.Buffer, recv: _C.Buffer, opts: _C.CallOptions) -> None:
        self._run("all_to_all", opts, send.device >= 0, lambda: dist.all_to_all_single(
            tensor_of(recv), tensor_of(send), group=self.group, async_op=True))

    def do_all_gather(self, send: _C.Buffer, recv: _C.Buffer, opts: _C.CallOptions) -> None:
        self._run("all_gather", opts, send.device >= 0, lambda: _all_gather(
            tensor_of(recv), tensor_of(send), group=self.group, async_op=True))

    def do_reduce_scatter(
        self, send: _C.Buffer, recv: _C.Buffer, op: _C.ReduceOp, opts: _C.CallOptions
    ) -> None:
        self._run("reduce_scatter", opts, send.device >= 0, lambda: _reduce_scatter(
            tensor_of(recv), tensor_of(send), op=_OPS[op], group=self.group, async_op=True))

    def do_all_reduce(self, buf: _C.Buffer, op: _C.ReduceOp, opts: _C.CallOptions) -> None:
        self._run("all_reduce", opts, buf.device >= 0, lambda: dist.all_reduce(
            tensor_of(buf), op=_OPS[op], group=self.group, async_op=True))

    def do_broadcast(self, buf: _C.Buffer, root: int, opts: _C.CallOptions) -> None:
        src = dist.get_global_rank(self.group, root)
        self._run("broadcast", opts, buf.device >= 0, lambda: dist.broadcast(
            tensor_of(buf), src=src, group=self.group, async_op=True))

    def do_barrier(self, opts: _C.CallOptions) -> None:
        self._run("barrier", opts, False, lambda: dist.barrier(group=self.group, async_op=True))


Group = Union[None, Any, _C.Communicator]

_FOREVER_S = 1e9  # about 31 years


def _live_groups() -> Optional[Any]:
    """torch's registry of live process groups (private; None on a torch without it)."""
    return getattr(getattr(getattr(dist, "distributed_c10d", None), "_world", None), "pg_map", None)


def _is_live(pg: Any) -> bool:
    live = _live_groups()
    return dist.is_initialized() if live is None else pg in live


def process_group(group: Optional[Any], call: str) -> Any:
    """``group`` (None: the world) as a live torch ProcessGroup that this process belongs to, or a
    TypeError/ValueError naming the argument ``group`` and this process's rank in the world."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{call}: a torch.distributed process group needs "
                           "torch.distributed.init_process_group() first")
    rank = dist.get_rank()
    pg = dist.group.WORLD if group is None else group
    if isinstance(pg, int) and pg == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"[rank {rank}] {call}: argument 'group': this process is not a member of that group "
            "(torch.distributed.new_group returns NON_GROUP_MEMBER on the ranks it leaves out)")
    if not isinstance(pg, dist.ProcessGroup):
        raise TypeError(
            f"[rank {rank}] {call}: argument 'group' must be None, a torch.distributed "
            f"ProcessGroup or a compcomm Communicator, got {type(pg).__name__}")
    if not _is_live(pg):
        raise ValueError(f"[rank {rank}] {call}: argument 'group' is a process group that "
                         "torch.distributed.destroy_process_group has destroyed")
    return pg

_local = _C.LocalCommunicator()
_default: Optional[_C.Communicator] = None
_torch_comms: dict = {}


def set_default_communicator(comm: Optional[_C.Communicator]) -> None:
    """Make ``comm`` what ``group=None`` means (``None`` restores the torch/local default)."""
    global _default
    _default = comm


def _native_nccl(group: Optional[Any]) -> Optional[_C.Communicator]:
    """compcomm's own NCCL communicator for a torch ``nccl`` process group, when this build has one
    (``$COMPCOMM_NATIVE_NCCL=0`` turns it off); None otherwise or if NCCL cannot be loaded here."""
    pg = group if group is not None else dist.group.WORLD
    if (os.environ.get("COMPCOMM_NATIVE_NCCL", "1") == "0" or not _C.build_info()["nccl"]
            or dist.get_backend(pg) != "nccl"):
        return None
    try:
        return _nccl.make_nccl_communicator(group)
    except UnsupportedError as e:  # e.g. no libnccl.so.2 here: the adapter still works
        warnings.warn(f"compcomm: native NCCL unavailable ({e}); using the torch adapter",
                      RuntimeWarning, stacklevel=3)
        return None


def resolve(group: Group) -> _C.Communicator:
    """The communicator for a ``group`` argument.

    ``None`` means: the communicator set by :func:`compcomm.init` if any, else torch's default
    process group if torch.distributed is initialized, else a world of one rank (no network).
    A ``torch.distributed`` process group gets a cached communicator: compcomm's native NCCL
    communicator for an ``nccl`` group (created once from the group: its unique id travels over
    it; CUDA tensors only, on the caller's stream) when the build has NCCL, else a
    :class:`TorchCommunicator`. The communicators of groups that
    ``torch.distributed.destroy_process_group`` has destroyed are dropped (native NCCL ones
    destroyed) when a communicator is next made for a group, when ``group=None`` finds no torch
    world, and at exit (the calls that find theirs cached pay nothing for it). A compcomm
    Communicator is used as it is.
    """
    if isinstance(group, _C.Communicator):
        return group
    if group is None:
        if _default is not None:
            return _default
        if not (dist.is_available() and dist.is_initialized()):
            if _torch_comms:  # the torch world is gone, and every group with it
                _drop_destroyed()
            return _local
    pg = dist.group.WORLD if group is None else group
    # the entry holds pg, so its id cannot be reused meanwhile
    entry = _torch_comms.get(id(pg)) if isinstance(pg, dist.ProcessGroup) else None
    if entry is None or entry[0] is not pg or getattr(entry[1], "closed", False):
        process_group(group, "group")  # a clear error for what is not a live group of ours
        _drop_destroyed()  # first those of groups destroyed since the last one was made
        entry = (pg, _native_nccl(group) or TorchCommunicator(group))
        _torch_comms[id(pg)] = entry
    return entry[1]


def _release(comms: List[_C.Communicator]) -> None:
    for c in comms:
        if hasattr(c, "destroy") and not c.closed:
            c.destroy(30.0)
    _nccl.forget_closed()  # its cache held them, and their process groups


def _drop_destroyed() -> None:
    """Drop the cached communicators of process groups that torch has destroyed
    (``destroy_process_group`` of one, or of all); native NCCL ones are destroyed."""
    live = _live_groups()  # a torch without it: only the whole world's end is seen
    if live is not None:
        dead = [k for k, (pg, _) in _torch_comms.items() if pg not in live]
    elif not dist.is_initialized():
        dead = list(_torch_comms)
    else:
        return
    if dead:
        _release([_torch_comms.pop(k)[1] for k in dead])


def wait_cancellable(comm: _C.Communicator, timeout: float) -> bool:
    """On a communicator that can cancel work it already enqueued (``abort_flag`` nonzero: native
    NCCL), wait at most ``timeout`` s for the device work of its collectives and raise the typed
    error of an abort (``CommTimeoutError``, ``BackendError``). A caller about to write state from
    what collectives received calls it first, so that a peer lost after the last host-side check
    raises before anything is written. No-op on other communicators (their calls complete or fail
    on the host). Returns True if it waited (the received data is then complete: the commits that
    follow pass ``gate=False``, so an abort during them cannot skip some buckets and not others)."""
    sync = getattr(comm, "synchronize", None)
    if sync is not None and comm.abort_flag:
        sync(timeout)
        return True
    return False


def group_communicators() -> List[_C.Communicator]:
    """The communicators cached for torch process groups (see :func:`resolve`)."""
    return [c for _, c in _torch_comms.values()]


def forget_process_groups() -> None:
    """Drop every communicator made for torch process groups; native NCCL ones are destroyed.
    (Those of destroyed groups also go by themselves, see :func:`resolve`; this drops the live
    ones too, as at exit.)"""
    comms = [c for _, c in _torch_comms.values()]
    _torch_comms.clear()
    _release(comms)


# The adapters hold their process groups; dropping them while the interpreter is still whole avoids
# destroying a gloo group during interpreter teardown (seen: "terminate called without an active
# exception" at exit after destroy_process_group()).
atexit.register(forget_process_groups)

