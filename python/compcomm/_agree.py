"""Ranks agree on the layout of what they are about to communicate (bucket count, sizes, dtypes,
the settings that decide them) before the first collective that depends on it.

Collectives of different sizes on different ranks do not fail cleanly: gloo and NCCL wait (or
read past a buffer) until a timeout. So a caller that builds a layout -- an optimizer's buckets, a
DDP bucket, ZeRO's partition -- describes it as a few named fields and calls
:meth:`LayoutCheck.agree`. The first time a description is seen, every rank all-gathers a record
of 32 bytes (a digest of the fields; the fields themselves, plain values exactly -- in as many
int64 words as the largest needs -- and the rest as 63-bit hashes, follow only when the digests
differ), and if any field differs
every rank raises the same :class:`~compcomm.errors.RankMismatchError`, naming the fields and
ranks. A description seen before (and agreed) costs nothing: one tuple compare.

A layout that changes on some ranks only after it was agreed makes those ranks check while their
peers, unchanged, go straight to their collective. When that collective is a compressed exchange
(the 1-bit phase), its first all-gather has the size of this check's first record, and both sides
recognise the other's record: RankMismatchError on every rank. Against any other collective (a
full-precision warm-up all-reduce) it still ends at that collective's timeout
(:class:`~compcomm.errors.CommTimeoutError`) or in the backend's own error.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Hashable, List, Optional, Sequence, Set, Tuple

import torch

from ._buffers import buffer_of
from ._comm import wait_cancellable
from ._defaults import DEFAULT_TIMEOUT
from .errors import RankMismatchError

__all__ = ["LayoutCheck", "digest", "agree_layout", "schedule_fields", "reject_exchange"]

# The magic numbers of the 32-byte records a first all-gather of compcomm can carry (cpp/
# compressed_allreduce.cpp): this check's, a compressed call's header, a batch's call count.
_MAGIC = 0xC0C01A70
# A rank that rejected its own arguments sends this record where its header would go (the C++ core's
# kRejectMagic): see reject_exchange.
_REJECT_MAGIC = 0xC0C0BAD5
_PEER_CALLS = {0xC0C0B175: "a compressed_allreduce call",
               0xC0C05CA7: "a compressed_reduce_scatter call", 0xC0C0BA7C: "a batch of compressed calls",
               _REJECT_MAGIC: "a compressed call whose arguments it rejected"}

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


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


# A field's value travels in as many int64 words as the largest value on any rank needs (two's
# complement, low word first), so values beyond int64 (freeze_step=10**20) still compare and print
# exactly on every rank; beyond _MAX_WORDS words, as a digest (tag 1) instead.
_MAX_WORDS = 64


def _words_needed(v: int) -> int:
    return min(v.bit_length() // 64 + 1, _MAX_WORDS)


def _encode(v: int, words: int) -> List[int]:
    """[tag, word 0, ..., word words-1]: tag 0, ``v`` exactly; tag 1, too large: its digest."""
    if v.bit_length() >= 64 * words:
        return [1, digest(v)] + [0] * (words - 1)
    u = v & ((1 << (64 * words)) - 1)
    return [0] + [_signed((u >> (64 * j)) & ((1 << 64) - 1)) for j in range(words)]


def _decode(ws: Sequence[int]) -> Any:
    """The value (or what is known of it) that :func:`_encode` made ``ws`` of."""
    if ws[0]:
        return f"an integer of more than {64 * (len(ws) - 1) - 1} bits"
    u = sum((w & ((1 << 64) - 1)) << (64 * j) for j, w in enumerate(ws[1:]))
    return u - (1 << (64 * (len(ws) - 1))) if u >> (64 * (len(ws) - 1) - 1) else u


def _gather(comm: Any, values: List[int], device: Optional[torch.device],
            timeout: float) -> List[List[int]]:
    send = torch.tensor([_signed(v) for v in values], dtype=torch.int64, device=device)
    recv = torch.zeros(comm.size() * len(values), dtype=torch.int64, device=device)
    stream = torch.cuda.current_stream(device).cuda_stream if send.is_cuda else 0
    comm.all_gather(buffer_of(send), buffer_of(recv), timeout, stream)
    # native NCCL returns before the data arrived and may abort it later (a peer never came):
    # raise that abort's typed error instead of reading what the buffer held
    wait_cancellable(comm, timeout)
    return recv.view(comm.size(), len(values)).tolist()


def reject_exchange(comm: Any, device: Optional[torch.device], timeout: float) -> None:
    """This rank's arguments to a compressed call failed their checks: take part in the call's first
    collective (the 32-byte header all-gather) with a record saying so, so that the peers, checking
    the headers, raise :class:`~compcomm.errors.RankMismatchError` at once instead of waiting for
    this rank until their timeout or pairing with its next call. The caller then raises its own
    error. ``device``: where the communicator's buffers must be (a CUDA device for NCCL)."""
    if comm.size() > 1:
        _gather(comm, [0, -1, -1, _REJECT_MAGIC << 32], device, timeout)


