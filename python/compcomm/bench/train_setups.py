"""The optimizer set-ups of ``compcomm-bench train`` (:mod:`compcomm.bench.train`).

Default arguments except ``lr`` and the warm-up (``--warmup``):

=====================  ========================================================================
ddp_adamw              DistributedDataParallel + torch.optim.AdamW
ddp_adamw_bf16hook     the same with DDP's ``bf16_compress_hook`` (on gloo: the same hook body;
                       torch refuses its own without NCCL)
onebitadam             compcomm.optim.OneBitAdam(freeze_step=--warmup) (no DDP: it communicates)
onebitadam_overlap     the same with ``overlap_backward=True`` (the compressed phase's groups of
                       buckets sent while the backward runs; ``--overlap-backward`` adds it)
onebitadam_nooverlap   the same with ``overlap_backward=False`` (every exchange in ``step()``)
onebitadam_nofreeze    OneBitAdam with freeze_step past the run (Adam with fp32 averaging)
onebitadam_identity    OneBitAdam(freeze_step=--warmup, compressor=IdentityCompressor): the same
                       schedule and frozen variance, exact averages (the identity twin)
zerooneadam            compcomm.optim.ZeroOneAdam(var_freeze_step=--warmup)
zerooneadam_identity   the same with ``compressor=IdentityCompressor``
zero2_adamw            compcomm.zero.ZeroOptimizer(stage 2) around torch.optim.AdamW
zero2_onebitadam       ZeroOptimizer(stage 2) around OneBitAdam(freeze_step=--warmup), the
                       default ``onebit_mode`` ("exact": parameters all-gathered every step)
zero2_onebitadam_noag  the same with ``onebit_mode="no_allgather"`` (momentum, frozen variance
                       replicated after the warm-up: a compressed step sends only the 1-bit
                       allreduce and an 8-byte norm)
onebitlamb             compcomm.optim.OneBitLamb(freeze_step=--warmup)
lamb                   OneBitLamb with freeze_step past the run (LAMB with fp32 averaging);
onebitlamb_nofreeze    the same as ``lamb``
onebitlamb_identity    OneBitLamb(freeze_step=--warmup, compressor=IdentityCompressor)
fsdp2_adamw            torch FSDP2: ``fully_shard`` on every transformer block and the root,
                       MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16) with bf16
                       autocast on GPUs (fp32 otherwise), torch.optim.AdamW on the DTensor shards
fsdp2_onebit           the same model with ``compcomm.fsdp.onebit(model, warmup_steps=--warmup)``
                       (FSDP's own reduce-scatter for --warmup steps, then compcomm's 1-bit
                       reduce-scatter with error feedback) and compcomm.fsdp.FrozenVarianceAdam
                       (AdamW's arguments; variance frozen at the switch: the 1-bit Adam recipe)
fsdp2_onebit_adamw     fsdp2_onebit with torch.optim.AdamW instead (variance keeps following the
                       1-bit gradients: the earlier pairing, for comparison)
fsdp2_onebit_ag_adamw  fsdp2_onebit_ag with torch.optim.AdamW
fsdp2_onebit_sr_adamw  fsdp2_onebit_adamw plus compcomm's exact all-gather (the re-gather cache)
                       with ``rounding="stochastic"``: bf16 parameters (GPU) are cast from the
                       fp32 master with stochastic rounding instead of FSDP's round to nearest
fsdp2_onebit_flat      fsdp2_onebit with one 1-bit segment per FSDP module
                       (``segment_elements=None``: the layout before tensor-aligned segments)
fsdp2_onebit_adamw_flat  both earlier choices: one segment per module and AdamW
fsdp2_frozen_identity  FSDP's own reduce-scatter (exact) with FrozenVarianceAdam(freeze_step=
                       --warmup): what freezing the variance costs without compression
fsdp2_onebit_ag        fsdp2_onebit plus compcomm's parameter all-gather: blockwise int8
                       (``quantized_allgather``, its defaults: blocks of 64, round to nearest,
                       parameters of <= 4096 elements unquantized; ``--ag-options
                       exact_numel=0,block=256`` gives the rows before) and the re-gather cache
                       (``regather_cache``)
fsdp2_onebit_cache     fsdp2_onebit plus the re-gather cache alone (exact all-gathers)
fsdp2_adamw_qag        fsdp2_adamw plus the int8 all-gather and the cache, FSDP's own
                       reduce-scatter: what the int8 weights alone cost in loss
fsdp2_onebitadam       ``onebit(..., mode="momentum")`` + FrozenVarianceAdam: DeepSpeed's 1-bit
                       Adam on the shards (the local momentum averaged by the full compressed
                       allreduce, kept replicated in 1-bit form); FSDP's own all-gather
fsdp2_onebitadam_ag    fsdp2_onebitadam plus the int8 all-gather and the re-gather cache
fsdp2_onebitadam_local ``onebit(..., mode="local_momentum")`` + FrozenVarianceAdam: each rank's
                       fp32 local momentum 1-bit reduce-scattered (no all-gather of the
                       result: half fsdp2_onebitadam's reduce bytes); FSDP's own all-gather
fsdp2_onebitadam_local_ag  fsdp2_onebitadam_local plus the int8 all-gather and the cache
=====================  ========================================================================

Two twins per 1-bit optimizer. ``TWIN``, the loss comparison with the 2 % target: the same optimizer
with no freeze (Adam / LAMB with fp32 averaging for the whole run: issue 13's warm-up rule for the
whole run). ``IDENTITY_TWIN``, an extra comparison: the same optimizer, schedule and frozen variance
with the compression replaced by exact averages (:class:`compcomm.compress.IdentityCompressor`, one
class; the optimizers are untouched), so that the loss gap to the 1-bit row is what compression
costs and the gap to the no-freeze row what the frozen variance costs.

Bytes of the FSDP2 rows: FSDP2 talks to torch, so each FSDP module's all-gather (and, for
``fsdp2_adamw``, its reduce-scatter) is FSDP's own default collective wrapped in a counter
(``set_custom_all_gather`` / ``set_custom_reduce_scatter``; the same calls, with the ring
convention of the other rows: a rank sends ``(W-1)`` shards per all-gather and per reduce-scatter,
in the dtype FSDP hands over). ``fsdp2_onebit``'s warm-up reduce-scatters (FSDP's own, inside
compcomm's ``ReduceScatter``) are counted by the same formula from the module's all-gather shard
size, its 1-bit reduce-scatters by compcomm's communicator (``bytes_sent``). The rows with
compcomm's all-gather count it by its own ``bytes_sent`` (ring convention, the int8 payload; a
re-gather served from the cache sends nothing); the benchmark drops that cache after each
validation pass so that every step's bytes are a training step's. The rows also carry
``reduce_bytes`` (the gradient reduce-scatters alone: what issue 16's 12x bytes target compares).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Tuple

__all__ = ["OPTIMIZERS", "TWIN", "IDENTITY_TWIN", "IDENTITY", "COMPRESSED", "make", "phase",
           "bf16_hook_cpu", "FSDPBytes", "shard_blocks", "ag_options"]

OPTIMIZERS = (
    "ddp_adamw",
    "ddp_adamw_bf16hook",
    "onebitadam",
    "onebitadam_overlap",
    "onebitadam_nooverlap",
    "onebitadam_nofreeze",
    "onebitadam_identity",
    "zerooneadam",
    "zerooneadam_identity",
    "zero2_adamw",
    "zero2_onebitadam",
    "zero2_onebitadam_noag",
    "lamb",
    "onebitlamb",
    "onebitlamb_nofreeze",
    "onebitlamb_identity",
    "fsdp2_adamw",
    "fsdp2_onebit",
    "fsdp2_onebit_ag",
    "fsdp2_onebit_cache",
    "fsdp2_adamw_qag",
    "fsdp2_onebit_adamw",
    "fsdp2_onebit_ag_adamw",
    "fsdp2_onebit_sr_adamw",
    "fsdp2_onebit_flat",
    "fsdp2_onebit_adamw_flat",
    "fsdp2_frozen_identity",
    "fsdp2_onebitadam",
    "fsdp2_onebitadam_ag",
    "fsdp2_onebitadam_local",
    "fsdp2_onebitadam_local_ag",
)
#: the uncompressed twin of each compressed optimizer (loss comparison) and its fp32 baseline
TWIN = {
    "onebitadam": "onebitadam_nofreeze",
    "onebitadam_overlap": "onebitadam_nofreeze",
    "onebitadam_nooverlap": "onebitadam_nofreeze",
    "zerooneadam": "onebitadam_nofreeze",
    "onebitlamb": "onebitlamb_nofreeze",
    "zero2_onebitadam": "zero2_adamw",
    "zero2_onebitadam_noag": "zero2_adamw",
    "fsdp2_onebit": "fsdp2_adamw",
    "fsdp2_onebit_ag": "fsdp2_adamw",
    "fsdp2_onebit_cache": "fsdp2_adamw",
    "fsdp2_adamw_qag": "fsdp2_adamw",
    "fsdp2_onebit_adamw": "fsdp2_adamw",
    "fsdp2_onebit_ag_adamw": "fsdp2_adamw",
    "fsdp2_onebit_sr_adamw": "fsdp2_adamw",
    "fsdp2_onebit_flat": "fsdp2_adamw",
    "fsdp2_onebit_adamw_flat": "fsdp2_adamw",
    "fsdp2_frozen_identity": "fsdp2_adamw",
    "fsdp2_onebitadam": "fsdp2_adamw",
    "fsdp2_onebitadam_ag": "fsdp2_adamw",
    "fsdp2_onebitadam_local": "fsdp2_adamw",
    "fsdp2_onebitadam_local_ag": "fsdp2_adamw",
}
#: the identity twin of each 1-bit optimizer (an extra loss comparison, no target)
IDENTITY_TWIN = {
    "onebitadam": "onebitadam_identity",
    "zerooneadam": "zerooneadam_identity",
    "onebitlamb": "onebitlamb_identity",
    "fsdp2_onebit": "fsdp2_frozen_identity",
    "fsdp2_onebit_ag": "fsdp2_frozen_identity",
    "fsdp2_onebit_flat": "fsdp2_frozen_identity",
    "fsdp2_onebitadam": "fsdp2_frozen_identity",
    "fsdp2_onebitadam_ag": "fsdp2_frozen_identity",
    "fsdp2_onebitadam_local": "fsdp2_frozen_identity",
    "fsdp2_onebitadam_local_ag": "fsdp2_frozen_identity",
}
#: uncompressed, but on the 1-bit schedule: as many steps as the compressed rows, and not among
#: the rows that set the time-to-target loss (a frozen variance may diverge)
IDENTITY = tuple(IDENTITY_TWIN.values())
COMPRESSED = ("onebitadam", "onebitadam_overlap", "onebitadam_nooverlap", "zerooneadam",
              "zero2_onebitadam", "zero2_onebitadam_noag",
              "onebitlamb", "fsdp2_onebit", "fsdp2_onebit_ag", "fsdp2_onebit_cache",
              "fsdp2_onebit_adamw", "fsdp2_onebit_ag_adamw", "fsdp2_onebit_sr_adamw",
              "fsdp2_onebit_flat", "fsdp2_onebit_adamw_flat", "fsdp2_onebitadam",
              "fsdp2_onebitadam_ag", "fsdp2_onebitadam_local", "fsdp2_onebitadam_local_ag")
#: steps 1..--warmup are "warmup", the later ones "compressed"
_FREEZING = ("onebitadam", "onebitadam_overlap", "onebitadam_nooverlap", "onebitlamb",
             "zero2_onebitadam", "zero2_onebitadam_noag",
             "fsdp2_onebit", "fsdp2_onebit_ag", "fsdp2_onebit_cache", "fsdp2_onebit_adamw",
             "fsdp2_onebit_ag_adamw", "fsdp2_onebit_sr_adamw", "fsdp2_onebit_flat",
             "fsdp2_onebit_adamw_flat", "fsdp2_frozen_identity", "fsdp2_onebitadam",
             "fsdp2_onebitadam_ag", "fsdp2_onebitadam_local", "fsdp2_onebitadam_local_ag",
             "onebitadam_identity",
             "onebitlamb_identity")


def phase(name: str, opt: Any, t: int, warm: int) -> str:
    """What step ``t`` (1-based, about to run) is for optimizer ``name``."""
    if name in ("zerooneadam", "zerooneadam_identity"):
        return opt.step_kind()
    if name in _FREEZING:
        return "warmup" if t <= warm else "compressed"
    return "full"


def make(name: str, model: Any, cfg: Dict[str, Any], world: int, dev: Any) -> Dict[str, Any]:
    """The training objects of optimizer ``name``: ``module`` (what to call), ``opt``, ``kind``;
    FSDP2 rows also ``sent`` and ``reduce_sent`` (cumulative bytes this rank sent: all, and the
    gradient reductions alone); the others count with ``opt.comm`` or DDP's ring formula."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from compcomm.compress import IdentityCompressor
    from compcomm.optim import OneBitAdam, OneBitLamb, ZeroOneAdam

    # "never" freezes after the longest run: the baselines run --baseline-steps when it is given
    never = max(cfg["steps"], cfg.get("baseline_steps") or 0) + 10
    lr, warm = cfg["lr"], cfg["warmup"]
    extra: Dict[str, Any] = {}
    if cfg.get("backend") in ("nccl", "mpi"):
        extra["comm_backend_name"] = cfg["backend"]
    if cfg.get("reduce_bucket_size") is not None:
        extra["reduce_bucket_size"] = int(cfg["reduce_bucket_size"])
    fused = {} if cfg.get("fused") is None else {"fused": bool(cfg["fused"])}
    if fused and "fused" not in inspect.signature(OneBitAdam).parameters:
        fused = {}  # this compcomm's optimizers no longer take it (bucketed by default)
    bc = {"bias_correction": True} if cfg.get("bias_correction") else {}
    if name.startswith("fsdp2_"):  # (fsdp2_frozen_identity is its own set-up)
        return _fsdp2(name, model, cfg, world, dev)
    if name in IDENTITY:  # the same optimizer, exact averages
        extra["compressor"] = IdentityCompressor
        name = name[:-len("_identity")]
    if name.startswith("ddp_"):
        ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
        if name == "ddp_adamw_bf16hook":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
                bf16_compress_hook,
            )

            hook = bf16_compress_hook if dev.type == "cuda" else bf16_hook_cpu
            ddp.register_comm_hook(dist.group.WORLD, hook)
        return {"module": ddp, "opt": torch.optim.AdamW(ddp.parameters(), lr=lr), "kind": "ddp"}
    if name.startswith("zero2_"):
        from compcomm.zero import ZeroOptimizer

        if name == "zero2_adamw":
            cls, kw = torch.optim.AdamW, {"lr": lr}
        else:
            cls, kw = OneBitAdam, dict(lr=lr, freeze_step=warm, **bc)
        mode = {"onebit_mode": "no_allgather"} if name == "zero2_onebitadam_noag" else {}
        opt = ZeroOptimizer(model.parameters(), cls, stage=2, module=model, optimizer_kwargs=kw,
                            **mode)
        return {"module": model, "opt": opt, "kind": "zero"}
    if name in ("onebitadam", "onebitadam_nofreeze", "onebitadam_overlap",
                "onebitadam_nooverlap"):
        fs = never if name == "onebitadam_nofreeze" else warm
        if name == "onebitadam_overlap":
            extra["overlap_backward"] = True
            if cfg.get("overlap_groups"):  # a tuning run (--overlap-groups): this rank's plans
                from compcomm.optim import overlap

                overlap.MAX_GROUPS = int(cfg["overlap_groups"])
        if name == "onebitadam_nooverlap":
            extra["overlap_backward"] = False
        opt = OneBitAdam(model.parameters(), lr=lr, freeze_step=fs, **bc, **fused, **extra)
    elif name == "zerooneadam":
        zk = {k: cfg[k] for k in ("local_step_scaler", "local_step_clipper") if cfg.get(k)}
        opt = ZeroOneAdam(model.parameters(), lr=lr, var_freeze_step=warm, **zk, **bc, **fused,
                          **extra)
    elif name in ("onebitlamb", "lamb", "onebitlamb_nofreeze"):
        fs = warm if name == "onebitlamb" else never
        opt = OneBitLamb(model.parameters(), lr=cfg["lamb_lr"], freeze_step=fs, **bc, **extra)
    else:
        raise ValueError(f"train: unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")
    return {"module": model, "opt": opt, "kind": "compcomm"}


