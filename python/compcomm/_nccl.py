"""Bootstrap of the native NCCL communicator (what ``compcomm.init(backend="nccl")`` uses).

Rank 0 of the group creates an ``ncclUniqueId`` (128 bytes) and shares it with the other ranks, over
the existing ``torch.distributed`` process group (``broadcast_object_list``, so torchrun works
unchanged) or, when the job was started by ``mpirun`` without torch.distributed, with mpi4py's
``bcast``. One communicator is made per (group, device), cached, and destroyed by
:func:`shutdown_nccl` (registered with ``atexit``).
"""

from __future__ import annotations

import atexit
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from . import _C
from ._defaults import DEFAULT_TIMEOUT
from .errors import UnsupportedError

__all__ = ["load_nccl", "make_nccl_communicator", "nccl_library_candidates", "shutdown_nccl"]

_MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")
_LOCAL_RANK_ENV = (
    "LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "MV2_COMM_WORLD_LOCAL_RANK",
)

# key -> (the object the key's id() belongs to, the communicator); holding the object keeps its id
# from being reused while the entry exists.
_cache: Dict[Tuple[str, int, int, bool], Tuple[Any, Any]] = {}
_atexit_registered = False


def nccl_library_candidates() -> List[str]:
    """Paths of libnccl.so.2 shipped with Python packages (the nvidia-nccl-cu* wheel torch uses)."""
    paths = []
    try:
        import nvidia.nccl  # namespace package of the nvidia-nccl-cu* wheels

        paths += [os.path.join(d, "lib", "libnccl.so.2") for d in nvidia.nccl.__path__]
    except ImportError:
        pass
    try:
        import torch

        paths.append(os.path.join(os.path.dirname(torch.__file__), "lib", "libnccl.so.2"))
    except ImportError:
        pass
    return [p for p in paths if os.path.exists(p)]


def load_nccl() -> str:
    """Load the NCCL library (once) and return its path.

    The copy already in the process (torch's) is preferred, then the wheel's, then the system's;
    ``$COMPCOMM_NCCL_LIBRARY`` overrides all.

    Raises
    ------
    compcomm.errors.UnsupportedError
        This build has no NCCL communicator, or no libnccl.so.2 could be loaded.
    """
    if not _C.build_info()["nccl"]:
        raise UnsupportedError(
            "this build of compcomm has no NCCL communicator (the CUDA toolkit or nccl.h was not "
            "found when it was built)",
            "load",
            "nccl",
        )
    import torch  # noqa: F401  (a CUDA build of torch loads its libnccl.so.2: reuse that copy)

    return _C.nccl.load(nccl_library_candidates())


def _device_index(device: Union[None, int, str, Any]) -> int:
    import torch

    if not torch.cuda.is_available():
        raise UnsupportedError(
            "backend 'nccl': the NCCL communicator needs a CUDA device; none is visible",
            "init",
            "nccl",
        )
    if device is None:
        for name in _LOCAL_RANK_ENV:  # torchrun / mpirun: one GPU per local rank
            if os.environ.get(name, "").isdigit():
                return int(os.environ[name]) % torch.cuda.device_count()
        return torch.cuda.current_device()
    d = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if d.type != "cuda":
        raise ValueError(
            f"make_nccl_communicator: argument 'device' must be a CUDA device, got {device}"
        )
    index = d.index if d.index is not None else torch.cuda.current_device()
    if not 0 <= index < torch.cuda.device_count():
        raise ValueError(
            f"make_nccl_communicator: argument 'device' is cuda:{index} but only "
            f"{torch.cuda.device_count()} CUDA device(s) are visible"
        )
    return index


def _is_mpi_comm(obj: Any) -> bool:
    return all(hasattr(obj, a) for a in ("Get_rank", "Get_size", "bcast"))


def _bootstrap(
    group: Any, device: int
) -> Tuple[str, Any, int, int, Callable[[Optional[bytes]], bytes]]:
    """(kind, key object, rank, size, share) for a group argument; share(id on rank 0) -> id everywhere."""
    import torch
    import torch.distributed as dist

    if group is not None and _is_mpi_comm(group):
        mpi = group
        return "mpi", mpi, mpi.Get_rank(), mpi.Get_size(), lambda uid: mpi.bcast(uid, root=0)
    if group is not None or (dist.is_available() and dist.is_initialized()):
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "make_nccl_communicator: argument 'group' is a process group but torch.distributed "
                "is not initialized"
            )
        pg = group if group is not None else dist.group.WORLD
        rank, size = dist.get_rank(pg), dist.get_world_size(pg)
        src = dist.get_global_rank(pg, 0) if group is not None else 0
        obj_device = torch.device("cuda", device) if dist.get_backend(pg) == "nccl" else None

        def share_torch(uid: Optional[bytes]) -> bytes:
            box = [uid]
            dist.broadcast_object_list(box, src=src, group=group, device=obj_device)
            return box[0]

        return "torch", pg, rank, size, share_torch
    if any(name in os.environ for name in _MPI_ENV):
        try:
            from mpi4py import MPI
        except ImportError as e:
            raise UnsupportedError(
                "launched by mpirun without torch.distributed: the NCCL bootstrap needs mpi4py "
                f"({e}); or call torch.distributed.init_process_group() first",
                "init",
                "nccl",
            ) from e
        mpi = MPI.COMM_WORLD
        return "mpi", mpi, mpi.Get_rank(), mpi.Get_size(), lambda uid: mpi.bcast(uid, root=0)
    return "single", None, 0, 1, lambda uid: uid  # one process, no launcher: a world of one rank


