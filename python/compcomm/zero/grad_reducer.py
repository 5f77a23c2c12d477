"""ZeRO's gradient staging and full-precision reduction.

Stage 1: gradients stay whole in ``p.grad``; ``flush()`` copies them into the flat layout and
reduce-scatters each bucket into the group's fp32 gradient shard (``master.grad``).

Stage 2/3: a post-accumulate hook (installed by ZeroOptimizer) hands every gradient to
:meth:`GradReducer.accumulate` as soon as autograd has accumulated it: it is added into its
bucket's staging buffer and ``p.grad`` is freed. A complete bucket is reduce-scattered right away
(:meth:`submit`), on the owner's ``AsyncComm`` worker thread, in the background when
``overlap_comm`` is set (at most two staging buffers in flight, taken from a pool). In a 1-bit step
every bucket stays staged until it is compressed, each in an exact-size buffer of its own kept
across steps (see :mod:`.onebit_reducer`).

Bounded staging. The pool's buffers hold ``piece`` elements (``reduce_bucket_size``, rounded up to
whole chunks; never more than the largest bucket), as DeepSpeed's bucket bounds its staging. A
bucket larger than that holds one tensor only (the plan gives such a tensor a bucket of its own):
its gradient is not staged but reduce-scattered in *pieces*: piece j is, of every rank's chunk,
the elements ``[j * s, (j + 1) * s)`` (``s = piece / world``), copied side by side into a pool
buffer, and its reduce-scatter gives this rank elements ``[j * s, (j + 1) * s)`` of its chunk.
Every element is reduced over the same ranks as in the whole-bucket reduce-scatter, only grouped
into smaller calls, so device memory stays bounded by a few ``piece``-sized buffers whatever the
largest tensor (an embedding, say), and with offload each piece is copied to the host on its own.

Launch order. Buckets leave in one fixed order on every rank (:attr:`GradReducer.order`: groups
and buckets from last to first, the order in which a backward usually completes them): a bucket
complete out of turn waits for those before it (:meth:`GradReducer.ready`), and the end of each
backward launches the rest, untouched ones as zeros (:meth:`GradReducer.launch_rest`). So ranks
whose backward reaches different parameters (a branch taken on one rank only) still issue the
same collectives in the same order; launched on completion, they would pair one rank's bucket
with another bucket of its peer (wrong sums when the sizes agree, a mismatch or hang otherwise).

Also here: the squared gradient norms behind ``gradient_clipping`` and the non-finite check (one
all-reduce of a float64 through the worker thread, so it never overtakes queued collectives).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .. import _C
from .._buffers import buffer_of
from .._scratch import stream_of
from .layout import GroupLayout

__all__ = ["GradReducer", "clip_coef"]


_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class _Accumulation:
    """One group's gradients of the current accumulation (stage 2/3)."""

    def __init__(self, num_buckets: int) -> None:
        self.arrived: List[set] = [set() for _ in range(num_buckets)]  # this backward's, per bucket
        self.exchanged: set = set()  # 1-bit overlap: buckets whose exchange has started
        self.views: Dict[int, torch.Tensor] = {}  # bucket -> staging view being filled
        self.bases: Dict[int, torch.Tensor] = {}  # bucket -> the buffer it views

    def reset(self) -> None:
        self.views.clear()
        self.bases.clear()
        self.exchanged.clear()
        for a in self.arrived:
            a.clear()


