"""The core's views of one compressed exchange's buckets, kept between calls
(:class:`PreparedBuckets`, used by :class:`compcomm.compress.OneBitCompressor`), and the checks of
what that compressor is given: buckets, staged tensors, loaded error buffers."""

from __future__ import annotations

import numbers
import weakref
from typing import Any, Dict, Hashable, List, Optional, Sequence, Tuple

import torch

from . import _C
from ._buffers import buffer_of

__all__ = ["PreparedBuckets", "check_buckets", "check_loaded", "check_staged"]

_CALL = "OneBitCompressor.average_"


def check_buckets(keys: Sequence[Hashable], numels: Sequence[int], rank: int) -> None:
    """TypeError/ValueError naming the argument (and the bucket) unless ``keys`` are distinct
    hashable names and ``numels`` as many element counts >= 0: two buckets of one key would share
    (or replace each other's) error buffers."""
    if len(numels) != len(keys):
        raise ValueError(f"[rank {rank}] {_CALL}: argument 'numels' has {len(numels)} entries but "
                         f"'keys' has {len(keys)}")
    seen: set = set()
    for i, (k, n) in enumerate(zip(keys, numels)):
        try:
            dup = k in seen
        except TypeError:
            raise TypeError(f"[rank {rank}] {_CALL}: argument 'keys': keys[{i}] is not hashable "
                            f"({type(k).__name__})") from None
        if dup:
            raise ValueError(f"[rank {rank}] {_CALL}: argument 'keys' names bucket {k!r} twice "
                             f"(keys[{list(keys).index(k)}] and keys[{i}]); each bucket needs a "
                             "key of its own (its error buffers)")
        seen.add(k)
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise TypeError(f"[rank {rank}] {_CALL}: argument 'numels': bucket {k!r} has a numel "
                            f"of type {type(n).__name__}, not an int")
        if n < 0:
            raise ValueError(f"[rank {rank}] {_CALL}: argument 'numels': bucket {k!r} has numel "
                             f"{n} < 0")


def check_staged(t: Any, i: int, key: Hashable, numel: int, device: torch.device,
                 rank: int) -> None:
    """ValueError naming bucket ``i`` (``key``) unless ``stage(i)`` returned a contiguous fp32
    tensor of ``numel`` elements on ``device``: the core writes ``numel`` elements from its first
    address, which in anything else would be memory outside the bucket."""
    if not isinstance(t, torch.Tensor):
        problem = f"a {type(t).__name__}, not a torch.Tensor"
    elif t.dtype != torch.float32:
        problem = f"a tensor of dtype {t.dtype}, not torch.float32"
    elif t.device.type != device.type or device.index not in (None, t.device.index):
        problem = f"a tensor on {t.device}, not on {device}"
    elif not t.is_contiguous():
        problem = "a non-contiguous tensor"
    elif t.numel() != numel:
        problem = f"a tensor of {t.numel()} elements, not numels[{i}]={numel}"
    else:
        return
    raise ValueError(f"[rank {rank}] {_CALL}: stage({i}) (bucket {key!r}) returned {problem}; "
                     "nothing was changed")


class PreparedBuckets:
    """One :meth:`OneBitCompressor.average_` call's buckets as the core takes them: the error
    buffers' and workspaces' Buffer views (and the staged tensors', while ``stage`` returns the
    same tensors), made once and reused while nothing they view has been replaced."""

    def __init__(self, keys: List[Hashable], numels: List[int], device: torch.device,
                 bufs: List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                 staging: Optional[_C.Buffer], created: List[Hashable],
                 replaced: Optional[Dict[Hashable, Tuple[torch.Tensor, ...]]] = None,
                 rank: int = 0) -> None:
        self.keys, self.numels, self.device, self.staging = keys, numels, device, staging
        self.created = created  # made by this call: dropped again if it fails
        # buffers this call replaced (a bucket's size or device changed): put back if it fails
        self.replaced = replaced or {}
        self.rank = rank
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

    def undo(self, buffers: Dict[Hashable, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
             ) -> bool:
        """Put ``buffers`` (the compressor's) back as they were before the failed call that made
        this: buffers it made dropped, buffers it replaced restored, unless a reset replaced them
        meanwhile. Returns whether any changed."""
        mine = dict(zip(self.keys, self.bufs))
        changed = bool(self.created or self.replaced)
        for k in self.created:
            if buffers.get(k) is mine[k]:
                del buffers[k]
        for k, old in self.replaced.items():
            if buffers.get(k) is mine[k]:
                buffers[k] = old
        self.created, self.replaced = [], {}
        return changed

    def tensor_buffer(self, i: int, t: torch.Tensor) -> _C.Buffer:
        """The Buffer of bucket ``i``'s staged tensor ``t`` (kept while ``t`` is the same; a new
        one is checked first: :func:`check_staged`)."""
        b, ref = self.tensors[i], self._staged[i]
        if ref is None or ref() is not t or b.data != t.data_ptr() or b.count != t.numel():
            check_staged(t, i, self.keys[i], self.numels[i], self.device, self.rank)
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


def _items(m: Any, what: str, where: str) -> List[Any]:
    """``m.items()``, or a TypeError naming ``what`` where ``m`` is no mapping."""
    items = getattr(m, "items", None)
    if items is None:
        raise TypeError(f"{where}: {what} must be a dict, got {type(m).__name__}")
    return list(items())


def check_loaded(state: Any, world: int, rank: int) -> None:
    """TypeError/ValueError naming the bucket, the buffer and the rank unless every bucket of
    ``state`` (``OneBitCompressor.load_state_dict``'s) holds a float32, 1-D, contiguous
    ``worker_error`` of ``P`` elements (a multiple of ``8 * world``) and ``server_error`` of ``P /
    world``, both on one CPU or CUDA device."""
    call = f"[rank {rank}] OneBitCompressor.load_state_dict"
    for k, bufs in _items(state, "argument 'state'", call):
        where = f"{call}: bucket {k!r}"
        got = dict(_items(bufs, "its value", where))
        for name in ("worker_error", "server_error"):
            t = got.get(name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{where}: '{name}' must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != torch.float32:
                raise TypeError(f"{where}: '{name}' must be torch.float32, got {t.dtype}")
            if t.dim() != 1 or not t.is_contiguous():
                raise ValueError(f"{where}: '{name}' must be 1-D and contiguous, got shape "
                                 f"{tuple(t.shape)}, strides {t.stride()}")
            if t.device.type not in ("cpu", "cuda"):
                raise ValueError(f"{where}: '{name}' is on {t.device}, not the CPU or a GPU")
        we, se = got["worker_error"], got["server_error"]
        if we.device != se.device:
            raise ValueError(f"{where}: 'worker_error' is on {we.device} but 'server_error' on "
                             f"{se.device}")
        if we.numel() % (8 * world) or se.numel() * world != we.numel():
            raise ValueError(f"{where}: error buffers of {we.numel()} / {se.numel()} elements, "
                             f"not for a world of {world}")
