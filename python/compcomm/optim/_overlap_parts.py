"""Parts of the backward overlap (:mod:`compcomm.optim.overlap`): a group of buckets sent
together, and the stream ordering after its exchanges."""

from __future__ import annotations

from typing import Any, Iterable, List, Optional, Tuple

import torch

__all__ = ["Group", "join_streams"]


class Group:
    """Buckets sent together: their indices in the plan, sizes, device and fill entries."""

    def __init__(self, plan: Any, buckets: List[int]) -> None:
        self.buckets = buckets
        self.numels = [plan.flats[b].numel() for b in buckets]
        self.device = plan.devices[buckets[0]]
        self.flats = [plan.flats[b] for b in buckets]
        self.per_bucket = [plan.entries[b] for b in buckets]
        self.entries = [e for b in buckets for e in plan.entries[b]]
        self.numel = sum(self.numels)
        self._check: Optional[Tuple[torch.Tensor, int, List[Any]]] = None  # scratch, shift, entries

    def staged(self) -> torch.Tensor:
        """The group's staged momenta as one tensor, its buckets in plan order: a view where they
        lie side by side (StagedPlan makes them so), else a copy."""
        flats = self.flats[::-1]  # the group walks the plan backwards
        ptr, off = flats[0].untyped_storage().data_ptr(), flats[0].storage_offset()
        for f in flats:
            if f.untyped_storage().data_ptr() != ptr or f.storage_offset() != off:
                return torch.cat(flats)
            off += f.numel()
        return torch.as_strided(flats[0], (self.numel,), (1,))

    def scratch_entries(self, scratch: torch.Tensor, shift: int) -> List[Any]:
        """The group's fill entries with their outputs in ``scratch[shift:]``, laid out as
        :meth:`staged` (kept while ``scratch`` and ``shift`` are the same)."""
        if self._check is not None and self._check[0] is scratch and self._check[1] == shift:
            return self._check[2]
        entries, off = [], self.numel + shift
        for f, bucket in zip(self.flats, self.per_bucket):  # from the last bucket of the plan
            off -= f.numel()  # where this bucket starts in plan order
            for group, p, view in bucket:
                o = off + view.storage_offset() - f.storage_offset()
                entries.append((group, p, scratch[o:o + p.numel()].view(p.shape)))
        self._check = (scratch, shift, entries)
        return entries


def join_streams(current: Any, users: Iterable[Any], side: Any = None) -> None:
    """Order the streams of a device after the exchanges (``x.wait_stream(y)`` on
    ``torch.cuda.Stream``-likes): ``current`` (``step()``'s: the commit, the frees) after every
    stream that staged and launched in the backward (``users``; over the torch adapter the
    exchanges ran there) and after ``side``; and each of ``users`` after ``side``, because the
    workspaces and error buffers were allocated on those streams and read on ``side``: the caching
    allocator may hand a freed block to its allocating stream at once, so that stream must not
    run ahead of ``side``'s last read (a backward run on a user stream)."""
    for s in users:
        if s != current:
            current.wait_stream(s)
        if side is not None:
            s.wait_stream(side)
    if side is not None:
        current.wait_stream(side)
