"""ZeroOptimizer: ZeRO stage 1/2/3 around any torch optimizer, on compcomm's bucketed collectives.

How it works. Each parameter group's parameters are laid out by ``_C.zero.plan_buckets``: a flat
buffer cut into buckets (``reduce_bucket_size`` elements for stage 1/2, one parameter per bucket for
stage 3), each padded to a multiple of ``world * 2`` elements and split into ``world`` equal chunks.
Rank r owns chunk r of every bucket; the concatenation of its chunks is its *shard*. The wrapped
optimizer sees one fp32 tensor per group: the rank's shard of the master weights, whose ``.grad`` is
the rank's shard of the averaged gradient. So optimizer state and master weights are 1/W (stage 1).

* Stage 1: gradients stay whole in ``p.grad``; ``step()`` copies them into the flat layout bucket by
  bucket and reduce-scatters each bucket into the fp32 gradient shard.
* Stage 2: a hook on every parameter copies its gradient into its bucket's staging buffer as soon as
  autograd has accumulated it and frees ``p.grad``; a full bucket is reduce-scattered right away, on
  the AsyncComm worker thread when ``overlap_comm`` is set (two staging buffers in flight at most),
  so only the gradient shard and the staging buffers stay alive.
* Stage 3: parameters too are stored only as shards (``param_dtype``); module hooks all-gather a
  module's own parameters before its forward and backward (prefetching the next modules of the
  recorded trace up to ``stage3_prefetch_bucket_size`` elements, never more than
  ``stage3_max_live_parameters`` alive) and free them afterwards, except parameters of at most
  ``stage3_param_persistence_threshold`` elements and parameters used again within
  ``stage3_max_reuse_distance`` elements of the trace.

After the inner step the fp32 shard is cast to the parameter dtype and (stage 1/2) all-gathered
back into the flat parameter buffer that the model's parameters are views of, in calls of at most
``allgather_bucket_size`` elements. Gradients are averaged over ranks and over
``gradient_accumulation_steps`` micro-steps; ``gradient_clipping`` clips by the global norm across
shards (one all-reduce of a scalar).

With ``compcomm.optim.OneBitAdam`` (stage 1/2/3) the compressed phase depends on ``onebit_mode``:
"exact" (default) and "no_allgather" replicate the momentum and compress ``b1*m + (1-b1)*g_local``
with the full compressed allreduce, as unsharded OneBitAdam (:mod:`.onebit_replicated`); "sharded"
reduces each bucket of the local momentum contribution ``(1-b1) * g_local`` with the 1-bit
:func:`~compcomm.zero.compressed_reduce_scatter`. ZeroOneAdam's 1-bit gradient steps reduce its local
gradient that way. See docs/zero.md, "1-bit optimizers with ZeRO". ZeroOneAdam's local-step phase needs every
rank's own full momentum, so from ``var_freeze_step`` on the wrapped optimizer runs unsharded on the
model's parameters (its state all-gathered once).

Collectives issued from hooks run in autograd's order, which is the same on every rank for the same
model; every rank must run the same modules.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch

from .. import _C
from .._buffers import buffer_of
from .._comm import resolve
from ..collectives import DEFAULT_TIMEOUT, workspace_bytes
from .rules import onebit_inner_kwargs, onebit_kind
from ..errors import NonFiniteError
from .config import validate_zero_config
from .onebit_replicated import MODES, ReplicatedMomentum


__all__ = ["ZeroOptimizer", "initialize"]

# Stage 3's backward pre-hooks also fire on modules whose inputs need no gradient (the first layer);
# torch warns about that case, which is exactly the one the hooks are meant for.
warnings.filterwarnings(
    "ignore", message="Full backward hook is firing when gradients are computed with respect to module outputs"
)

ALIGNMENT = 2  # DeepSpeed's nccl_start_alignment_factor
ONEBIT_ALIGNMENT = 8  # 1-bit optimizers: chunks of whole bytes of signs


class _Group:
    """One parameter group: its layout, master shard and buffers."""

    def __init__(self, params: List[torch.nn.Parameter], plan: Any, options: Dict[str, Any]):
        self.params = params
        self.plan = plan
        self.options = options
        self.tensors = plan.tensors  # (numel, offset, bucket)
        self.buckets = plan.buckets
        self.dtype = params[0].dtype if params else torch.float32
        self.flat: Optional[torch.Tensor] = None  # stage 1/2: the full parameters (param dtype)
        self.shard16: Optional[torch.Tensor] = None  # this rank's parameter shard (param dtype)
        self.master: Optional[torch.Tensor] = None  # fp32 shard, .grad = fp32 gradient shard
        # stage 2/3 hook bookkeeping
        self.arrived: List[set] = [set() for _ in self.buckets]
        # stage 2 + overlap_comm, 1-bit steps: micro-steps completed per bucket, buckets exchanged
        self.rounds: List[int] = [0] * len(self.buckets)
        self.exchanged: set = set()
        self.staging: Dict[int, torch.Tensor] = {}  # bucket -> view being filled
        self.staging_base: Dict[int, torch.Tensor] = {}  # bucket -> the pool buffer it views
        self.max_padded = max((b["padded"] for b in self.buckets), default=0)


class ZeroOptimizer:
    """ZeRO stage 1, 2 or 3 around any ``torch.optim`` optimizer.

    Parameters
    ----------
    params : iterable of Parameter or of dict
        The model's parameters, or parameter groups (dicts with ``params`` and per-group options
        such as ``lr``) as for any torch optimizer. Every rank passes the same parameters in the same
        order; rank 0's initial values are broadcast. All on one device: the CPU, or a GPU with a
        communicator that takes device buffers (see docs/zero.md, "Devices").
    optimizer_class : callable
        The optimizer to wrap, e.g. ``torch.optim.AdamW`` (or a ``functools.partial`` of one). It is
        built on the fp32 master shards, one tensor per group. Must be elementwise (Adam, AdamW,
        SGD, ...): a per-tensor rule such as LAMB would see shards, not tensors.
        ``compcomm.optim.OneBitAdam`` (stage 1/2/3) and ``ZeroOneAdam`` (stage 1/2) are supported:
        the wrapped optimizer runs on the shards without communicating. OneBitAdam's compressed
        phase follows ``onebit_mode`` (a ``zero_config`` key): "exact" (default: unsharded
        OneBitAdam's numerics, momentum replicated, parameters all-gathered), "no_allgather" (also
        the frozen variance replicated: whole-parameter updates, no all-gather; stage 1/2) or
        "sharded" (``(1-b1) * g_local`` through the compressed reduce-scatter into the momentum
        shard). ZeroOneAdam's 1-bit gradient steps reduce ``g_local`` with the compressed
        reduce-scatter, error feedback per bucket and rank.
        ZeroOneAdam's local-step phase (after ``var_freeze_step``) runs unsharded: its state is
        all-gathered once and the steps are exactly unsharded ZeroOneAdam's (see docs/zero.md).
        ``exact_resume=True`` in ``optimizer_kwargs`` makes checkpoints carry the error buffers.
        ZeroOneAdam with stage 3, and ``OneBitLamb``, raise ValueError.
    stage : {1, 2, 3}
        ZeRO stage.
    process_group : torch ProcessGroup or compcomm Communicator, optional
        The data-parallel group (default: compcomm's default, see ``compcomm.get_communicator``).
    module : torch.nn.Module, optional
        The model; required for stage 3 (its modules get the gather/release hooks).
    optimizer_kwargs : dict, optional
        Keyword arguments for ``optimizer_class`` (``lr``, ``betas``, ...).
    gradient_accumulation_steps : int
        Micro-steps per ``step()``; gradients are averaged over them (and over ranks).
    gradient_clipping : float
        Clip the gradient to this global L2 norm (0: no clipping), as DeepSpeed's
        ``gradient_clipping``.
    loss_scale : float
        fp16 loss scale: 0 means dynamic (starting at ``initial_scale_power``), > 0 static. Use
        :meth:`backward` so the scale is applied. Steps whose gradient is not finite are skipped.
    timeout : float
        Seconds any collective may take.
    **zero_config
        DeepSpeed ``zero_optimization`` keys (``reduce_bucket_size``, ``allgather_bucket_size``,
        ``overlap_comm``, ``contiguous_gradients``, ``stage3_*`` ...); unknown keys raise ValueError.
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: Callable[..., torch.optim.Optimizer] = torch.optim.Adam,
        stage: int = 1,
        process_group: Any = None,
        *,
        module: Optional[torch.nn.Module] = None,
        optimizer_kwargs: Optional[Dict[str, Any]] = None,
        gradient_accumulation_steps: int = 1,
        gradient_clipping: float = 0.0,
        loss_scale: float = 1.0,
        initial_scale_power: int = 16,
        loss_scale_window: int = 1000,
        min_loss_scale: float = 1.0,
        timeout: float = DEFAULT_TIMEOUT,
        **zero_config: Any,
    ) -> None:
        if stage not in (1, 2, 3) or isinstance(stage, bool):
            raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
        if "stage" in zero_config and zero_config["stage"] != stage:
            raise ValueError(f"stage={stage} contradicts zero_config stage={zero_config['stage']}")
        zero_config = dict(zero_config, stage=stage)
        self.config = validate_zero_config(zero_config, where="ZeroOptimizer")
        if stage == 3 and module is None:
            raise ValueError("module: stage 3 needs the model (module=...) to install its hooks")
        if int(gradient_accumulation_steps) < 1:
            raise ValueError(
                f"gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}"
            )
        if gradient_clipping < 0:
            raise ValueError(f"gradient_clipping must be >= 0, got {gradient_clipping}")
        if loss_scale < 0:
            raise ValueError(f"loss_scale must be >= 0 (0: dynamic), got {loss_scale}")
        self.stage = stage
        self.comm = resolve(process_group)
        self.world = self.comm.size()
        self.rank = self.comm.rank()
        self.timeout = float(timeout)
        self.gas = int(gradient_accumulation_steps)
        self.clip = float(gradient_clipping)
        self.dynamic_scale = loss_scale == 0
        self.loss_scale = float(2**initial_scale_power) if self.dynamic_scale else float(loss_scale)
        self.scale_window = int(loss_scale_window)
        self.min_scale = float(min_loss_scale)
        self._good_steps = 0
        self.skipped_steps = 0
        self.global_steps = 0
        self.overlap = bool(self.config["overlap_comm"])
        self.onebit = onebit_kind(optimizer_class)
        if self.onebit == "ZeroOneAdam" and stage == 3:
            raise ValueError(
                "optimizer_class: ZeroOneAdam with ZeRO stage 3 is not supported (its local steps "
                "update every rank's full copy of the parameters, which stage 3 does not keep); use "
                "stage 1 or 2, or OneBitAdam"
            )
        self.onebit_mode = _onebit_mode(self.onebit, self.config["onebit_mode"], stage)
        self._errors: Dict[tuple, tuple] = {}  # (group, bucket) -> (worker_error, server_error)
        # ZeroOneAdam after var_freeze_step: the wrapped optimizer runs unsharded (_enter_local_phase)
        self._local_phase = False
        self.exact_resume = bool((optimizer_kwargs or {}).get("exact_resume", False))
        # stage 2 + overlap_comm, 1-bit steps: (work, group, bucket, fp32 input) exchanged during
        # backward and committed by step(); per-bucket workspaces, reused every step
        self._exchanges: List[tuple] = []
        self._exchange_ws: Dict[tuple, torch.Tensor] = {}
        self._async = _C.zero.AsyncComm(self.comm)
        self._pending: List[tuple] = []  # stage 2/3: (work, group, bucket, staging, recv)
        self._free_staging: Dict[tuple, List[torch.Tensor]] = {}
        # 1-bit steps stage every bucket at once: one exact-size buffer per bucket, kept across steps
        self._bucket_staging: Dict[tuple, torch.Tensor] = {}
        self._bucket_staging_ids: set = set()  # ids of those (alive: held in the dict above)

        groups = self._param_groups(params)
        seen = set()
        devices: set = set()
        self.groups: List[_Group] = []
        bucket = self.config["reduce_bucket_size"] if stage < 3 else 0
        for g in groups:
            ps = list(g["params"])
            for p in ps:
                if not isinstance(p, torch.Tensor) or not p.requires_grad:
                    raise ValueError("params: every parameter must be a tensor with requires_grad")
                if id(p) in seen:
                    raise ValueError("params: a parameter appears twice")
                seen.add(id(p))
                devices.add(p.device)
            dtypes = {p.dtype for p in ps}
            if len(dtypes) > 1:
                raise ValueError(f"params: a parameter group mixes dtypes {sorted(map(str, dtypes))}")
            # 1-bit: chunks a multiple of 8 elements, so a bucket is directly the compressed
            # reduce-scatter's input (P = padded, a multiple of 8 * world) and chunk r its output
            align = ONEBIT_ALIGNMENT if self.onebit is not None else ALIGNMENT
            if self.onebit_mode in ("exact", "no_allgather"):
                # the compressed allreduce's padding as unsharded OneBitAdam's (padded_numel):
                # the same chunks and scales, hence the same numerics
                align = 8 // math.gcd(self.world, 8) * self.world
            plan = _C.zero.plan_buckets([p.numel() for p in ps], bucket, self.world, align)
            options = {k: v for k, v in g.items() if k != "params"}
            self.groups.append(_Group(ps, plan, options))

        if len(devices) > 1:
            raise ValueError(
                f"params: all parameters must be on one device, got {sorted(map(str, devices))}")
        #: where every buffer lives: the parameters' device (CPU, or a GPU with a communicator
        #: that takes device buffers: NCCL, CUDA-aware or host-staged MPI, torch's NCCL group)
        self.device = devices.pop() if devices else torch.device("cpu")
        for grp in self.groups:
            self._partition(grp)

        kwargs = dict(optimizer_kwargs or {})
        if self.onebit is not None:
            kwargs = onebit_inner_kwargs(self.onebit, kwargs)
        self.optimizer = optimizer_class(
            [dict(grp.options, params=[grp.master]) for grp in self.groups], **kwargs
        )
        self._shard_comm = getattr(self.optimizer, "comm", None)  # 1-bit: the one-rank communicator
        #: OneBitAdam's compressed phase in the "exact" / "no_allgather" modes (onebit_replicated.py)
        self._replicated: Optional[ReplicatedMomentum] = (
            ReplicatedMomentum(self, self.onebit_mode)
            if self.onebit_mode in ("exact", "no_allgather") else None)
        self._hooks: List[Any] = []
        if stage >= 2:
            self._install_grad_hooks()
        self._stage3: Optional[_Stage3] = None
        if stage == 3:
            self._stage3 = _Stage3(self, module)

    # ---- setup -------------------------------------------------------------------------------

    @staticmethod
    def _param_groups(params: Iterable[Any]) -> List[Dict[str, Any]]:
        params = list(params)
        if not params:
            raise ValueError("params: got an empty parameter list")
        if isinstance(params[0], dict):
            return [dict(g) for g in params]
        return [{"params": params}]

    def _flatten(self, grp: _Group, tensors: Iterable[Optional[torch.Tensor]],
                 dtype: torch.dtype) -> torch.Tensor:
        """The group's flat layout (zero padding) holding ``tensors`` (one per parameter, None: 0)."""
        flat = torch.zeros(grp.plan.flat_numel, dtype=dtype, device=self.device)
        for t, (n, off, _) in zip(tensors, grp.tensors):
            if t is not None:
                flat[off : off + n].copy_(t.reshape(-1))
        return flat

    def _own_chunks(self, grp: _Group, flat: torch.Tensor, shard: torch.Tensor) -> None:
        """Copy this rank's chunk of every bucket of the flat layout into ``shard``."""
        for b in grp.buckets:
            lo = b["offset"] + self.rank * b["chunk"]
            _shard_of(shard, b).copy_(flat[lo : lo + b["chunk"]])

    def _partition(self, grp: _Group) -> None:
        plan = grp.plan
        flat = self._flatten(grp, (p.detach() for p in grp.params), grp.dtype)
        self.comm.broadcast(buffer_of(flat), 0, self.timeout)  # every rank starts from rank 0's
        shard16 = torch.empty(plan.shard_numel, dtype=grp.dtype, device=self.device)
        self._own_chunks(grp, flat, shard16)
        grp.master = shard16.to(torch.float32, copy=True)
        grp.shard16 = shard16 if self.stage == 3 else None  # stage 1/2: a temporary in _publish
        grp.master.grad = torch.zeros_like(grp.master) if self.stage >= 2 else None
        if self.stage < 3:
            grp.flat = flat
            for p, (n, off, _) in zip(grp.params, grp.tensors):
                p.data = flat[off : off + n].view(p.shape)
        else:
            del flat
            for p in grp.params:
                p._zero_shape = p.shape  # type: ignore[attr-defined]
                p._zero_numel = p.numel()  # type: ignore[attr-defined]
                p.data = torch.empty(0, dtype=grp.dtype, device=self.device)

    # ---- gradient reduction ------------------------------------------------------------------

    def _install_grad_hooks(self) -> None:
        for gi, grp in enumerate(self.groups):
            for ti, p in enumerate(grp.params):
                h = p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, gi, ti))
                self._hooks.append(h)

    def _staging_for(self, gi: int, bi: int) -> torch.Tensor:
        """The staging view for bucket bi of group gi: from a pool of largest-bucket buffers (a few
        in flight at a time), or in a 1-bit step, where every bucket stays staged until it is
        compressed, the bucket's own exact-size buffer."""
        grp = self.groups[gi]
        st = grp.staging.get(bi)
        if st is None:
            padded = grp.buckets[bi]["padded"]
            if self._compressed_phase():
                if self.onebit == "OneBitAdam":
                    self._free_staging.clear()  # its warm-up (the pool's user) never comes back
                base = self._bucket_staging.get((gi, bi))
                if base is None:
                    base = torch.empty(padded, dtype=grp.dtype, device=self.device)
                    self._bucket_staging[(gi, bi)] = base
                    self._bucket_staging_ids.add(id(base))
            else:
                pool = self._free_staging.setdefault((grp.max_padded, grp.dtype), [])
                if not pool and len(self._pending) >= 2:
                    self._complete(1)  # reuse a buffer in flight rather than grow the pool
                base = (pool.pop() if pool
                        else torch.empty(grp.max_padded, dtype=grp.dtype, device=self.device))
            st = base[:padded]
            st.zero_()
            grp.staging[bi] = st
            grp.staging_base[bi] = base
        return st

    def _release_staging(self, grp: _Group, base: torch.Tensor) -> None:
        """A staging buffer is free again: back to the pool unless it is a bucket's own."""
        if id(base) not in self._bucket_staging_ids:
            self._free_staging.setdefault((grp.max_padded, grp.dtype), []).append(base)

    def _grad_ready(self, gi: int, ti: int, p: torch.Tensor) -> None:
        grp = self.groups[gi]
        n, off, bi = grp.tensors[ti]
        if p.grad is None or self._local_phase:  # local phase: gradients stay whole and local
            return
        if bi in grp.exchanged:
            raise RuntimeError(
                f"ZeroOptimizer: a gradient arrived for bucket {bi} after its 1-bit exchange started: "
                f"more than gradient_accumulation_steps={self.gas} backward passes before step()")
        st = self._staging_for(gi, bi)
        lo = off - grp.buckets[bi]["offset"]
        st[lo : lo + n].add_(p.grad.reshape(-1))
        p.grad = None
        grp.arrived[bi].add(ti)
        b = grp.buckets[bi]
        if len(grp.arrived[bi]) == b["last_tensor"] - b["first_tensor"]:
            if self._compressed_phase():
                grp.arrived[bi].clear()  # staged: compressed in step(), or now if overlapping
                if self._overlap_compression():
                    grp.rounds[bi] += 1
                    if grp.rounds[bi] == self.gas:  # the last micro-step: the bucket is complete
                        self._submit_exchange(gi, bi)
            else:
                self._submit_bucket(gi, bi)
        if self._stage3 is not None:
            self._stage3.after_grad(p)

    def _submit_bucket(self, gi: int, bi: int) -> None:
        grp = self.groups[gi]
        st = grp.staging.pop(bi)
        base = grp.staging_base.pop(bi)
        grp.arrived[bi].clear()
        recv = torch.empty(grp.buckets[bi]["chunk"], dtype=grp.dtype, device=self.device)
        work = self._async.reduce_scatter(buffer_of(st), buffer_of(recv), timeout_s=self.timeout)
        self._pending.append((work, gi, bi, base, recv))
        if not self.overlap:
            self._complete(len(self._pending))

    def _complete(self, count: int) -> None:
        """Wait for the oldest ``count`` pending reductions and add them to the gradient shards."""
        for _ in range(count):
            work, gi, bi, base, recv = self._pending.pop(0)
            work.wait(self.timeout)
            grp = self.groups[gi]
            _shard_of(grp.master.grad, grp.buckets[bi]).add_(recv)
            self._release_staging(grp, base)

    def _flush(self) -> None:
        """Reduce every partly filled bucket (parameters without gradients count as 0), wait all."""
        if self.stage >= 2:
            for gi, grp in enumerate(self.groups):
                for bi in sorted(grp.staging):
                    self._submit_bucket(gi, bi)
            self._complete(len(self._pending))
            return
        for grp in self.groups:  # stage 1: gradients are whole in p.grad
            flat = self._flatten(grp, (p.grad for p in grp.params), grp.dtype)
            shard = torch.empty(grp.plan.shard_numel, dtype=grp.dtype, device=self.device)
            self._async.bucketed_reduce_scatter(
                grp.plan, buffer_of(flat), buffer_of(shard), timeout_s=self.timeout
            ).wait(self.timeout)
            grp.master.grad = shard.to(torch.float32)

    # ---- 1-bit optimizers: the compressed phase -----------------------------------------------

    def _compressed_phase(self) -> bool:
        """Whether the coming step reduces gradients with the 1-bit compressed reduce-scatter."""
        if self.onebit is None:
            return False
        if self.onebit == "ZeroOneAdam":
            return self.optimizer.step_kind() == "grad1bit"
        return not self.optimizer.next_step_averages()

    def _momentum_factor(self, gi: int) -> float:
        """What the compressed tensor is multiplied by: ``1 - beta1`` for OneBitAdam (its local
        momentum contribution), 1 for ZeroOneAdam (which compresses gradients)."""
        if self.onebit == "OneBitAdam":
            return 1.0 - float(self.optimizer.param_groups[gi]["betas"][0])
        return 1.0

    def _error_buffers(self, gi: int, bi: int) -> tuple:
        """(worker_error of the bucket's padded length, server_error of its chunk), fp32."""
        key = (gi, bi)
        if key not in self._errors:  # not error_buffers(): its padded_numel would pad further
            b = self.groups[gi].buckets[bi]
            self._errors[key] = (torch.zeros(b["padded"], dtype=torch.float32, device=self.device),
                                 torch.zeros(b["chunk"], dtype=torch.float32, device=self.device))
        return self._errors[key]

    def _flush_compressed(self) -> float:
        """Compressed phase: compress every bucket of this rank's local gradient into its fp32
        gradient shard. Bucket ``b`` of the local gradient ``g`` (averaged over micro-steps,
        unscaled, clipped) is sent as ``k * g_b`` (``k = 1 - beta1`` for OneBitAdam, 1 for
        ZeroOneAdam) through :func:`compressed_reduce_scatter` with the bucket's error buffers;
        chunk r of the 1-bit average, divided by ``k`` and zero at padding positions, becomes rank
        r's gradient shard, so the
        wrapped optimizer's ``m = b1*m + (1-b1)*grad`` adds ``RS_1bit((1-b1) g_local)_r``.

        Returns the mean over ranks of the squared norm of the local gradients (one all-reduce),
        used for the non-finite check and for ``gradient_clipping``.
        """
        from .compressed import compressed_reduce_scatter

        self._complete(len(self._pending))
        if self._exchanges or self._overlap_compression():
            return self._finish_exchanges()
        scale = 1.0 / (self.gas * self.loss_scale)
        items = self._local_buckets()
        norm_sq = self._mean_sq_norm([(x, scale) for _, _, x in items])
        if not math.isfinite(norm_sq):
            return norm_sq
        coef = self._local_coef(norm_sq, scale)
        for gi, bi, x in items:
            x.mul_(coef * self._momentum_factor(gi))
            out = _shard_of(self.groups[gi].master.grad, self.groups[gi].buckets[bi])
            if self.world == 1:  # as the unsharded optimizers: no compression without peers
                out.copy_(x)
            else:
                we, se = self._error_buffers(gi, bi)
                compressed_reduce_scatter(x, we, se, out=out, group=self.comm, timeout=self.timeout)
            self._finish_shard(gi, bi, out)
        return norm_sq

    def _local_buckets(self) -> List[tuple]:
        """This rank's local gradient (summed over micro-steps, unscaled), bucket by bucket:
        ``[(group, bucket, fp32 tensor of the bucket's padded length, zero padding)]``. The staging
        bookkeeping is reset (the fp32 tensors stay valid: nothing reuses them before the next
        backward). Stage 1 also replaces the gradient shards by zeros."""
        self._complete(len(self._pending))
        items = []
        for gi, grp in enumerate(self.groups):
            if self.stage >= 2:
                for bi, b in enumerate(grp.buckets):
                    st = grp.staging.get(bi)
                    x = (st.to(torch.float32) if st is not None
                         else torch.zeros(b["padded"], device=self.device))
                    items.append((gi, bi, x))
            else:
                flat = self._flatten(grp, (p.grad for p in grp.params), torch.float32)
                for bi, b in enumerate(grp.buckets):
                    items.append((gi, bi, flat[b["offset"] : b["offset"] + b["padded"]]))
                grp.master.grad = torch.zeros(grp.plan.shard_numel, dtype=torch.float32,
                                              device=self.device)
        self._reset_staging()
        return items

    def _finish_shard(self, gi: int, bi: int, out: torch.Tensor) -> None:
        """Rank r's chunk of a bucket's 1-bit average -> its gradient shard: divided by the momentum
        factor, zero at padding positions (1 bit cannot say 0)."""
        b = self.groups[gi].buckets[bi]
        k = self._momentum_factor(gi)
        if k != 1.0:
            out.div_(k)
        pad = max(0, b["numel"] - self.rank * b["chunk"])
        if pad < b["chunk"]:
            out[pad:].zero_()

    # ---- stage 2 + overlap_comm: 1-bit buckets exchanged during backward, committed together ----

    def _overlap_compression(self) -> bool:
        """Whether a 1-bit step exchanges each bucket as soon as its gradient is complete: stage 2/3
        with overlap_comm and more than one rank, without gradient_clipping (clipping needs the norm
        of the whole local gradient before the first bucket is compressed)."""
        return (self.stage >= 2 and self.overlap and self.clip == 0 and self.world > 1
                and self._replicated is None and self._compressed_phase())

    def _submit_exchange(self, gi: int, bi: int) -> None:
        """Scale bucket bi's local gradient to what is compressed and queue the collective half of its
        compressed reduce-scatter; the local writes (error buffers, gradient shard) wait for step(),
        so the buckets of a step commit together, or none does if any rank's gradient is not finite."""
        grp = self.groups[gi]
        b = grp.buckets[bi]
        st = self._staging_for(gi, bi)
        x = st if st.dtype == torch.float32 else st.to(torch.float32)
        if x is not st:  # the fp32 copy is what is exchanged: the staging buffer can be reused
            grp.staging.pop(bi)
            self._release_staging(grp, grp.staging_base.pop(bi))
        x.mul_(self._momentum_factor(gi) / (self.gas * self.loss_scale))
        we, se = self._error_buffers(gi, bi)
        ws = self._exchange_ws.get((gi, bi))
        if ws is None:  # zero-filled: the GPU scratch must start zeroed (every call leaves it so)
            total = workspace_bytes(b["padded"], self.world, self.device.type == "cuda")
            ws = torch.zeros(total, dtype=torch.uint8, device=self.device)
            self._exchange_ws[(gi, bi)] = ws
        out = _shard_of(grp.master.grad, b)
        work = self._async.compressed_reduce_scatter_exchange(
            buffer_of(x), buffer_of(we), buffer_of(se), buffer_of(out), buffer_of(ws),
            timeout_s=self.timeout)
        self._exchanges.append((work, gi, bi, x))
        grp.exchanged.add(bi)

    def _finish_exchanges(self) -> float:
        """step() of an overlapped 1-bit step: exchange the buckets not complete yet (parameters
        without gradients, fewer micro-steps) in bucket order, then the norm all-reduce; if every
        exchange succeeded and the norm is finite, commit every bucket into the gradient shards.
        Returns the mean over ranks of the squared norm of the local gradients (inf: skip)."""
        for gi, grp in enumerate(self.groups):
            for bi in range(len(grp.buckets)):
                if bi not in grp.exchanged:
                    self._submit_exchange(gi, bi)
        # x = k * g / (gas * loss_scale): the norm is that of x / k
        norm_sq = self._mean_sq_norm([(x, 1.0 / self._momentum_factor(gi))
                                      for _, gi, _, x in self._exchanges])
        failure: Optional[Exception] = None
        for work, *_ in self._exchanges:
            try:
                work.wait(self.timeout)
            except NonFiniteError:  # raised on every rank for the same bucket: skip the step
                norm_sq = math.inf
            except Exception as e:  # noqa: BLE001 -- re-raised once every work is done
                failure = failure or e
        if failure is None and math.isfinite(norm_sq):
            for _, gi, bi, x in self._exchanges:
                grp = self.groups[gi]
                we, se = self._error_buffers(gi, bi)
                out = _shard_of(grp.master.grad, grp.buckets[bi])
                _C.zero.compressed_reduce_scatter_commit(
                    self.comm, buffer_of(x), buffer_of(we), buffer_of(se), buffer_of(out),
                    buffer_of(self._exchange_ws[(gi, bi)]))
                self._finish_shard(gi, bi, out)
        self._drop_exchanges()
        if failure is not None:
            raise failure
        return norm_sq

    def _drop_exchanges(self) -> None:
        """Wait for queued exchanges (their errors are dropped) and release their buffers."""
        for work, *_ in self._exchanges:
            try:
                work.wait(self.timeout)
            except Exception:  # noqa: BLE001 -- nothing was committed; the step is abandoned
                pass
        self._exchanges.clear()
        self._reset_staging()

    def _reset_staging(self) -> None:
        """Forget every staged gradient and the bookkeeping of the current accumulation."""
        for grp in self.groups:
            for base in grp.staging_base.values():
                self._release_staging(grp, base)
            grp.staging.clear()
            grp.staging_base.clear()
            grp.exchanged.clear()
            grp.rounds = [0] * len(grp.buckets)
            for a in grp.arrived:
                a.clear()

    def _mean_sq_norm(self, grads: List[tuple]) -> float:
        """Mean over ranks of ``sum ||c * g||^2`` over the given ``(g, c)`` pairs: the compressed
        and local phases never form the averaged gradient, so clipping and the non-finite check use
        this (every rank gets the same value, so all clip or skip alike)."""
        return self._sum_sq_norm(grads) / self.world

    def _sum_sq_norm(self, grads: List[tuple]) -> float:
        """Sum over ranks of ``sum ||c * g||^2`` over the given ``(g, c)`` pairs (one all-reduce of
        a float64)."""
        local = torch.zeros(1, dtype=torch.float64, device=self.device)
        for g, c in grads:
            local += g.double().pow(2).sum() * (c * c)
        # through the worker thread: it must not overtake collectives still queued there
        self._async.all_reduce(buffer_of(local), _C.ReduceOp.sum, self.timeout).wait(self.timeout)
        return float(local.item())

    def _local_coef(self, norm_sq: float, scale: float) -> float:
        """What a local gradient is multiplied by: ``scale``, times the clip factor if needed."""
        norm = math.sqrt(norm_sq)
        if self.clip > 0 and norm > self.clip:
            return scale * self.clip / (norm + 1e-6)
        return scale

    # ---- ZeroOneAdam's local-step phase: the wrapped optimizer runs unsharded ------------------

    def _enter_local_phase(self, gather: bool = True) -> None:
        """Switch the wrapped ZeroOneAdam from the shards to the model's own parameters.

        Its local steps update each rank's own copy of every parameter with the rank's own
        momentum, so they need the full momentum, the frozen variance and (for fp16/bf16 params)
        the full fp32 master on every rank: they are all-gathered once here (``gather``; a checkpoint
        load fills them instead), and the optimizer then talks through the real group, exactly as
        unsharded ZeroOneAdam (per-parameter compressed allreduce of the accumulated update at
        syncs). The master shards keep the last synchronised parameters (for checkpoints and
        ``consolidate``); the bucket error buffers are dropped, as 0/1 Adam zeroes its errors at
        the freeze.
        """
        opt = self.optimizer
        self._complete(len(self._pending))
        for gi, grp in enumerate(self.groups):
            shard_state = opt.state.pop(grp.master, {})
            full: Dict[str, torch.Tensor] = {}
            if gather:
                sources = {k: shard_state[k] for k in ("exp_avg", "exp_avg_sq")}
                if grp.dtype != torch.float32:
                    sources["master_param"] = grp.master.detach()
                works = []
                for key, shard in sources.items():
                    full[key] = torch.empty(grp.plan.flat_numel, dtype=torch.float32,
                                            device=self.device)
                    shard = shard.contiguous()
                    works.append((self._async.bucketed_all_gather(
                        grp.plan, buffer_of(shard), buffer_of(full[key]), timeout_s=self.timeout), shard))
                for w, _ in works:
                    w.wait(self.timeout)
            for p, (n, off, _) in zip(grp.params, grp.tensors):
                st: Dict[str, Any] = {}
                if gather:
                    st = {k: f[off : off + n].view(p.shape) for k, f in full.items()}
                    st["step"] = shard_state.get("step", 0)
                opt.state[p] = st
            opt.param_groups[gi]["params"] = list(grp.params)
            grp.master.grad = None
        opt._set_comm(self.comm, grads_averaged=False)
        self._errors.clear()
        self._free_staging.clear()
        self._bucket_staging.clear()
        self._bucket_staging_ids.clear()
        self._local_phase = True

    def _leave_local_phase(self) -> None:
        """Back to the sharded layout (loading a variance-phase checkpoint into a local-phase
        optimizer); the state is then filled by the load."""
        opt = self.optimizer
        for gi, grp in enumerate(self.groups):
            for p in grp.params:
                opt.state.pop(p, None)
            opt.param_groups[gi]["params"] = [grp.master]
            grp.master.grad = torch.zeros_like(grp.master) if self.stage >= 2 else None
        opt._set_comm(self._shard_comm, grads_averaged=True)
        self._local_phase = False

    def _local_step(self, norm_sq: float) -> None:
        """One local or sync step of the unsharded ZeroOneAdam on this rank's local gradients."""
        opt = self.optimizer
        sync = opt.step_kind() == "sync"
        coef = self._local_coef(norm_sq, 1.0 / (self.gas * self.loss_scale))
        # The GradScaler protocol: the optimizer divides its fp32 copies of the gradients by
        # grad_scale (p.grad itself may be fp16/bf16 and is not touched).
        opt.grad_scale = 1.0 / coef
        try:
            opt.step()
        finally:
            del opt.grad_scale
        if sync:  # every rank now holds the same parameters: refresh the master shards
            for grp in self.groups:
                full = grp.flat if grp.dtype == torch.float32 else self._flatten(
                    grp, (opt.state[p]["master_param"] for p in grp.params), torch.float32)
                self._own_chunks(grp, full, grp.master.data)

    # ---- public API --------------------------------------------------------------------------

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        """The wrapped optimizer's parameter groups (one fp32 shard each); LR changes go here."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        """The wrapped optimizer's state (shards)."""
        return self.optimizer.state

    def backward(self, loss: torch.Tensor) -> None:
        """``(loss * loss_scale).backward()``: use this with fp16 loss scaling."""
        (loss * self.loss_scale if self.loss_scale != 1.0 else loss).backward()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop accumulated gradients (whole ones in stage 1, shards in stage 2/3)."""
        self._complete(len(self._pending))
        self._drop_exchanges()  # and the staged gradients
        for grp in self.groups:
            for p in grp.params:
                p.grad = None
            if self.stage >= 2 and not self._local_phase:
                grp.master.grad.zero_()
            else:
                grp.master.grad = None

    def _global_norm_sq(self) -> float:
        """Squared norm of the averaged gradient: the sum over ranks of their shards'."""
        return self._sum_sq_norm(
            [(grp.master.grad, 1.0) for grp in self.groups if grp.master.grad is not None])

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Optional[Any]:
        """Reduce the remaining gradients, step the wrapped optimizer on the shards, and re-assemble
        the parameters (stage 1/2: all-gather; stage 3: refresh the shards the hooks gather from).

        Returns the closure's value, if one was given. Skips the update (and, with a dynamic loss
        scale, halves the scale) if the gradient is not finite.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compressed = self._compressed_phase()
        local = self._local_phase
        replicated = compressed and self._replicated is not None
        if replicated:
            norm_sq = self._replicated.reduce()
        elif local:
            self._complete(len(self._pending))
            scale = 1.0 / (self.gas * self.loss_scale)
            norm_sq = self._mean_sq_norm([(p.grad, scale) for grp in self.groups for p in grp.params
                                          if p.grad is not None])
        elif compressed:
            norm_sq = self._flush_compressed()
        else:
            self._flush()
            div = float(self.world * self.gas) * self.loss_scale
            for grp in self.groups:
                grp.master.grad.div_(div)
            norm_sq = self._global_norm_sq()
        self.last_grad_norm = math.sqrt(norm_sq) if math.isfinite(norm_sq) else float("inf")
        if not math.isfinite(norm_sq):
            self.skipped_steps += 1
            if self.dynamic_scale:
                self.loss_scale = max(self.loss_scale / 2, self.min_scale)
                self._good_steps = 0
            self.zero_grad()
            return loss
        if self.clip > 0 and self.last_grad_norm > self.clip and not (compressed or local):
            coef = self.clip / (self.last_grad_norm + 1e-6)
            for grp in self.groups:
                grp.master.grad.mul_(coef)
        if local:
            self._local_step(norm_sq)
        elif replicated:
            self._replicated.update()
        else:
            self.optimizer.step()
        self.global_steps += 1
        if self.dynamic_scale:
            self._good_steps += 1
            if self._good_steps % self.scale_window == 0:
                self.loss_scale *= 2
        if not local and not (replicated and not self._replicated.publishes):
            self._publish()
        if self.onebit == "ZeroOneAdam" and not local and self.optimizer.freeze_key:
            self._enter_local_phase()
        if self.stage >= 2 and not self._local_phase:
            for grp in self.groups:
                grp.master.grad.zero_()
        else:
            for grp in self.groups:
                grp.master.grad = None
                for p in grp.params:
                    p.grad = None
        return loss

    def _publish(self) -> None:
        """fp32 shards -> parameter dtype shards -> (stage 1/2) the full parameters everywhere."""
        ag = self.config["allgather_bucket_size"]
        works = []
        for grp in self.groups:
            if self.stage == 3:
                grp.shard16.copy_(grp.master)
            else:
                shard16 = grp.master.to(grp.dtype)
                big = max((b["padded"] for b in grp.buckets), default=0)
                if self.device.type != "cpu":
                    ag = 0  # the split all-gather scatters pieces on the host; GPU buckets go whole
                staging = torch.empty(ag if 0 < ag < big else 0, dtype=grp.dtype)
                works.append(
                    (
                        self._async.bucketed_all_gather(
                            grp.plan,
                            buffer_of(shard16),
                            buffer_of(grp.flat),
                            max_elements=ag,
                            staging=buffer_of(staging),
                            timeout_s=self.timeout,
                        ),
                        (staging, shard16),
                    )
                )
        for w, _ in works:
            w.wait(self.timeout)
        if self._stage3 is not None:
            self._stage3.after_step()

    def gather_parameters(self) -> None:
        """Stage 3: all-gather every parameter now (for evaluation or saving outside the hooks);
        they are freed again by the next ``step()``. No-op for stage 1/2."""
        if self._stage3 is not None:
            self._stage3.gather_all()

    # ---- introspection -----------------------------------------------------------------------

    def memory_bytes(self) -> Dict[str, int]:
        """Bytes this rank holds, by kind: ``params`` (model parameters as stored: full in stage
        1/2, the shards plus whatever is gathered in stage 3), ``grads`` (``p.grad`` plus the fp32
        gradient shards), ``master`` (fp32 master shards) and
        ``optimizer_state`` (tensors in the wrapped optimizer's state), ``buffers`` (stage 2/3
        gradient staging buffers, at most a few buckets)."""
        params = grads = master = state = buffers = 0
        for grp in self.groups:
            if self.stage < 3:
                params += grp.flat.numel() * grp.flat.element_size()
            else:
                params += grp.shard16.numel() * grp.shard16.element_size()
                params += sum(p.data.numel() * p.data.element_size() for p in grp.params)
            for p in grp.params:
                if p.grad is not None:
                    grads += p.grad.numel() * p.grad.element_size()
            if grp.master.grad is not None:
                grads += grp.master.grad.numel() * 4
            master += grp.master.numel() * 4
        for pool in self._free_staging.values():
            buffers += sum(t.numel() * t.element_size() for t in pool)
        own = list(self._bucket_staging.values())
        buffers += sum(t.numel() * t.element_size() for t in own)
        for grp in self.groups:
            buffers += sum(t.numel() * t.element_size() for t in grp.staging_base.values()
                           if id(t) not in self._bucket_staging_ids)
        buffers += sum(e[3].numel() * e[3].element_size() + e[4].numel() * e[4].element_size()
                       for e in self._pending)
        for we, se in self._errors.values():
            buffers += (we.numel() + se.numel()) * 4
        buffers += sum(ws.numel() for ws in self._exchange_ws.values())
        if self._replicated is not None:  # the momentum (no_allgather: variance, master) in full
            full, workspaces = self._replicated.nbytes()
            state += full
            buffers += workspaces
        for st in self.optimizer.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    state += v.numel() * v.element_size()
        if hasattr(self.optimizer, "memory_bytes"):  # a 1-bit optimizer's own error feedback
            inner = self.optimizer.memory_bytes()
            state += inner["error_feedback"]
            buffers += inner["buffers"]
        return {
            "params": params,
            "grads": grads,
            "master": master,
            "optimizer_state": state,
            "buffers": buffers,
        }

    def close(self) -> None:
        """Wait for pending work, remove hooks, and stop the communication thread."""
        self._complete(len(self._pending))
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._stage3 is not None:
            self._stage3.remove()
        self._async.close()

    def __del__(self) -> None:
        # stop the worker thread with the GIL released (close() drains the queue first)
        a = getattr(self, "_async", None)
        if a is not None:
            try:
                a.close()
            except Exception:
                pass

    def state_dict(self) -> Dict[str, Any]:
        """This rank's shard of the optimizer (see :mod:`compcomm.zero.checkpoint`)."""
        from .checkpoint import shard_state_dict

        return shard_state_dict(self)

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore this rank's shard saved by :meth:`state_dict` (same world size and layout).

        Collective: the shard is validated and the ranks agree first, so a bad shard on any rank
        raises on every rank and changes nothing
        (:func:`compcomm.zero.checkpoint.load_shard_state_dict`).
        """
        from .checkpoint import load_shard_state_dict

        load_shard_state_dict(self, sd)


def _onebit_mode(onebit: Optional[str], mode: Optional[str], stage: int) -> Optional[str]:
    """The compressed phase's form for OneBitAdam (None for other optimizers); ValueError naming
    ``onebit_mode`` for a value that does not apply."""
    if onebit != "OneBitAdam":
        if mode is not None:
            raise ValueError(f"zero_optimization.onebit_mode={mode!r} applies only to OneBitAdam, "
                             f"not to {onebit or 'this optimizer'}")
        return None
    mode = "exact" if mode is None else mode
    if mode not in MODES:
        raise ValueError(f"zero_optimization.onebit_mode must be one of {', '.join(map(repr, MODES))}"
                         f", got {mode!r}")
    if mode == "no_allgather" and stage == 3:
        raise ValueError("zero_optimization.onebit_mode='no_allgather' needs stage 1 or 2 (every "
                         "rank updates the whole parameters, which stage 3 does not keep)")
    return mode


def _shard_of(t: torch.Tensor, b: Dict[str, int]) -> torch.Tensor:
    """Bucket ``b``'s range of a shard-layout tensor (the rank's chunk of that bucket)."""
    return t[b["shard_offset"] : b["shard_offset"] + b["chunk"]]


def _numel(p: torch.Tensor) -> int:
    """Elements of a parameter, also while stage 3 holds it released (empty)."""
    return getattr(p, "_zero_numel", None) or p.numel()


class _Stage3:
    """Module hooks that gather a module's parameters before use and free them after."""

    def __init__(self, opt: ZeroOptimizer, module: torch.nn.Module) -> None:
        self.opt = opt
        cfg = opt.config
        self.prefetch = cfg["stage3_prefetch_bucket_size"]
        self.persist_threshold = cfg["stage3_param_persistence_threshold"]
        self.max_live = cfg["stage3_max_live_parameters"]
        self.reuse = cfg["stage3_max_reuse_distance"]
        self.where: Dict[int, tuple] = {}  # id(param) -> (group, tensor index)
        for gi, grp in enumerate(opt.groups):
            for ti, p in enumerate(grp.params):
                self.where[id(p)] = (gi, ti)
        model_cap = cfg["stage3_model_persistence_threshold"] // max(opt.world, 1)
        self.persistent = set()
        total = 0
        for grp in opt.groups:
            for p in sorted(grp.params, key=lambda q: _numel(q)):
                n = _numel(p)
                if n <= self.persist_threshold and total + n <= model_cap:
                    self.persistent.add(id(p))
                    total += n
        self.inflight: Dict[int, tuple] = {}  # id(param) -> (work, buffer)
        self.live = 0  # gathered elements alive (not counting persistent ones)
        self.peak_live = 0
        self.prefetched = 0  # parameters gathered ahead of use (statistics)
        self.trace: List[torch.nn.Module] = []
        self.trace_done = False
        self.handles: List[Any] = []
        self.modules = [m for m in module.modules() if any(True for _ in m.parameters(recurse=False))]
        for m in self.modules:
            for p in m.parameters(recurse=False):
                if id(p) not in self.where:
                    raise ValueError(
                        f"module: parameter of {type(m).__name__} is not among the optimizer's params"
                    )
            self.handles.append(m.register_forward_pre_hook(self._pre_forward))
            self.handles.append(m.register_forward_hook(self._post_forward))
            self.handles.append(m.register_full_backward_pre_hook(self._pre_backward))
        self.gather_all(persistent_only=True)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    # -- gather / release
    def _param(self, pid: int) -> torch.nn.Parameter:
        gi, ti = self.where[pid]
        return self.opt.groups[gi].params[ti]

    def _available(self, p: torch.Tensor) -> bool:
        return p.data.shape == p._zero_shape and p.data.numel() == _numel(p)

    def _submit(self, p: torch.Tensor) -> None:
        gi, ti = self.where[id(p)]
        grp = self.opt.groups[gi]
        n, _, bi = grp.tensors[ti]
        b = grp.buckets[bi]
        buf = torch.empty(b["padded"], dtype=grp.dtype, device=self.opt.device)
        send = _shard_of(grp.shard16, b)
        work = self.opt._async.all_gather(buffer_of(send), buffer_of(buf), timeout_s=self.opt.timeout)
        self.inflight[id(p)] = (work, buf, send)
        if id(p) not in self.persistent:
            self.live += n

    def _fetch(self, params: List[torch.Tensor]) -> None:
        for p in params:
            if not self._available(p) and id(p) not in self.inflight:
                self._submit(p)
        for p in params:
            entry = self.inflight.pop(id(p), None)
            if entry is not None:
                entry[0].wait(self.opt.timeout)
                p.data = entry[1][: _numel(p)].view(p._zero_shape)
        self.peak_live = max(self.peak_live, self.live)

    def _release(self, p: torch.Tensor) -> None:
        if id(p) in self.persistent or id(p) in self.inflight or not self._available(p):
            return
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.live -= _numel(p)

    def gather_all(self, persistent_only: bool = False) -> None:
        ps = [self._param(pid) for pid in self.where if not persistent_only or pid in self.persistent]
        self._fetch(ps)

    def after_step(self) -> None:
        # shards changed: drop every gathered copy, refresh the persistent ones
        self._drain()
        for grp in self.opt.groups:
            for p in grp.params:
                if id(p) in self.persistent:
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                else:
                    self._release(p)
        self.live = 0
        self.gather_all(persistent_only=True)
        if self.trace:
            self.trace_done = True

    def _drain(self) -> None:
        for pid, (work, buf, _) in list(self.inflight.items()):
            work.wait(self.opt.timeout)
            self._param(pid).data = buf[: _numel(self._param(pid))].view(self._param(pid)._zero_shape)
        self.inflight.clear()

    def _own(self, m: torch.nn.Module) -> List[torch.Tensor]:
        return list(m.parameters(recurse=False))

    def _prefetch_after(self, m: torch.nn.Module, order: List[torch.nn.Module]) -> None:
        if not self.trace_done or self.prefetch <= 0:
            return
        try:
            i = order.index(m)
        except ValueError:
            return
        budget = min(self.prefetch, self.max_live - self.live)
        for nxt in order[i + 1 :]:
            for p in self._own(nxt):
                if self._available(p) or id(p) in self.inflight:
                    continue
                if _numel(p) > budget:
                    return
                budget -= _numel(p)
                self._submit(p)
                self.prefetched += 1

    # -- hooks
    def _pre_forward(self, m: torch.nn.Module, args: Any) -> None:
        if not self.trace_done and m not in self.trace:
            self.trace.append(m)
        self._fetch(self._own(m))
        self._prefetch_after(m, self.trace)

    def _reuse_distance(self, m: torch.nn.Module) -> float:
        # elements gathered between this module's forward and its backward (the trace reversed)
        if not self.trace_done or m not in self.trace:
            return math.inf
        i = self.trace.index(m)
        return 2 * sum(_numel(p) for later in self.trace[i + 1 :] for p in self._own(later))

    def _post_forward(self, m: torch.nn.Module, args: Any, out: Any) -> None:
        if not torch.is_grad_enabled():
            keep = False
        else:
            keep = self._reuse_distance(m) <= self.reuse
        if not keep:
            for p in self._own(m):
                self._release(p)

    def _pre_backward(self, m: torch.nn.Module, grad_out: Any) -> None:
        self._fetch(self._own(m))
        self._prefetch_after(m, list(reversed(self.trace)))

    def after_grad(self, p: torch.Tensor) -> None:
        self._release(p)