def make_nccl_communicator(
    group: Any = None,
    device: Union[None, int, str, Any] = None,
    *,
    timeout: Optional[float] = None,
    blocking: Optional[bool] = None,
) -> "_C.NcclCommunicator":
    """The native NCCL communicator of ``group`` on ``device`` (created once, then cached).

    Collective: every rank of the group must call it (the first time for this group and device).
    The unique id travels over ``group`` (with its timeout); NCCL's own initialization then waits
    for all ranks (bounded by ``timeout`` only for a non-blocking communicator).

    Parameters
    ----------
    group : torch.distributed.ProcessGroup, mpi4py communicator or None
        Whose ranks form the communicator. ``None``: torch's default group when torch.distributed is
        initialized, else ``MPI.COMM_WORLD`` when launched by mpirun, else a world of one rank.
    device : int, str or torch.device, optional
        The CUDA device of this rank. Default: the local rank given by the launcher ($LOCAL_RANK,
        $OMPI_COMM_WORLD_LOCAL_RANK) modulo the visible devices, else the current device.
    timeout : float, optional
        Seconds to wait for all ranks to join (default ``compcomm.DEFAULT_TIMEOUT``).
    blocking : bool, optional
        Blocking NCCL communicator (the default: kernels are launched by the calling thread, the
        fastest and what CUDA graph capture expects) or non-blocking (``False``: NCCL launches each
        call from a helper thread and compcomm polls it; slower). ``$COMPCOMM_NCCL_BLOCKING=0``
        changes the default. Both modes time out on a dead peer (the watchdog aborts).

    Returns
    -------
    compcomm._C.NcclCommunicator
        A Communicator for CUDA tensors on ``device``; pass it as ``group=`` to the collectives.

    Raises
    ------
    compcomm.errors.UnsupportedError
        No NCCL in this build, no libnccl.so.2, or no CUDA device.
    compcomm.errors.BackendError, compcomm.errors.CommTimeoutError
        NCCL failed to create the communicator, or the ranks did not all join in time.
    """
    timeout_s = DEFAULT_TIMEOUT if timeout is None else float(timeout)
    if not timeout_s > 0:
        raise ValueError(
            f"make_nccl_communicator: argument 'timeout' must be positive, got {timeout}"
        )
    if blocking is None:
        blocking = os.environ.get("COMPCOMM_NCCL_BLOCKING", "1") != "0"
    load_nccl()
    dev = _device_index(device)
    kind, key_obj, rank, size, share = _bootstrap(group, dev)
    key = (kind, id(key_obj), dev, bool(blocking))
    entry = _cache.get(key)
    if entry is not None and entry[0] is key_obj and not entry[1].closed:
        return entry[1]
    uid = share(_C.nccl.unique_id() if rank == 0 else None)
    comm = _C.NcclCommunicator(uid, rank, size, dev, timeout_s, bool(blocking))
    forget_closed()
    _cache[key] = (key_obj, comm)
    _register_atexit()
    return comm


def shutdown_nccl(timeout: float = 30.0, keep: Sequence[Any] = ()) -> int:
    """Destroy every cached NCCL communicator but those in ``keep`` (each waits at most ``timeout``
    s for its pending work, then aborts).

    Returns how many were destroyed. Safe to call more than once; registered with ``atexit``;
    ``compcomm.shutdown()`` calls it (keeping those that ``group=`` arguments use, see there).
    """
    kept = {id(c) for c in keep}
    doomed = [k for k, (_, c) in _cache.items() if id(c) not in kept]
    comms = [_cache.pop(k)[1] for k in doomed]
    for c in comms:
        c.destroy(timeout)
    return len(comms)


def forget_closed() -> None:
    """Drop the cache's closed communicators (destroyed, or aborted after an error), and with them
    the groups they were made from."""
    for key in [k for k, (_, c) in _cache.items() if c.closed]:
        del _cache[key]


def _register_atexit() -> None:
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(shutdown_nccl)
        _atexit_registered = True
