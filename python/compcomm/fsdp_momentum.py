"""The momentum mode of :func:`compcomm.fsdp.onebit`: DeepSpeed's 1-bit Adam on FSDP2's shards.

Why. Compressing FSDP's *gradient* reduce-scatter and letting the optimizer form
``m = b1 m + (1 - b1) C(g)`` on its shard is ZeRO's "sharded" algorithm, which trains worse than
DeepSpeed's (docs/zero.md; on the H200 every FSDP 1-bit row stalled after the switch). DeepSpeed
compresses the *momentum*: every rank forms its local momentum ``b1 m + (1 - b1) g_local`` on the
whole model and averages that with the full compressed allreduce (worker and server error
feedback); the result, the new momentum, is the same on every rank and is itself 1-bit (signs
plus one scale per chunk), so it is kept replicated in that form (``P/8`` bytes plus ``W`` scales
per segment, :class:`~compcomm.zero.packed_momentum.PackedMomentum`), as compcomm's ZeRO "exact"
mode does.

How it meets FSDP. In the 1-bit phase the module's :class:`MomentumReduceScatter` gets FSDP's
rank-major input (row r: this rank's gradient of rank r's pieces, every parameter dim-0 padded).
Per tensor-aligned segment it stages ``W`` rows of ``R`` elements (``R``: the segment's columns
rounded up to ``lcm(W, 8)``, so the compressed allreduce's chunk ``j`` is exactly row ``j``):
``b1 * unpack(m)`` (one pass) plus ``(1 - b1) * c * input`` where ``c`` makes the average what
FSDP's reduction would give the optimizer -- AVG: 1, SUM: ``W / post``, ``PREMUL_SUM(f)``: ``W f``
(``post``: FSDP's division after the call, read from the module's settings as FSDP computes it;
FSDP's pre-division has already been applied to the input). Row padding is zero, as in the
gradient mode. One batched exchange averages every segment
(:meth:`~compcomm.compress.OneBitCompressor.packed_average`); this rank's row of the result is
its chunk of the new momentum, handed to :class:`~compcomm.fsdp_optim.FrozenVarianceAdam` in fp32
(:meth:`MomentumState.take`; never rounded through a bf16 gradient). The gradient FSDP receives
carries the same values (times FSDP's post-division), for code that reads it.

The switch. At the first 1-bit call the replicated momentum is the warm-up's: the optimizer's
``exp_avg`` shards are all-gathered once into the rows (each rank's pieces in FSDP's order,
padded as FSDP pads). After a checkpoint load the packed momentum comes from the checkpoint.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ._comm import resolve
from .compress import IdentityCompressor, OneBitCompressor
from .errors import UnsupportedError
from .zero.packed_momentum import PackedMomentum

__all__ = ["MomentumState", "untaken_message", "MomentumReduceScatter", "WarmupReduceScatter", "row_elements",
           "post_divide_factor", "scale_of", "reduce_scatter_tensor"]

# torch 2.13 renamed the tensor form of reduce_scatter; older releases have only this one.
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def scale_of(op: Any, world: int) -> float:
    """What the average over ranks is multiplied by to give FSDP's reduction ``op``."""
    if op == dist.ReduceOp.AVG:
        return 1.0
    if op == dist.ReduceOp.SUM:
        return float(world)
    if getattr(op, "op", None) == dist.ReduceOp.PREMUL_SUM:  # ReduceOp.PREMUL_SUM(factor)
        return float(world) * float(op.factor)
    raise UnsupportedError(f"compcomm.fsdp: reduce op {op!r} is not supported (AVG, SUM, PREMUL_SUM)",
                           "reduce_scatter", "fsdp")


