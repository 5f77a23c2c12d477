"""Sharded checkpoints of a ZeroOptimizer (one file per rank) and their consolidation.

Each rank writes ``<dir>/zero_rank<r>_of<W>.pt`` holding its fp32 master shards, the wrapped optimizer's
state (shards), the layout needed to put shards back together (tensor sizes and shapes, bucket size,
alignment, world size) and, if a module was given, the parameter names. 1-bit optimizers built with
``exact_resume=True`` also save this rank's error buffers. In ZeroOneAdam's local-step phase the
wrapped optimizer's state is this rank's full (unsharded) state and the file also holds this rank's
parameters, which differ between ranks until the next sync; the master shards hold the last
synchronised parameters. ``consolidate`` reads all ranks' files and rebuilds the full fp32 weights
(like DeepSpeed's ``zero_to_fp32``).

Loading validates the whole shard first (layout, shapes, the wrapped optimizer's state, error
buffers, counters) and the ranks agree (one all-reduce of a flag per rank) before anything is
replaced: if any rank's shard is bad or unreadable, every rank raises and none changes. Files are
written atomically (temporary file, fsync, rename), so a process killed while saving leaves the
previous checkpoint loadable.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import torch

from .. import _C
from .._agree import agree_layout, digest
from .._checkpoint import (
    atomic_save,
    check_optimizer_state,
    is_real,
    need_int,
    need_list,
    need_mapping,
    need_tensor,
    read_checkpoint,
    torch_adam_spec,
)
from ..compress import Compressor

__all__ = ["shard_state_dict", "load_shard_state_dict", "save_checkpoint", "load_checkpoint",
           "consolidate", "shard_file", "errors_of", "load_errors"]

FORMAT = "compcomm.zero/1"


def shard_file(directory: str, rank: int, world: int) -> str:
    """Path of rank ``rank``'s shard file in ``directory``."""
    return os.path.join(directory, f"zero_rank{rank}_of{world}.pt")


def errors_of(compressor: Compressor) -> Dict[tuple, tuple]:
    """Copies of the bucket error buffers of ZeRO's ``compressor`` in the checkpoints' form,
    ``{(group, bucket): (worker_error, server_error)}``."""
    return {k: (v["worker_error"], v["server_error"]) for k, v in compressor.state_dict().items()}


def load_errors(compressor: Compressor, errors: Optional[Dict[tuple, tuple]]) -> None:
    """Hand ``compressor`` the error buffers of :func:`errors_of`'s form (checked against the
    layout by :func:`validate_shard_state_dict`); None or ``{}``: they restart at zero."""
    compressor.load_state_dict({k: {"worker_error": we, "server_error": se}
                                for k, (we, se) in (errors or {}).items()})


def shard_state_dict(opt: Any, names: Optional[Dict[int, str]] = None) -> Dict[str, Any]:
    """This rank's checkpoint of ``opt`` (a ZeroOptimizer) as a dict of CPU tensors and plain data."""
    state = opt.export_state()
    groups = []
    for grp, master in zip(opt.groups, state["masters"]):
        groups.append(
            {
                "sizes": [s.numel for s in grp.tensors],
                "shapes": grp.shapes(),
                "names": [names.get(id(p)) if names else None for p in grp.params],
                "dtype": str(grp.dtype).replace("torch.", ""),
                "bucket_size": grp.plan.bucket_size,
                "alignment": grp.plan.alignment,
                "master": master.detach().cpu().clone(),
            }
        )
    local = state["local_params"]
    errors = state["errors"]
    sd = {
        "format": FORMAT,
        "stage": opt.stage,
        "world": opt.world,
        "rank": opt.rank,
        "groups": groups,
        "optimizer": state["optimizer"],
        "local_phase": state["local_phase"],
        "local_params": [f.detach().cpu().clone() for f in local] if local is not None else None,
        "errors": ({k: (we.cpu(), se.cpu()) for k, (we, se) in errors.items()}
                   if errors is not None else None),
        "loss_scale": state["loss_scale"],
        "global_steps": state["global_steps"],
        "skipped_steps": state["skipped_steps"],
    }
    # the dynamic scale's progress towards its next doubling; written only when nonzero, so a
    # shard saved right after loading a file of the original format still matches it byte for byte
    if opt.scaler.good_steps:
        sd["loss_scale_good_steps"] = opt.scaler.good_steps
    return sd


