"""ZeRO's layout: where each parameter lives in its group's flat buffer, buckets and shards.

``_C.zero.plan_buckets`` lays a group's parameters end to end in a flat buffer cut into buckets
(``reduce_bucket_size`` elements for stage 1/2, one parameter per bucket for stage 3). Each bucket
is zero-padded to ``world * chunk`` elements; rank r owns chunk r of every bucket, and the
concatenation of its chunks is its *shard*. A :class:`GroupLayout` holds one group's plan as typed
:class:`Bucket` and :class:`Slot` records and the tensors that live in that layout: the flat
parameters (stage 1/2), the parameter shard (stage 3) and the fp32 master shard whose ``.grad`` is
the gradient shard.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Dict, Iterable, Iterator, List, NamedTuple, Optional, Tuple

import torch

from .. import _C
from .._agree import Field, digest
from .._buffers import buffer_of
from .._scratch import stream_of

__all__ = ["ALIGNMENT", "ONEBIT_ALIGNMENT", "Bucket", "Slot", "GroupLayout", "alignment",
           "build_groups", "layout_fields", "partition", "full_numel", "full_shape"]

ALIGNMENT = 2  # DeepSpeed's nccl_start_alignment_factor
ONEBIT_ALIGNMENT = 8  # 1-bit optimizers: chunks of whole bytes of signs


@dataclasses.dataclass(frozen=True)
class Bucket(Mapping):
    """One bucket of a group's flat layout.

    ``numel`` elements of parameters start at ``offset`` of the flat buffer, zero-padded to
    ``padded = world * chunk``; rank r owns ``[offset + r * chunk, offset + (r + 1) * chunk)``,
    stored at ``shard_offset`` of its shard. Tensors ``first_tensor .. last_tensor - 1`` of the
    group lie in it. Reads also as the plan's dict (``b["padded"]``, ``dict(b)``).
    """

    offset: int
    numel: int
    padded: int
    chunk: int
    shard_offset: int
    first_tensor: int
    last_tensor: int

    def __getitem__(self, key: str) -> int:
        if key not in _BUCKET_FIELDS:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(_BUCKET_FIELDS)

    def __len__(self) -> int:
        return len(_BUCKET_FIELDS)

    @property
    def num_tensors(self) -> int:
        """Tensors that lie in this bucket."""
        return self.last_tensor - self.first_tensor

    def span(self, flat: torch.Tensor) -> torch.Tensor:
        """The bucket's range (``padded`` elements) of a flat-layout tensor."""
        return flat[self.offset : self.offset + self.padded]

    def chunk_of(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s chunk of the bucket in a flat-layout tensor."""
        lo = self.offset + rank * self.chunk
        return flat[lo : lo + self.chunk]

    def shard_of(self, shard: torch.Tensor) -> torch.Tensor:
        """The bucket's range of a shard-layout tensor (the rank's chunk of this bucket)."""
        return shard[self.shard_offset : self.shard_offset + self.chunk]

    def padding_start(self, rank: int) -> int:
        """Where the zero padding starts in rank ``rank``'s chunk (``chunk``: none)."""
        return min(self.chunk, max(0, self.numel - rank * self.chunk))


_BUCKET_FIELDS = tuple(f.name for f in dataclasses.fields(Bucket))


class Slot(NamedTuple):
    """Where one parameter lies: ``numel`` elements at ``offset`` of the flat buffer, in bucket
    ``bucket``."""

    numel: int
    offset: int
    bucket: int