class GradReducer:
    """Staging and full-precision reduce-scatter of the gradients into the fp32 gradient shards.

    Parameters
    ----------
    groups : list of GroupLayout
        The partitioned groups (``master.grad`` is where reduced gradients land).
    stage : {1, 2, 3}
    async_comm : _C.zero.AsyncComm
        The owner's worker thread (every collective here goes through it).
    overlap : bool
        ``overlap_comm``: reductions stay in flight while backward continues.
    rank, world : int
    device : torch.device
    timeout : float
    piece : int
        Elements of a staging buffer (``reduce_bucket_size``; <= 0: the largest bucket's): larger
        buckets are reduced in pieces (see the module docstring).
    """

    def __init__(self, groups: List[GroupLayout], stage: int, async_comm: _C.zero.AsyncComm,
                 overlap: bool, rank: int, world: int, device: torch.device,
                 timeout: float, piece: int = 0) -> None:
        self.groups = groups
        self.stage = stage
        self.async_comm = async_comm
        self.overlap = overlap
        self.rank = rank
        self.world = world
        self.device = device
        self.timeout = timeout
        self.acc = [_Accumulation(len(g.buckets)) for g in groups]
        #: the order buckets are launched in, the same on every rank (the module docstring)
        self.order = [(gi, bi) for gi in reversed(range(len(groups)))
                      for bi in reversed(range(len(groups[gi].buckets)))]
        self._ready: set = set()  # buckets complete out of turn in this round
        self._next = 0  # index in order of the next bucket to launch
        self.rounds = 0  # rounds launched (every bucket once) since the last step or reset
        #: per group: elements of a pool buffer; a larger bucket is reduced in pieces
        self.cap = [_cap(g, piece, world) for g in groups]
        self._pending: List[tuple] = []  # (work, group, bucket, staging base, recv, chunk offset)
        self._pool: Dict[tuple, List[torch.Tensor]] = {}  # (numel, dtype) -> free buffers
        # 1-bit steps stage every bucket at once: one exact-size buffer per bucket, kept
        self._own: Dict[Tuple[int, int], torch.Tensor] = {}
        self._own_ids: set = set()  # ids of those (alive: held in the dict above)
        #: ZeRO-Offload (:class:`.offload.HostOffload`): reduced chunks go to the host through it
        self.sink: Any = None

    # ---- staging -----------------------------------------------------------------------------

    def view(self, gi: int, bi: int, onebit: bool, keep_pool: bool = True) -> torch.Tensor:
        """The staging view of bucket ``bi`` of group ``gi`` (zeroed when first taken): from the
        pool, or in a 1-bit step (``onebit``) the bucket's own exact-size buffer; ``keep_pool``
        False frees the pool (a full-precision step never comes back)."""
        grp, acc = self.groups[gi], self.acc[gi]
        st = acc.views.get(bi)
        if st is None:
            padded = grp.buckets[bi].padded
            if onebit:
                if not keep_pool:
                    self._pool.clear()
                base = self._own.get((gi, bi))
                if base is None:
                    base = torch.empty(padded, dtype=grp.dtype, device=self.device)
                    self._own[(gi, bi)] = base
                    self._own_ids.add(id(base))
            else:
                base = self._buffer(gi)
            st = base[:padded]
            st.zero_()
            acc.views[bi] = st
            acc.bases[bi] = base
        return st

    def _buffer(self, gi: int) -> torch.Tensor:
        """A pool buffer of group ``gi`` (``cap`` elements, contents undefined)."""
        grp = self.groups[gi]
        pool = self._pool.setdefault((self.cap[gi], grp.dtype), [])
        if not pool and len(self._pending) >= 2:
            self.complete(1)  # reuse a buffer in flight rather than grow the pool
        return (pool.pop() if pool
                else torch.empty(self.cap[gi], dtype=grp.dtype, device=self.device))

    def split(self, gi: int, bi: int) -> bool:
        """Whether bucket ``bi`` of group ``gi`` is reduced in pieces (larger than a pool buffer;
        then it holds one tensor)."""
        b = self.groups[gi].buckets[bi]
        return b.padded > self.cap[gi] and b.num_tensors == 1

    def release(self, gi: int, base: Optional[torch.Tensor]) -> None:
        """A staging buffer is free again: back to the pool unless it is a bucket's own (None:
        a split bucket's gradient, which is no buffer of ours)."""
        if base is not None and id(base) not in self._own_ids:
            grp = self.groups[gi]
            self._pool.setdefault((self.cap[gi], grp.dtype), []).append(base)

    def take(self, gi: int, bi: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Remove bucket ``bi``'s staging view from the accumulation: (view, base buffer)."""
        acc = self.acc[gi]
        return acc.views.pop(bi), acc.bases.pop(bi)

    def accumulate(self, gi: int, ti: int, grad: torch.Tensor, onebit: bool,
                   keep_pool: bool = True) -> bool:
        """Add tensor ``ti``'s gradient into its bucket's staging; True when every tensor of the
        bucket has arrived in this backward (the arrivals are then counted afresh)."""
        grp = self.groups[gi]
        slot = grp.tensors[ti]
        b = grp.buckets[slot.bucket]
        acc = self.acc[gi]
        if not onebit and self.split(gi, slot.bucket):
            # the bucket's only tensor: its gradient is the staging (pieces are copied from it in
            # submit(); unpadded, flat)
            prev = acc.views.get(slot.bucket)  # (the hook submits at once: normally None)
            g = grad.reshape(-1)
            acc.views[slot.bucket] = g if prev is None else prev.add(g)
            acc.bases[slot.bucket] = None
            return True
        st = self.view(gi, slot.bucket, onebit, keep_pool)
        lo = slot.offset - b.offset
        st[lo : lo + slot.numel].add_(grad.reshape(-1))
        arrived = acc.arrived[slot.bucket]
        arrived.add(ti)
        if len(arrived) == b.num_tensors:
            arrived.clear()
            return True
        return False

    def reset(self) -> None:
        """Forget every staged gradient and the bookkeeping of the current accumulation."""
        for gi, acc in enumerate(self.acc):
            for base in acc.bases.values():
                self.release(gi, base)
            acc.reset()
        self._ready.clear()
        self._next = 0
        self.rounds = 0

    # ---- launch order --------------------------------------------------------------------------

    def ready(self, gi: int, bi: int, launch: Callable[[int, int], Any]) -> None:
        """Bucket ``bi`` of group ``gi`` is complete on this rank: ``launch`` it, and the buckets
        after it in :attr:`order` that are complete too, once every bucket before it has gone."""
        self._ready.add((gi, bi))
        while self._next < len(self.order) and self.order[self._next] in self._ready:
            self._next += 1
            launch(*self.order[self._next - 1])

    def launch_rest(self, launch: Callable[[int, int], Any]) -> None:
        """``launch`` every bucket not launched yet in this round, in order; the next round
        starts from the first bucket. Every tensor's arrivals are counted afresh."""
        rest, self._next = self.order[self._next:], 0
        self.rounds += 1
        self._ready.clear()
        self.clear_arrivals()
        for gi, bi in rest:
            launch(gi, bi)

    def clear_arrivals(self) -> None:
        """A backward ended: every bucket's arrivals are counted afresh in the next one."""
        for acc in self.acc:
            for a in acc.arrived:
                a.clear()

    def round_open(self) -> bool:
        """Whether a bucket was staged or launched since the last :meth:`launch_rest`."""
        return self._next > 0 or bool(self._ready) or any(acc.views for acc in self.acc)

    def drop_buffers(self) -> None:
        """Free the pool and the buckets' own buffers (nothing is staged: after :meth:`reset`)."""
        self._pool.clear()
        self._own.clear()
        self._own_ids.clear()

    # ---- full-precision reduction --------------------------------------------------------------

    def submit(self, gi: int, bi: int) -> None:
        """Reduce-scatter bucket ``bi``'s staged gradient (added to the shard by
        :meth:`complete`); a split bucket's in pieces; zeros if nothing was staged."""
        grp = self.groups[gi]
        if bi not in self.acc[gi].views:
            if self.split(gi, bi):  # no gradient: zero pieces (staging stays bounded)
                self._submit_pieces(gi, bi, None)
                return
            self.view(gi, bi, onebit=False)
        st, base = self.take(gi, bi)
        self.acc[gi].arrived[bi].clear()
        if base is None:
            self._submit_pieces(gi, bi, st)
            return
        recv = torch.empty(grp.buckets[bi].chunk, dtype=grp.dtype, device=self.device)
        self._reduce(gi, bi, st, base, recv, 0)

    def _reduce(self, gi: int, bi: int, st: torch.Tensor, base: Optional[torch.Tensor],
                recv: torch.Tensor, lo: int) -> None:
        work = self.async_comm.reduce_scatter(buffer_of(st), buffer_of(recv),
                                              timeout_s=self.timeout, stream=stream_of(recv))
        self._pending.append((work, gi, bi, base, recv, lo))
        if not self.overlap:
            self.complete(len(self._pending))

    def _submit_pieces(self, gi: int, bi: int, grad: Optional[torch.Tensor]) -> None:
        """Reduce-scatter a split bucket's gradient ``grad`` (unpadded; None: zeros) piece by
        piece (see the module docstring): each piece gathers ``s`` elements of every rank's chunk
        into a pool buffer, zero past the gradient's end (the bucket's padding)."""
        grp = self.groups[gi]
        b = grp.buckets[bi]
        s = self.cap[gi] // self.world
        n = 0 if grad is None else grad.numel()
        for lo in range(0, b.chunk, s):
            m = min(s, b.chunk - lo)
            base = self._buffer(gi)
            st = base[: m * self.world]
            for r in range(self.world):
                row, start = st[r * m : (r + 1) * m], r * b.chunk + lo
                have = max(0, min(m, n - start))
                if have:
                    row[:have].copy_(grad[start : start + have])
                if have < m:
                    row[have:].zero_()
            recv = torch.empty(m, dtype=grp.dtype, device=self.device)
            self._reduce(gi, bi, st, base, recv, lo)

    def complete(self, count: int) -> None:
        """Wait for the oldest ``count`` pending reductions and add them to the gradient shards."""
        for _ in range(count):
            work, gi, bi, base, recv, lo = self._pending.pop(0)
            work.wait(self.timeout)
            grp = self.groups[gi]
            if self.sink is not None:
                self.sink.receive(gi, grp, bi, recv, lo)
            else:
                shard = grp.buckets[bi].shard_of(grp.master.grad)
                shard[lo : lo + recv.numel()].add_(recv)
            self.release(gi, base)

    def wait(self) -> None:
        """Wait for every pending reduction (with offload: and its copy to the host)."""
        self.complete(len(self._pending))
        if self.sink is not None:
            self.sink.drain()

    def flush(self, rounds: int = 1) -> None:
        """Launch the buckets of an open round (parameters without gradients count as 0), wait
        all. Stage 2/3: a rank that launched fewer than ``rounds`` rounds in this step (its
        backward passes reached none of the parameters, or fewer backward passes than
        ``gradient_accumulation_steps``) launches the missing ones as zeros, so that its
        collectives pair with its peers'. Stage 1: reduce-scatter each group's whole gradients
        (``p.grad``) into a new shard."""
        if self.stage >= 2:
            if self.round_open():  # the end of backward launched them, unless it never came
                self.launch_rest(self.submit)
            while self.rounds < rounds:
                self.launch_rest(self.submit)
            self.rounds = 0
            self.wait()
            return
        for gi, grp in enumerate(self.groups):
            flat = grp.flatten((p.grad for p in grp.params), grp.dtype, self.device)
            shard = torch.empty(grp.plan.shard_numel, dtype=grp.dtype, device=self.device)
            self.async_comm.bucketed_reduce_scatter(
                grp.plan, buffer_of(flat), buffer_of(shard), timeout_s=self.timeout,
                stream=stream_of(shard)).wait(self.timeout)
            if self.sink is None:
                grp.master.grad = shard.to(torch.float32)
                continue
            grp.master.grad = None  # the sink attaches its zeroed host shard
            for bi, b in enumerate(grp.buckets):
                self.sink.receive(gi, grp, bi, b.shard_of(shard))
        if self.sink is not None:
            self.sink.drain()

    def local_buckets(self, device: Optional[torch.device] = None
                      ) -> List[Tuple[int, int, torch.Tensor]]:
        """This rank's local gradient (summed over micro-steps, unscaled), bucket by bucket:
        ``[(group, bucket, fp32 tensor of the bucket's padded length, zero padding)]``, on
        ``device`` (default: the parameters'; another one gets the staged dtype copied, then
        converted there). The staging bookkeeping is reset (the fp32 tensors stay valid: nothing
        reuses them before the next backward). Stage 1 also replaces the gradient shards by
        zeros."""
        self.wait()
        dev = device if device is not None else self.device
        items = []
        for gi, grp in enumerate(self.groups):
            if self.stage >= 2:
                for bi, b in enumerate(grp.buckets):
                    st = self.acc[gi].views.get(bi)
                    x = (st.to(dev).to(torch.float32) if st is not None
                         else torch.zeros(b.padded, device=dev))
                    items.append((gi, bi, x))
            else:
                flat = grp.flatten((p.grad for p in grp.params), torch.float32, dev)
                for bi, b in enumerate(grp.buckets):
                    items.append((gi, bi, b.span(flat)))
                grp.master.grad = torch.zeros(grp.plan.shard_numel, dtype=torch.float32,
                                              device=grp.master.device)
        self.reset()
        return items

    # ---- norms ---------------------------------------------------------------------------------

    def sum_sq_norm(self, grads: List[Tuple[torch.Tensor, float]]) -> float:
        """Sum over ranks of ``sum ||c * g||^2`` over the given ``(g, c)`` pairs (one all-reduce of
        a float64)."""
        local = torch.zeros(1, dtype=torch.float64, device=self.device)
        for g, c in grads:
            if g.is_cpu and g.is_contiguous() and g.dtype in _KERNEL_DTYPES:
                # one pass in fp64 (an fp64 copy first costs ~40x more on 4M elements)
                local += _C.kernels.sum_squares(buffer_of(g)) * (c * c)
            else:
                local += g.double().pow(2).sum() * (c * c)
        # through the worker thread: it must not overtake collectives still queued there
        work = self.async_comm.all_reduce(buffer_of(local), _C.ReduceOp.sum, self.timeout,
                                          stream_of(local))
        work.wait(self.timeout)
        return float(local.item())

    def mean_sq_norm(self, grads: List[Tuple[torch.Tensor, float]]) -> float:
        """Mean over ranks of ``sum ||c * g||^2``: the compressed and local phases never form the
        averaged gradient, so clipping and the non-finite check use this (every rank gets the
        same value, so all clip or skip alike)."""
        return self.sum_sq_norm(grads) / self.world

    def shard_norm_sq(self) -> float:
        """Squared norm of the averaged gradient: the sum over ranks of their shards'."""
        return self.sum_sq_norm(
            [(grp.master.grad, 1.0) for grp in self.groups if grp.master.grad is not None])

    # ---- introspection -------------------------------------------------------------------------

    def nbytes(self) -> int:
        """Bytes of staging buffers held now (pool, buckets' own, in use, in flight)."""
        total = sum(t.numel() * t.element_size() for pool in self._pool.values() for t in pool)
        total += sum(t.numel() * t.element_size() for t in self._own.values())
        for acc in self.acc:
            total += sum(t.numel() * t.element_size() for t in acc.bases.values()
                         if t is not None and id(t) not in self._own_ids)
        total += sum(e[4].numel() * e[4].element_size() for e in self._pending)
        total += sum(e[3].numel() * e[3].element_size() for e in self._pending
                     if e[3] is not None and id(e[3]) not in self._own_ids)
        return total


def _cap(grp: GroupLayout, piece: int, world: int) -> int:
    """Elements of group ``grp``'s pool buffers: ``piece`` rounded up to whole chunks (a
    multiple of ``world * alignment``), at most the largest bucket, at least every bucket of
    several tensors (those are staged whole)."""
    if piece <= 0:
        return grp.max_padded
    unit = world * grp.plan.alignment
    several = max((b.padded for b in grp.buckets if b.num_tensors != 1), default=0)
    return min(grp.max_padded, max(-(-piece // unit) * unit, several))


def clip_coef(norm_sq: float, clip: float, scale: float) -> float:
    """What a local gradient is multiplied by: ``scale``, times the clip factor if needed."""
    norm = math.sqrt(norm_sq)
    if clip > 0 and norm > clip:
        return scale * clip / (norm + 1e-6)
    return scale
