"""Sharded checkpoints of a ZeroOptimizer (one file per rank) and their consolidation.

Each rank writes ``<dir>/zero_rank<r>_of<W>.pt`` holding its fp32 master shards, the wrapped optimizer's
state (shards), the layout needed to put shards back together (tensor sizes and shapes, bucket size,
alignment, world size) and, if a module was given, the parameter names. 1-bit optimizers built with
``exact_resume=True`` also save this rank's error buffers. In ZeroOneAdam's local-step phase the
wrapped optimizer's state is this rank's full (unsharded) state and the file also holds this rank's
parameters, which differ between ranks until the next sync; the master shards hold the last
synchronised parameters. ``consolidate`` reads all ranks' files and rebuilds the full fp32 weights
(like DeepSpeed's ``zero_to_fp32``).
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import torch

from .. import _C

__all__ = ["shard_state_dict", "load_shard_state_dict", "save_checkpoint", "load_checkpoint",
           "consolidate", "shard_file"]

FORMAT = "compcomm.zero/1"


def shard_file(directory: str, rank: int, world: int) -> str:
    """Path of rank ``rank``'s shard file in ``directory``."""
    return os.path.join(directory, f"zero_rank{rank}_of{world}.pt")


def shard_state_dict(opt: Any, names: Optional[Dict[int, str]] = None) -> Dict[str, Any]:
    """This rank's checkpoint of ``opt`` (a ZeroOptimizer) as a dict of CPU tensors and plain data."""
    opt._complete(len(opt._pending))
    groups = []
    for grp in opt.groups:
        groups.append(
            {
                "sizes": [t[0] for t in grp.tensors],
                "shapes": [tuple(getattr(p, "_zero_shape", p.shape)) for p in grp.params],
                "names": [names.get(id(p)) if names else None for p in grp.params],
                "dtype": str(grp.dtype).replace("torch.", ""),
                "bucket_size": grp.plan.bucket_size,
                "alignment": grp.plan.alignment,
                "master": grp.master.detach().cpu().clone(),
            }
        )
    return {
        "format": FORMAT,
        "stage": opt.stage,
        "world": opt.world,
        "rank": opt.rank,
        "groups": groups,
        "optimizer": opt.optimizer.state_dict(),
        "local_phase": opt._local_phase,
        "local_params": ([grp.flat.detach().cpu().clone() for grp in opt.groups]
                         if opt._local_phase else None),
        "errors": ({k: (we.cpu().clone(), se.cpu().clone()) for k, (we, se) in opt._errors.items()}
                   if opt.exact_resume else None),
        "loss_scale": opt.loss_scale,
        "global_steps": opt.global_steps,
        "skipped_steps": opt.skipped_steps,
    }


def load_shard_state_dict(opt: Any, sd: Dict[str, Any]) -> None:
    """Restore ``opt`` from :func:`shard_state_dict` output of the same rank and world size."""
    if sd.get("format") != FORMAT:
        raise ValueError(f"state_dict: not a compcomm ZeRO shard (format {sd.get('format')!r})")
    if sd["world"] != opt.world or sd["rank"] != opt.rank:
        raise ValueError(
            f"state_dict: saved by rank {sd['rank']} of {sd['world']}, loading on rank {opt.rank} of "
            f"{opt.world}; use consolidate() and build a new optimizer to change the world size"
        )
    if len(sd["groups"]) != len(opt.groups):
        raise ValueError("state_dict: number of parameter groups differs")
    for gi, (g, grp) in enumerate(zip(sd["groups"], opt.groups)):
        if g["sizes"] != [t[0] for t in grp.tensors] or g["bucket_size"] != grp.plan.bucket_size:
            raise ValueError(f"state_dict: group {gi} has a different layout (sizes or bucket size)")
        grp.master.data.copy_(g["master"])
    local = bool(sd.get("local_phase"))
    if local and not opt._local_phase:
        opt._enter_local_phase(gather=False)  # the state comes from the checkpoint
    elif opt._local_phase and not local:
        opt._leave_local_phase()
    opt.optimizer.load_state_dict(sd["optimizer"])
    saved_errors = sd.get("errors") or {}
    opt._errors = ({k: (we.to(opt.device, copy=True), se.to(opt.device, copy=True))
                    for k, (we, se) in saved_errors.items()} if opt.exact_resume else {})
    opt.loss_scale = sd["loss_scale"]
    opt.global_steps = sd["global_steps"]
    opt.skipped_steps = sd["skipped_steps"]
    if local:
        for grp, flat in zip(opt.groups, sd["local_params"]):
            grp.flat.copy_(flat)
    else:
        opt._publish()


def save_checkpoint(opt: Any, directory: str, module: Optional[torch.nn.Module] = None) -> str:
    """Write this rank's shard file into ``directory`` (every rank calls this); returns its path.

    ``module`` (optional) supplies parameter names for :func:`consolidate`.
    """
    os.makedirs(directory, exist_ok=True)
    names = {id(p): n for n, p in module.named_parameters()} if module is not None else None
    path = shard_file(directory, opt.rank, opt.world)
    torch.save(shard_state_dict(opt, names), path)
    return path


def load_checkpoint(opt: Any, directory: str) -> None:
    """Load this rank's shard file from ``directory`` into ``opt`` (every rank calls this)."""
    sd = torch.load(shard_file(directory, opt.rank, opt.world), map_location="cpu", weights_only=False)
    load_shard_state_dict(opt, sd)


def consolidate(directory: str) -> Dict[str, torch.Tensor]:
    """Full fp32 weights from all ranks' shard files in ``directory`` (like ``zero_to_fp32``).

    Returns
    -------
    dict
        ``name -> fp32 tensor`` of the parameter's shape; parameters saved without a module are
        named ``group{g}.param{i}``.
    """
    files = sorted(f for f in os.listdir(directory) if f.startswith("zero_rank") and f.endswith(".pt"))
    if not files:
        raise FileNotFoundError(f"directory: no zero_rank*_of*.pt files in {directory!r}")
    world = int(files[0].rsplit("_of", 1)[1][:-3])
    shards: List[Dict[str, Any]] = []
    for r in range(world):
        path = shard_file(directory, r, world)
        if not os.path.exists(path):
            raise FileNotFoundError(f"directory: {path} is missing (world size {world})")
        sd = torch.load(path, map_location="cpu", weights_only=False)
        if sd.get("format") != FORMAT or sd["world"] != world or sd["rank"] != r:
            raise ValueError(f"{path}: not rank {r} of {world} of a compcomm ZeRO checkpoint")
        shards.append(sd)
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
