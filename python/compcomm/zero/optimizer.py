"""ZeroOptimizer: ZeRO stage 1/2/3 around any torch optimizer, on compcomm's bucketed collectives.

Each parameter group is laid out flat and cut into buckets; rank r owns chunk r of every bucket
(:mod:`.layout`). The wrapped optimizer sees one fp32 tensor per group: the rank's shard of the
master weights, whose ``.grad`` is the rank's shard of the averaged gradient, so optimizer state and
master weights are 1/W (stage 1). Stage 2 also reduces gradients bucket by bucket during backward
(:mod:`.grad_reducer`); stage 3 also stores parameters as shards and gathers them per module
(:mod:`.param_gather`). After the inner step the fp32 shards are cast to the parameter dtype and
(stage 1/2) all-gathered back into the flat parameters, in calls of at most
``allgather_bucket_size`` elements. Gradients are averaged over ranks and over
``gradient_accumulation_steps`` micro-steps; ``gradient_clipping`` clips by the global norm.

The 1-bit optimizers: OneBitAdam's compressed phase follows ``onebit_mode`` -- "exact" (default)
and "no_allgather" replicate the momentum (:mod:`.onebit_replicated`), "sharded" reduces
``(1-b1) * g_local`` with the compressed reduce-scatter (:mod:`.onebit_reducer`), as ZeroOneAdam's
1-bit gradient steps reduce its local gradient. ZeroOneAdam's local-step phase runs unsharded
(:mod:`.unsharded`). See docs/zero.md, "1-bit optimizers with ZeRO".

Stage 2 launches the buckets' reductions in one fixed order on every rank (:mod:`.grad_reducer`,
:mod:`.hooks`), so the ranks' backward passes may reach different parameters (unused ones count
as zero gradients). Stage 3 also gathers parameters per module as the ranks run them: every rank
must run the same modules.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch

from .. import _C
from .._agree import agree_layout
from .._buffers import buffer_of
from .._scratch import stream_of
from .._comm import resolve, wait_cancellable
from .._defaults import DEFAULT_TIMEOUT
from ..amp import LossScaler
from ..compress import Compressor
from .checkpoint import errors_of, load_errors, load_shard_state_dict, shard_state_dict
from .config import check_arguments
from .grad_reducer import GradReducer, clip_coef
from .hooks import GradHooks
from .layout import alignment, build_groups, layout_fields, partition
from .memory import measure
from .offload import HostOffload, check_offload, check_placement, step_inner
from .onebit_reducer import OneBitReducer
from .onebit_replicated import ReplicatedMomentum
from .param_gather import ParamGatherer, publish
from .rules import (RULES, Phase, build_compressor, check_stage, onebit_inner_kwargs, onebit_kind,
                    onebit_mode)
from .unsharded import UnshardedPhase

__all__ = ["ZeroOptimizer", "Phase"]


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
        The wrapped optimizer's ``compressor`` (e.g. ``IdentityCompressor``) also does ZeRO's
        compressed communication in every mode.
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
        #: the validated ``zero_optimization`` keys
        self.config = check_arguments(stage, zero_config, module, gradient_accumulation_steps,
                                      gradient_clipping, loss_scale)
        self.stage = stage
        self.comm = resolve(process_group)
        self.world = self.comm.size()
        self.rank = self.comm.rank()
        # its worker thread calls the communicator: made before any collective, so a communicator
        # only one thread may call (MPI below MPI_THREAD_MULTIPLE) is refused on every rank here
        self._async = _C.zero.AsyncComm(self.comm)
        self.timeout = float(timeout)
        self.gas = int(gradient_accumulation_steps)
        self.clip = float(gradient_clipping)
        #: the loss scaler (``backward`` multiplies the loss by ``scaler.scale``)
        self.scaler = LossScaler(loss_scale, initial_scale_power, loss_scale_window, min_loss_scale)
        self.dynamic_scale, self.scale_window, self.min_scale = (
            self.scaler.dynamic, self.scaler.window, self.scaler.min_scale)
        self.skipped_steps = 0
        self.global_steps = 0
        self.overlap = bool(self.config["overlap_comm"])
        #: "OneBitAdam" / "ZeroOneAdam" for those compcomm optimizers, else None
        self.onebit = onebit_kind(optimizer_class)
        check_stage(self.onebit, stage)
        self._rules = RULES.get(self.onebit or "")
        # full-precision steps come back (any optimizer but OneBitAdam): keep the staging pool
        self._keep_pool = self._rules is None or self._rules.full_steps_recur
        self.onebit_mode = onebit_mode(self.onebit, self.config["onebit_mode"], stage)
        replicated = self.onebit_mode in ("exact", "no_allgather")
        check_offload(self.config, self.onebit, self.onebit_mode)
        self.exact_resume = bool((optimizer_kwargs or {}).get("exact_resume", False))

        align = alignment(self._rules is not None, replicated, self.world)
        bucket = self.config["reduce_bucket_size"] if stage < 3 else 0
        #: the parameter groups' layouts (:class:`compcomm.zero.layout.GroupLayout`)
        self.groups, self.device = build_groups(params, bucket, self.world, align)
        agree_layout(self.comm, "ZeroOptimizer", layout_fields(  # before any other collective
            self.groups, self.config, stage, self.onebit, self.onebit_mode, self.gas,
            optimizer_class, optimizer_kwargs or {}), self.device, self.timeout)
        check_placement(self.config, self.comm, self.device)
        #: ZeRO-Offload (:mod:`.offload`): host master/state/gradient shards; None without
        self.offload: Optional[HostOffload] = HostOffload.create(self.config, stage, self.device)
        for grp in self.groups:
            partition(grp, self.comm, self.rank, stage, self.device, self.timeout, self.offload)
        self._shards: Optional[List[torch.Tensor]] = None  # offload: the step's uploaded shards

        kwargs = dict(optimizer_kwargs or {})
        if self._rules is not None:
            kwargs = onebit_inner_kwargs(self.onebit, kwargs, self.comm)
        self.optimizer = optimizer_class(
            [dict(grp.options, params=[grp.master]) for grp in self.groups], **kwargs
        )
        if self._rules is not None:  # its layout was agreed above, with the partition's
            self.optimizer.check_layout = False
        #: 1-bit optimizers: the compressor of ZeRO's buckets (key (group, bucket)), from the
        #: wrapped optimizer's ``compressor_factory``: 1-bit with error feedback by default
        self.compressor: Optional[Compressor] = (
            build_compressor(self.optimizer, self.comm, self.timeout, not replicated)
            if self._rules is not None else None)
        self._grads = GradReducer(self.groups, stage, self._async, self.overlap, self.rank,
                                  self.world, self.device, self.timeout,
                                  piece=self.config["reduce_bucket_size"])
        self._grads.sink = self.offload if self.offload and self.offload.optimizer else None
        self._onebit: Optional[OneBitReducer] = None
        if self._rules is not None and not replicated:
            self._onebit = OneBitReducer(
                self.groups, self._grads, self.comm, self._async, self.compressor,
                self._input_scale, lambda: self.scaler.scale, self.gas, self.clip,
                overlap=stage >= 2 and self.overlap and self.clip == 0 and self.world > 1,
                keep_pool=self._keep_pool, rank=self.rank, world=self.world,
                device=self.device, timeout=self.timeout)
        #: OneBitAdam's compressed phase in the "exact" / "no_allgather" modes
        self._replicated: Optional[ReplicatedMomentum] = None
        if replicated:
            self._replicated = ReplicatedMomentum(
                self.onebit_mode, self.groups, self._grads, self.optimizer, self.compressor,
                self._async, lambda: self.scaler.scale, self.gas, self.clip, self.rank,
                self.world, self.device, self.timeout,
                offload=self._grads.sink is not None,
                placement=self.config["onebit_placement"] or "device")
        self._unsharded: Optional[UnshardedPhase] = None
        if self._rules is not None and self._rules.local_phase:
            self._unsharded = UnshardedPhase(self.groups, self.optimizer, self._async, stage,
                                             self.rank, self.device, self.timeout)
        self._stage3: Optional[ParamGatherer] = None
        if stage == 3:
            self._stage3 = ParamGatherer(self.groups, module, self.config, self._async, self.world,
                                         self.device, self.timeout)
        #: stage 2/3: the gradient hooks and the end-of-backward callback (:mod:`.hooks`)
        self._hooks: Optional[GradHooks] = None
        if stage >= 2:
            self._hooks = GradHooks(self.groups, self._grads, self._onebit, self._stage3,
                                    self._keep_pool, self.gas, lambda: self.phase)

    # ---- what the coming step does -----------------------------------------------------------

    @property
    def phase(self) -> Phase:
        """How the coming ``step()`` reduces the gradients: from the wrapped optimizer's schedule
        (:class:`compcomm.schedule.StepKind`) and ``onebit_mode``."""
        if self.local_phase:
            return Phase.LOCAL
        if self._rules is None or not Phase.compresses(self.optimizer.schedule.next_kind()):
            return Phase.FULL
        return Phase.REPLICATED if self._replicated is not None else Phase.ONEBIT

    @property
    def local_phase(self) -> bool:
        """Whether ZeroOneAdam runs unsharded now (its local-step phase, :mod:`.unsharded`)."""
        return self._unsharded is not None and self._unsharded.active

    _local_phase = local_phase  # kept for the tests written before the split (private names)

    def _compressed_phase(self) -> bool:
        return self.phase.compressed

    @property
    def _exchanges(self) -> List[tuple]:
        """The 1-bit exchanges queued during backward (read by tests)."""
        return self._onebit.exchanges if self._onebit is not None else []

    @property
    def _errors(self) -> Dict[tuple, tuple]:
        """Copies of the bucket error buffers (as checkpoints hold them)."""
        return errors_of(self.compressor) if self.compressor is not None else {}

    def _input_scale(self, gi: int) -> float:
        return self._rules.input_scale(self.optimizer.param_groups[gi])

    # ---- ZeroOneAdam's local-step phase ----------------------------------------------------------

    def _enter_local_phase(self, gather: bool = True) -> None:
        """Run the wrapped ZeroOneAdam unsharded (:mod:`.unsharded`); the bucket error buffers are
        dropped, as 0/1 Adam zeroes its errors at the freeze, and so is the gradient staging."""
        self._grads.wait()
        self._unsharded.enter(gather)
        self.compressor.reset()
        self._grads.drop_buffers()

    # ---- public API --------------------------------------------------------------------------

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        """The wrapped optimizer's parameter groups (one fp32 shard each); LR changes go here."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        """The wrapped optimizer's state (shards)."""
        return self.optimizer.state

    @property
    def loss_scale(self) -> float:
        """The current loss scale (``scaler.scale``)."""
        return self.scaler.scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self.scaler.scale = float(value)

    def backward(self, loss: torch.Tensor) -> None:
        """``(loss * loss_scale).backward()``: use this with fp16 loss scaling."""
        self.scaler.scale_loss(loss).backward()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop accumulated gradients (whole ones in stage 1, shards in stage 2/3)."""
        if self._hooks is not None:
            self._hooks.new_step()
        self._grads.wait()
        if self._onebit is not None:
            self._onebit.drop()  # and the staged gradients
        else:
            self._grads.reset()
        for grp in self.groups:
            for p in grp.params:
                p.grad = None
            if self.stage >= 2 and not self.local_phase:
                grp.master.grad.zero_()
            else:
                grp.master.grad = None

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Optional[Any]:
        """Reduce the remaining gradients, step the wrapped optimizer on the shards, and re-assemble
        the parameters (stage 1/2: all-gather; stage 3: refresh the shards the hooks gather from).

        Returns the closure's value, if one was given. Skips the update (and, with a dynamic loss
        scale, halves the scale) if the gradient is not finite.
        """
        if len(self.optimizer.param_groups) != len(self.groups):
            raise ValueError(
                f"[rank {self.rank}] ZeroOptimizer.step: the wrapped optimizer has "
                f"{len(self.optimizer.param_groups)} param groups, ZeRO partitioned "
                f"{len(self.groups)}; groups added to it later are neither reduced nor "
                "partitioned: build a new ZeroOptimizer with every group")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._hooks is not None:
            self._hooks.new_step()
        phase = self.phase
        scale = 1.0 / (self.gas * self.scaler.scale)
        if phase is Phase.REPLICATED:
            norm_sq = self._replicated.reduce()
        elif phase is Phase.LOCAL:
            self._grads.wait()
            norm_sq = self._grads.mean_sq_norm(self._unsharded.grads(scale))
        elif phase is Phase.ONEBIT:
            norm_sq = self._onebit.reduce()
        else:
            self._grads.flush(self.gas)
            div = float(self.world * self.gas) * self.scaler.scale
            for grp in self.groups:
                if grp.master.grad is None:  # stage 1, offload: a group of no bucket got nothing
                    grp.master.grad = torch.zeros_like(grp.master)
                grp.master.grad.div_(div)
            norm_sq = self._grads.shard_norm_sq()
        # NCCL: a collective of this step released by an abort left garbage (a finite norm, too);
        # raise that abort now, before the update writes anything.
        wait_cancellable(self.comm, self.timeout)
        self.last_grad_norm = math.sqrt(norm_sq) if math.isfinite(norm_sq) else float("inf")
        if not math.isfinite(norm_sq):
            self.skipped_steps += 1
            self.scaler.update(finite=False)
            self.zero_grad()
            return loss
        if self.clip > 0 and self.last_grad_norm > self.clip and phase is Phase.FULL:
            for grp in self.groups:
                grp.master.grad.mul_(self.clip / (self.last_grad_norm + 1e-6))
        if phase is Phase.LOCAL:
            self._unsharded.step(clip_coef(norm_sq, self.clip, scale))
        elif phase is Phase.REPLICATED:
            self._replicated.update()
        else:  # the wrapped optimizer's update on the (host, with offload) master shards
            self._shards = step_inner(self.optimizer, self.groups, self._rules, self._grads.sink)
        self.global_steps += 1
        self.scaler.update(finite=True)
        if phase is not Phase.LOCAL and (phase is not Phase.REPLICATED
                                         or self._replicated.publishes):
            self._publish()
        if (self._unsharded is not None and phase is not Phase.LOCAL
                and self.optimizer.schedule.frozen):
            self._enter_local_phase()
        if self.stage >= 2 and not self.local_phase:
            for grp in self.groups:
                grp.master.grad.zero_()
        else:
            for grp in self.groups:
                grp.master.grad = None
                for p in grp.params:
                    p.grad = None
        return loss

    def _publish(self) -> None:
        """The new master shards become the model's parameters (:func:`.param_gather.publish`)."""
        # the step's uploaded copies are used once: a failed all-gather must not leave them for
        # the next publish (a checkpoint load publishes its own masters)
        shards, self._shards = self._shards, None
        publish(self.groups, self._async, self.config["allgather_bucket_size"], self.device,
                self.timeout, shards)
        if self._stage3 is not None:
            self._stage3.after_step()
        else:  # NCCL: an abort during the all-gather left garbage in the parameters: raise now
            wait_cancellable(self.comm, self.timeout)

    def gather_parameters(self) -> None:
        """Stage 3: all-gather every parameter now (for evaluation or saving outside the hooks);
        they are freed again by the next ``step()``. No-op for stage 1/2."""
        if self._stage3 is not None:
            self._stage3.gather_all()
            wait_cancellable(self.comm, self.timeout)  # NCCL: raise an abort before they are read

    # ---- checkpoints: the interface of zero/checkpoint.py (which owns the file format) --------

    @property
    def has_local_phase(self) -> bool:
        """Whether the wrapped optimizer steps unsharded after its freeze (ZeroOneAdam)."""
        return self._unsharded is not None

    def wait(self) -> None:
        """Wait for the gradient reductions still queued (stage 2/3 with ``overlap_comm``)."""
        self._grads.wait()

    def export_state(self) -> Dict[str, Any]:
        """This rank's state, as checkpoints hold it (live tensors; nothing copied): ``masters``
        (the fp32 master shard of each group), ``optimizer`` (the wrapped optimizer's state
        dict), ``local_phase``, ``local_params`` (ZeroOneAdam's local phase: each group's flat
        parameters, this rank's own; else None), ``errors`` (with ``exact_resume``: copies of the
        bucket error buffers, ``{(group, bucket): (worker, server)}``; else None),
        ``loss_scale``, ``global_steps``, ``skipped_steps``. Waits for queued reductions first."""
        self.wait()
        local = self.local_phase
        inner = self.optimizer.state_dict()
        if self._rules is not None and not local:
            # the shard state belongs to no group's layout: recorded as a world of one (what
            # the shard checkpoints have always said, checkpoint.py validates it so)
            inner["compcomm"].update(world_size=1, rank=0)
        return {
            "masters": [grp.master for grp in self.groups],
            "optimizer": inner,
            "local_phase": local,
            "local_params": [grp.flat for grp in self.groups] if local else None,
            "errors": errors_of(self.compressor) if self.exact_resume else None,
            "loss_scale": self.loss_scale,
            "global_steps": self.global_steps,
            "skipped_steps": self.skipped_steps,
        }

    def import_state(self, state: Dict[str, Any]) -> None:
        """Take over a state of :meth:`export_state`'s form, already checked against this
        optimizer (:func:`compcomm.zero.checkpoint.validate_shard_state_dict`). Collective (the
        parameters are re-assembled from the new shards, except in the local phase)."""
        for grp, master in zip(self.groups, state["masters"]):
            grp.master.data.copy_(master)
        local = bool(state["local_phase"])
        if local and not self.local_phase:
            self._enter_local_phase(gather=False)  # the state comes from the checkpoint
        elif self.local_phase and not local:
            self._unsharded.leave()
        self.optimizer.load_state_dict(state["optimizer"])
        if self._replicated is not None:  # OneBitAdam's full momentum: regathered from the shards
            self._replicated.reset()
        if self.compressor is not None:
            load_errors(self.compressor, state["errors"] if self.exact_resume else None)
        self.loss_scale = float(state["loss_scale"])
        self.global_steps = int(state["global_steps"])
        self.skipped_steps = int(state["skipped_steps"])
        if local:
            for grp, flat in zip(self.groups, state["local_params"]):
                grp.flat.copy_(flat)
        else:
            self._publish()

    def ranks_failed(self, failed: bool) -> List[int]:
        """Collective: the ranks that pass ``failed=True`` (one all-reduce of a flag per rank,
        through the worker thread so that it never overtakes queued collectives)."""
        if self.world == 1:
            return [self.rank] if failed else []
        flags = torch.zeros(self.world, dtype=torch.float32, device=self.device)
        flags[self.rank] = float(failed)
        self._async.all_reduce(buffer_of(flags), _C.ReduceOp.sum, self.timeout,
                               stream_of(flags)).wait(self.timeout)
        return [r for r, f in enumerate(flags.tolist()) if f > 0]

    # ---- introspection -----------------------------------------------------------------------

    def memory_bytes(self) -> Dict[str, int]:
        """Bytes this rank holds, by kind: ``params`` (model parameters as stored: full in stage
        1/2, the shards plus whatever is gathered in stage 3), ``grads`` (``p.grad`` plus the fp32
        gradient shards), ``master`` (fp32 master shards), ``optimizer_state`` (tensors in the
        wrapped optimizer's state), ``buffers`` (gradient staging, 1-bit error feedback and
        workspaces, offload copies); and where the first four kinds are: ``device`` and ``host``
        (with offload: master, state, gradient and, with ``offload_param``, parameter shards in
        host memory), and of ``buffers`` ``buffers_host`` (offload's host copies) and
        ``buffers_device`` (the rest: staging, 1-bit buffers; :func:`.memory.measure`)."""
        return measure(self)

    def close(self) -> None:
        """Wait for pending work, remove hooks, and stop the communication thread."""
        self._grads.wait()
        if self._hooks is not None:
            self._hooks.remove()
        if self._stage3 is not None:
            self._stage3.remove()
        if self.compressor is not None:
            self.compressor.close()
        self._async.close()

    def __del__(self) -> None:
        # stop the worker threads with the GIL released (close() drains the queue first)
        for owner in (getattr(self, "compressor", None), getattr(self, "_async", None)):
            if owner is not None:
                try:
                    owner.close()
                except Exception:
                    pass

    def state_dict(self) -> Dict[str, Any]:
        """This rank's shard of the optimizer (see :mod:`compcomm.zero.checkpoint`)."""
        return shard_state_dict(self)

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore this rank's shard saved by :meth:`state_dict` (same world size and layout).

        Collective: the shard is validated and the ranks agree first, so a bad shard on any rank
        raises on every rank and changes nothing
        (:func:`compcomm.zero.checkpoint.load_shard_state_dict`).
        """
        load_shard_state_dict(self, sd)
