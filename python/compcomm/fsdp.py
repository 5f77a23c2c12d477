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
``s`` elements each (every parameter dim-0 padded to a multiple of W) and expects the reduced shard of
this rank. Each shard is copied into a row of ``s8 = ceil(s / 8) * 8`` fp32 elements (the 1-bit chunk
of a rank must be whole bytes), so chunk r of the compressed reduce-scatter is exactly FSDP's shard r.
The result is the 1-bit *average*; FSDP's ``op`` says what it wants: AVG as it is, SUM times W,
``PREMUL_SUM(f)`` times W * f. FSDP records an event right after the call returns, so the call is
stream-ordered on the caller's stream (CUDA) and writes only ``output_tensor``.

The parameter all-gathers (FSDP's bf16 gathers before each forward and backward) are
:mod:`compcomm.fsdp_gather`'s: ``onebit(..., quantized_allgather=True, regather_cache=True)`` or
:func:`compressed_allgather` on its own.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from .collectives import compressed_allreduce, compressed_reduce_scatter, padded_numel
from .errors import UnsupportedError
from .fsdp_gather import GatherState, compressed_allgather
from .fsdp_optim import FrozenVarianceAdam
from .quantize import DEFAULT_BLOCK


__all__ = ["OneBitFSDP", "OneBitReduceScatter", "onebit", "compressed_allgather", "GatherState",
           "FrozenVarianceAdam"]

# torch 2.13 renamed the tensor form of reduce_scatter; older releases have only this one.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _scale_of(op: Any, world: int) -> float:
    """What the 1-bit average is multiplied by to give FSDP's ``op``."""
    if op == dist.ReduceOp.AVG:
        return 1.0
    if op == dist.ReduceOp.SUM:
        return float(world)
    if getattr(op, "op", None) == dist.ReduceOp.PREMUL_SUM:  # ReduceOp.PREMUL_SUM(factor)
        return float(world) * float(op.factor)
    raise UnsupportedError(f"compcomm.fsdp: reduce op {op!r} is not supported (AVG, SUM, PREMUL_SUM)",
                           "reduce_scatter", "fsdp")


class OneBitFSDP:
    """The state of :func:`onebit` for one model: step counts and error buffers per FSDP module.

    A module is in its 1-bit phase once it has reduced ``warmup_steps`` times (one reduce-scatter
    per module per backward). ``state_dict()``/``load_state_dict()`` hold this rank's error buffers
    (they differ per rank: save one file per rank, e.g. ``torch.save(ctrl.state_dict(),
    f"onebit_rank{r}.pt")``); loading on another world size resets them, as DeepSpeed does.

    Attributes
    ----------
    warmup_steps : int
    steps : dict
        Reductions done per module name.
    allgather : GatherState or None
        The all-gather's state when :func:`onebit` installed one (``quantized_allgather`` or
        ``regather_cache``): its counters and ``invalidate()``.
    """

    def __init__(self, warmup_steps: int, replicate_group: Optional[Any] = None) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"compcomm.fsdp.onebit: argument 'warmup_steps' must be an integer >= 0, "
                             f"got {warmup_steps!r}")
        self.warmup_steps = warmup_steps
        self.replicate_group = replicate_group
        self.steps: Dict[str, int] = {}
        self._errors: Dict[str, List[torch.Tensor]] = {}  # name -> [worker_error, server_error]
        # name -> (worker, server) error-buffer sizes, known from the parameters when installed
        # (so that state_dict() is a complete template for torch.distributed.checkpoint.load)
        self._sizes: Dict[str, Tuple[int, int]] = {}
        self.allgather: Optional[GatherState] = None

    def invalidate(self) -> None:
        """Drop the all-gather's re-gather cache (on every rank), e.g. after changing parameters
        outside an optimizer step; nothing to do without one."""
        if self.allgather is not None:
            self.allgather.invalidate()

    def compressing(self, name: str) -> bool:
        """Whether module ``name``'s next reduction is 1-bit."""
        return self.steps.get(name, 0) >= self.warmup_steps

    def errors(self, name: str, padded: int, world: int, device: torch.device) -> List[torch.Tensor]:
        """Module ``name``'s error buffers for ``padded`` elements (zero when new or resized)."""
        bufs = self._errors.get(name)
        if bufs is None or bufs[0].numel() != padded or bufs[0].device != device:
            if bufs is not None and bufs[0].numel() == padded:  # loaded on another device
                bufs = [b.to(device) for b in bufs]
            else:
                bufs = [torch.zeros(padded, dtype=torch.float32, device=device),
                        torch.zeros(padded // world, dtype=torch.float32, device=device)]
            self._errors[name] = bufs
        return bufs

    def state_dict(self) -> Dict[str, Any]:
        """Step counts and this rank's error buffers (CPU copies), for every module from the start
        (zeros and 0 before its first 1-bit reduction): a fresh state's ``state_dict()`` is the
        template ``torch.distributed.checkpoint.load`` fills in place."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        errors = {k: [torch.zeros(w), torch.zeros(sv)] for k, (w, sv) in self._sizes.items()}
        errors.update({k: [b.detach().cpu().clone() for b in v] for k, v in self._errors.items()})
        return {"format": "compcomm.fsdp/1", "rank": rank, "world": world,
                "steps": {**{k: 0 for k in self._sizes}, **self.steps}, "errors": errors}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; error buffers only when rank and world size match."""
        if not isinstance(sd, dict) or sd.get("format") != "compcomm.fsdp/1":
            raise ValueError("compcomm.fsdp: load_state_dict: argument 'sd' is not a state dict of "
                             "OneBitFSDP (format 'compcomm.fsdp/1')")
        steps = sd["steps"]
        if not all(isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in steps.items()):
            raise ValueError("compcomm.fsdp: load_state_dict: 'steps' must map names to counts")
        mine = self.state_dict()
        same = sd["rank"] == mine["rank"] and sd["world"] == mine["world"]
        self.steps = dict(steps)
        self._errors = {k: [b.clone() for b in v] for k, v in sd["errors"].items()} if same else {}


class OneBitReduceScatter(ReduceScatter):
    """FSDP2 ``ReduceScatter`` of one module: FSDP's own reduce-scatter during the warm-up, then the
    1-bit compressed reduce-scatter with this module's error buffers (see the module docstring)."""

    def __init__(self, state: OneBitFSDP, name: str) -> None:
        self.state = state
        self.name = name

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 op: Any, async_op: bool = False) -> Optional[dist.Work]:
        state, name = self.state, self.name
        if not state.compressing(name):
            state.steps[name] = state.steps.get(name, 0) + 1
            return _reduce_scatter(output_tensor, input_tensor, op=op, group=group,
                                   async_op=async_op)
        world = group.size()
        s = output_tensor.numel()
        s8 = -(-s // 8) * 8
        staged = torch.zeros(world, s8, dtype=torch.float32, device=input_tensor.device)
        staged[:, :s].copy_(input_tensor.view(world, s))
        we, se = state.errors(name, world * s8, world, staged.device)
        out = compressed_reduce_scatter(staged.view(-1), we, se, group=group)
        output_tensor.copy_(out[:s].mul_(_scale_of(op, world)))
        state.steps[name] = state.steps.get(name, 0) + 1
        return None


def _all_reduce_hook(state: OneBitFSDP, name: str):
    key = name + "/replicas"

    def hook(reduce_output: torch.Tensor) -> None:
        group = state.replicate_group
        if not state.compressing(key):  # full precision during the warm-up (the average)
            dist.all_reduce(reduce_output, group=group)
            reduce_output.div_(dist.get_world_size(group))
        else:
            world = dist.get_world_size(group)
            we, se = state.errors(key, padded_numel(reduce_output.numel(), world), world,
                                  reduce_output.device)
            flat = reduce_output.view(-1)
            compressed_allreduce(flat, we, se, group)
        state.steps[key] = state.steps.get(key, 0) + 1

    return hook


def _shard_numel(m: torch.nn.Module) -> int:
    """Elements of FSDP module ``m``'s reduced gradient shard: its own parameters (not those of
    nested FSDP modules) that take gradients, each dim-0 padded to a multiple of the mesh size."""
    total, stack = 0, [m]
    while stack:
        mod = stack.pop()
        stack.extend(c for c in mod.children() if not isinstance(c, FSDPModule))
        for p in mod.parameters(recurse=False):
            if not p.requires_grad or p.numel() == 0:
                continue
            mesh = getattr(p, "device_mesh", None)
            world = mesh.size() if mesh is not None else 1
            dim0 = p.shape[0] if p.dim() else 1
            total += math.ceil(dim0 / world) * (p.numel() // dim0)
    return total


def onebit(model: torch.nn.Module, warmup_steps: int = 100,
           replicate_group: Optional[Any] = None, *, quantized_allgather: bool = False,
           regather_cache: bool = False, allgather_block: int = DEFAULT_BLOCK,
           optimizer: Any = None) -> OneBitFSDP:
    """Install 1-bit compressed gradient reduction on every FSDP2 module of ``model``.

    Parameters
    ----------
    model : torch.nn.Module
        A model whose submodules (and/or itself) were wrapped with ``fully_shard``.
    warmup_steps : int, default 100
        Reductions per module in full precision before 1-bit compression starts (the 1-bit Adam
        recipe: pair with an optimizer whose variance is frozen from then on, see docs/fsdp.md).
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
    allgather_block : int, default 256
        Elements per int8 block of ``quantized_allgather``.
    optimizer : torch.optim.Optimizer or list, optional
        Whose steps invalidate the re-gather cache (default: any optimizer's step).

    Returns
    -------
    OneBitFSDP
        The state (step counts, error buffers; ``state_dict``/``load_state_dict``).

    Raises
    ------
    ValueError
        ``model`` has no FSDP module, or a bad ``warmup_steps`` or ``allgather_block``.
    UnsupportedError
        An all-gather part was asked for on a torch without ``set_custom_all_gather``.
    """
    state = OneBitFSDP(warmup_steps, replicate_group)
    mods = [(n or "<root>", m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not mods:
        raise ValueError("compcomm.fsdp.onebit: argument 'model' has no FSDP module "
                         "(wrap it with torch.distributed.fsdp.fully_shard first)")
    if quantized_allgather or regather_cache:  # first: it checks everything before installing
        state.allgather = compressed_allgather(model, quantized=quantized_allgather,
                                               cache=regather_cache, block=allgather_block,
                                               optimizer=optimizer)
    for name, m in mods:
        shard = _shard_numel(m)
        if replicate_group is None:
            m.set_custom_reduce_scatter(OneBitReduceScatter(state, name))
            s8 = -(-shard // 8) * 8
            world = shard and next(p for p in m.parameters() if p.requires_grad).device_mesh.size()
            size = (world * s8, s8)
        else:
            m.set_all_reduce_hook(_all_reduce_hook(state, name))
            name += "/replicas"
            world = dist.get_world_size(replicate_group)
            size = (padded_numel(shard, world), padded_numel(shard, world) // world)
        if shard:
            state._sizes[name] = size
    return state
