"""The core's views of one compressed exchange's buckets, kept between calls
(:class:`PreparedBuckets`, used by :class:`compcomm.compress.OneBitCompressor`)."""

from __future__ import annotations

import weakref
from typing import Dict, Hashable, List, Optional, Tuple

import torch

from . import _C
from ._buffers import buffer_of

__all__ = ["PreparedBuckets"]


class PreparedBuckets:
    """One :meth:`OneBitCompressor.average_` call's buckets as the core takes them: the error
    buffers' and workspaces' Buffer views (and the staged tensors', while ``stage`` returns the
    same tensors), made once and reused while nothing they view has been replaced."""

    def __init__(self, keys: List[Hashable], numels: List[int], device: torch.device,
                 bufs: List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                 staging: Optional[_C.Buffer], created: List[Hashable]) -> None:
        self.keys, self.numels, self.device, self.staging = keys, numels, device, staging
        self.created = created  # made by this call: dropped again if it fails
        self.bufs = bufs
        self.wes = [buffer_of(we) for we, _, _ in bufs]
        self.ses = [buffer_of(se) for _, se, _ in bufs]
        self.wss = [buffer_of(ws) for _, _, ws in bufs]
        self.error_args = list(zip(self.wes, self.ses, self.wss))
        self._staged: List[Optional["weakref.ref[torch.Tensor]"]] = [None] * len(keys)
        self.tensors: List[_C.Buffer] = [None] * len(keys)  # type: ignore[list-item]

    def valid(self, buffers: Dict[Hashable, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
              ) -> bool:
        """Whether every bucket still has the buffers this was made of."""
        return all(buffers.get(k) is b for k, b in zip(self.keys, self.bufs))

    def tensor_buffer(self, i: int, t: torch.Tensor) -> _C.Buffer:
        """The Buffer of bucket ``i``'s staged tensor ``t`` (kept while ``t`` is the same)."""
        b, ref = self.tensors[i], self._staged[i]
        if ref is None or ref() is not t or b.data != t.data_ptr() or b.count != t.numel():
            self._staged[i] = weakref.ref(t)
            b = self.tensors[i] = buffer_of(t)
        else:
            b.owner = t
        return b

    def release(self) -> None:
        """Let go of the staged tensors once a call is over: only weak references stay, so a
        ``stage`` that makes new tensors every call (ZeRO's replicated mode) does not have a
        whole model's worth of them kept alive until the next call."""
        for b in self.tensors:
            if b is not None:
                b.owner = None
