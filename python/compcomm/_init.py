"""``compcomm.init``/``shutdown``: choose the communicator that ``group=None`` means.

A process started by ``mpirun`` needs only ``compcomm.init("mpi")``: no ``torch.distributed``
initialisation. Each backend is one factory in ``_FACTORIES``; adding a backend means adding a
factory (see :func:`register_backend`).
"""

from __future__ import annotations

import atexit
from typing import Any, Callable, Dict, List, Optional

import torch.distributed as dist

from . import _C, _nccl
from ._comm import (TorchCommunicator, group_communicators, process_group, resolve,
                    set_default_communicator)
from ._defaults import DEFAULT_TIMEOUT
from .errors import UnsupportedError

__all__ = ["init", "shutdown", "make_communicator", "register_backend", "build_info",
           "available_backends"]

Factory = Callable[[Optional[bool], Any, float], _C.Communicator]

_FACTORIES: Dict[str, Factory] = {}
_atexit_registered = False


def register_backend(name: str, factory: Factory) -> None:
    """Make ``init(backend=name)`` call ``factory(cuda_aware, comm, timeout_s)``."""
    _FACTORIES[name] = factory


def _mpi_handle(comm: Any) -> Optional[int]:
    """The integer MPI_Comm handle of ``comm`` (None, an int, or an mpi4py communicator)."""
    if comm is None:
        return comm
    if isinstance(comm, int) and not isinstance(comm, bool):
        # Open MPI's handles are pointers, MPICH's have high bits set: a small integer is a Fortran
        # handle (mpi4py's py2f()) or a mistake, and MPI would abort the job on it
        if not 1 << 16 <= comm < 1 << 64:
            raise ValueError(
                f"init: argument 'comm' = {comm} is not an MPI_Comm handle (a small integer is a "
                "Fortran handle, e.g. from py2f()); pass the mpi4py communicator itself")
        return comm
    if type(comm).__module__.startswith("mpi4py"):
        from mpi4py import MPI

        theirs = MPI.Get_library_version().splitlines()[0].strip().rstrip(",")
        ours = _C.mpi_library_version()
        if theirs.split(",")[0] != ours.split(",")[0]:  # a handle of another MPI would be garbage
            raise UnsupportedError(
                f"init: mpi4py uses '{theirs}' but compcomm was built against '{ours}'; "
                "their communicators cannot be shared",
                "init",
                "mpi",
            )
        if comm == MPI.COMM_NULL:
            raise ValueError("init: argument 'comm' is MPI.COMM_NULL (this process is not in it)")
        return int(MPI._handleof(comm))
    raise TypeError(
        "init: argument 'comm' must be None (MPI_COMM_WORLD), an mpi4py communicator or an integer "
        f"MPI_Comm handle for backend='mpi', got {type(comm).__name__}"
    )


def _make_mpi(cuda_aware: Optional[bool], comm: Any, timeout_s: float) -> _C.Communicator:
    if not hasattr(_C, "MpiCommunicator"):
        raise UnsupportedError(
            "init: backend='mpi' needs compcomm built with MPI (build_info()['mpi'] is False: no MPI "
            "library was found at build time, or it was built with -DCOMPCOMM_WITH_MPI=OFF)",
            "init",
            "mpi",
        )
    return _C.MpiCommunicator(_mpi_handle(comm), cuda_aware, timeout_s)


def _make_torch(cuda_aware: Optional[bool], comm: Any, timeout_s: float) -> _C.Communicator:
    # cuda_aware is an MPI notion; torch's process groups handle device memory themselves.
    pg = process_group(comm, "init")
    if dist.get_backend(pg) != "nccl":  # the adapter group=pg already means: one per group, so
        return resolve(pg)  # that users of the group see each other (compcomm.is_shared)
    return TorchCommunicator(pg)  # resolve would make a native NCCL one


def _make_local(cuda_aware: Optional[bool], comm: Any, timeout_s: float) -> _C.Communicator:
    return _C.LocalCommunicator()


def _make_nccl(cuda_aware: Optional[bool], comm: Any, timeout_s: float) -> _C.Communicator:
    # comm: a torch.distributed process group, an mpi4py communicator or None (see _nccl.py).
    if not _C.build_info()["nccl"]:
        raise UnsupportedError(
            "init: backend='nccl' needs compcomm's native NCCL communicator, which this build does "
            "not have (no CUDA toolkit or nccl.h at build time); use backend='torch' over a "
            "torch.distributed 'nccl' process group instead",
            "init",
            "nccl",
        )
    return _nccl.make_nccl_communicator(comm, timeout=timeout_s)


register_backend("mpi", _make_mpi)
register_backend("torch", _make_torch)
register_backend("local", _make_local)
register_backend("nccl", _make_nccl)


