"""Parameters from their shards: after a step (:func:`publish`) and, in stage 3, per module.

After the inner step the fp32 master shards are cast to the parameter dtype and (stage 1/2)
all-gathered back into the flat parameters that the model's parameters are views of, in calls of
at most ``allgather_bucket_size`` elements; stage 3 keeps only the new parameter shard.

Stage 3 stores parameters only as shards (:class:`ParamGatherer`): module hooks all-gather a
module's own parameters (a leaf module's, such as attention: its children's too) before its
forward and, through an identity autograd function on its outputs, before its backward, prefetching
the next modules of the recorded trace (the first step's forward order; reversed for backward) up
to ``stage3_prefetch_bucket_size`` elements and never more than ``stage3_max_live_parameters``
alive, and release them afterwards -- except parameters of at most
``stage3_param_persistence_threshold`` elements (within ``stage3_model_persistence_threshold`` in
all), which stay gathered, and parameters used again within ``stage3_max_reuse_distance`` elements
of the trace. Every all-gather goes through the owner's ``AsyncComm`` worker thread, so it is
ordered with the gradient reductions; every rank must run the same modules.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import torch
from torch.utils._pytree import tree_map_only

from .._buffers import buffer_of
from .._scratch import stream_of
from .layout import GroupLayout, full_numel, full_shape

__all__ = ["ParamGatherer", "publish"]

#: modules whose forward uses their children's parameters without calling the children (torch's
#: attention reads ``out_proj.weight`` itself): their hooks gather those parameters too
LEAF_MODULES = (torch.nn.MultiheadAttention,)


class _GatherForBackward(torch.autograd.Function):
    """The identity on a module's output whose backward gathers the module's parameters: the
    gradient reaches the output before any of the module's own backward nodes run. (Module
    full-backward hooks do this too, but make the outputs views that in-place ops may not change
    (``ReLU(inplace=True)``, ``out += x``), and skip outputs in a dict or list.)"""

    @staticmethod
    def forward(ctx: Any, gatherer: "ParamGatherer", module: torch.nn.Module,
                t: torch.Tensor) -> torch.Tensor:
        ctx.gatherer, ctx.module = gatherer, module
        return t.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        ctx.gatherer._pre_backward(ctx.module)
        return None, None, grad


class ParamGatherer:
    """Module hooks that gather a module's parameters before use and free them after.

    Parameters
    ----------
    groups : list of GroupLayout
        The partitioned groups (stage 3: each holds its ``param_shard``).
    module : torch.nn.Module
        The model: every module that owns parameters gets the hooks.
    config : dict
        The validated ``zero_optimization`` keys (``stage3_*``).
    async_comm : _C.zero.AsyncComm
        The owner's worker thread (gathers are ordered with its other collectives).
    world : int
    device : torch.device
    timeout : float
    """

    def __init__(self, groups: List[GroupLayout], module: torch.nn.Module, config: Dict[str, Any],
                 async_comm: Any, world: int, device: torch.device, timeout: float) -> None:
        self.groups = groups
        self.async_comm = async_comm
        self.device = device
        self.timeout = timeout
        self.prefetch = config["stage3_prefetch_bucket_size"]
        self.persist_threshold = config["stage3_param_persistence_threshold"]
        self.max_live = config["stage3_max_live_parameters"]
        self.reuse = config["stage3_max_reuse_distance"]
        self.where: Dict[int, tuple] = {}  # id(param) -> (group, tensor index)
        for gi, grp in enumerate(groups):
            for ti, p in enumerate(grp.params):
                self.where[id(p)] = (gi, ti)
        model_cap = config["stage3_model_persistence_threshold"] // max(world, 1)
        self.persistent = set()
        total = 0
        for grp in groups:
            for p in sorted(grp.params, key=lambda q: full_numel(q)):
                n = full_numel(p)
                if n <= self.persist_threshold and total + n <= model_cap:
                    self.persistent.add(id(p))
                    total += n
        self.inflight: Dict[int, tuple] = {}  # id(param) -> (work, buffer, send)
        self.live = 0  # gathered elements alive (not counting persistent ones)
        #: most gathered elements alive at once (persistent ones not counted)
        self.peak_live = 0
        #: parameters gathered ahead of use
        self.prefetched = 0
        self.trace: List[torch.nn.Module] = []
        self.trace_done = False
        self.handles: List[Any] = []
        for m in module.modules():
            for p in m.parameters(recurse=False):
                if id(p) not in self.where and p.requires_grad:
                    raise ValueError(f"module: parameter of {type(m).__name__} is not among the "
                                     "optimizer's params")
        # the children of a leaf module are gathered by its hooks
        inner = {id(c) for m in module.modules() if isinstance(m, LEAF_MODULES)
                 for c in m.modules() if c is not m}
        # frozen parameters (requires_grad=False, not given to the optimizer) stay whole everywhere
        self.modules = [m for m in module.modules() if id(m) not in inner and self._own(m)]
        for m in self.modules:
            self.handles.append(m.register_forward_pre_hook(self._pre_forward))
            self.handles.append(m.register_forward_hook(self._post_forward))
            # the parameters of a module live in the shards: a state dict of it would hold empty
            # tensors, and one loaded into it would be overwritten from the shards
            self.handles.append(m.register_state_dict_pre_hook(self._before_state_dict))
            self.handles.append(m.register_load_state_dict_pre_hook(self._before_load))
        self.gather_all(persistent_only=True)

    def remove(self) -> None:
        """Remove the module hooks."""
        for h in self.handles:
            h.remove()
        self.handles.clear()

    # -- gather / release
    def _param(self, pid: int) -> torch.nn.Parameter:
        gi, ti = self.where[pid]
        return self.groups[gi].params[ti]

    def _available(self, p: torch.Tensor) -> bool:
        return p.data.shape == full_shape(p) and p.data.numel() == full_numel(p)

    def _submit(self, p: torch.Tensor) -> None:
        gi, ti = self.where[id(p)]
        grp = self.groups[gi]
        slot = grp.tensors[ti]
        b = grp.buckets[slot.bucket]
        buf = torch.empty(b.padded, dtype=grp.dtype, device=self.device)
        send = b.shard_of(grp.param_shard)
        if send.device != self.device:  # offload_param: the shard is in host memory
            send = send.to(self.device, non_blocking=True)
        work = self.async_comm.all_gather(buffer_of(send), buffer_of(buf), timeout_s=self.timeout,
                                          stream=stream_of(buf))
        self.inflight[id(p)] = (work, buf, send)
        if id(p) not in self.persistent:
            self.live += slot.numel

    def _fetch(self, params: List[torch.Tensor]) -> None:
        for p in params:
            if not self._available(p) and id(p) not in self.inflight:
                self._submit(p)
        for p in params:
            entry = self.inflight.pop(id(p), None)
            if entry is not None:
                entry[0].wait(self.timeout)
                p.data = entry[1][: full_numel(p)].view(full_shape(p))
        self.peak_live = max(self.peak_live, self.live)

    def _release(self, p: torch.Tensor) -> None:
        if id(p) in self.persistent or id(p) in self.inflight or not self._available(p):
            return
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.live -= full_numel(p)

    def gather_all(self, persistent_only: bool = False) -> None:
        """Gather every parameter (or only the persistent ones) now."""
        ps = [self._param(pid) for pid in self.where if not persistent_only or pid in self.persistent]
        self._fetch(ps)

    def after_step(self) -> None:
        """The shards changed: drop every gathered copy, refresh the persistent ones."""
        self._drain()
        for grp in self.groups:
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
            work.wait(self.timeout)
            p = self._param(pid)
            p.data = buf[: full_numel(p)].view(full_shape(p))
        self.inflight.clear()

    def _own(self, m: torch.nn.Module) -> List[torch.Tensor]:
        leaf = isinstance(m, LEAF_MODULES)
        return [p for p in m.parameters(recurse=leaf) if id(p) in self.where]

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
                if full_numel(p) > budget:
                    return
                budget -= full_numel(p)
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
        return 2 * sum(full_numel(p) for later in self.trace[i + 1 :] for p in self._own(later))

    def _post_forward(self, m: torch.nn.Module, args: Any, out: Any) -> None:
        grad = torch.is_grad_enabled()
        own = self._own(m)
        if not grad or self._reuse_distance(m) > self.reuse:
            for p in own:
                self._release(p)
        if not grad or all(id(p) in self.persistent for p in own):
            return None
        return tree_map_only(torch.Tensor, lambda t: _GatherForBackward.apply(self, m, t)
                             if t.requires_grad else t, out)

    def _pre_backward(self, m: torch.nn.Module) -> None:
        self._fetch(self._own(m))
        self._prefetch_after(m, list(reversed(self.trace)))

    def _before_state_dict(self, m: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
        if not all(self._available(p) for p in self._own(m)):
            raise RuntimeError(
                f"ZeRO stage 3 holds the parameters of {type(m).__name__} ({prefix or 'the model'})"
                " as shards: call ZeroOptimizer.gather_parameters() on every rank first (or save "
                "with compcomm.zero.save_checkpoint)")

    def _before_load(self, m: torch.nn.Module, *_: Any) -> None:
        raise RuntimeError(
            f"ZeRO stage 3 holds the parameters of {type(m).__name__} as shards, which a module's "
            "load_state_dict does not write: load the weights before making the ZeroOptimizer, or "
            "load a checkpoint with compcomm.zero.load_checkpoint")

    def after_grad(self, p: torch.Tensor) -> None:
        """``p``'s gradient has been taken: release it (unless it persists)."""
        self._release(p)


