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
  precision, as in the warm-up. Memory: the full momentum in its 1-bit form (about ``P/8`` bytes,
  :mod:`.packed_momentum`) on top of ZeRO's shards.
* ``"no_allgather"``: the frozen variance, and for fp16/bf16 parameters the fp32 master weights,
  are also all-gathered once; every rank then applies the shared momentum to the whole parameters,
  as unsharded 1-bit Adam does, so a compressed step sends only the compressed allreduce (plus the
  8-byte norm all-reduce). Memory: the packed momentum, the full frozen variance (``4 P``; or, on
  the torch-op path, the frozen denominator ``sqrt(v) + eps`` computed once in its place) and for
  fp16/bf16 parameters the fp32 master (``4 P``).

The momentum between steps. The compressor hands back each bucket's result as signs plus one
scale per chunk (:meth:`~compcomm.compress.OneBitCompressor.packed_average`); that is all this
object keeps of the momentum. A step unpacks it (exactly: ``tau * +-1``) into the bucket's staging
tensor, forms the local momentum there, and the compressed allreduce's output in that tensor is
the new momentum for this step's update. The full fp32 momentum exists only at the first
compressed step (gathered from the warm-up's shards), after a checkpoint load (regathered from the
shards, which hold exactly the unpacked values), and with a compressor that does not pack (one
rank, :class:`~compcomm.compress.IdentityCompressor`).

With ZeRO-Offload (``offload_optimizer``; "exact" mode) the shards live in host memory and
``zero_optimization.onebit_placement`` says where the 1-bit work of a bucket runs:

* ``"device"`` (default): where the gradients are. The local momentum is formed, compressed and
  averaged on the device; then this rank's chunk of the result is copied to the host momentum
  shard as fp32 values. (Copying only its 1-bit form, 32x fewer bytes over PCIe, and unpacking on
  the host measured 4.1x slower on the H200: 6.2 against 1.5 ms per 10M-element bucket,
  ``bench/bench_offload.py`` part (d): the host's unpacking costs more than PCIe saves.) Device
  memory: the error feedback, the packed momentum and the staged gradient.
* ``"host"``: the local gradient of every bucket is copied to the host (in the parameter dtype,
  converted there) and the momentum, the compression, its error feedback and the packed momentum
  are all in host memory (the CPU kernels); nothing 1-bit stays on the device. The communicator
  must take host buffers (MPI, the local one; not NCCL with several ranks).

The numerics are the same in both (the CPU kernels are the GPU kernels' twins, to fp32 rounding;
on a CPU-only run the two are the same operations).

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
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .._buffers import buffer_of
from .._scratch import stream_of
from ..compress import Compressor
from ..errors import NonFiniteError
from ..optim import cpu_adam
from ..optim.adam import cpu_kernels_usable
from ..optim.functional import adam_denom, adam_update
from .grad_reducer import GradReducer, clip_coef
from .layout import GroupLayout
from .packed_momentum import PackedMomentum

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
    offload : bool
        The master and state shards are in host memory (``offload_optimizer``).
    placement : {"device", "host"}
        With ``offload``: where the 1-bit work runs (see the module docstring).
    """

    def __init__(self, mode: str, groups: List[GroupLayout], grads: GradReducer, inner: Any,
                 compressor: Compressor, async_comm: Any,
                 loss_scale: Callable[[], float], gas: int,
                 clip: float, rank: int, world: int, device: torch.device,
                 timeout: float, offload: bool = False, placement: str = "device") -> None:
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
        if placement not in ("device", "host") or (placement == "host" and not offload):
            raise ValueError(f"ReplicatedMomentum: placement must be 'device' or (with offload) "
                             f"'host', got {placement!r}")
        #: where the momentum, the compression and its buffers live
        self.where = torch.device("cpu") if placement == "host" else device
        # group -> full fp32 momentum (flat layout): only until every bucket of the group is packed
        self.m: Dict[int, torch.Tensor] = {}
        self.packed = PackedMomentum()  # (group, bucket) -> the 1-bit momentum
        self.v: Dict[int, torch.Tensor] = {}  # no_allgather: group -> full frozen variance
        self.d: Dict[int, torch.Tensor] = {}  # no_allgather, torch path: frozen sqrt(v) + eps
        self.w: Dict[int, torch.Tensor] = {}  # no_allgather, fp16/bf16: group -> full fp32 master
        self._avg: List[Tuple[int, int, torch.Tensor]] = []  # reduced buckets awaiting update()
        # ... and their 1-bit form (signs, scales), from the compressor
        self._packs: Optional[List[Tuple[torch.Tensor, torch.Tensor]]] = None

    # ---- state -------------------------------------------------------------------------------

    @property
    def publishes(self) -> bool:
        """Whether a compressed step ends with ZeRO's all-gather of the parameter shards."""
        return self.mode == "exact"

    def reset(self) -> None:
        """Forget the full tensors (a checkpoint was loaded): regathered from the shards."""
        self.m.clear()
        self.packed.reset()
        self.v.clear()
        self.d.clear()
        self.w.clear()
        self._avg.clear()
        self._packs = None

    def nbytes(self) -> int:
        """Optimizer-state bytes of what is kept in full: the packed momentum (or, before it
        exists or with a compressor that does not pack, the fp32 one), the no_allgather tensors."""
        full = sum(t.numel() * 4 for d in (self.m, self.v, self.d, self.w) for t in d.values())
        return full + self.packed.nbytes()

    def _packed_group(self, gi: int) -> bool:
        return all((gi, bi) in self.packed for bi in range(len(self.groups[gi].buckets)))

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
            st = self._shard_state(gi)
            srcs = []
            if gi not in self.m and not self._packed_group(gi):
                srcs.append((self.m, st["exp_avg"]))
            if self.mode == "no_allgather" and gi not in self.v and gi not in self.d:
                srcs.append((self.v, st["exp_avg_sq"]))
                if grp.dtype != torch.float32:
                    srcs.append((self.w, grp.master.detach()))
            for dst, shard in srcs:
                full = torch.empty(grp.plan.flat_numel, dtype=torch.float32, device=self.where)
                dst[gi] = full
                shard = shard.to(self.where).contiguous()  # offload: from host memory
                works.append((self.async_comm.bucketed_all_gather(
                    grp.plan, buffer_of(shard), buffer_of(full), timeout_s=self.timeout,
                    stream=stream_of(full)), shard))
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
        items = self.grads.local_buckets(self.where)
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
            b = self.groups[gi].buckets[bi]
            # the same operations as unsharded OneBitAdam's staging, so the same bits (unpacking
            # is exact: the fp32 momentum had these values)
            if (gi, bi) in self.packed:  # b1 * m in the unpacking pass
                y = self.packed.unpack_((gi, bi), torch.empty(b.padded, device=self.where),
                                        mul=b1)
                y.add_(x, alpha=1 - b1)
            else:
                y = torch.mul(b.span(self.m[gi]), b1).add_(x, alpha=1 - b1)
            staged.append((gi, bi, y))
            return y

        keys = [(gi, bi) for gi, bi, _ in items]
        numels = [self.groups[gi].buckets[bi].padded for gi, bi, _ in items]
        packed_average = getattr(self.compressor, "packed_average", None)
        try:
            if packed_average is not None:
                self._packs = packed_average(keys, numels, stage, self.where)
            else:
                self.compressor.average_(keys, numels, stage, self.where)
                self._packs = None
        except NonFiniteError:  # raised on every rank, nothing written: skip the step
            return math.inf
        self._avg = staged
        return norm_sq

    def update(self) -> None:
        """Apply the averaged momentum (after the skip decision; nothing here fails)."""
        inner, r = self.inner, self.rank
        ys: Dict[Tuple[int, int], torch.Tensor] = {}
        for i, (gi, bi, y) in enumerate(self._avg):
            b = self.groups[gi].buckets[bi]
            y[b.numel:].zero_()  # padding: 1 bit cannot say 0, unsharded keeps no padding
            ys[(gi, bi)] = y
            if self._packs is not None:  # what persists: signs + scales
                signs, scales = self._packs[i]
                self.packed.put((gi, bi), signs, scales, b.numel, b.chunk)
            else:
                b.span(self.m[gi]).copy_(y)
        self._avg, self._packs = [], None
        t = inner.schedule.step + 1
        for gi, grp in enumerate(self.groups):
            if gi in self.m and self._packed_group(gi):
                del self.m[gi]  # the packed form took over
            group = inner.param_groups[gi]
            st = self._shard_state(gi)
            for bi, b in enumerate(grp.buckets):  # shards stay current for checkpoints
                b.shard_of(st["exp_avg"]).copy_(ys[(gi, bi)][r * b.chunk: (r + 1) * b.chunk])
            st["step"] = t
            # variance frozen since the warm-up: its correction too, as unsharded OneBitAdam
            bc2_t = min(t, inner.freeze_step)
            if self.mode == "exact":
                w = grp.master.data
                w.add_(adam_update(st["exp_avg"], st["exp_avg_sq"], w, group, t, bc2_t),
                       alpha=-group["lr"])
                continue
            self._whole_update(gi, grp, group, ys, t, bc2_t)
        inner.schedule.advance(inner.schedule.next_kind())  # the wrapped optimizer's step count

    def _whole_update(self, gi: int, grp: GroupLayout, group: Dict[str, Any],
                      ys: Dict[Tuple[int, int], torch.Tensor], t: int, bc2_t: int) -> None:
        """no_allgather: every rank updates the whole parameters with the shared momentum, bucket
        by bucket (elementwise, so the bits of one whole-tensor update), with the frozen
        denominator ``sqrt(v) + eps`` computed once (in the full variance's place). On the CPU one
        C++ pass per bucket (:func:`compcomm.optim.cpu_adam.onebit_compressed_step_` with
        ``denom=True``, also writing the fp16/bf16 parameters) where those kernels give the torch
        ops' bits here; otherwise the torch ops."""
        half = gi in self.w
        w = self.w[gi] if half else grp.flat
        fused = cpu_kernels_usable(group, [w], frozen=True)  # the kernels read d, not v
        if gi not in self.d:  # sqrt(v) + eps is frozen too: once, in v's place
            self.d[gi] = adam_denom(self.v.pop(gi), group, bc2_t)
        for bi, b in enumerate(grp.buckets):
            y, wb = ys[(gi, bi)], b.span(w)
            if fused:
                cpu_adam.onebit_compressed_step_(wb, y, b.span(self.d[gi]), y, group, t, bc2_t,
                                                 param_out=b.span(grp.flat) if half else None,
                                                 denom=True)
            else:
                d = b.span(self.d[gi])  # (v is not read when the denominator is given)
                wb.add_(adam_update(y, d, wb, group, t, bc2_t, denom=d), alpha=-group["lr"])
                if half:
                    b.span(grp.flat).copy_(wb)  # the model's parameters (param dtype)
            b.shard_of(grp.master.data).copy_(b.chunk_of(w, self.rank))