def bf16_hook_cpu(state, bucket):  # type: ignore[no-untyped-def]  (DDP checks annotations)
    """torch's ``bf16_compress_hook`` (refused by DDP without NCCL), for gloo: the bucket divided
    by W, cast to bf16, summed by allreduce and copied back."""
    import torch
    import torch.distributed as dist

    buf = bucket.buffer()
    c = buf.to(torch.bfloat16).div_(dist.get_world_size())
    fut = dist.all_reduce(c, async_op=True).get_future()

    def decompress(f):  # type: ignore[no-untyped-def]
        buf.copy_(f.value()[0])
        return buf

    return fut.then(decompress)


# ------------------------------------------------------------------------------------------------
# FSDP2
# ------------------------------------------------------------------------------------------------
class FSDPBytes:
    """Bytes this rank sends in FSDP2's collectives, per FSDP module (ring convention: ``W-1``
    shards per all-gather and per reduce-scatter)."""

    def __init__(self) -> None:
        self.gather = 0
        self.reduce = 0
        #: module name -> (elements of its all-gather shard, world size)
        self.shard: Dict[str, Tuple[int, int]] = {}

    def gathered(self, name: str, shard: Any, world: int, count: bool = True) -> None:
        self.shard[name] = (shard.numel(), world)
        if count:
            self.gather += (world - 1) * shard.numel() * shard.element_size()

    def reduced(self, full: Any, world: int) -> None:
        self.reduce += (world - 1) * full.numel() * full.element_size() // world

    def reduce_formula(self, reductions: Dict[str, int], element_size: int) -> int:
        """Bytes of ``reductions[name]`` full-precision reduce-scatters of each module, by the
        ring formula from its all-gather shard (FSDP pads both the same way)."""
        return sum((w - 1) * n * element_size * reductions.get(name, 0)
                   for name, (n, w) in self.shard.items())