def _inner_target(opt: Any, local: bool) -> tuple:
    """(params per group, world size, rank) the wrapped optimizer has after the load."""
    if local:
        return [list(grp.params) for grp in opt.groups], opt.world, opt.rank
    return [[grp.master] for grp in opt.groups], 1, 0


def validate_shard_state_dict(opt: Any, sd: Any) -> None:
    """Check a shard from :func:`shard_state_dict` for ``opt`` without changing anything.

    Raises
    ------
    TypeError, ValueError
        Naming the bad entry of ``sd`` (layout, world size, rank, shapes, counters, the wrapped
        optimizer's state).
    """
    w = "ZeroOptimizer.load_state_dict: sd"
    sd = need_mapping(w, sd)
    if sd.get("format") != FORMAT:
        raise ValueError(f"{w}: not a compcomm ZeRO shard (format {sd.get('format')!r})")
    world = need_int(f"{w}['world']", sd.get("world"), 1)
    rank = need_int(f"{w}['rank']", sd.get("rank"))
    if world != opt.world or rank != opt.rank:
        raise ValueError(
            f"{w}: saved by rank {rank} of {world}, loading on rank {opt.rank} of "
            f"{opt.world}; use consolidate() and build a new optimizer to change the world size"
        )
    groups = need_list(f"{w}['groups']", sd.get("groups"))
    if len(groups) != len(opt.groups):
        raise ValueError(f"{w}['groups']: {len(groups)} parameter groups, this optimizer has "
                         f"{len(opt.groups)}")
    for gi, (g, grp) in enumerate(zip(groups, opt.groups)):
        gw = f"{w}['groups'][{gi}]"
        g = need_mapping(gw, g)
        if (g.get("sizes") != [s.numel for s in grp.tensors]
                or g.get("bucket_size") != grp.plan.bucket_size
                or g.get("alignment", grp.plan.alignment) != grp.plan.alignment):
            raise ValueError(f"{gw} has a different layout (sizes, bucket size or alignment)")
        need_tensor(f"{gw}['master']", g.get("master"), shape=tuple(grp.master.shape))
    local = sd.get("local_phase")
    if local is not None and not isinstance(local, bool):
        raise TypeError(f"{w}['local_phase'] must be true or false, got {local!r}")
    local = bool(local)
    if local and not opt.has_local_phase:
        raise ValueError(f"{w}['local_phase'] is true but the wrapped optimizer is not ZeroOneAdam")
    if local:
        flats = need_list(f"{w}['local_params']", sd.get("local_params"))
        if len(flats) != len(opt.groups):
            raise ValueError(f"{w}['local_params'] has {len(flats)} entries, expected "
                             f"{len(opt.groups)}")
        for gi, (f, grp) in enumerate(zip(flats, opt.groups)):
            need_tensor(f"{w}['local_params'][{gi}]", f, shape=tuple(grp.flat.shape))
    params, iworld, irank = _inner_target(opt, local)
    inner = opt.optimizer
    if hasattr(inner, "sched") and hasattr(inner, "exact_resume"):  # a compcomm 1-bit optimizer
        from ..optim.checkpoint import validate_state_dict

        validate_state_dict(inner, sd.get("optimizer"), params, iworld, irank, f"{w}['optimizer']")
    else:
        adam = isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))
        specs = [torch_adam_spec(g) for g in inner.param_groups] if adam else None
        check_optimizer_state(f"{w}['optimizer']", sd.get("optimizer"), params, inner.param_groups,
                              specs)
    errors = sd.get("errors")
    if errors is not None:
        for key, pair in need_mapping(f"{w}['errors']", errors).items():
            ew = f"{w}['errors'][{key!r}]"
            ok = (isinstance(key, tuple) and len(key) == 2 and 0 <= key[0] < len(opt.groups)
                  and 0 <= key[1] < len(opt.groups[key[0]].buckets))
            if not ok:
                raise ValueError(f"{ew}: not a (group, bucket) of this optimizer's layout")
            b = opt.groups[key[0]].buckets[key[1]]
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
                raise TypeError(f"{ew} must be a (worker_error, server_error) pair")
            need_tensor(f"{ew}[0]", pair[0], dtype=torch.float32, numel=b["padded"])
            need_tensor(f"{ew}[1]", pair[1], dtype=torch.float32, numel=b["chunk"])
    scale = sd.get("loss_scale")
    if not is_real(scale) or not float(scale) > 0:
        raise ValueError(f"{w}['loss_scale'] must be a number > 0, got {scale!r}")
    if sd.get("loss_scale_good_steps") is not None:  # absent in older shards: 0
        need_int(f"{w}['loss_scale_good_steps']", sd["loss_scale_good_steps"])
    need_int(f"{w}['global_steps']", sd.get("global_steps"))
    need_int(f"{w}['skipped_steps']", sd.get("skipped_steps"))