def publish(groups: List[GroupLayout], async_comm: Any, allgather_bucket_size: int,
            device: torch.device, timeout: float,
            shards: Optional[List[torch.Tensor]] = None) -> None:
    """fp32 master shards -> parameter dtype shards -> (stage 1/2: groups with a ``flat``) the
    full parameters on every rank (collective). ``shards``: the parameter-dtype shards already
    made (ZeRO-Offload's uploads), one per group."""
    ag = allgather_bucket_size
    if device.type != "cpu":
        ag = 0  # the split all-gather scatters pieces on the host; GPU buckets go whole
    works = []
    for gi, grp in enumerate(groups):
        new = grp.master if shards is None else shards[gi]
        if grp.flat is None:  # stage 3: the hooks gather from the parameter shard
            if new is not grp.param_shard:  # (offload uploads into it directly)
                grp.param_shard.copy_(new)
            continue
        if new is grp.flat:  # offload with one rank: uploaded into the parameters directly
            continue
        shard = new.to(device=device, dtype=grp.dtype)  # offload: uploads a host master
        staging = torch.empty(ag if 0 < ag < grp.max_padded else 0, dtype=grp.dtype)
        works.append((async_comm.bucketed_all_gather(
            grp.plan, buffer_of(shard), buffer_of(grp.flat), max_elements=ag,
            staging=buffer_of(staging), timeout_s=timeout, stream=stream_of(shard)),
            (staging, shard)))
    for w, _ in works:
        w.wait(timeout)
