"""ZeRO's gradient staging and full-precision reduction.

Stage 1: gradients stay whole in ``p.grad``; ``flush()`` copies them into the flat layout and
reduce-scatters each bucket into the group's fp32 gradient shard (``master.grad``).

Stage 2/3: a post-accumulate hook (installed by ZeroOptimizer) hands every gradient to
:meth:`GradReducer.accumulate` as soon as autograd has accumulated it: it is added into its
bucket's staging buffer and ``p.grad`` is freed. A complete bucket is reduce-scattered right away
(:meth:`submit`), on the owner's ``AsyncComm`` worker thread, in the background when
``overlap_comm`` is set (at most two staging buffers in flight, taken from a pool of largest-bucket
buffers). In a 1-bit step every bucket stays staged until it is compressed, each in an exact-size
buffer of its own kept across steps (see :mod:`.onebit_reducer`).

Also here: the squared gradient norms behind ``gradient_clipping`` and the non-finite check (one
all-reduce of a float64 through the worker thread, so it never overtakes queued collectives).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

import torch

from .. import _C
from .._buffers import buffer_of
from .layout import GroupLayout

__all__ = ["GradReducer", "clip_coef"]


_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class _Accumulation:
    """One group's gradients of the current accumulation (stage 2/3)."""

    def __init__(self, num_buckets: int) -> None:
        self.arrived: List[set] = [set() for _ in range(num_buckets)]  # tensors staged per bucket
        self.rounds: List[int] = [0] * num_buckets  # 1-bit overlap: micro-steps completed
        self.exchanged: set = set()  # 1-bit overlap: buckets whose exchange has started
        self.views: Dict[int, torch.Tensor] = {}  # bucket -> staging view being filled
        self.bases: Dict[int, torch.Tensor] = {}  # bucket -> the buffer it views

    def reset(self) -> None:
        self.views.clear()
        self.bases.clear()
        self.exchanged.clear()
        self.rounds = [0] * len(self.rounds)
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
    """

    def __init__(self, groups: List[GroupLayout], stage: int, async_comm: _C.zero.AsyncComm,
                 overlap: bool, rank: int, world: int, device: torch.device,
                 timeout: float) -> None:
        self.groups = groups
        self.stage = stage
        self.async_comm = async_comm
        self.overlap = overlap
        self.rank = rank
        self.world = world
        self.device = device
        self.timeout = timeout
        self.acc = [_Accumulation(len(g.buckets)) for g in groups]
        self._pending: List[tuple] = []  # (work, group, bucket, staging base, recv)
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
                pool = self._pool.setdefault((grp.max_padded, grp.dtype), [])
                if not pool and len(self._pending) >= 2:
                    self.complete(1)  # reuse a buffer in flight rather than grow the pool
                base = (pool.pop() if pool
                        else torch.empty(grp.max_padded, dtype=grp.dtype, device=self.device))
            st = base[:padded]
            st.zero_()
            acc.views[bi] = st
            acc.bases[bi] = base
        return st

    def release(self, gi: int, base: torch.Tensor) -> None:
        """A staging buffer is free again: back to the pool unless it is a bucket's own."""
        if id(base) not in self._own_ids:
            grp = self.groups[gi]
            self._pool.setdefault((grp.max_padded, grp.dtype), []).append(base)

    def take(self, gi: int, bi: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Remove bucket ``bi``'s staging view from the accumulation: (view, base buffer)."""
        acc = self.acc[gi]
        return acc.views.pop(bi), acc.bases.pop(bi)

    def accumulate(self, gi: int, ti: int, grad: torch.Tensor, onebit: bool,
                   keep_pool: bool = True) -> bool:
        """Add tensor ``ti``'s gradient into its bucket's staging; True when every tensor of the
        bucket has arrived (the arrivals are then counted afresh)."""
        grp = self.groups[gi]
        slot = grp.tensors[ti]
        b = grp.buckets[slot.bucket]
        st = self.view(gi, slot.bucket, onebit, keep_pool)
        lo = slot.offset - b.offset
        st[lo : lo + slot.numel].add_(grad.reshape(-1))
        arrived = self.acc[gi].arrived[slot.bucket]
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

    def drop_buffers(self) -> None:
        """Free the pool and the buckets' own buffers (nothing is staged: after :meth:`reset`)."""
        self._pool.clear()
        self._own.clear()
        self._own_ids.clear()

    # ---- full-precision reduction --------------------------------------------------------------

    def submit(self, gi: int, bi: int) -> None:
        """Reduce-scatter bucket ``bi``'s staged gradient (added to the shard by
        :meth:`complete`)."""
        grp = self.groups[gi]
        st, base = self.take(gi, bi)
        self.acc[gi].arrived[bi].clear()
        recv = torch.empty(grp.buckets[bi].chunk, dtype=grp.dtype, device=self.device)
        work = self.async_comm.reduce_scatter(buffer_of(st), buffer_of(recv),
                                              timeout_s=self.timeout)
        self._pending.append((work, gi, bi, base, recv))
        if not self.overlap:
            self.complete(len(self._pending))

    def complete(self, count: int) -> None:
        """Wait for the oldest ``count`` pending reductions and add them to the gradient shards."""
        for _ in range(count):
            work, gi, bi, base, recv = self._pending.pop(0)
            work.wait(self.timeout)
            grp = self.groups[gi]
            if self.sink is not None:
                self.sink.receive(gi, grp, bi, recv)
            else:
                grp.buckets[bi].shard_of(grp.master.grad).add_(recv)
            self.release(gi, base)

    def wait(self) -> None:
        """Wait for every pending reduction (with offload: and its copy to the host)."""
        self.complete(len(self._pending))
        if self.sink is not None:
            self.sink.drain()

    def flush(self) -> None:
        """Reduce every partly filled bucket (parameters without gradients count as 0), wait all.
        Stage 1: reduce-scatter each group's whole gradients (``p.grad``) into a new shard."""
        if self.stage >= 2:
            for gi, acc in enumerate(self.acc):
                for bi in sorted(acc.views):
                    self.submit(gi, bi)
            self.wait()
            return
        for gi, grp in enumerate(self.groups):
            flat = grp.flatten((p.grad for p in grp.params), grp.dtype, self.device)
            shard = torch.empty(grp.plan.shard_numel, dtype=grp.dtype, device=self.device)
            self.async_comm.bucketed_reduce_scatter(
                grp.plan, buffer_of(flat), buffer_of(shard), timeout_s=self.timeout
            ).wait(self.timeout)
            if self.sink is None:
                grp.master.grad = shard.to(torch.float32)
                continue
            grp.master.grad = None  # the sink attaches its zeroed host shard
            for bi, b in enumerate(grp.buckets):
                self.sink.receive(gi, grp, bi, b.shard_of(shard))
        if self.sink is not None:
            self.sink.drain()

    def local_buckets(self) -> List[Tuple[int, int, torch.Tensor]]:
        """This rank's local gradient (summed over micro-steps, unscaled), bucket by bucket:
        ``[(group, bucket, fp32 tensor of the bucket's padded length, zero padding)]``. The staging
        bookkeeping is reset (the fp32 tensors stay valid: nothing reuses them before the next
        backward). Stage 1 also replaces the gradient shards by zeros."""
        self.wait()
        items = []
        for gi, grp in enumerate(self.groups):
            if self.stage >= 2:
                for bi, b in enumerate(grp.buckets):
                    st = self.acc[gi].views.get(bi)
                    x = (st.to(torch.float32) if st is not None
                         else torch.zeros(b.padded, device=self.device))
                    items.append((gi, bi, x))
            else:
                flat = grp.flatten((p.grad for p in grp.params), torch.float32, self.device)
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
        work = self.async_comm.all_reduce(buffer_of(local), _C.ReduceOp.sum, self.timeout)
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
                         if id(t) not in self._own_ids)
        total += sum(e[3].numel() * e[3].element_size() + e[4].numel() * e[4].element_size()
                     for e in self._pending)
        return total


def clip_coef(norm_sq: float, clip: float, scale: float) -> float:
    """What a local gradient is multiplied by: ``scale``, times the clip factor if needed."""
    norm = math.sqrt(norm_sq)
    if clip > 0 and norm > clip:
        return scale * clip / (norm + 1e-6)
    return scale
