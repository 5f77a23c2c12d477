"""The staging of a bucket plan, worked out once per plan: each bucket's flat fp32 buffer, the
views of its parameters into it and the entries a fill callback takes, grouped by device.

Rebuilding these every step cost ~0.1 ms per bucket in Python (208 one-tensor buckets: a third
of the compressed step), so :class:`StagedPlan` keeps them for as long as the plan and the
parameters' shapes and devices stay the same.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["StagedPlan", "staged_plan"]

Item = Tuple[Dict[str, Any], torch.Tensor]
Entry = Tuple[Dict[str, Any], torch.Tensor, torch.Tensor]


class StagedPlan:
    """Staging buffers, views and fill entries of one bucket plan.

    Parameters
    ----------
    plan_key : tuple
        The optimizer's plan key (the object itself: a new plan is a new key object).
    items : list of (group, parameter)
        The parameters that communicate, in plan order.
    buckets : list of list of int
        Indices into ``items``, bucket by bucket.
    staging : dict
        Bucket index -> flat fp32 buffer of an earlier plan; the buffers are reused where all
        sizes and devices still fit, else made anew (the buckets of a device are consecutive
        views of one buffer), and the dict is updated in place.
    """

    def __init__(self, plan_key: Any, items: Sequence[Item], buckets: List[List[int]],
                 staging: Dict[int, torch.Tensor]) -> None:
        self.plan_key = plan_key
        self.shapes = [p.shape for _, p in items]
        self.devices = [items[idx[0]][1].device for idx in buckets]
        numels = [sum(items[j][1].numel() for j in idx) for idx in buckets]
        fit = all(staging.get(b) is not None and staging[b].numel() == n
                  and staging[b].device == dev
                  for b, (n, dev) in enumerate(zip(numels, self.devices)))
        if not fit:  # all before any exchange; one buffer per device, the buckets in plan order
            # side by side (the backward overlap checks a group of consecutive buckets in one pass)
            staging.clear()
            for dev in dict.fromkeys(self.devices):
                idx = [b for b, d in enumerate(self.devices) if d == dev]
                buf = torch.empty(sum(numels[b] for b in idx), dtype=torch.float32, device=dev)
                off = 0
                for b in idx:
                    staging[b] = buf[off:off + numels[b]]
                    off += numels[b]
        self.flats = [staging[b] for b in range(len(buckets))]
        self.views: Dict[torch.Tensor, torch.Tensor] = {}
        self.entries: List[List[Entry]] = []
        for b, idx in enumerate(buckets):
            off, entries = 0, []
            for j in idx:
                group, p = items[j]
                view = self.flats[b][off:off + p.numel()].view(p.shape)
                self.views[p] = view
                entries.append((group, p, view))
                off += p.numel()
            self.entries.append(entries)
        #: per device, in first-use order: (device, bucket indices, their numels, all entries)
        self.by_device: List[Tuple[torch.device, List[int], List[int], List[Entry]]] = []
        for dev in dict.fromkeys(self.devices):
            idx = [b for b, d in enumerate(self.devices) if d == dev]
            self.by_device.append((dev, idx, [numels[b] for b in idx],
                                   [e for b in idx for e in self.entries[b]]))

    def fits(self, plan_key: Any, items: Sequence[Item]) -> bool:
        """Whether this staging still serves ``items`` under ``plan_key``: the same plan, and every
        parameter with the shape and (first of a bucket) device it had (``p.data`` may have
        been replaced)."""
        if plan_key is not self.plan_key or len(items) != len(self.shapes):
            return False
        shapes = self.shapes
        for i, (_, p) in enumerate(items):
            if p.shape != shapes[i]:
                return False
        return all(e[0][1].device == dev for e, dev in zip(self.entries, self.devices))

    def stage_fn(self, b: List[int], entries: List[Entry],
                 fill: Callable[[List[Entry]], None], ahead: bool) -> Callable[[int], torch.Tensor]:
        """The ``stage`` callback of a compressor's ``average_`` over buckets ``b``: fills bucket
        ``b[i]`` and returns its buffer. With ``ahead`` (the compressor stages every bucket before
        sending any) the first call fills them all with one ``fill`` call, which spares the
        per-bucket cost of the fill (its checks, one C++ call per run instead of per bucket)."""
        flats, per_bucket = self.flats, self.entries

        def stage(i: int) -> torch.Tensor:
            if not ahead:
                fill(per_bucket[b[i]])
            elif i == 0:
                fill(entries)
            return flats[b[i]]

        return stage


def staged_plan(cached: Optional[StagedPlan], plan_key: Any, items: Sequence[Item],
                buckets: List[List[int]], staging: Dict[int, torch.Tensor]) -> StagedPlan:
    """``cached`` if it still fits, else a new :class:`StagedPlan`."""
    if cached is not None and cached.fits(plan_key, items):
        return cached
    return StagedPlan(plan_key, items, buckets, staging)