def make_communicator(
    backend: str = "mpi",
    cuda_aware: Optional[bool] = None,
    comm: Any = None,
    *,
    timeout: float = DEFAULT_TIMEOUT,
) -> _C.Communicator:
    """A new Communicator of the given backend (not made the default; see :func:`init`).

    Parameters
    ----------
    backend : {"mpi", "torch", "nccl", "local"}
        ``"mpi"``: compcomm's MPI communicator; ``"torch"``: a ``torch.distributed`` process group
        (``comm``, default the world group); ``"nccl"``: the native NCCL communicator (when built);
        ``"local"``: a world of one rank.
    cuda_aware : bool or None
        MPI only. ``None`` detects (``MPIX_Query_cuda_support``); ``True`` passes CUDA device
        pointers to MPI and raises :class:`~compcomm.errors.UnsupportedError` if the MPI is not
        CUDA-aware; ``False`` stages device buffers through pinned host memory. Ignored by the
        other backends.
    comm : mpi4py communicator, int, ProcessGroup or None
        MPI: an ``mpi4py.MPI.Comm`` (or its integer handle) to duplicate, default
        ``MPI_COMM_WORLD``. torch: the process group, default the world group.
    timeout : float
        Seconds the MPI communicator's creation (a collective ``MPI_Comm_idup``) may wait.

    Returns
    -------
    compcomm.Communicator

    Raises
    ------
    ValueError, TypeError
        Unknown ``backend``, or ``cuda_aware``/``comm`` of the wrong kind.
    compcomm.errors.UnsupportedError
        The backend is not built in, or ``cuda_aware=True`` with an MPI that is not CUDA-aware.
    """
    if not isinstance(backend, str) or backend not in _FACTORIES:
        raise ValueError(f"init: argument 'backend' must be one of {sorted(_FACTORIES)}, got {backend!r}")
    if cuda_aware is not None and not isinstance(cuda_aware, bool):
        raise TypeError(f"init: argument 'cuda_aware' must be True, False or None, got {cuda_aware!r}")
    if not timeout > 0:
        raise ValueError(f"init: argument 'timeout' must be positive, got {timeout}")
    return _FACTORIES[backend](cuda_aware, comm, float(timeout))


def init(
    backend: str = "mpi",
    cuda_aware: Optional[bool] = None,
    comm: Any = None,
    *,
    timeout: float = DEFAULT_TIMEOUT,
) -> _C.Communicator:
    """Create a communicator and make it the default (what ``group=None`` means everywhere).

    After ``mpirun -np N python train.py``, ``compcomm.init("mpi")`` is all the set-up needed:
    ``compcomm.compressed_allreduce(t, we, se)`` then runs over MPI, with no
    ``torch.distributed`` process group. Calling ``init`` again replaces the default.
    Arguments as in :func:`make_communicator`.

    Returns
    -------
    compcomm.Communicator
        The new default communicator (``.rank()``, ``.size()``; MPI: ``.cuda_aware``).

    Examples
    --------
    >>> import compcomm                                        # doctest: +SKIP
    >>> comm = compcomm.init(backend="mpi", cuda_aware=False)  # doctest: +SKIP
    >>> from mpi4py import MPI                                 # doctest: +SKIP
    >>> half = MPI.COMM_WORLD.Split(MPI.COMM_WORLD.rank % 2)   # doctest: +SKIP
    >>> comm = compcomm.init(backend="mpi", comm=half)         # doctest: +SKIP
    """
    global _atexit_registered
    new = make_communicator(backend, cuda_aware, comm, timeout=timeout)
    _shutdown(keep=new)
    set_default_communicator(new)
    if not _atexit_registered:  # drop the communicator before MPI is finalized at exit
        atexit.register(shutdown)
        _atexit_registered = True
    return new


def shutdown() -> None:
    """Forget the communicator made by :func:`init`.

    ``group=None`` then means torch's default process group again (or a world of one rank).
    The MPI communicator is freed once nothing else refers to it; MPI itself stays initialised
    (compcomm finalizes it at exit if compcomm initialised it). Native NCCL communicators made by
    :func:`init` or ``make_nccl_communicator`` are destroyed (ncclCommFinalize/Destroy; aborted if
    their work does not finish); those made for torch process groups passed as ``group=`` (or
    for ``group=None`` over torch's world) stay: they go with their group, or at exit.
    """
    _shutdown(keep=None)


def _shutdown(keep: Optional[_C.Communicator]) -> None:
    set_default_communicator(None)  # only init() sets one
    if _C.build_info()["nccl"]:  # those group= arguments use stay: optimizers hold them
        _nccl.shutdown_nccl(keep=[c for c in (keep,) if c is not None] + group_communicators())


def build_info() -> Dict[str, Any]:
    """What this build of compcomm contains.

    Returns
    -------
    dict
        ``cuda``, ``nccl``, ``mpi`` (bool: compiled in), ``cuda_version``, ``nccl_version``,
        ``mpi_version`` (str or None), ``version``, ``compiler``, plus at run time ``torch_version``
        and ``cuda_devices`` (CUDA devices visible now).
    """
    import torch

    info = dict(_C.build_info())
    info["torch_version"] = torch.__version__
    info["cuda_devices"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return info


def available_backends() -> List[str]:
    """Backends usable in this process: ``"local"`` always; ``"torch"`` when torch.distributed is
    available; ``"mpi"`` and ``"nccl"`` when compiled in (and, for nccl, a GPU is visible)."""
    import torch
    import torch.distributed as dist

    info = build_info()
    names = ["local"]
    if dist.is_available():
        names.append("torch")
    if info["mpi"]:
        names.append("mpi")
    if info["nccl"] and torch.cuda.is_available():
        names.append("nccl")
    return names