def agree_layout(comm: Any, call: str, fields: Sequence[Field],
                 device: Optional[torch.device] = None, timeout: float = DEFAULT_TIMEOUT,
                 flags: int = 0) -> int:
    """Raise RankMismatchError on every rank of ``comm`` if any of ``fields`` differs between
    ranks. Every rank must call it (one rank: nothing happens). Returns the bitwise OR of every
    rank's ``flags`` (a verdict all ranks then act on alike; 0 <= flags < 2**62), carried in the
    same record at no extra cost.

    First one all-gather of a 32-byte record per rank: a digest of ``call`` and of all fields, and
    a magic number where compressed_allreduce's header has its own (so a peer that went on to a
    compressed exchange instead, its layout unchanged while this rank's changed, raises there
    too, and this rank names it). Only if the digests differ, a second all-gather of the fields
    themselves, to say which differ: one int64 each, or as many as the largest value on any rank
    needs (the first record says how many), so a value beyond int64 is still exact.

    Raises
    ------
    RankMismatchError
        On every rank, naming each differing field: plain values per rank, hashed ones as the
        ranks whose value differs from rank 0's.
    """
    world, rank = comm.size(), comm.rank()
    if world == 1:
        return int(flags)
    values = [int(v) for _, v, _ in fields]
    words = max((_words_needed(v) for v in values), default=1)
    record = [digest(values), digest((call, len(fields))), int(flags), (_MAGIC << 32) | words]
    rows = _gather(comm, record, device, timeout)
    magics = [(r[3] >> 32) & 0xFFFFFFFF for r in rows]
    other = [f"rank {i}: " + _PEER_CALLS.get(m, "an unknown record")
             for i, m in enumerate(magics) if m != _MAGIC]
    if other or any(r[1] != record[1] for r in rows):
        other += [f"rank {i}: another layout check" for i, r in enumerate(rows)
                  if magics[i] == _MAGIC and r[1] != record[1]]
        raise RankMismatchError(
            f"[rank {rank}] {call}: this rank checks the layout of what it communicates, other "
            f"ranks are in another call ({', '.join(other)}): the layout changed on some ranks "
            "only, or the ranks run different code", call, "", 0, rank)
    if all(r[0] == record[0] for r in rows):
        verdict = 0
        for r in rows:
            verdict |= r[2]
        return verdict
    # every rank saw the digests differ: all come, with the widest rank's number of words
    words = max(max(r[3] & 0xFF, 1) for r in rows)
    sent = [w for v in values for w in _encode(v, words)]
    rows = _gather(comm, sent, device, timeout)
    width = words + 1
    what = []
    for k, (name, _, hashed) in enumerate(fields):
        col = [tuple(r[k * width:(k + 1) * width]) for r in rows]  # one encoding per value
        if len(set(col)) == 1:
            continue
        if hashed:
            what.append(f"{name} (rank(s) {[i for i, v in enumerate(col) if v != col[0]]} "
                        "differ from rank 0)")
        else:
            per_rank = ", ".join(f"rank {i}: {_decode(v)}" for i, v in enumerate(col))
            what.append(f"{name} ({per_rank})")
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
        #: the communicator a DDP hook checks over (compcomm.ddp makes it on first use)
        self.torch_comm: Any = None

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

    def known(self, key: Hashable) -> bool:
        """Whether ``key`` was agreed before (:meth:`agree` then sends nothing)."""
        return key in self._agreed

    def forget(self) -> None:
        """Check again at the next :meth:`agree` (after a checkpoint load, say)."""
        self._agreed.clear()