def _agree(opt: Any, error: Optional[BaseException]) -> None:
    """Raise on every rank if ``error`` is set on any (one all-reduce of a flag per rank)."""
    bad = opt.ranks_failed(error is not None)
    if error is not None:
        raise error
    if bad:
        raise ValueError(f"[rank {opt.rank}] ZeroOptimizer.load_state_dict: rank(s) {bad} rejected "
                         "their checkpoint shard; nothing was loaded on any rank")


def load_shard_state_dict(opt: Any, sd: Dict[str, Any]) -> None:
    """Restore ``opt`` from :func:`shard_state_dict` output of the same rank and world size.

    Collective (every rank calls it). The shard is validated and the ranks agree before anything
    changes: a bad shard on any rank raises on every rank and leaves every rank's optimizer as it
    was (TypeError/ValueError naming the entry on the rank that had it, ValueError naming that
    rank on the others).
    """
    _load_agreed(opt, sd, None)


def _load_agreed(opt: Any, sd: Any, error: Optional[BaseException]) -> None:
    if error is None:
        try:
            validate_shard_state_dict(opt, sd)
        except Exception as e:  # any failure, so that the peers learn of it and do not hang
            error = e
    _agree(opt, error)
    # Every rank's shard is valid; they must also come from the same step: the phase decides the
    # collectives (a rank in the local phase alone would skip the all-gather below, and ranks at
    # other steps would run other phases' collectives), so RankMismatchError on every rank here.
    inner = sd["optimizer"].get("compcomm", {}) if isinstance(sd["optimizer"], dict) else {}
    agree_layout(opt.comm, "ZeroOptimizer.load_state_dict",
                 [("local_phase", int(bool(sd.get("local_phase"))), False),
                  ("global_steps", int(sd["global_steps"]), False),
                  ("skipped_steps", int(sd["skipped_steps"]), False),
                  ("wrapped optimizer's schedule", digest(inner.get("sched")), True)],
                 opt.device, opt.timeout)
    # validated and agreed on every rank: nothing below raises on bad input
    local = bool(sd.get("local_phase"))
    opt.import_state({
        "masters": [g["master"] for g in sd["groups"]],
        "optimizer": sd["optimizer"],
        "local_phase": local,
        "local_params": sd["local_params"] if local else None,
        "errors": sd.get("errors"),
        "loss_scale": float(sd["loss_scale"]),
        "global_steps": int(sd["global_steps"]),
        "skipped_steps": int(sd["skipped_steps"]),
    })
    opt.scaler.good_steps = int(sd.get("loss_scale_good_steps") or 0)


def save_checkpoint(opt: Any, directory: str, module: Optional[torch.nn.Module] = None) -> str:
    """Write this rank's shard file into ``directory`` (every rank calls this); returns its path.

    ``module`` (optional) supplies parameter names for :func:`consolidate`. The file is written
    atomically: a process killed while saving leaves the previous file whole.
    """
    os.makedirs(directory, exist_ok=True)
    names = {id(p): n for n, p in module.named_parameters()} if module is not None else None
    path = shard_file(directory, opt.rank, opt.world)
    atomic_save(shard_state_dict(opt, names), path)
    return path