class _CountedGather:
    """FSDP2's default all-gather (the same call), counting what this rank sends; or ``inner``
    (compcomm's, which counts its own bytes), recording only the shard sizes."""

    def __init__(self, tally: FSDPBytes, name: str, inner: Any = None) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

        self.inner, self.tally, self.name = inner or DefaultAllGather(), tally, name
        self.count = inner is None

    def allocate(self, size: Any, *, dtype: Any, device: Any) -> Any:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Any, input_tensor: Any, group: Any,
                 async_op: bool = False) -> Any:
        self.tally.gathered(self.name, input_tensor, group.size(), self.count)
        return self.inner(output_tensor, input_tensor, group, async_op)


class _CountedReduceScatter:
    """FSDP2's default reduce-scatter (the same call), counting what this rank sends."""

    def __init__(self, tally: FSDPBytes) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

        self.inner, self.tally = DefaultReduceScatter(), tally

    def allocate(self, size: Any, *, dtype: Any, device: Any) -> Any:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        self.tally.reduced(input_tensor, group.size())
        return self.inner(output_tensor, input_tensor, group, op, async_op)


def shard_blocks(model: Any, world: int, device_type: str = "cpu", mp_policy: Any = None) -> Any:
    """``fully_shard`` on every transformer block of a benchmark model and on its root, over a 1-D
    mesh of ``world`` ranks (the FSDP2 rows' layout); returns the mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    mesh = init_device_mesh(device_type, (world,))
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return mesh


def ag_options(text: str) -> Dict[str, Any]:
    """``--ag-options``: ``'k=v,k=v'`` -> keyword arguments (integers where they parse)."""
    out: Dict[str, Any] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        k, _, v = item.partition("=")
        out[k.strip()] = int(v) if v.strip().lstrip("-").isdigit() else v.strip()
    return out


def _fsdp2(name: str, model: Any, cfg: Dict[str, Any], world: int, dev: Any) -> Dict[str, Any]:
    import torch
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

    import compcomm
    import compcomm.fsdp
    import compcomm.fsdp_gather

    bf16 = (dev.type == "cuda" and cfg.get("amp") == "bf16") or bool(cfg.get("fsdp_bf16"))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 \
        else MixedPrecisionPolicy()
    mesh = shard_blocks(model, world, dev.type, mp)
    # module names as compcomm.fsdp.onebit names them (its step counts are keyed by them)
    mods: List[Tuple[str, Any]] = [(n or "<root>", m) for n, m in model.named_modules()
                                   if isinstance(m, FSDPModule)]
    tally = FSDPBytes()
    for n, m in mods:
        m.set_custom_all_gather(_CountedGather(tally, n))
    reduce_sent: Callable[[], int]
    ag = {"fsdp2_onebit_ag": dict(quantized_allgather=True, regather_cache=True),
          "fsdp2_onebit_ag_adamw": dict(quantized_allgather=True, regather_cache=True),
          "fsdp2_onebit_cache": dict(regather_cache=True),
          "fsdp2_onebit_sr_adamw": dict(regather_cache=True, rounding="stochastic"),
          "fsdp2_onebitadam_ag": dict(quantized_allgather=True, regather_cache=True),
          "fsdp2_onebitadam_local_ag": dict(quantized_allgather=True, regather_cache=True),
          "fsdp2_adamw_qag": dict(quantized_allgather=True, regather_cache=True)}.get(name)
    gstate = None
    if ag is not None:  # compcomm's all-gather, wrapped to record the shard sizes
        gstate = compcomm.fsdp.compressed_allgather(
            model, quantized=ag.get("quantized_allgather", False), cache=ag["regather_cache"],
            **{**{k: v for k, v in ag.items() if k == "rounding"},
               **ag_options(cfg.get("ag_options", ""))})
        for n, m in mods:
            inner = compcomm.fsdp_gather.CompressedAllGather(gstate, n, m)
            m.set_custom_all_gather(_CountedGather(tally, n, inner))
    if name.startswith("fsdp2_onebit"):
        flat = name.endswith("_flat")  # one segment per module, as before segments
        mode = "gradient" if not name.startswith("fsdp2_onebitadam") else \
            "local_momentum" if name.startswith("fsdp2_onebitadam_local") else "momentum"
        state = compcomm.fsdp.onebit(model, warmup_steps=cfg["warmup"], mode=mode,
                                     **(dict(segment_elements=None) if flat else {}))
        state.batch_segments = not cfg.get("fsdp_unbatched")
        comm = compcomm.get_communicator(mesh.get_group())
        esize = 2 if bf16 else 4
        warm = cfg["warmup"]

        def reduce_sent() -> int:  # FSDP's own reduce-scatters in the warm-up, then compcomm's
            if set(state.steps) - set(tally.shard):
                raise RuntimeError(f"train: compcomm.fsdp module names {sorted(state.steps)} "
                                   f"differ from the benchmark's {sorted(tally.shard)}")
            full = {k: min(v, warm) for k, v in state.steps.items()}
            return tally.reduce_formula(full, esize) + int(comm.bytes_sent)
    else:
        for _, m in mods:
            m.set_custom_reduce_scatter(_CountedReduceScatter(tally))

        def reduce_sent() -> int:
            return tally.reduce

    if name.startswith("fsdp2_onebit") and "_adamw" not in name:
        opt = compcomm.fsdp.FrozenVarianceAdam(model.parameters(), lr=cfg["lr"], freeze_step=state)
    elif name == "fsdp2_frozen_identity":
        opt = compcomm.fsdp.FrozenVarianceAdam(model.parameters(), lr=cfg["lr"],
                                               freeze_step=cfg["warmup"])
    elif name in ("fsdp2_adamw", "fsdp2_adamw_qag", "fsdp2_onebit_adamw", "fsdp2_onebit_ag_adamw",
                  "fsdp2_onebit_sr_adamw", "fsdp2_onebit_adamw_flat"):
        opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    else:
        raise ValueError(f"train: unknown FSDP2 set-up {name!r}")
    gathered: Callable[[], int] = (lambda: tally.gather) if gstate is None else \
        (lambda: gstate.bytes_sent)
    return {"module": model, "opt": opt, "kind": "fsdp", "reduce_sent": reduce_sent,
            "sent": lambda: gathered() + reduce_sent(), "gather_state": gstate,
            "after_eval": gstate.invalidate if gstate is not None else None}