def initialize(
    model: torch.nn.Module,
    optimizer_config: Dict[str, Any],
    zero_config: Dict[str, Any],
    process_group: Any = None,
    **kwargs: Any,
) -> ZeroOptimizer:
    """A ZeroOptimizer for ``model`` from DeepSpeed-style sections.

    Parameters
    ----------
    model : torch.nn.Module
        The model (its parameters; stage 3 also installs module hooks).
    optimizer_config : dict
        DeepSpeed's ``optimizer`` section, e.g. ``{"type": "AdamW", "params": {"lr": 1e-3}}``.
    zero_config : dict
        DeepSpeed's ``zero_optimization`` section; ``stage`` must be 1, 2 or 3.
    process_group : optional
        The data-parallel group.
    **kwargs
        Further ZeroOptimizer arguments (``gradient_accumulation_steps``, ``gradient_clipping``,
        ``loss_scale``, ``timeout``).
    """
    from ..optim.factory import optimizer_from_config as _optimizer_factory
    from .config import validate_zero_config

    zero = validate_zero_config(zero_config)
    if zero["stage"] not in (1, 2, 3):
        raise ValueError(f"zero_config.stage must be 1, 2 or 3, got {zero['stage']!r}")
    cls, kw, _ = _optimizer_factory(optimizer_config)
    return ZeroOptimizer(model.parameters(), cls, process_group=process_group, module=model,
                         optimizer_kwargs=kw, **kwargs, **zero)