def load_checkpoint(opt: Any, directory: str) -> None:
    """Load this rank's shard file from ``directory`` into ``opt`` (every rank calls this).

    A missing or unreadable file, or a malformed shard, on any rank raises on every rank and
    changes nothing (see :func:`load_shard_state_dict`).
    """
    sd, error = None, None
    path = shard_file(directory, opt.rank, opt.world)
    try:
        sd = read_checkpoint(path, map_location="cpu")
    except (OSError, ValueError) as e:  # reported to the peers by _load_agreed, then raised
        error = e
        others = _world_sizes(directory) - {opt.world} if os.path.isdir(directory) else set()
        if isinstance(e, FileNotFoundError) and others:
            error = FileNotFoundError(
                f"load_checkpoint: {path} is missing; {directory!r} holds shards of world size(s) "
                f"{sorted(others)}: to change the world size, consolidate(directory, world_size=...)"
                " and load the full weights into a new optimizer")
    _load_agreed(opt, sd, error)


def _world_sizes(directory: str) -> set:
    """The world sizes of the shard files (``zero_rank<r>_of<W>.pt``) in ``directory``."""
    names = [f for f in os.listdir(directory) if f.startswith("zero_rank") and f.endswith(".pt")]
    return {int(f.rsplit("_of", 1)[1][:-3]) for f in names}


def consolidate(directory: str, world_size: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """Full fp32 weights from all ranks' shard files in ``directory`` (like ``zero_to_fp32``).

    Parameters
    ----------
    directory : str
    world_size : int, optional
        Which run's shards (``zero_rank<r>_of<world_size>.pt``) when the directory holds shards of
        runs of several world sizes; without it such a directory raises ValueError.

    Returns
    -------
    dict
        ``name -> fp32 tensor`` of the parameter's shape; parameters saved without a module are
        named ``group{g}.param{i}``.
    """
    sizes = sorted(_world_sizes(directory))
    if not sizes:
        raise FileNotFoundError(f"directory: no zero_rank*_of*.pt files in {directory!r}")
    if world_size is None and len(sizes) > 1:
        raise ValueError(f"directory: {directory!r} holds shards of runs of world sizes {sizes}; "
                         "pass world_size to say which")
    world = sizes[0] if world_size is None else int(world_size)
    shards: List[Dict[str, Any]] = []
    for r in range(world):
        path = shard_file(directory, r, world)
        if not os.path.exists(path):
            raise FileNotFoundError(f"directory: {path} is missing (world size {world})")
        sd = read_checkpoint(path, map_location="cpu")
        if (not isinstance(sd, dict) or sd.get("format") != FORMAT or sd.get("world") != world
                or sd.get("rank") != r or not isinstance(sd.get("groups"), list)):
            raise ValueError(f"{path}: not rank {r} of {world} of a compcomm ZeRO checkpoint")
        shards.append(sd)
    try:
        return _assemble(shards, world)
    except (KeyError, TypeError, IndexError, ValueError, RuntimeError) as e:
        raise ValueError(f"directory: the shards in {directory!r} (world size {world}) do not fit "
                         f"together ({type(e).__name__}: {e})") from e


def _assemble(shards: List[Dict[str, Any]], world: int) -> Dict[str, torch.Tensor]:
    """The full weights from every rank's shard (read and checked by :func:`consolidate`)."""
    out: Dict[str, torch.Tensor] = {}
    for gi, g in enumerate(shards[0]["groups"]):
        plan = _C.zero.plan_buckets(g["sizes"], g["bucket_size"], world, g["alignment"])
        flat = torch.empty(plan.flat_numel, dtype=torch.float32)
        for r in range(world):
            master = shards[r]["groups"][gi]["master"]
            for b in plan.buckets:
                lo = b["offset"] + r * b["chunk"]
                flat[lo : lo + b["chunk"]] = master[b["shard_offset"] : b["shard_offset"] + b["chunk"]]
        for i, ((n, off, _), shape, name) in enumerate(zip(plan.tensors, g["shapes"], g["names"])):
            out[name or f"group{gi}.param{i}"] = flat[off : off + n].clone().view(shape)
    return out
