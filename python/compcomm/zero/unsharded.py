"""ZeroOneAdam's local-step phase under ZeRO: the wrapped optimizer runs unsharded.

0/1 Adam's local steps (after ``var_freeze_step``) update each rank's own copy of every parameter
with the rank's own momentum, so they need the full momentum, the frozen variance and (for
fp16/bf16 parameters) the full fp32 master on every rank. :meth:`UnshardedPhase.enter` all-gathers
them once and hands the wrapped optimizer the model's own parameters: from then on its ``step()``
is exactly unsharded ZeroOneAdam's (a per-bucket compressed allreduce of the accumulated update at
syncs, on the group it was built with, ZeroOptimizer's). The master shards keep the last
synchronised parameters, for checkpoints and ``consolidate``.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from .._buffers import buffer_of
from .._scratch import stream_of
from ..schedule import StepKind
from .layout import GroupLayout

__all__ = ["UnshardedPhase"]


class UnshardedPhase:
    """Switches the wrapped ZeroOneAdam between the shards and the model's parameters.

    Parameters
    ----------
    groups : list of GroupLayout
    inner : ZeroOneAdam
        The wrapped optimizer (one parameter group per layout group), built on the data-parallel
        group: on the shards ZeroOptimizer calls its ``step_on`` (no communication), unsharded
        its ``step()``.
    async_comm : _C.zero.AsyncComm
        The owner's worker thread (the state is all-gathered through it).
    stage, rank : int
    device : torch.device
    timeout : float
    """

    def __init__(self, groups: List[GroupLayout], inner: Any, async_comm: Any, stage: int,
                 rank: int, device: torch.device, timeout: float) -> None:
        self.groups = groups
        self.inner = inner
        self.async_comm = async_comm
        self.stage = stage
        self.rank = rank
        self.device = device
        self.timeout = timeout
        #: whether the wrapped optimizer runs unsharded now
        self.active = False

    def enter(self, gather: bool = True) -> None:
        """Give the wrapped optimizer the model's parameters, with the full state all-gathered
        from the shards (``gather``; a checkpoint load fills it instead)."""
        opt = self.inner
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
                    works.append((self.async_comm.bucketed_all_gather(
                        grp.plan, buffer_of(shard), buffer_of(full[key]), timeout_s=self.timeout,
                        stream=stream_of(shard)), shard))
                for w, _ in works:
                    w.wait(self.timeout)
            views = {k: grp.views(f) for k, f in full.items()}
            for ti, p in enumerate(grp.params):
                st: Dict[str, Any] = {}
                if gather:
                    st = {k: v[ti] for k, v in views.items()}
                    st["step"] = shard_state.get("step", 0)
                opt.state[p] = st
            opt.param_groups[gi]["params"] = list(grp.params)
            grp.master.grad = None
        self.active = True

    def leave(self) -> None:
        """Back to the shards (loading a variance-phase checkpoint into a local-phase optimizer);
        the state is then filled by the load."""
        opt = self.inner
        for gi, grp in enumerate(self.groups):
            for p in grp.params:
                opt.state.pop(p, None)
            opt.param_groups[gi]["params"] = [grp.master]
            grp.master.grad = torch.zeros_like(grp.master) if self.stage >= 2 else None
        self.active = False

    def grads(self, scale: float) -> List[tuple]:
        """``(p.grad, scale)`` of every parameter with a local gradient (for the norm)."""
        return [(p.grad, scale) for grp in self.groups for p in grp.params if p.grad is not None]

    def step(self, coef: float) -> None:
        """One local or sync step of the unsharded ZeroOneAdam on this rank's local gradients
        times ``coef`` (the micro-step average, loss scale and clipping)."""
        opt = self.inner
        sync = opt.schedule.next_kind() is StepKind.SYNC
        # The GradScaler protocol: the optimizer divides its fp32 copies of the gradients by
        # grad_scale (p.grad itself may be fp16/bf16 and is not touched).
        opt.grad_scale = 1.0 / coef
        try:
            opt.step()
        finally:
            del opt.grad_scale
        if sync:  # every rank now holds the same parameters: refresh the master shards
            for grp in self.groups:
                full = grp.flat if grp.dtype == torch.float32 else grp.flatten(
                    (opt.state[p]["master_param"] for p in grp.params), torch.float32, self.device)
                grp.own_chunks(full, grp.master.data, self.rank)
