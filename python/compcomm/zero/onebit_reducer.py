"""ZeRO's 1-bit gradient reduction: the local gradient compressed and reduce-scattered to shards.

The reduce-scatter is the compressor's (``reduce_scatter_*`` of :class:`compcomm.compress.Compressor`):
the wrapped optimizer's ``compressor_factory`` builds it, 1-bit with error feedback by default,
full precision with :class:`~compcomm.compress.IdentityCompressor`.

Used by OneBitAdam's compressed phase in ``onebit_mode="sharded"`` and by ZeroOneAdam's 1-bit
gradient steps. Bucket ``b`` of this rank's local gradient ``g`` (averaged over micro-steps,
unscaled, clipped) is sent as ``k * g_b`` through the compressed reduce-scatter, with the bucket's
error-feedback buffers; ``k`` is the wrapped optimizer's input scale (``1 - beta1`` for
OneBitAdam, whose momentum update adds ``(1-b1) g``; 1 for ZeroOneAdam, which compresses the
gradient). Chunk r of the 1-bit average, divided by ``k`` and zero at padding positions (1 bit
cannot say 0), becomes rank r's gradient shard, so the wrapped optimizer's ``m = b1*m +
(1-b1)*grad`` adds ``RS_1bit((1-b1) g_local)_r``.

With stage 2/3, ``overlap_comm``, more than one rank and no ``gradient_clipping`` (clipping needs
the norm of the whole local gradient before the first bucket is compressed), each bucket is
exchanged as soon as its gradient is complete in the last micro-step and the buckets before it in
the launch order have gone (:mod:`.grad_reducer`; every collective and check of the compressed
reduce-scatter; only the bucket's workspace is written), on the owner's worker thread while
backward continues, and the end of that backward exchanges the rest; otherwise ``step()``
exchanges them all. ``step()`` then commits every bucket together -- or none, if any exchange
failed or any rank's gradient is not finite -- so a failed or skipped step changes nothing.
"""

from __future__ import annotations

import math
from typing import Any, Callable, List, Optional

import torch

from .._comm import wait_cancellable
from ..compress import Compressor
from ..errors import NonFiniteError
from .grad_reducer import GradReducer, clip_coef
from .layout import GroupLayout

__all__ = ["OneBitReducer"]