class GroupLayout:
    """One parameter group laid out for ZeRO: its parameters, plan and the tensors in its layout."""

    def __init__(self, params: List[torch.nn.Parameter], plan: Any, options: Dict[str, Any]):
        self.params = params
        self.plan = plan
        #: the group's options (``lr`` ...) as given, without ``params``
        self.options = options
        self.tensors: List[Slot] = [Slot(*t) for t in plan.tensors]
        self.buckets: List[Bucket] = [Bucket(**{k: b[k] for k in _BUCKET_FIELDS})
                                      for b in plan.buckets]
        self.dtype = params[0].dtype if params else torch.float32
        self.flat: Optional[torch.Tensor] = None  # stage 1/2: the full parameters (param dtype)
        self.param_shard: Optional[torch.Tensor] = None  # stage 3: this rank's parameter shard
        self.master: Optional[torch.Tensor] = None  # fp32 shard, .grad = fp32 gradient shard
        self.max_padded = max((b.padded for b in self.buckets), default=0)

    def flatten(self, tensors: Iterable[Optional[torch.Tensor]], dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
        """The flat layout (zero padding) holding ``tensors`` (one per parameter, None: 0)."""
        flat = torch.zeros(self.plan.flat_numel, dtype=dtype, device=device)
        for t, s in zip(tensors, self.tensors):
            if t is not None:
                flat[s.offset : s.offset + s.numel].copy_(t.reshape(-1))
        return flat

    def own_chunks(self, flat: torch.Tensor, shard: torch.Tensor, rank: int) -> None:
        """Copy rank ``rank``'s chunk of every bucket of the flat-layout ``flat`` into ``shard``."""
        for b in self.buckets:
            b.shard_of(shard).copy_(b.chunk_of(flat, rank))

    def views(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """One view of ``flat`` (a flat-layout tensor) per parameter, shaped like it."""
        return [flat[s.offset : s.offset + s.numel].view(full_shape(p))
                for p, s in zip(self.params, self.tensors)]

    def nbytes(self) -> Dict[str, int]:
        """Bytes this group holds, by kind: ``params`` (the flat parameters in stage 1/2; the
        shard plus whatever is gathered in stage 3), ``grads`` (``p.grad`` and the fp32 gradient
        shard), ``master`` (the fp32 master shard)."""
        if self.flat is not None:
            params = self.flat.numel() * self.flat.element_size()
        else:
            params = self.param_shard.numel() * self.param_shard.element_size()
            params += sum(p.data.numel() * p.data.element_size() for p in self.params)
        grads = sum(p.grad.numel() * p.grad.element_size() for p in self.params
                    if p.grad is not None)
        if self.master.grad is not None:
            grads += self.master.grad.numel() * 4
        return {"params": params, "grads": grads, "master": self.master.numel() * 4}

    def shapes(self) -> List[Tuple[int, ...]]:
        """The parameters' full shapes (also while stage 3 holds them released)."""
        return [tuple(full_shape(p)) for p in self.params]


def alignment(onebit: bool, replicated: bool, world: int) -> int:
    """The plan's per-chunk alignment: 1-bit optimizers want chunks of whole bytes of signs, so a
    bucket is directly the compressed reduce-scatter's input (a multiple of ``8 * world``) and
    chunk r its output; OneBitAdam's replicated modes want the compressed allreduce's padding of
    unsharded OneBitAdam (``padded_numel``): the same chunks and scales, hence the same numerics."""
    if replicated:
        return 8 // math.gcd(world, 8) * world
    return ONEBIT_ALIGNMENT if onebit else ALIGNMENT


def _param_groups(params: Iterable[Any]) -> List[Dict[str, Any]]:
    params = list(params)
    if not params:
        raise ValueError("params: got an empty parameter list")
    if isinstance(params[0], dict):
        return [dict(g) for g in params]
    return [{"params": params}]


def layout_fields(groups: List[GroupLayout], config: Mapping, stage: int, onebit: Optional[str],
                  onebit_mode: Optional[str], gas: int, optimizer: Any,
                  kwargs: Mapping) -> List[Field]:
    """What ZeroOptimizer's ranks must agree on before the partition's first collective
    (:func:`compcomm._agree.agree_layout`): the groups' parameters and buckets and the settings
    that decide which collectives run, the wrapped optimizer's class and plain arguments among
    them (a 1-bit optimizer's ``freeze_step`` decides when ZeRO compresses)."""
    def plain(v: Any) -> bool:  # values whose repr is the same on every rank (no addresses)
        return v is None or isinstance(v, (bool, int, float, str)) or (
            isinstance(v, tuple) and all(plain(x) for x in v))

    args = sorted((k, v) for k, v in kwargs.items() if plain(v))
    stage3 = sorted(k for k in config if k.startswith("stage3_"))
    return [
        ("stage", stage, False),
        ("parameter groups", len(groups), False),
        ("number of parameters", sum(len(g.params) for g in groups), False),
        ("parameter shapes", digest([[tuple(p.shape) for p in g.params] for g in groups]), True),
        ("parameter dtypes", digest([str(g.dtype) for g in groups]), True),
        ("buckets", sum(len(g.buckets) for g in groups), False),
        ("bucket sizes", digest([[(b.numel, b.padded) for b in g.buckets] for g in groups]), True),
        ("reduce_bucket_size", int(config["reduce_bucket_size"]), False),
        ("allgather_bucket_size", int(config["allgather_bucket_size"]), False),
        ("overlap_comm", int(bool(config["overlap_comm"])), False),
        ("stage3_* settings", digest([(k, config[k]) for k in stage3]), True),
        ("1-bit optimizer and onebit_mode", digest((onebit, onebit_mode)), True),
        ("optimizer and optimizer_kwargs",
         digest((getattr(optimizer, "__qualname__", type(optimizer).__name__), args)), True),
        ("gradient_accumulation_steps", gas, False),
    ]


def build_groups(params: Iterable[Any], bucket_size: int, world: int,
                 align: int) -> Tuple[List[GroupLayout], torch.device]:
    """Check ``params`` (tensors or groups, as for any torch optimizer) and plan each group.

    Returns the groups (nothing allocated yet) and the parameters' common device (the CPU if
    there are none). ValueError naming ``params`` for a parameter without ``requires_grad``, one
    given twice, a group mixing dtypes or parameters on several devices.
    """
    seen: set = set()
    devices: set = set()
    groups: List[GroupLayout] = []
    for gi, g in enumerate(_param_groups(params)):
        ps = list(g["params"])
        for i, p in enumerate(ps):
            if not isinstance(p, torch.Tensor) or not p.requires_grad:
                raise ValueError(
                    f"params: parameter {i} of group {gi} is not a tensor with requires_grad "
                    "(pass the trainable ones: [p for p in model.parameters() if p.requires_grad])")
            if id(p) in seen:
                raise ValueError("params: a parameter appears twice")
            seen.add(id(p))
            devices.add(p.device)
        dtypes = {p.dtype for p in ps}
        if len(dtypes) > 1:
            raise ValueError(f"params: a parameter group mixes dtypes {sorted(map(str, dtypes))}")
        plan = _C.zero.plan_buckets([p.numel() for p in ps], bucket_size, world, align)
        groups.append(GroupLayout(ps, plan, {k: v for k, v in g.items() if k != "params"}))
    if len(devices) > 1:
        raise ValueError(
            f"params: all parameters must be on one device, got {sorted(map(str, devices))}")
    return groups, (devices.pop() if devices else torch.device("cpu"))


def partition(grp: GroupLayout, comm: Any, rank: int, stage: int, device: torch.device,
              timeout: float, offload: Any = None) -> None:
    """Lay ``grp``'s parameters out (collective: every rank starts from rank 0's values).

    Makes the fp32 master shard (with a zero gradient shard for stage 2/3). Stage 1/2: the
    parameters become views of the flat buffer. Stage 3: they are released (empty, their full
    size remembered) and only this rank's parameter shard is kept. With ``offload``
    (:class:`.offload.HostOffload`) the master shard, and the parameter shard with
    ``offload_param``, are made in host memory by it.
    """
    flat = grp.flatten((p.detach() for p in grp.params), grp.dtype, device)
    comm.broadcast(buffer_of(flat), 0, timeout, stream_of(flat))
    shard = torch.empty(grp.plan.shard_numel, dtype=grp.dtype, device=device)
    grp.own_chunks(flat, shard, rank)
    if offload is not None:
        offload.place(grp, shard)
    else:
        grp.master = shard.to(torch.float32, copy=True)
        grp.master.grad = torch.zeros_like(grp.master) if stage >= 2 else None
        grp.param_shard = shard
    if stage < 3:
        grp.param_shard = None
        grp.flat = flat
        for p, v in zip(grp.params, grp.views(flat)):
            p.data = v
        return
    for p in grp.params:
        p._zero_shape = p.shape  # type: ignore[attr-defined]
        p._zero_numel = p.numel()  # type: ignore[attr-defined]
        p.data = torch.empty(0, dtype=grp.dtype, device=device)


def full_numel(p: torch.Tensor) -> int:
    """Elements of a parameter, also while stage 3 holds it released (empty)."""
    return getattr(p, "_zero_numel", None) or p.numel()


def full_shape(p: torch.Tensor) -> torch.Size:
    """Shape of a parameter, also while stage 3 holds it released (empty)."""
    return getattr(p, "_zero_shape", p.shape)
