"""The interface an optimizer needs from a compressor (:class:`Compressor`); the implementations
are in :mod:`compcomm.compress`."""

from __future__ import annotations

from typing import Any, Callable, Dict, Hashable, List, Mapping, Protocol, Sequence, Tuple

import torch

__all__ = ["Compressor"]


class Compressor(Protocol):
    """What an optimizer needs from a compressor (built as ``cls(comm)``: one per communicator).

    ``average_(keys, numels, stage, device)`` averages the buckets ``stage(0), stage(1), ...``
    (``numels[i]`` fp32 elements on ``device``) in place on every rank, all or nothing (an exception on one rank is raised on every rank and leaves every
    bucket's state unchanged); ``keys`` name the buckets whose state persists between calls.
    ``state_dict``/``load_state_dict`` carry that state for exact resume (``{key: {name:
    tensor}}``; empty for a stateless compressor); ``reset`` forgets it, ``zero_`` zeroes it;
    ``keys`` lists the buckets that have state; ``nbytes`` is (state bytes, workspace bytes);
    ``close`` releases threads. Optional: ``packed_average`` (as ``average_``, returning each
    bucket's result in its 1-bit form, see :meth:`OneBitCompressor.packed_average`), which lets
    ZeRO keep its replicated momentum at ~P/8 bytes; without it ZeRO keeps it in fp32. Optional:
    ``stages_ahead`` (default False), True where ``average_`` calls every ``stage(i)`` before it
    sends anything, so that a caller may fill all buckets at the first call.

    ZeRO's sharded form (``onebit_mode="sharded"``, ZeroOneAdam's gradient steps) also needs a
    reduce-scatter of one bucket: ``tensor`` (fp32, ``P = world * out.numel()`` elements, the same
    ``P`` on every rank; it may be overwritten) gives this rank's chunk of the average in ``out``.
    ``reduce_scatter_`` does it at once; ``reduce_scatter_exchange`` queues the collectives on
    ``async_comm`` (a ``_C.zero.AsyncComm``) and returns its work, writing only the compressor's
    scratch, and ``reduce_scatter_commit`` (after every exchange succeeded) does the local writes.
    """

    def average_(self, keys: Sequence[Hashable], numels: Sequence[int],
                 stage: Callable[[int], torch.Tensor], device: torch.device) -> None: ...

    def keys(self) -> List[Hashable]: ...

    def reset(self) -> None: ...

    def zero_(self) -> None: ...

    def nbytes(self) -> Tuple[int, int]: ...

    def state_dict(self) -> Dict[Hashable, Dict[str, torch.Tensor]]: ...

    def load_state_dict(self, state: Mapping[Hashable, Mapping[str, torch.Tensor]]) -> None: ...

    def close(self) -> None: ...

    def reduce_scatter_(self, key: Hashable, tensor: torch.Tensor, out: torch.Tensor) -> None: ...

    def reduce_scatter_exchange(self, key: Hashable, tensor: torch.Tensor, out: torch.Tensor,
                                async_comm: Any) -> Any: ...

    def reduce_scatter_commit(self, key: Hashable, tensor: torch.Tensor, out: torch.Tensor,
                              gate: bool = True) -> None: ...
