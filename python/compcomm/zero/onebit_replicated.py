"""OneBitAdam under ZeRO with DeepSpeed's numerics: the momentum is replicated in the compressed phase.

Why this works. After a compressed step of 1-bit Adam the momentum is the output of the compressed
allreduce: identical on every rank, and itself a 1-bit tensor (a sign per element, one scale per
chunk). So it need not be sharded. At the first compressed step each rank all-gathers the momentum
shards once; from then on every rank forms ``b1 * m + (1 - b1) * g_local`` for every bucket and
averages it with the full compressed allreduce (per-bucket error feedback), exactly what unsharded
OneBitAdam compresses. The result is the new momentum on every rank.

Two modes (``zero_optimization.onebit_mode``):

* ``"exact"`` (default): master weights and the frozen variance stay sharded; each rank updates its
  shard with its own chunks of the shared momentum and the shards are all-gathered in full
  precision, as in the warm-up. Memory: the full momentum (fp32, ``4 P`` bytes) on top of ZeRO's
  shards.
* ``"no_allgather"``: the frozen variance, and for fp16/bf16 parameters the fp32 master weights,
  are also all-gathered once; every rank then applies the shared momentum to the whole parameters,
  as unsharded 1-bit Adam does, so a compressed step sends only the compressed allreduce (plus the
  8-byte norm all-reduce). Memory: unsharded 1-bit Adam's optimizer state.

The shards stay authoritative for checkpoints: after every compressed step this rank's chunks of the
momentum (and, in ``no_allgather``, of the master weights) are copied back into the wrapped
optimizer's shard state, so a checkpoint has the usual format and a load simply drops the full
tensors, which the next compressed step gathers again (bit for bit the same, since the momentum is
the same on every rank).

Equal to unsharded OneBitAdam when that optimizer compresses the same buckets: its
``reduce_bucket_size`` equal to ZeRO's and ZeRO's buckets padded like ``compcomm.padded_numel``
(ZeroOptimizer aligns 1-bit buckets to ``world * lcm(world, 8)`` in these modes for that reason).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Tuple

import torch

from .._buffers import buffer_of
from ..compress import Compressor
from ..errors import NonFiniteError
from ..optim.functional import adam_update
from .grad_reducer import GradReducer, clip_coef
from .layout import GroupLayout

__all__ = ["ReplicatedMomentum"]


class ReplicatedMomentum:
    """The compressed phase of ZeRO + OneBitAdam in the ``exact`` and ``no_allgather`` modes.

    Parameters
    ----------
    mode : {"exact", "no_allgather"}
    groups : list of GroupLayout
    grads : GradReducer
        Where the local gradients are staged (and the norm all-reduce).
    inner : OneBitAdam
        The wrapped optimizer (its shard state, hyper-parameters and schedule).
    compressor : compcomm.compress.Compressor
        The compressed average and every bucket's state (1-bit: error-feedback buffers).
    async_comm : _C.zero.AsyncComm
        The owner's worker thread (the full tensors are all-gathered through it).
    loss_scale : callable
        Returns the current loss scale.
    gas : int
    clip : float
    rank, world : int
    device : torch.device
    timeout : float
    """

    def __init__(self, mode: str, groups: List[GroupLayout], grads: GradReducer, inner: Any,
                 compressor: Compressor, async_comm: Any,
                 loss_scale: Callable[[], float], gas: int,
                 clip: float, rank: int, world: int, device: torch.device,
                 timeout: float) -> None:
        if mode not in ("exact", "no_allgather"):
            raise ValueError(f"ReplicatedMomentum: mode must be 'exact' or 'no_allgather', got {mode!r}")
        self.mode = mode
        self.groups = groups
        self.grads = grads
        self.inner = inner
        self.compressor = compressor
        self.async_comm = async_comm
        self.loss_scale = loss_scale
        self.gas = gas
        self.clip = clip
        self.rank = rank
        self.world = world
        self.device = device
        self.timeout = timeout
        self.m: Dict[int, torch.Tensor] = {}  # group -> full fp32 momentum (flat layout)
        self.v: Dict[int, torch.Tensor] = {}  # no_allgather: group -> full frozen variance
        self.w: Dict[int, torch.Tensor] = {}  # no_allgather, fp16/bf16: group -> full fp32 master
        self._avg: List[Tuple[int, int, torch.Tensor]] = []  # reduced buckets awaiting update()

    # ---- state -------------------------------------------------------------------------------

    @property
    def publishes(self) -> bool:
        """Whether a compressed step ends with ZeRO's all-gather of the parameter shards."""
        return self.mode == "exact"

    def reset(self) -> None:
        """Forget the full tensors (a checkpoint was loaded): regathered from the shards."""
        self.m.clear()
        self.v.clear()
        self.w.clear()
        self._avg.clear()

    def nbytes(self) -> int:
        """Optimizer-state bytes of the full tensors."""
        return sum(t.numel() * 4 for d in (self.m, self.v, self.w) for t in d.values())

    def _shard_state(self, gi: int) -> Dict[str, Any]:
        grp = self.groups[gi]
        st = self.inner.state[grp.master]
        if "exp_avg" not in st:  # zeros if no warm-up step ran (freeze_step=0)
            st["exp_avg"] = torch.zeros_like(grp.master, dtype=torch.float32)
            st["exp_avg_sq"] = torch.zeros_like(grp.master, dtype=torch.float32)
        return st

    def _ensure(self) -> None:
        """All-gather, once, the shards this mode keeps in full (momentum; no_allgather: also the
        frozen variance and fp16/bf16 master weights)."""
        works = []
        for gi, grp in enumerate(self.groups):
            if gi in self.m:
                continue
            st = self._shard_state(gi)
            srcs = [(self.m, st["exp_avg"])]
            if self.mode == "no_allgather":
                srcs.append((self.v, st["exp_avg_sq"]))
                if grp.dtype != torch.float32:
                    srcs.append((self.w, grp.master.detach()))
            for dst, shard in srcs:
                full = torch.empty(grp.plan.flat_numel, dtype=torch.float32, device=self.device)
                dst[gi] = full
                shard = shard.to(self.device).contiguous()  # offload: from host memory
                works.append((self.async_comm.bucketed_all_gather(
                    grp.plan, buffer_of(shard), buffer_of(full), timeout_s=self.timeout), shard))
        for w, _ in works:
            w.wait(self.timeout)

    # ---- the step ----------------------------------------------------------------------------

    def reduce(self) -> float:
        """Compress every bucket's ``b1 * m + (1 - b1) * g_local`` with the compressed allreduce
        (the compressor's :meth:`~compcomm.compress.OneBitCompressor.average_`, error feedback
        per bucket, key ``(group, bucket)``).

        Nothing outside this object's scratch is written unless every exchange succeeded and the
        gradient norm is finite; then the error buffers are committed and the averaged buckets wait
        for :meth:`update`. Returns the mean over ranks of the squared local-gradient norms
        (``inf``: the step is skipped on every rank).
        """
        items = self.grads.local_buckets()
        scale = 1.0 / (self.gas * self.loss_scale())
        norm_sq = self.grads.mean_sq_norm([(x, scale) for _, _, x in items])
        if not math.isfinite(norm_sq):
            return norm_sq
        self._ensure()
        coef = clip_coef(norm_sq, self.clip, scale)
        staged: List[Tuple[int, int, torch.Tensor]] = []

        def stage(i: int) -> torch.Tensor:  # bucket i + 1 is staged while bucket i is on the wire
            gi, bi, x = items[i]
            b1 = float(self.inner.param_groups[gi]["betas"][0])
            if coef != 1.0:
                x.mul_(coef)
            m = self.groups[gi].buckets[bi].span(self.m[gi])
            # the same operations as unsharded OneBitAdam's staging, so the same bits
            y = torch.mul(m, b1).add_(x, alpha=1 - b1)
            staged.append((gi, bi, y))
            return y

        try:
            self.compressor.average_([(gi, bi) for gi, bi, _ in items],
                                     [self.groups[gi].buckets[bi].padded for gi, bi, _ in items],
                                     stage, self.device)
        except NonFiniteError:  # raised on every rank, nothing written: skip the step
            return math.inf
        self._avg = staged
        return norm_sq

    def update(self) -> None:
        """Apply the averaged momentum (after the skip decision; nothing here fails)."""
        inner = self.inner
        for gi, bi, y in self._avg:
            b = self.groups[gi].buckets[bi]
            y[b.numel:].zero_()  # padding: 1 bit cannot say 0, unsharded keeps no padding
            b.span(self.m[gi]).copy_(y)
        self._avg = []
        t = inner.schedule.step + 1
        for gi, grp in enumerate(self.groups):
            group = inner.param_groups[gi]
            st = self._shard_state(gi)
            grp.own_chunks(self.m[gi], st["exp_avg"], self.rank)
            if self.mode == "exact":
                w, m, v = grp.master.data, st["exp_avg"], st["exp_avg_sq"]
            else:
                w = self.w[gi] if gi in self.w else grp.flat
                m, v = self.m[gi], self.v[gi]
            # variance frozen since the warm-up: its correction too, as unsharded OneBitAdam
            update = adam_update(m, v, w, group, t, min(t, inner.freeze_step))
            w.add_(update, alpha=-group["lr"])
            st["step"] = t
            if self.mode == "no_allgather":
                if gi in self.w:
                    grp.flat.copy_(w)  # the model's parameters (param dtype)
                grp.own_chunks(w, grp.master.data, self.rank)  # shards stay current for checkpoints
        inner.schedule.advance(inner.schedule.next_kind())  # the wrapped optimizer's step count
