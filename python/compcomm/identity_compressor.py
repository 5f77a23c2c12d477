"""The full-precision twin of the 1-bit compressor (re-exported by :mod:`compcomm.compress`)."""

from __future__ import annotations

from typing import Any, Callable, Dict, Hashable, List, Mapping, Sequence, Tuple

import torch

from . import _C
from ._bucketing import all_finite
from ._buffers import buffer_of
from ._scratch import stream_of
from ._defaults import DEFAULT_TIMEOUT
from .errors import NonFiniteError

__all__ = ["IdentityCompressor"]



class IdentityCompressor:
    """Full-precision average (fp32 sum all-reduce times ``1/W``), with no error feedback.

    The uncompressed twin of :class:`OneBitCompressor` with the same interface: an optimizer built
    with ``compressor=IdentityCompressor`` runs its compressed phase on exact averages (1-bit
    Adam then is Adam with a variance frozen after ``freeze_step``), which separates what the
    compression does from what the rest of the algorithm does. No state: checkpoints hold no
    error buffers, and error buffers of a checkpoint are dropped on load.

    Parameters
    ----------
    comm : compcomm Communicator
        The group the average runs over.
    timeout : float
        Seconds each all-reduce may wait for peers.
    """

    #: :meth:`average_` stages every bucket before it sends anything
    stages_ahead = True

    def __init__(self, comm: _C.Communicator, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.comm = comm
        self.timeout = float(timeout)
        self._recv: Dict[Hashable, torch.Tensor] = {}  # exchanged reduce-scatter chunks, by bucket

    def average_(self, keys: Sequence[Hashable], numels: Sequence[int],
                 stage: Callable[[int], torch.Tensor], device: torch.device) -> None:
        """Average the buckets ``stage(0), stage(1), ...`` in place on every rank (see
        :meth:`OneBitCompressor.average_`; one rank: the buckets keep their values).

        A non-finite value on any rank makes the sums non-finite on every rank, so every rank
        raises :class:`~compcomm.errors.NonFiniteError` (only the buckets were written).
        """
        world = self.comm.size()
        buckets = [stage(i) for i in range(len(keys))]
        if world == 1:
            return
        for t in buckets:  # synchronous, as the optimizers' warm-up average
            self.comm.all_reduce(buffer_of(t), _C.ReduceOp.sum, self.timeout, stream_of(t))
        if not all_finite(buckets):
            raise NonFiniteError(f"[rank {self.comm.rank()}] IdentityCompressor: non-finite "
                                 "values on some rank", "average_", "", 0, self.comm.rank())
        inv = 1.0 / world
        for t in buckets:
            t.mul_(inv)

    def reduce_scatter_(self, key: Hashable, tensor: torch.Tensor, out: torch.Tensor) -> None:
        """Full-precision reduce-scatter: this rank's chunk of the average of ``tensor`` (``P``
        fp32 elements, ``P = world * out.numel()``) into ``out`` (the sum times ``1/W``)."""
        self.comm.reduce_scatter(buffer_of(tensor), buffer_of(out), _C.ReduceOp.sum, self.timeout,
                                 stream_of(out))
        out.mul_(1.0 / self.comm.size())

    def reduce_scatter_exchange(self, key: Hashable, tensor: torch.Tensor, out: torch.Tensor,
                                async_comm: Any) -> Any:
        """Queue on ``async_comm`` the reduce-scatter of :meth:`reduce_scatter_` into a scratch
        chunk of bucket ``key`` (``out`` is written by :meth:`reduce_scatter_commit`)."""
        recv = self._recv.get(key)
        if recv is None or recv.numel() != out.numel() or recv.device != out.device:
            recv = self._recv[key] = torch.empty_like(out)
        return async_comm.reduce_scatter(buffer_of(tensor), buffer_of(recv),
                                         timeout_s=self.timeout, stream=stream_of(recv))

    def reduce_scatter_commit(self, key: Hashable, tensor: torch.Tensor, out: torch.Tensor,
                              gate: bool = True) -> None:
        """``out`` = the exchanged chunk times ``1/W`` (``gate``: unused, nothing is cancellable)."""
        torch.mul(self._recv[key], 1.0 / self.comm.size(), out=out)

    def keys(self) -> List[Hashable]:
        """No bucket has state."""
        return []

    def reset(self) -> None:
        """Nothing to forget (the reduce-scatter scratch is freed)."""
        self._recv.clear()

    def zero_(self) -> None:
        """Nothing to zero."""

    def nbytes(self) -> Tuple[int, int]:
        """(0, scratch bytes of the exchanged reduce-scatters): no error buffers."""
        return 0, sum(t.numel() * t.element_size() for t in self._recv.values())

    def state_dict(self) -> Dict[Hashable, Dict[str, torch.Tensor]]:
        """``{}``: nothing to save."""
        return {}

    def load_state_dict(self, state: Mapping[Hashable, Mapping[str, torch.Tensor]]) -> None:
        """Drop ``state`` (error buffers of a compressing run mean nothing here)."""

    def close(self) -> None:
        """Nothing to stop."""
