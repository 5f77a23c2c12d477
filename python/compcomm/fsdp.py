"""1-bit compression with error feedback for PyTorch's FSDP2 (``fully_shard``).

FSDP2 lets a module's gradient reduce-scatter be replaced (``FSDPModule.set_custom_reduce_scatter``)
and runs a user hook on each reduced shard (``set_all_reduce_hook``: after HSDP's replica all-reduce,
or, with 1-D FSDP, right after the reduce-scatter). :func:`onebit` installs compcomm's 1-bit
compressed reduce-scatter (DeepSpeed's algorithm without its final all-gather, worker and server
error feedback per module) on every FSDP module of a model, after ``warmup_steps`` steps of FSDP's own
full-precision reduce-scatter; with ``replicate_group`` it also compresses HSDP's cross-replica
all-reduce (the slow inter-node link) with :func:`compcomm.compressed_allreduce` while the
intra-replica reduce-scatter (fast links) stays full precision.

How the 1-bit reduce-scatter meets FSDP's contract: FSDP hands a flat rank-major input of W shards of
``s`` elements each (every parameter dim-0 padded to a multiple of W; shard r is every parameter's
piece r, in FSDP's parameter order) and expects the reduced shard of this rank. The module's
parameters are cut into tensor-aligned *segments* (:func:`compcomm.compress.plan_buckets` with
``segment_elements``, 16384 by default, as OneBitAdam's buckets: every parameter of more elements is
a segment of its own, smaller neighbours share one), and each segment is its own compressed
reduce-scatter with its own error buffers and scales -- a LayerNorm weight never shares a 1-bit
scale with a weight matrix. Segment k covers the same columns ``[o_k, o_k + S_k)`` of every shard;
each rank's piece is copied into a row of ``ceil(S_k / 8) * 8`` fp32 elements (the 1-bit chunk of a
rank must be whole bytes), so chunk r of the segment's reduce-scatter is exactly rank r's part of
FSDP's shard.
The result is the 1-bit *average*; FSDP's ``op`` says what it wants: AVG as it is, SUM times W,
``PREMUL_SUM(f)`` times W * f. FSDP records an event right after the call returns, so the call is
stream-ordered on the caller's stream (CUDA) and writes only ``output_tensor``.

The optimizer of the 1-bit phase: :class:`FrozenVarianceAdam` (:mod:`compcomm.fsdp_optim`), AdamW on
the shards with the variance frozen at the switch (``freeze_step=`` the state :func:`onebit` returns).
``mode="momentum"`` compresses the momentum instead (DeepSpeed's 1-bit Adam, :mod:`.fsdp_momentum`);
``mode="local_momentum"`` reduce-scatters each rank's fp32 local momentum with this exchange
(:mod:`.fsdp_local`: no all-gather, no replicated momentum), also on FSDP's own 2-D (HSDP) mesh
(:mod:`.fsdp_hsdp`), where it is the default.

The parameter all-gathers (FSDP's bf16 gathers before each forward and backward) are
:mod:`compcomm.fsdp_gather`'s: ``onebit(..., quantized_allgather=True, regather_cache=True)`` or
:func:`compressed_allgather` on its own.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from . import _C
from .collectives import compressed_allreduce, padded_numel, workspace_bytes
from .compress import DEFAULT_BUCKET_ELEMENTS
from .errors import NonFiniteError, UnsupportedError
from .fsdp_checkpoint import all_true, check_state
from .fsdp_gather import DEFAULT_EXACT_NUMEL, GatherState, compressed_allgather
from .fsdp_exchange import reduce_scatter_segments
from .fsdp_hsdp import (check_one_group, check_onebit, local_default, mesh_ndim,
                        replicas_summed, take_replicas)
from .fsdp_layout import plan_indices, plan_segments, shard_params
from .fsdp_local import (LocalMomentumReduceScatter, load_local, local_fits, local_state_dict,
                         replica_hook)
from .fsdp_momentum import (MomentumReduceScatter, MomentumState, WarmupReduceScatter,
                            row_elements, scale_of)
from .fsdp_optim import FrozenVarianceAdam
from .quantize import DEFAULT_BLOCK


__all__ = ["OneBitFSDP", "OneBitReduceScatter", "onebit", "compressed_allgather", "GatherState",
           "FrozenVarianceAdam", "STATE_FORMAT"]

_scale_of = scale_of  # (the name the tests know)


#: The state format of :meth:`OneBitFSDP.state_dict` (3: the mode and the momentum mode's packed
#: momentum, or the local-momentum mode's fp32 momentum; 2: error buffers per segment; 1: one pair
#: per module)
STATE_FORMAT = "compcomm.fsdp/3"
_OLD_FORMATS = ("compcomm.fsdp/1", "compcomm.fsdp/2")  # gradient mode, loaded as such
MODES = ("gradient", "momentum", "local_momentum")
MOMENTUM_MODES = ("momentum", "local_momentum")  # FrozenVarianceAdam takes its momentum from here


def _check_segment_elements(value: Any) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError("compcomm.fsdp.onebit: argument 'segment_elements' must be an integer "
                         f">= 0 or None, got {value!r}")
    return value


class OneBitFSDP:
    """The state of :func:`onebit` for one model: step counts and error buffers per FSDP module.

    A module is in its 1-bit phase once it has reduced ``warmup_steps`` times (one reduce-scatter
    per module per backward). Each module's reduction is cut into tensor-aligned segments (see the
    module docstring), each with its own pair of error buffers, keyed ``"<module>#<k>"`` (one
    segment, ``segment_elements=None``: keyed by the module's name, as format 1 was).
    ``state_dict()``/``load_state_dict()`` hold this rank's error buffers (they differ per rank:
    save one file per rank, e.g. ``torch.save(ctrl.state_dict(), f"onebit_rank{r}.pt")``); loading
    on another world size resets them, as DeepSpeed does.

    Attributes
    ----------
    warmup_steps : int
    segment_elements : int or None
        The segment plan's limit (``plan_buckets``): parameters of more elements are segments of
        their own, smaller neighbours are grouped up to it; ``0`` one segment per parameter,
        ``None`` one segment per module.
    steps : dict
        Reductions done per module name.
    segments : dict
        Per module name, the planned segments' element counts per shard (``S_k``).
    batch_segments : bool
        True (default): a module's segments travel in one batched exchange (three collectives,
        ``compressed_reduce_scatter_exchange_many``), then each is committed; False: one
        compressed reduce-scatter (two collectives) per segment. The same bits either way.
    allgather : GatherState or None
        The all-gather's state when :func:`onebit` installed one (``quantized_allgather`` or
        ``regather_cache``): its counters and ``invalidate()``.
    """

    def __init__(self, warmup_steps: int, replicate_group: Optional[Any] = None,
                 segment_elements: Optional[int] = DEFAULT_BUCKET_ELEMENTS,
                 mode: str = "gradient", beta1: Optional[float] = None) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"compcomm.fsdp.onebit: argument 'warmup_steps' must be an integer >= 0, "
                             f"got {warmup_steps!r}")
        self.warmup_steps = warmup_steps
        self.replicate_group = replicate_group
        self.segment_elements = _check_segment_elements(segment_elements)
        if mode not in MODES:
            raise ValueError(f"compcomm.fsdp.onebit: argument 'mode' must be one of {MODES}, "
                             f"got {mode!r}")
        if beta1 is not None and (isinstance(beta1, bool) or not isinstance(beta1, (int, float))
                                  or not 0.0 <= beta1 < 1.0):
            raise ValueError(f"compcomm.fsdp.onebit: argument 'beta1' must be in [0, 1) or None, "
                             f"got {beta1!r}")
        if mode == "momentum" and replicate_group is not None:
            raise UnsupportedError(f"compcomm.fsdp.onebit: mode={mode!r} with 'replicate_group' "
                                   "(HSDP) is not implemented; use mode='gradient'", "onebit",
                                   "fsdp")
        self.mode = mode
        #: the momentum modes' momentum (replicated 1-bit, or this rank's fp32 local one in
        #: ``full``) and the optimizers bound to it (None in the gradient mode)
        self.momentum = MomentumState(None if beta1 is None else float(beta1), mode) \
            if mode in MOMENTUM_MODES else None
        self.steps: Dict[str, int] = {}
        self.segments: Dict[str, List[int]] = {}
        self._errors: Dict[str, List[torch.Tensor]] = {}  # key -> [worker_error, server_error]
        # key -> (worker, server) error-buffer sizes, known from the parameters when installed
        # (so that state_dict() is a complete template for torch.distributed.checkpoint.load)
        self._sizes: Dict[str, Tuple[int, int]] = {}
        self._packed_sizes: Dict[str, Tuple[int, int]] = {}  # momentum: key -> (sign bytes, W)
        # the batched exchange's scratch: a workspace per segment (zeroed when made: the GPU
        # kernels need that on first use) and one staging buffer; not state
        self._workspaces: Dict[str, torch.Tensor] = {}
        self._staging = torch.zeros(0, dtype=torch.uint8)
        self.batch_segments = True  # False: one exchange per segment (the same bits; benchmarks)
        self.allgather: Optional[GatherState] = None

    def replicas(self) -> int:
        """The replica count (1 without a replica group): with the world size, what the layout
        of the buffers depends on (each shard group's rows)."""
        g = self.replicate_group
        return 1 if g is None else dist.get_world_size(g)

    def invalidate(self) -> None:
        """Drop the all-gather's re-gather cache (on every rank), e.g. after changing parameters
        outside an optimizer step; nothing to do without one."""
        if self.allgather is not None:
            self.allgather.invalidate()

    def compressing(self, name: str) -> bool:
        """Whether module ``name``'s next reduction is 1-bit."""
        return self.steps.get(name, 0) >= self.warmup_steps

    def segments_for(self, name: str, s: int) -> Tuple[List[int], List[str]]:
        """Module ``name``'s segments for a shard of ``s`` elements and their error-buffer keys:
        the planned ones, or, when FSDP reduces fewer parameters than planned (some had no
        gradient this step), one segment for the whole shard under a key of that size."""
        segs = self.segments.get(name)
        if segs is not None and sum(segs) == s:
            return segs, [name] if len(segs) == 1 else [f"{name}#{k}" for k in range(len(segs))]
        return [s], [name if segs is None else f"{name}#flat{s}"]

    def errors(self, name: str, padded: int, world: int, device: torch.device) -> List[torch.Tensor]:
        """Error buffers ``name`` for ``padded`` elements (zero when new or resized)."""
        bufs = self._errors.get(name)
        if bufs is None or bufs[0].numel() != padded or bufs[0].device != device:
            if bufs is not None and bufs[0].numel() == padded:  # loaded on another device
                bufs = [b.to(device) for b in bufs]
            else:
                bufs = [torch.zeros(padded, dtype=torch.float32, device=device),
                        torch.zeros(padded // world, dtype=torch.float32, device=device)]
            self._errors[name] = bufs
        return bufs

    def scratch(self, keys: List[str], paddeds: List[int], world: int,
                device: torch.device) -> Tuple[List[torch.Tensor], torch.Tensor]:
        """The batched exchange's workspaces of segments ``keys`` and its staging buffer."""
        cuda = device.type == "cuda"
        wss = []
        for k, p in zip(keys, paddeds):
            nbytes = workspace_bytes(p, world, cuda)
            ws = self._workspaces.get(k)
            if ws is None or ws.numel() != nbytes or ws.device != device:
                ws = self._workspaces[k] = torch.zeros(nbytes, dtype=torch.uint8, device=device)
            wss.append(ws)
        nbytes = _C.zero.compressed_allreduce_batch_bytes(paddeds, world)
        if self._staging.numel() < nbytes or self._staging.device != device:
            self._staging = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return wss, self._staging

    def state_dict(self) -> Dict[str, Any]:
        """Step counts and this rank's error buffers (CPU copies), for every segment from the
        start (zeros and 0 before its first 1-bit reduction): a fresh state's ``state_dict()`` is
        the template ``torch.distributed.checkpoint.load`` fills in place."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        errors = {k: [torch.zeros(w), torch.zeros(sv)] for k, (w, sv) in self._sizes.items()}
        mine = self.momentum.errors() if self.mode == "momentum" else self._errors
        errors.update({k: [b.detach().cpu().clone() for b in v] for k, v in mine.items()})
        modules = {k.split("#")[0] for k in self._sizes} | set(self.steps)
        sd = {"format": STATE_FORMAT, "rank": rank, "world": world, "mode": self.mode,
              "replicas": self.replicas(),
              "segment_elements": -1 if self.segment_elements is None else self.segment_elements,
              "steps": {**{k: 0 for k in modules}, **self.steps}, "errors": errors}
        if self.mode == "momentum":  # the packed momentum (zeros before the switch)
            packed = {k: {"signs": torch.zeros(b, dtype=torch.uint8), "scales": torch.zeros(w)}
                      for k, (b, w) in self._packed_sizes.items()}
            packed.update({k: {"signs": d["signs"], "scales": d["scales"]}
                           for k, d in self.momentum.packed.state_dict().items()})
            sd["momentum"] = packed
        if self.mode == "local_momentum":
            sd["local_momentum"] = local_state_dict(self._sizes, self.momentum)
        return sd

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; error buffers (and the momentum modes' momentum) only when
        rank, world size and replica count match *on every rank*, else reset on every rank. Every
        rank calls it: one all-reduce of two flags (a rank keeping its momentum while its peers
        reset would take other collectives at the next step).

        Raises
        ------
        ValueError
            ``sd`` is not such a state, lacks an entry or holds a bad one (the message names the
            key), or its segment plan differs from this state's (a format-1 state, one pair of
            buffers per module, loads only with ``segment_elements=None``); raised on every rank
            when it is one rank's. Nothing is changed then.
        """
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        try:
            steps = check_state(sd, self.mode, self.segment_elements,
                                (STATE_FORMAT,) + _OLD_FORMATS, rank)
            # another split of the same world (replicas x shards) lays the buffers out otherwise
            same = sd["rank"] == rank and sd["world"] == world and \
                sd.get("replicas", 1) == self.replicas()
            if self.mode == "local_momentum":
                same = local_fits(sd, self._sizes) and same
        except ValueError:
            all_true([False, False])  # the peers raise too, rather than wait here
            raise
        ok, same = all_true([True, same])
        if not ok:
            raise ValueError(f"[rank {rank}] compcomm.fsdp: load_state_dict: another rank's "
                             "argument 'sd' failed its checks (its ValueError says why); nothing "
                             "was changed")
        if self.mode == "local_momentum":  # errors and momentum: same rank and world, else reset
            self._errors = load_local(sd, steps, self.warmup_steps, same, self.momentum)
            self.steps = dict(steps)
            if self.replicate_group is not None:  # saved without replicas: their hooks' counts
                for name in [n for n in steps if not n.endswith("/replicas")]:
                    self.steps.setdefault(name + "/replicas", steps[name])
            return
        if self.momentum is not None:
            # a segment's packed momentum exists once its module took a 1-bit step
            live = {k: d for k, d in sd["momentum"].items()
                    if steps.get(k.split("#")[0], 0) > self.warmup_steps}
            if same:
                self.momentum.load(sd["errors"], live)
            else:  # errors reset; the momentum is gathered again from the optimizer's shards
                self.momentum.reset()
        else:
            self._errors = {k: [b.clone() for b in v] for k, v in sd["errors"].items()} \
                if same else {}
        self.steps = dict(steps)


class OneBitReduceScatter(WarmupReduceScatter, ReduceScatter):
    """FSDP2 ``ReduceScatter`` of one module: FSDP's own reduce-scatter during the warm-up, then the
    1-bit compressed reduce-scatter, one per segment with its own error buffers (see the module
    docstring)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 op: Any, async_op: bool = False) -> Optional[dist.Work]:
        warm, work = self.warmup(output_tensor, input_tensor, group, op, async_op)
        if warm:
            return work
        state, name = self.state, self.name
        scale = _scale_of(op, group.size())  # before anything runs: an unsupported op raises
        world = group.size()
        s = output_tensor.numel()
        segs, keys = state.segments_for(name, s)
        rows = [-(-n // 8) * 8 for n in segs]  # each rank's piece of a segment, whole bytes
        dev = input_tensor.device
        staged = torch.zeros(world * sum(rows), dtype=torch.float32, device=dev)
        out = torch.empty(sum(rows), dtype=torch.float32, device=dev)
        src = input_tensor.view(world, s)
        bufs = [state.errors(k, world * r8, world, dev) for k, r8 in zip(keys, rows)]
        segments, outs = [], []
        o = o8 = 0
        for n, r8 in zip(segs, rows):
            segments.append(staged[world * o8: world * (o8 + r8)])
            segments[-1].view(world, r8)[:, :n].copy_(src[:, o: o + n])
            outs.append(out[o8: o8 + r8])
            o, o8 = o + n, o8 + r8
        try:
            reduce_scatter_segments(state, keys, segments, bufs, outs, group, dev)
        except NonFiniteError:
            # raised on every rank, no error buffer changed: non-finite gradients as FSDP's own
            # give (a GradScaler skips the step), not an error that leaves FSDP unsharded
            output_tensor.fill_(float("nan"))
            return None
        o = o8 = 0
        for n, r8 in zip(segs, rows):
            output_tensor[o: o + n].copy_(out[o8: o8 + n].mul_(scale))
            o, o8 = o + n, o8 + r8
        state.steps[name] = state.steps.get(name, 0) + 1
        return None


def _all_reduce_hook(state: OneBitFSDP, name: str, module: Any = None):
    """The replicas' all-reduce of module ``name``'s shard; ``module``: on FSDP's own 2-D mesh
    (:mod:`.fsdp_hsdp`), whose HSDP sums the replicas when a divide factor is set."""
    key = name + "/replicas"

    def hook(reduce_output: torch.Tensor) -> None:
        group = state.replicate_group
        if not state.compressing(key):  # full precision during the warm-up (the average)
            dist.all_reduce(reduce_output, group=group)
            if module is None or not replicas_summed(module):
                reduce_output.div_(dist.get_world_size(group))
        else:
            world = dist.get_world_size(group)
            flat = reduce_output.view(-1)
            segs, keys = state.segments_for(key, flat.numel())
            o = 0
            for n, k in zip(segs, keys):  # the same tensor-aligned segments, each its own scales
                we, se = state.errors(k, padded_numel(n, world), world, reduce_output.device)
                compressed_allreduce(flat[o: o + n], we, se, group)
                o += n
        state.steps[key] = state.steps.get(key, 0) + 1

    return hook


def onebit(model: torch.nn.Module, warmup_steps: int = 100,
           replicate_group: Optional[Any] = None, *, quantized_allgather: bool = False,
           regather_cache: bool = False, allgather_block: int = DEFAULT_BLOCK,
           optimizer: Any = None, allgather_exact_numel: int = DEFAULT_EXACT_NUMEL,
           allgather_rounding: str = "nearest",
           segment_elements: Optional[int] = DEFAULT_BUCKET_ELEMENTS,
           mode: Optional[str] = None, beta1: Optional[float] = None) -> OneBitFSDP:
    """Install 1-bit compressed gradient reduction on every FSDP2 module of ``model``.

    Parameters
    ----------
    model : torch.nn.Module
        A model whose submodules (and/or itself) were wrapped with ``fully_shard``.
    warmup_steps : int, default 100
        Reductions per module in full precision before 1-bit compression starts (the 1-bit Adam
        recipe: pair with an optimizer whose variance is frozen from then on,
        ``FrozenVarianceAdam(params, freeze_step=state)``; measurements in docs/fsdp.md).
    replicate_group : ProcessGroup, optional
        HSDP by hand: shard ``model`` with ``fully_shard`` over the intra-replica mesh only (1-D,
        fast links) and pass the cross-replica group here; the replica all-reduce of each reduced
        shard is then done by compcomm in FSDP's all-reduce hook (full precision during the
        warm-up, 1-bit after) while the reduce-scatter within a replica stays FSDP's own. Without
        it the reduce-scatter itself is compressed.
    quantized_allgather : bool, default False
        Also all-gather the parameters blockwise int8 (:func:`compressed_allgather`).
    regather_cache : bool, default False
        Also serve the backward's parameter re-gather from the forward's (exact; memory: the
        gathered payloads of the resharding modules until their backward).
    allgather_block : int, default 64
        Elements per int8 block of ``quantized_allgather``.
    optimizer : torch.optim.Optimizer or list, optional
        Whose steps invalidate the re-gather cache (default: any optimizer's step).
    allgather_exact_numel : int, default 4096
    allgather_rounding : {"nearest", "stochastic"}, default "nearest"
        ``exact_numel`` and ``rounding`` of :func:`compressed_allgather` (defaults: small
        parameters unquantized, round to nearest; docs/fsdp.md, "Issue 16: the int8 all-gather
        with the 1-bit reduce-scatter").
    segment_elements : int or None, default 16384
        Tensor-aligned segments of each module's reduction (``compress.plan_buckets`` over the
        parameters' padded sizes, as OneBitAdam's buckets): a parameter of more elements is a
        segment of its own, smaller neighbours share one; each segment is its own 1-bit
        reduce-scatter (two collectives) with its own scales and error buffers. ``0``: one
        segment per parameter; ``None``: one per module (the layout before segments).
    mode : {"momentum", "gradient", "local_momentum"}, optional
        What the 1-bit phase compresses; default ``"momentum"``; on FSDP's own 2-D (HSDP) mesh
        ``"local_momentum"`` (``"gradient"`` with a shard dim of size 1); with ``replicate_group``
        ``"gradient"``. ``"gradient"``: FSDP's reduce-scatter of the gradient (the optimizer
        forms the momentum from the 1-bit average on its shard; stalled on the H200, docs/fsdp.md).
        ``"momentum"``:
        DeepSpeed's 1-bit Adam on the shards (:mod:`compcomm.fsdp_momentum`): every rank's local
        momentum ``b1 m + (1 - b1) g`` is averaged with the full compressed allreduce and the new
        momentum kept replicated in 1-bit form; pair it with ``FrozenVarianceAdam(params,
        freeze_step=state)``, which takes its momentum from here (without one bound, the first
        warm-up reduction raises ValueError). Not with ``replicate_group`` or a 2-D mesh.
        ``"local_momentum"`` (:mod:`compcomm.fsdp_local`): every rank keeps its own fp32
        momentum of the whole module (4 bytes per parameter element more memory) and only the
        1-bit reduce-scatter of it travels (half the momentum mode's bytes); paired as
        ``"momentum"``; with ``replicate_group`` or on a 2-D mesh (:mod:`compcomm.fsdp_hsdp`:
        FSDP's own replica all-reduce is turned off) the replicas average each momentum shard
        with ``compressed_allreduce`` in FSDP's all-reduce hook.
    beta1 : float, optional
        The momentum mode's ``b1``; default: the paired FrozenVarianceAdam's (they must agree).

    Returns
    -------
    OneBitFSDP
        The state (step counts, error buffers; ``state_dict``/``load_state_dict``).

    Raises
    ------
    ValueError
        ``model`` has no FSDP module or one of several FSDP parameter groups (nothing is
        installed then), or a bad ``warmup_steps``, ``allgather_block``,
        ``segment_elements``, ``mode`` or ``beta1``; ``optimizer`` not a FrozenVarianceAdam in
        the momentum modes; ``replicate_group`` with a 2-D mesh in the local-momentum mode.
    UnsupportedError
        An all-gather part was asked for on a torch without ``set_custom_all_gather``, or
        ``mode="momentum"`` with ``replicate_group`` or on a 2-D (HSDP) mesh, or
        ``"local_momentum"`` on a 2-D mesh it cannot take or over shard groups of one rank
        (:func:`.fsdp_hsdp.check_onebit`).
    """
    mods = [(n or "<root>", m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not mods:
        raise ValueError("compcomm.fsdp.onebit: argument 'model' has no FSDP module "
                         "(wrap it with torch.distributed.fsdp.fully_shard first)")
    check_one_group(mods, "compcomm.fsdp.onebit")  # FSDP's setters would raise halfway through
    hsdp = any(mesh_ndim(m) > 1 for _, m in mods)  # FSDP's own HSDP (2-D mesh)
    if mode is None:  # FSDP's own 2-D mesh: the local-momentum mode where it applies
        mode = "momentum" if replicate_group is None and not hsdp else "gradient"
        if hsdp and replicate_group is None and local_default(mods):
            mode = "local_momentum"
    native = mode == "local_momentum" and hsdp  # FSDP's own HSDP: its replica all-reduce ours
    replicas, native_groups = check_onebit(mods, mode, hsdp, replicate_group)
    state = OneBitFSDP(warmup_steps, replicate_group, segment_elements, mode, beta1)
    if mode in MOMENTUM_MODES and optimizer is not None:  # the cache's optimizer: the paired one
        opts = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
        if not all(isinstance(o, FrozenVarianceAdam) for o in opts):
            raise ValueError("compcomm.fsdp.onebit: argument 'optimizer' must be FrozenVarianceAdam"
                             f" in mode={mode!r} (pass mode='gradient' for other optimizers; "
                             "docs/fsdp.md shows the order: onebit, FrozenVarianceAdam(freeze_step="
                             "state), then compressed_allgather(..., optimizer=opt))")
    if quantized_allgather or regather_cache:  # first: it checks everything before installing
        state.allgather = compressed_allgather(model, quantized=quantized_allgather,
                                               cache=regather_cache, block=allgather_block,
                                               optimizer=optimizer,
                                               exact_numel=allgather_exact_numel,
                                               rounding=allgather_rounding)
    if native:  # every check passed: FSDP's own replica all-reduce off, the hook's instead
        take_replicas(native_groups)
        state.replicate_group = replicas
    for name, m in mods:
        params = shard_params(m)
        pieces = [(pc, padded) for _, pc, padded in params]
        world = pieces[0][1] // pieces[0][0] if pieces else 1
        segs = plan_segments(pieces, segment_elements)
        rows8 = [(world * r8, r8) for r8 in (-(-n // 8) * 8 for n in segs)]  # whole-byte rows
        hook = _all_reduce_hook(state, name, m if native else None)
        if mode in MOMENTUM_MODES:
            plan = [[params[i][:2] for i in b] for b in plan_indices(pieces, segment_elements)]
            cls = MomentumReduceScatter if mode == "momentum" else LocalMomentumReduceScatter
            rs = cls(state, name, m, plan)
            m.set_custom_reduce_scatter(rs)
            if native:
                rs.summed = lambda m=m: replicas_summed(m)
            hook = replica_hook(state, rs, hook)  # with a replica group (local momentum)
        if mode == "momentum":
            _register(state, name, segs, [(world * r, r) for r in (row_elements(n, world)
                                                                   for n in segs)])
        elif state.replicate_group is None:  # the gradient and the local-momentum modes' rows
            if mode == "gradient":
                m.set_custom_reduce_scatter(OneBitReduceScatter(state, name))
            _register(state, name, segs, rows8)
        else:  # HSDP: the replicas' all-reduce in the hook (after the local momentum's RS)
            if mode == "local_momentum":
                _register(state, name, segs, rows8)
            m.set_all_reduce_hook(hook)
            world = dist.get_world_size(state.replicate_group)
            _register(state, name + "/replicas", segs,
                      [(padded_numel(n, world), padded_numel(n, world) // world) for n in segs])
    return state


def _register(state: OneBitFSDP, name: str, segs: List[int], sizes: List[Tuple[int, int]]) -> None:
    """Module (or replica key) ``name``'s segments and their buffers' sizes (the checkpoint
    template)."""
    if not segs:
        return
    state.segments[name] = segs
    _, keys = state.segments_for(name, sum(segs))
    state._sizes.update(zip(keys, sizes))
    if state.mode == "momentum":  # signs and scales of the packed momentum
        state._packed_sizes.update((k, (w // 8, w // r)) for k, (w, r) in zip(keys, sizes))
