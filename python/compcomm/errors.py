"""The compcomm error family.

Every error raised by a collective carries the failing ``call``, the ``backend`` (``"torch:gloo"``,
``"mpi"``, ``"nccl"``, ``"cuda"``...), the backend's ``code`` and the ``rank`` that raised it. Bad
arguments raise the built-in ``TypeError``/``ValueError`` with a message naming the argument and rank.
All classes pickle, so a rank's error can be re-raised in a parent process.
"""

from __future__ import annotations

__all__ = [
    "CommError",
    "BackendError",
    "CommTimeoutError",
    "RankMismatchError",
    "NonFiniteError",
    "UnsupportedError",
]


class CommError(RuntimeError):
    """Base class of compcomm's errors."""

    def __init__(
        self, message: str, call: str = "", backend: str = "", code: int = 0, rank: int = -1
    ) -> None:
        super().__init__(message)
        self.message = message
        self.call = call
        self.backend = backend
        self.code = code
        self.rank = rank

    def __reduce__(self):  # keeps the fields when pickled across processes
        return (type(self), (self.message, self.call, self.backend, self.code, self.rank))


class BackendError(CommError):
    """The communication library (torch process group, MPI, NCCL, CUDA) reported a failure."""


class CommTimeoutError(CommError, TimeoutError):
    """A collective did not complete within its timeout (a peer died, hung or never called)."""


class RankMismatchError(CommError, ValueError):
    """Ranks called the same collective with different sizes or dtypes."""


class NonFiniteError(CommError, ValueError):
    """An input (tensor plus worker error) held NaN or Inf on some rank; nothing was changed."""


class UnsupportedError(CommError, NotImplementedError):
    """This build or machine lacks what the call needs (CUDA kernels, NCCL, MPI)."""