def row_elements(n: int, world: int) -> int:
    """Elements of one rank's row of a segment of ``n`` columns: a multiple of ``lcm(W, 8)``, so
    that ``W`` rows are a whole compressed-allreduce bucket (``padded_numel``) of chunk ``R``."""
    unit = world * 8 // math.gcd(world, 8)
    return max(-(-n // unit) * unit, unit)


def post_divide_factor(module: Any, group: Any, reduce_dtype: torch.dtype, op: Any) -> float:
    """The division FSDP applies to the reduced shard after the reduce-scatter call (1 unless FSDP
    reduces with SUM and divides afterwards: fp16 reductions or ``set_force_sum_reduction_for_comms``)."""
    if op != dist.ReduceOp.SUM:
        return 1.0  # AVG / PREMUL_SUM carry the whole division (torch's _get_gradient_divide_factors)
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            _get_gradient_divide_factors as factors)
        st = module._get_fsdp_state()
        pg = st._fsdp_param_group
        post = factors(group, None, reduce_dtype, pg.device.type, pg.gradient_divide_factor,
                       pg.force_sum_reduction_for_comms)[1]
    except Exception as e:  # noqa: BLE001 - another torch's internals
        raise UnsupportedError("compcomm.fsdp.onebit (momentum modes): cannot read FSDP's "
                               f"post-division for a SUM reduction on this torch ({e!r})",
                               "reduce_scatter", "fsdp") from e
    return 1.0 if post is None else float(post)


def untaken_message(rank: Optional[int], mode: str = "momentum") -> str:
    return (f"[rank {rank}] compcomm.fsdp.onebit(mode={mode!r}): a second gradient reduction "
            "before the optimizer step (gradient accumulation with FSDP's default sync?): call "
            "model.set_requires_gradient_sync(False) for all but the last micro-batch, or use "
            "mode='gradient'")


class MomentumState:
    """The replicated momentum of every module's segments and the exchange that averages it.

    Attributes
    ----------
    beta1 : float or None
        The momentum's ``b1`` (from ``onebit(beta1=)`` or the bound optimizer).
    exact : bool
        Test hook: average with :class:`~compcomm.compress.IdentityCompressor` (full precision,
        no error feedback) instead of 1-bit; the momentum is then kept in fp32.
    """

    def __init__(self, beta1: Optional[float], mode: str = "momentum") -> None:
        self.beta1 = beta1
        self.mode = mode  # which of onebit's momentum modes (for messages)
        self.exact = False
        self.packed = PackedMomentum()  # segment key -> the 1-bit momentum (signs, scales)
        self.full: Dict[str, torch.Tensor] = {}  # segment key -> fp32 (no packing: exact, W=1)
        self._compressors: Dict[int, Tuple[Any, Any]] = {}  # id(group) -> (group, compressor)
        self.pending_errors: Dict[str, List[torch.Tensor]] = {}  # loaded, not yet in a compressor
        self._optimizers: List[Any] = []  # weakrefs to every bound FrozenVarianceAdam
        self._shards: Dict[int, Tuple[Any, torch.Tensor]] = {}  # id(param) -> (param, fp32 m)

    # -- the optimizer's side

    def bind(self, optimizer: Any, beta1: float) -> None:
        """Called by :class:`~compcomm.fsdp_optim.FrozenVarianceAdam` built with
        ``freeze_step=state``: its ``exp_avg`` seeds the momentum at the switch."""
        if self.beta1 is not None and beta1 != self.beta1:
            raise ValueError(f"FrozenVarianceAdam: argument 'betas' has b1={beta1}, but "
                             f"compcomm.fsdp.onebit was given beta1={self.beta1}; they must agree")
        self.beta1 = beta1
        # several optimizers may split the parameters: keep them all (weakly)
        self._optimizers = [r for r in self._optimizers if r() is not None and r() is not optimizer]
        self._optimizers.append(weakref.ref(optimizer))

    def take(self, p: Any) -> Optional[torch.Tensor]:
        """Parameter ``p``'s chunk of the new momentum (fp32, the local shard's shape), once."""
        got = self._shards.pop(id(p), None)
        return None if got is None or got[0] is not p else got[1]

    def holds(self, p: Any) -> bool:
        """Whether ``p`` has a chunk handed over and not yet taken by an optimizer step."""
        got = self._shards.get(id(p))
        return got is not None and got[0] is p

    def give(self, p: Any, m: torch.Tensor, rank: Optional[int] = None) -> None:
        if self.holds(p):  # a second reduction before the step would lose the first's momentum
            raise RuntimeError(untaken_message(rank, self.mode))
        self._shards[id(p)] = (p, m)

    def bound(self) -> List[Any]:
        """The live optimizers bound to this state."""
        return [o for o in (r() for r in self._optimizers) if o is not None]

    def exp_avg(self, p: Any, rank: int = -1) -> torch.Tensor:
        """``p``'s warm-up momentum from the bound optimizer that holds it (zeros if it has no
        state yet: no warm-up gradient); ValueError if no bound optimizer holds ``p``."""
        for opt in self.bound():
            if any(q is p for g in opt.param_groups for q in g["params"]):
                m = opt.state.get(p, {}).get("exp_avg")
                if m is None:
                    return torch.zeros_like(p.to_local() if hasattr(p, "to_local") else p,
                                            dtype=torch.float32)
                return m.to_local() if hasattr(m, "to_local") else m
        raise ValueError(f"[rank {rank}] compcomm.fsdp.onebit(mode={self.mode!r}): a parameter of "
                         "shape {} is in no FrozenVarianceAdam bound to this state: every "
                         "parameter must be in a FrozenVarianceAdam(..., freeze_step=state) "
                         "(argument 'freeze_step')".format(tuple(p.shape)))

    # -- the exchange

    def compressor(self, group: Any) -> Any:
        """The exchange over ``group`` (made once; loaded error buffers go into it)."""
        got = self._compressors.get(id(group))
        if got is not None and got[0] is group:
            return got[1]
        comm = resolve(group)
        comp = IdentityCompressor(comm) if self.exact else OneBitCompressor(comm)
        if self.pending_errors and not self.exact:
            comp.load_state_dict({k: {"worker_error": we, "server_error": se}
                                  for k, (we, se) in self.pending_errors.items()})
            self.pending_errors = {}
        self._compressors[id(group)] = (group, comp)
        return comp

    def errors(self) -> Dict[str, List[torch.Tensor]]:
        """Every segment's ``[worker_error, server_error]`` (CPU copies)."""
        out = {k: [b.detach().cpu().clone() for b in v] for k, v in self.pending_errors.items()}
        for _, comp in self._compressors.values():
            for k, d in comp.state_dict().items() if hasattr(comp, "state_dict") else ():
                out[k] = [d["worker_error"].detach().cpu().clone(),
                          d["server_error"].detach().cpu().clone()]
        return out

    def load(self, errors: Dict[str, List[torch.Tensor]],
             packed: Dict[str, Dict[str, torch.Tensor]]) -> None:
        self._compressors.clear()
        self.pending_errors = {k: [b.clone() for b in v] for k, v in errors.items()}
        self.full.clear()
        self.packed.reset()
        for k, d in packed.items():
            n = d["signs"].numel() * 8
            self.packed.put(k, d["signs"].clone(), d["scales"].clone(), n, n // d["scales"].numel())
        self._shards.clear()

    def reset(self) -> None:
        """Forget the momentum and errors (another world size): gathered again at the next step."""
        self.load({}, {})


class WarmupReduceScatter:
    """What compcomm's FSDP2 reduce-scatters share: FSDP's ``ReduceScatter`` contract
    (``allocate``) and the warm-up, FSDP's own reduce-scatter until ``state.compressing(name)``."""

    def __init__(self, state: Any, name: str) -> None:
        self.state = state
        self.name = name

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def warmup(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
               async_op: bool) -> Tuple[bool, Optional[dist.Work]]:
        """(True, FSDP's own reduce-scatter's work) during the warm-up, else (False, None)."""
        state, name = self.state, self.name
        if state.compressing(name):
            return False, None
        mom = getattr(state, "momentum", None)
        if mom is not None and not mom.bound():  # fail now, not at the switch hours later
            raise ValueError(f"[rank {group.rank()}] compcomm.fsdp.onebit(mode={mom.mode!r}): no "
                             "optimizer is bound to this state: pair it with compcomm.fsdp."
                             "FrozenVarianceAdam(params, freeze_step=state), or pass "
                             "mode='gradient' for other optimizers")
        state.steps[name] = state.steps.get(name, 0) + 1
        return True, reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group,
                                           async_op=async_op)


class MomentumReduceScatter(WarmupReduceScatter):
    """FSDP2 ``ReduceScatter`` of one module in the momentum mode (see the module docstring):
    FSDP's own reduce-scatter during the warm-up, then the compressed momentum average.

    ``segments``: per segment, ``[(param, piece)]`` in FSDP's order (``piece``: elements of one
    rank's dim-0 padded piece of the parameter)."""

    def __init__(self, state: Any, name: str, module: Any,
                 segments: Sequence[Sequence[Tuple[Any, int]]]) -> None:
        super().__init__(state, name)
        self.module = weakref.ref(module)
        self.segments = [list(s) for s in segments]

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 op: Any, async_op: bool = False) -> Optional[dist.Work]:
        warm, work = self.warmup(output_tensor, input_tensor, group, op, async_op)
        if warm:
            return work
        world, rank = group.size(), group.rank()
        mom: MomentumState = self.state.momentum
        scale, post, b1, segs, keys = self.prepare(output_tensor, input_tensor, group, op)
        s = output_tensor.numel()
        dev = input_tensor.device
        rows = [row_elements(n, world) for n in segs]
        seed = self._seed(keys, rows, world, group, dev)
        src = input_tensor.view(world, s)
        c = scale / post
        offs = [0]
        for n in segs:
            offs.append(offs[-1] + n)
        comp = mom.compressor(group)
        staged: List[torch.Tensor] = []

        def stage(i: int) -> torch.Tensor:
            n, r, k = segs[i], rows[i], keys[i]
            if k in mom.packed:  # b1 * m in the unpacking pass (exact: m is tau * +-1)
                y = mom.packed.unpack_(k, torch.empty(world * r, device=dev), mul=b1)
            else:
                y = torch.mul(seed[k] if k in seed else mom.full[k], b1)
            v = y.view(world, r)
            g = src[:, offs[i]: offs[i] + n].float()
            v[:, :n].add_(g if c == 1.0 else g * c, alpha=1 - b1)
            v[:, n:].zero_()  # row padding: no parameter there
            staged.append(y)
            return y

        numels = [world * r for r in rows]
        packs = getattr(comp, "packed_average", None)
        packs = packs(keys, numels, stage, dev) if packs is not None else comp.average_(
            keys, numels, stage, dev)
        # every exchange succeeded: commit the momentum, hand the chunks over
        mine = torch.empty(s, dtype=torch.float32, device=dev)
        for i, (k, y) in enumerate(zip(keys, staged)):
            n, r = segs[i], rows[i]
            if packs is not None:
                signs, scales = packs[i]
                mom.packed.put(k, signs, scales, world * r, r)
                mom.full.pop(k, None)
            else:
                mom.full[k] = y
            mine[offs[i]: offs[i] + n].copy_(y.view(world, r)[rank, :n])
        self.give_all(mine, rank)
        output_tensor.copy_(mine if post == 1.0 else mine * post)
        self.state.steps[self.name] = self.state.steps.get(self.name, 0) + 1
        return None

    def prepare(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                op: Any) -> Tuple[float, float, float, List[int], List[str]]:
        """The checks of both momentum modes, before anything is written: ``(scale, post, b1,
        segments, keys)`` of this call, or a typed error naming the rank (an unsupported op, no
        ``beta1``, a second reduction before the step, a shard that is not the planned segments)."""
        state, name, rank = self.state, self.name, group.rank()
        mom: MomentumState = state.momentum
        tag = f"compcomm.fsdp.onebit(mode={mom.mode!r})"
        scale = scale_of(op, group.size())
        post = post_divide_factor(self.module(), group, input_tensor.dtype, op)
        if mom.beta1 is None:
            raise ValueError(f"[rank {rank}] {tag}: no beta1: pass argument 'beta1' or build "
                             "FrozenVarianceAdam(..., freeze_step=state)")
        if any(mom.holds(p) for sp in self.segments for p, _ in sp):
            raise RuntimeError(untaken_message(rank, mom.mode))
        s = output_tensor.numel()
        segs, keys = state.segments_for(name, s)
        if len(segs) != len(self.segments) or any(
                n != sum(pc for _, pc in sp) for n, sp in zip(segs, self.segments)):
            raise UnsupportedError(f"[rank {rank}] {tag}: module {name!r} reduced a shard of {s} "
                                   "elements, not its planned segments (a parameter without a "
                                   "gradient?)", "reduce_scatter", "fsdp")
        return scale, post, mom.beta1, segs, keys

    def give_all(self, mine: torch.Tensor, rank: int) -> None:
        """Hand each parameter its chunk of ``mine`` (this rank's shard of the new momentum, in
        FSDP's order) for :class:`~compcomm.fsdp_optim.FrozenVarianceAdam`'s next step."""
        o = 0
        for sp in self.segments:
            for p, pc in sp:
                loc = p.to_local() if hasattr(p, "to_local") else p
                self.state.momentum.give(p, mine[o: o + loc.numel()].view(loc.shape), rank)
                o += pc

    def _seed(self, keys: List[str], rows: List[int], world: int, group: Any,
              dev: torch.device) -> Dict[str, torch.Tensor]:
        """The switch: the full fp32 momentum of segments without one, all-gathered from the
        optimizer's ``exp_avg`` shards into the rows (each rank's pieces, FSDP's order)."""
        mom: MomentumState = self.state.momentum
        missing = [i for i, k in enumerate(keys) if k not in mom.packed and k not in mom.full]
        if not missing:
            return {}
        rank = group.rank()
        mine = []
        for i in missing:
            row = torch.zeros(rows[i], dtype=torch.float32, device=dev)
            o = 0
            for p, pc in self.segments[i]:
                m = mom.exp_avg(p, rank)
                row[o: o + m.numel()].copy_(m.reshape(-1))
                o += pc
            mine.append(row)
        flat = torch.cat(mine)
        full = torch.empty(world * flat.numel(), dtype=torch.float32, device=dev)
        _all_gather(full, flat, group=group)
        full = full.view(world, -1)
        out, o = {}, 0
        for i in missing:
            out[keys[i]] = full[:, o: o + rows[i]].contiguous().view(-1)
            o += rows[i]
        return out
