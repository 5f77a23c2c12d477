"""Ranks agree on the layout of what they are about to communicate (bucket count, sizes, dtypes,
the settings that decide them) before the first collective that depends on it.

Collectives of different sizes on different ranks do not fail cleanly: gloo and NCCL wait (or
read past a buffer) until a timeout. So a caller that builds a layout -- an optimizer's buckets, a
DDP bucket, ZeRO's partition -- describes it as a few named fields and calls
:meth:`LayoutCheck.agree`. The first time a description is seen, every rank all-gathers a record
of fixed size (one int64 per field: small values as they are, the rest as 63-bit hashes), and if
any field differs every rank raises the same :class:`~compcomm.errors.RankMismatchError`, naming
the fields and ranks. A description seen before (and agreed) costs nothing: one tuple compare.

What this cannot catch: a layout that changes on some ranks only after it was agreed (a rank that
checks while its peers, unchanged, go straight to their collective). That still ends at the
collective's timeout (:class:`~compcomm.errors.CommTimeoutError`).
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Hashable, List, Optional, Sequence, Set, Tuple

import torch

from . import _C
from ._buffers import buffer_of
from ._defaults import DEFAULT_TIMEOUT
from .errors import RankMismatchError

__all__ = ["LayoutCheck", "digest", "agree_layout", "schedule_fields"]

_MAGIC = 0x636F6D6C61796F  # "comlayo": a record from a peer that is not checking is not this

#: A field: (name, value, hashed). Hashed values are shown as "differs" rather than printed.
Field = Tuple[str, int, bool]


def digest(obj: Any) -> int:
    """A 63-bit hash of ``repr(obj)`` (stable across processes, unlike ``hash``)."""
    h = hashlib.blake2b(repr(obj).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def schedule_fields(schedule: Any) -> List[Field]:
    """A 1-bit optimizer's schedule (:mod:`compcomm.schedule`) as fields: its class, its public
    settings (``freeze_step``, 0/1 Adam's four; at most 4, so every rank sends as many fields) and
    its step counter."""
    settings = sorted((k, v) for k, v in vars(schedule).items() if not k.startswith("_"))[:4]
    settings += [("(unused)", 0)] * (4 - len(settings))
    return [("schedule", digest(type(schedule).__name__), True),
            *((name, int(v), False) for name, v in settings),
            ("step", int(schedule.step), False),
            ("schedule state", digest(sorted(schedule.state_dict().items())), True)]


def agree_layout(comm: Any, call: str, fields: Sequence[Field], device: Optional[torch.device] = None,
                 timeout: float = DEFAULT_TIMEOUT) -> None:
    """All-gather ``fields`` (one int64 each) over ``comm`` and raise RankMismatchError on every
    rank if any differs between ranks. Every rank of ``comm`` must call it with the same field
    names (a collective of ``8 * (len(fields) + 2)`` bytes per rank); one rank: nothing happens.

    Raises
    ------
    RankMismatchError
        On every rank, naming each differing field: plain values per rank, hashed ones as the
        ranks whose value differs from rank 0's.
    """
    world, rank = comm.size(), comm.rank()
    if world == 1:
        return
    values = [_MAGIC, len(fields)] + [int(v) for _, v, _ in fields]
    send = torch.tensor(values, dtype=torch.int64, device=device)
    recv = torch.empty(world * len(values), dtype=torch.int64, device=device)
    stream = torch.cuda.current_stream(device).cuda_stream if send.is_cuda else 0
    comm.all_gather(buffer_of(send), buffer_of(recv), timeout, stream)
    rows: List[List[int]] = recv.view(world, len(values)).tolist()
    if any(r[:2] != values[:2] for r in rows):  # a peer in another call: do not guess at fields
        raise RankMismatchError(
            f"[rank {rank}] {call}: rank(s) {[i for i, r in enumerate(rows) if r[:2] != values[:2]]}"
            " sent a record of another call (the ranks' collectives are out of step)",
            call, "", 0, rank)
    what = []
    for k, (name, _, hashed) in enumerate(fields):
        col = [r[k + 2] for r in rows]
        if len(set(col)) == 1:
            continue
        if hashed:
            what.append(f"{name} (rank(s) {[i for i, v in enumerate(col) if v != col[0]]} "
                        "differ from rank 0)")
        else:
            what.append(f"{name} ({', '.join(f'rank {i}: {v}' for i, v in enumerate(col))})")
    if what:
        raise RankMismatchError(f"[rank {rank}] {call}: ranks disagree on the layout of what they "
                                f"communicate: {'; '.join(what)}; nothing was changed",
                                call, "", 0, rank)


class LayoutCheck:
    """Remembers the layouts every rank agreed on, so :meth:`agree` communicates only for a layout
    this rank has not used before (the first use included)."""

    #: agreed keys kept; more (a layout that keeps changing) starts the set afresh
    MAX_KEYS = 64

    def __init__(self) -> None:
        self._agreed: Set[Hashable] = set()

    def agree(self, comm: Any, call: str, key: Hashable, fields: Callable[[], Sequence[Field]],
              device: Optional[torch.device] = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        """:func:`agree_layout` of ``fields()`` (a callable, so a known layout builds nothing)
        unless ``key`` was agreed before."""
        if key in self._agreed or comm.size() == 1:
            return
        agree_layout(comm, call, fields(), device, timeout)
        if len(self._agreed) >= self.MAX_KEYS:
            self._agreed.clear()
        self._agreed.add(key)

    def forget(self) -> None:
        """Check again at the next :meth:`agree` (after a checkpoint load, say)."""
        self._agreed.clear()
