"""Where FSDP2 puts a module's parameters in its reduce-scatter, and compcomm's tensor-aligned
segments of it (shared by :mod:`compcomm.fsdp`'s two 1-bit modes).

FSDP's flat rank-major input holds, for each rank r, every parameter's dim-0 piece r (dim 0 padded
to a multiple of the mesh size), in FSDP's parameter order; :func:`shard_params` lists those
parameters with their piece sizes, :func:`plan_indices` cuts them into segments
(:func:`compcomm.compress.plan_buckets` over the padded sizes).
"""

from __future__ import annotations

import math
from typing import Any, List, Optional, Tuple

import torch
from torch.distributed.fsdp import FSDPModule

from .compress import plan_buckets

__all__ = ["fsdp_params", "shard_size", "piece_numel", "shard_pieces", "shard_params",
           "plan_indices", "plan_segments"]


def fsdp_params(m: torch.nn.Module) -> Optional[List[Any]]:
    """FSDP's own parameter list of module ``m`` (its reduce-scatter order), or None when this
    torch's internals do not give one group of them."""
    try:
        st = m._get_fsdp_state()
        groups = [g for g in (getattr(st, "_fsdp_param_groups", None)
                              or [getattr(st, "_fsdp_param_group", None)]) if g is not None]
        return list(groups[0].fsdp_params) if len(groups) == 1 else None
    except Exception:  # noqa: BLE001 - another torch's internals: one segment per module
        return None


def shard_size(p: torch.Tensor) -> int:
    """Ranks parameter ``p`` is sharded over: its mesh's sharded dims (a 2-D HSDP mesh: the shard
    dim, not the replicas)."""
    mesh = getattr(p, "device_mesh", None)
    if mesh is None:
        return 1
    placements = getattr(p, "placements", None)
    if placements is None:
        return mesh.size()
    return math.prod(mesh.size(i) for i, pl in enumerate(placements) if pl.is_shard())


def piece_numel(p: torch.Tensor) -> int:
    """Elements of one rank's piece of parameter ``p``'s gradient in FSDP's reduce-scatter (its
    shard dim, 0 unless ``shard_placement_fn`` says another, padded to a multiple of the shard
    group's size)."""
    world = shard_size(p)
    dims = [pl.dim for pl in getattr(p, "placements", ()) if pl.is_shard()]
    dim = dims[-1] if dims else 0
    n = p.shape[dim] if p.dim() else 1
    return math.ceil(n / world) * (p.numel() // n)


def shard_pieces(m: torch.nn.Module) -> List[Tuple[int, int]]:
    """(piece, whole parameter's padded numel) of every parameter of FSDP module ``m`` that takes
    gradients, in FSDP's order (its parameters, not those of nested FSDP modules)."""
    return [(piece, padded) for _, piece, padded in shard_params(m)]


def shard_params(m: torch.nn.Module) -> List[Tuple[Any, int, int]]:
    """:func:`shard_pieces` with the parameters: (param, piece, padded numel)."""
    fps = fsdp_params(m)
    if fps is not None:
        params = [fp.sharded_param for fp in fps]
    else:  # FSDP's order is a post-order walk of the managed modules
        params, stack = [], []

        def walk(mod: torch.nn.Module) -> None:
            for c in mod.children():
                if not isinstance(c, FSDPModule):
                    walk(c)
            stack.append(mod)
        walk(m)
        seen: set = set()
        for mod in stack:
            for p in mod.parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
    out = []
    for p in params:
        if not p.requires_grad or p.numel() == 0:
            continue
        piece = piece_numel(p)
        out.append((p, piece, piece * shard_size(p)))
    return out


def plan_indices(pieces: List[Tuple[int, int]], limit: Optional[int]) -> List[List[int]]:
    """The parameters (indices into ``pieces``) of each segment."""
    if not pieces:
        return []
    if limit is None:
        return [list(range(len(pieces)))]
    return plan_buckets([(0, n) for _, n in pieces], limit)


def plan_segments(pieces: List[Tuple[int, int]], limit: Optional[int]) -> List[int]:
    """Segment sizes (elements per shard) of a module whose parameters have ``pieces``."""
    return [sum(pieces[i][0] for i in b) for b in plan_indices(pieces, limit)]