class OneBitReducer:
    """1-bit compressed reduce-scatter of the local gradient into the fp32 gradient shards.

    Parameters
    ----------
    groups : list of GroupLayout
    grads : GradReducer
        Where the local gradients are staged.
    comm : compcomm Communicator
        The data-parallel group.
    async_comm : _C.zero.AsyncComm
        The owner's worker thread (the overlapped exchanges go through it).
    compressor : compcomm.compress.Compressor
        Does each bucket's reduce-scatter (key ``(group, bucket)``) and holds its state (1-bit:
        error-feedback buffers and exchange workspace), across steps and in checkpoints.
    input_scale : callable
        ``input_scale(group index)``: what the compressed tensor is the local gradient times.
    loss_scale : callable
        Returns the current loss scale (the gradients are divided by it).
    gas : int
        Micro-steps per step (the gradients are averaged over them).
    clip : float
        ``gradient_clipping`` (0: none).
    overlap : bool
        Exchange each bucket during backward (see the module docstring for when that applies).
    keep_pool : bool
        Whether the full-precision staging pool is used again later (ZeroOneAdam's variance
        steps); OneBitAdam's warm-up never comes back, so its pool is freed.
    rank, world : int
    device : torch.device
    timeout : float
    """

    def __init__(self, groups: List[GroupLayout], grads: GradReducer, comm: Any, async_comm: Any,
                 compressor: Compressor,
                 input_scale: Callable[[int], float], loss_scale: Callable[[], float], gas: int,
                 clip: float, overlap: bool, keep_pool: bool, rank: int, world: int,
                 device: torch.device, timeout: float) -> None:
        self.groups = groups
        self.grads = grads
        self.comm = comm
        self.async_comm = async_comm
        self.compressor = compressor
        self.input_scale = input_scale
        self.loss_scale = loss_scale
        self.gas = gas
        self.clip = clip
        self.overlap = overlap
        self.keep_pool = keep_pool
        self.rank = rank
        self.world = world
        self.device = device
        self.timeout = timeout
        #: overlapped exchanges of this step: (work, group, bucket, fp32 input)
        self.exchanges: List[tuple] = []

    # ---- during backward -----------------------------------------------------------------------

    def check_open(self, gi: int, bi: int) -> None:
        """RuntimeError if bucket ``bi``'s exchange has started (a gradient came too late)."""
        if bi in self.grads.acc[gi].exchanged:
            raise RuntimeError(
                f"ZeroOptimizer: a gradient arrived for bucket {bi} after its 1-bit exchange "
                f"started: more than gradient_accumulation_steps={self.gas} backward passes before step()")

    def bucket_complete(self, gi: int, bi: int, last: bool) -> None:
        """Every gradient of bucket ``bi`` has arrived in this backward: with overlap, in the
        last micro-step (``last``), exchange it in its turn (GradReducer.ready); else it waits,
        staged, for ``step()``."""
        if self.overlap and last:
            self.grads.ready(gi, bi, self._exchange_once)

    def backward_done(self, last: bool) -> None:
        """A backward ended: with overlap, after the last micro-step, exchange every bucket not
        exchanged yet, in order (parameters without gradients count as 0)."""
        if self.overlap and last:
            self.grads.launch_rest(self._exchange_once)
        else:
            self.grads.clear_arrivals()

    def _exchange_once(self, gi: int, bi: int) -> None:
        if bi not in self.grads.acc[gi].exchanged:
            self.submit_exchange(gi, bi)

    def submit_exchange(self, gi: int, bi: int) -> None:
        """Scale bucket bi's local gradient to what is compressed and queue the collective half of
        its compressed reduce-scatter; the local writes (error buffers, gradient shard) wait for
        step(), so the buckets of a step commit together, or none does."""
        grp = self.groups[gi]
        b = grp.buckets[bi]
        st = self.grads.view(gi, bi, onebit=True, keep_pool=self.keep_pool)
        x = st if st.dtype == torch.float32 else st.to(torch.float32)
        if x is not st:  # the fp32 copy is what is exchanged: the staging buffer can be reused
            _, base = self.grads.take(gi, bi)
            self.grads.release(gi, base)
        x.mul_(self.input_scale(gi) / (self.gas * self.loss_scale()))
        out = b.shard_of(grp.master.grad)
        work = self.compressor.reduce_scatter_exchange((gi, bi), x, out, self.async_comm)
        self.exchanges.append((work, gi, bi, x))
        self.grads.acc[gi].exchanged.add(bi)

    # ---- step ----------------------------------------------------------------------------------

    def reduce(self) -> float:
        """Compress every bucket of this rank's local gradient into its fp32 gradient shard.

        Returns the mean over ranks of the squared norm of the local gradients (one all-reduce),
        used for the non-finite check and for ``gradient_clipping``; ``inf``: nothing was written
        and the step is skipped on every rank.
        """
        self.grads.wait()
        if self.exchanges or self.overlap:
            return self._finish_exchanges()
        scale = 1.0 / (self.gas * self.loss_scale())
        items = self.grads.local_buckets()
        norm_sq = self.grads.mean_sq_norm([(x, scale) for _, _, x in items])
        if not math.isfinite(norm_sq):
            return norm_sq
        coef = clip_coef(norm_sq, self.clip, scale)
        for gi, bi, x in items:
            x.mul_(coef * self.input_scale(gi))
            out = self.groups[gi].buckets[bi].shard_of(self.groups[gi].master.grad)
            if self.world == 1:  # as the unsharded optimizers: no compression without peers
                out.copy_(x)
                self._finish_shard(gi, bi, out)
            else:  # every bucket exchanged first, then all committed (or none, on a failure)
                work = self.compressor.reduce_scatter_exchange((gi, bi), x, out, self.async_comm)
                self.exchanges.append((work, gi, bi, x))
        return self._commit_exchanges(norm_sq) if self.exchanges else norm_sq

    def _finish_shard(self, gi: int, bi: int, out: torch.Tensor) -> None:
        """Rank r's chunk of a bucket's 1-bit average -> its gradient shard: divided by the input
        scale, zero at padding positions (1 bit cannot say 0)."""
        b = self.groups[gi].buckets[bi]
        k = self.input_scale(gi)
        if k != 1.0:
            out.div_(k)
        pad = b.padding_start(self.rank)
        if pad < b.chunk:
            out[pad:].zero_()

    def _finish_exchanges(self) -> float:
        """step() of an overlapped 1-bit step: exchange the buckets not exchanged yet (fewer
        micro-steps than gradient_accumulation_steps) in launch order, then the norm all-reduce;
        if every exchange succeeded and the norm is finite, commit every bucket into the gradient
        shards.
        Returns the mean over ranks of the squared norm of the local gradients (inf: skip)."""
        self.grads.launch_rest(self._exchange_once)
        # x = k * g / (gas * loss_scale): the norm is that of x / k
        norm_sq = self.grads.mean_sq_norm([(x, 1.0 / self.input_scale(gi))
                                           for _, gi, _, x in self.exchanges])
        return self._commit_exchanges(norm_sq)

    def _commit_exchanges(self, norm_sq: float) -> float:
        """Wait for every queued exchange; if all succeeded and ``norm_sq`` is finite, commit every
        bucket into the gradient shards, else none (a failed step leaves every error buffer and
        shard as it was). Returns ``norm_sq`` (inf: skip the step); raises an exchange's error."""
        failure: Optional[Exception] = None
        for work, *_ in self.exchanges:
            try:
                work.wait(self.timeout)
            except NonFiniteError:  # raised on every rank for the same bucket: skip the step
                norm_sq = math.inf
            except Exception as e:  # noqa: BLE001 -- re-raised once every work is done
                failure = failure or e
        synced = False
        if failure is None and math.isfinite(norm_sq):
            try:  # NCCL: a peer lost in the last exchange raises here, before any commit
                synced = wait_cancellable(self.comm, self.timeout)
            except Exception as e:  # noqa: BLE001 -- re-raised below, after drop()
                failure = e
        if failure is None and math.isfinite(norm_sq):
            for _, gi, bi, x in self.exchanges:  # after a wait that found no abort, all write
                grp = self.groups[gi]
                out = grp.buckets[bi].shard_of(grp.master.grad)
                self.compressor.reduce_scatter_commit((gi, bi), x, out, gate=not synced)
                self._finish_shard(gi, bi, out)
        self.drop()
        if failure is not None:
            raise failure
        return norm_sq

    def drop(self) -> None:
        """Wait for queued exchanges (their errors are dropped), release their buffers and forget
        the staged gradients."""
        for work, *_ in self.exchanges:
            try:
                work.wait(self.timeout)
            except Exception:  # noqa: BLE001 -- nothing was committed; the step is abandoned
                pass
        self.exchanges.clear()
        self.grads.reset()
