"""Who issues collectives on a communicator from a thread of its own: the registry that keeps the
1-bit optimizers' backward overlap (:mod:`compcomm.optim.overlap`) from sharing a communicator.

Each :class:`compcomm.compress.OneBitCompressor` has its own worker thread, and the core requires
one thread issuing collectives per communicator at a time (``cpp/zero/bucket.h``). With the
backward overlap, a compressor's exchanges run on its worker thread during the backward and until
``step()``; a second compcomm optimizer (a GAN's generator and discriminator, two optimizers over
parts of one model) on the same communicator would issue its own collectives meanwhile, from
another thread, in an order that may differ by rank: a hang, a malformed message, or (NCCL) data
silently mixed. So a communicator with more than one live user is *shared*, and on a shared
communicator no overlap runs: what one already sent is drained (waited for and dropped) when the
second user joins, and each overlap switches itself off at its next ``arm()``.

Deciding alike on every rank. Users join at construction, which every rank runs alike (SPMD);
whether an earlier user is still alive would depend on when each rank's garbage collector ran,
so a join that finds earlier users runs :func:`gc.collect` first: then exactly the reachable ones
count, on every rank. The shared mark changes only there and in :func:`recheck` (an overlap's
``arm()`` that finds the mark, at a step: every rank alike; it lets ``opt = OneBitAdam(...)``
replace an earlier optimizer still bound to ``opt`` while the new one was made), never when a
user dies, so every rank's overlap sees the same mark at the same point.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any, Dict

__all__ = ["join", "watch", "is_shared", "recheck"]


class _Entry:
    def __init__(self) -> None:
        self.users: "weakref.WeakSet[Any]" = weakref.WeakSet()  # compressors (anything with .comm)
        self.watchers: "weakref.WeakSet[Any]" = weakref.WeakSet()  # overlaps: .on_shared()
        self.shared = False


_entries: Dict[int, _Entry] = {}  # by id(comm); an entry whose users hold another comm is stale


def _entry(comm: Any) -> _Entry:
    e = _entries.get(id(comm))
    if e is None or any(getattr(u, "comm", comm) is not comm for u in list(e.users)):
        e = _entries[id(comm)] = _Entry()
    return e


def join(comm: Any, user: Any) -> None:
    """Count ``user`` (an object with a worker thread issuing collectives on ``comm``) as a user of
    ``comm`` while it lives. The second live user marks ``comm`` shared, and every overlap watching
    it is told (``on_shared()``: drain and switch off). Call at construction (every rank alike)."""
    if comm.size() < 2:  # nothing is sent: nothing to share
        return
    e = _entry(comm)
    if user in e.users:
        return
    if len(e.users):
        gc.collect()  # only the reachable users count, alike on every rank
    if not len(e.users):
        e.shared = False
    e.users.add(user)
    if len(e.users) > 1 and not e.shared:
        e.shared = True
        for w in list(e.watchers):
            w.on_shared()


def watch(comm: Any, overlap: Any) -> bool:
    """Tell ``overlap`` (``on_shared()``) when ``comm`` becomes shared; returns whether it is
    already."""
    e = _entry(comm)
    e.watchers.add(overlap)
    return e.shared


def is_shared(comm: Any) -> bool:
    """Whether more than one live user has joined ``comm`` (as of the last join)."""
    e = _entries.get(id(comm))
    return e is not None and e.shared


def recheck(comm: Any) -> bool:
    """Whether ``comm`` is still shared once unreachable users are collected (:func:`gc.collect`;
    call at a point every rank reaches alike); clears the mark if at most one user lives."""
    e = _entries.get(id(comm))
    if e is None or not e.shared:
        return False
    gc.collect()
    e.shared = len(e.users) > 1
    return e.shared
