"""FSDP2's own HSDP (a 2-D ``("replicate", "shard")`` device mesh) for
:func:`compcomm.fsdp.onebit`'s local-momentum mode.

Why this touches FSDP's internals. On a 2-D mesh FSDP reduce-scatters over the shard dim and then
*always* all-reduces the shard over the replicate dim itself, in full precision, before it runs
the user's all-reduce hook (torch's ``foreach_reduce``: ``dist.all_reduce`` whenever the parameter
group's mesh info is a ``DDPMeshInfo``); the hook cannot replace that all-reduce, and
``set_requires_all_reduce(False)`` skips the hook and the gradient too. So :func:`take_replicas`
gives each of the module's parameter groups a 1-D ``FSDPMeshInfo`` of the same mesh and shard dim:
FSDP then reduce-scatters over the shard group only (its divide factors as on a 1-D mesh of the
shard group) and hands the shard to the hook, which does the replicas' reduction -- the same path
as HSDP by hand (``replicate_group`` with a 1-D shard mesh). The parameters' own DTensor layout
(the 2-D mesh, ``(Replicate(), Shard(0))``), the all-gathers and checkpoints are untouched.

The replicas' reduction keeps FSDP's HSDP semantics: FSDP all-reduces with AVG when it averages
by default and with SUM when a gradient divide factor is set (torch's
``_get_gradient_divide_factors``); with a forced SUM reduction and no factor, its post-division
is the shard group's size here (the world's on the 2-D mesh), so the replicas average.
:func:`replicas_summed` tells which: the warm-up's hook then sums, and in the 1-bit phase the
reduce-scatter scales the gradients by the replicas' count, so that the replicas' average of the
momenta is FSDP's sum (the seed, the optimizer's ``exp_avg``, fits as it is).
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch.distributed as dist

from .errors import UnsupportedError
from .fsdp_layout import shard_params, shard_size

__all__ = ["check_onebit", "check_one_group", "taken", "local_default", "check_replicas",
           "take_replicas", "replicas_summed", "param_groups", "mesh_ndim"]


def param_groups(module: Any) -> List[Any]:
    """FSDP's parameter groups of FSDP2 module ``module`` (torch 2.13 keeps a list; earlier
    versions one group or None). No broad ``except``: a torch whose internals differ must fail
    loudly here, not be taken for a model without a 2-D mesh (its replicas would then never be
    reduced)."""
    st = module._get_fsdp_state()
    groups = getattr(st, "_fsdp_param_groups", None)
    if groups is None:
        groups = [st._fsdp_param_group]
    return [g for g in groups if g is not None]


def check_one_group(mods: List[Tuple[str, Any]], call: str) -> None:
    """FSDP2's custom reduce-scatter, all-gather and all-reduce hook refuse a module of several
    parameter groups (a per-parameter mesh, ``shard_placement_fn``): ValueError naming the first
    such module of ``mods`` (name, module), before ``call`` installs anything on any of them."""
    for name, m in mods:
        n = len(param_groups(m))
        if n > 1:
            rank = dist.get_rank() if dist.is_initialized() else 0
            raise ValueError(f"[rank {rank}] {call}: argument 'model': module {name!r} has {n} "
                             "FSDP parameter groups (a per-parameter mesh from shard_placement_fn);"
                             " compcomm's hooks take one per module (nothing was installed)")


def mesh_ndim(module: Any) -> int:
    """The dimensions of the device mesh FSDP2 module ``module`` is sharded over (the largest of
    its parameter groups'; 1 without parameters)."""
    return max([int(g.mesh_info.mesh.ndim) for g in param_groups(module)] or [1])


def _replicas_of(mi: Any) -> Optional[Any]:
    """The replicate group of a 2-D mesh info: FSDP's own, or one :func:`take_replicas` took."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo

    if isinstance(mi, HSDPMeshInfo):
        return mi.replicate_process_group
    return getattr(mi, "compcomm_replicas", None)


def taken(module: Any) -> bool:
    """Whether :func:`take_replicas` turned FSDP's own replica all-reduce off on ``module`` (a
    local-momentum state was installed on it before)."""
    return any(getattr(pg.mesh_info, "compcomm_replicas", None) is not None
               for pg in param_groups(module))


def check_onebit(mods: List[Tuple[str, Any]], mode: str, hsdp: bool,
                 replicate_group: Any) -> Tuple[Optional[Any], List[Any]]:
    """``onebit``'s checks of meshes and modes, before it changes anything: :func:`check_replicas`
    in the local-momentum mode on a 2-D mesh (``hsdp``), else ``(None, [])``.

    Raises
    ------
    UnsupportedError
        ``mode="momentum"`` on a 2-D mesh; another mode than the local-momentum one on a model
        that had it on its 2-D mesh (FSDP's replica all-reduce is off there); the local-momentum
        mode with ``replicate_group`` on a shard group of one rank (FSDP then makes no
        reduce-scatter call to carry the momentum); :func:`check_replicas`'s.
    ValueError
        ``replicate_group`` with a 2-D mesh in the local-momentum mode.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    tag = f"[rank {rank}] compcomm.fsdp.onebit(mode={mode!r})"
    if mode == "momentum" and hsdp:
        raise UnsupportedError(f"{tag}: not implemented on a 2-D (HSDP) device mesh; use "
                               "mode='local_momentum'", "onebit", "fsdp")
    if hsdp and mode != "local_momentum" and any(taken(m) for _, m in mods):
        raise UnsupportedError(f"{tag}: the model had mode='local_momentum' on its 2-D mesh "
                               "(FSDP's own replica all-reduce is off there): use "
                               "mode='local_momentum'", "onebit", "fsdp")
    if mode == "local_momentum" and hsdp and replicate_group is not None:
        raise ValueError(f"{tag}: argument 'replicate_group' with a model sharded over a 2-D "
                         "(HSDP) mesh: the mesh's replicate dim is the replica group; pass one "
                         "or the other")
    if mode == "local_momentum" and replicate_group is not None:
        for name, m in mods:
            if any(shard_size(p) == 1 for p, _, _ in shard_params(m)):
                raise UnsupportedError(f"{tag}: module {name!r} is sharded over one rank (its "
                                       "shard group): nothing carries the local momentum; use "
                                       "mode='gradient'", "onebit", "fsdp")
    if mode == "local_momentum" and hsdp:
        replicas, groups = check_replicas(mods, mode)
        if replicas is None or not groups:  # never 1-D rules on a 2-D mesh: replicas unreduced
            raise UnsupportedError(f"{tag}: found no replicate group on the model's 2-D mesh "
                                   "(this torch's FSDP internals differ?)", "onebit", "fsdp")
        return replicas, groups
    return None, []


def local_default(mods: List[Tuple[str, Any]]) -> bool:
    """Whether ``onebit``'s default on these modules is the local-momentum mode: some are on a 2-D
    mesh and :func:`check_replicas` accepts them all (a shard dim of size 1 keeps the gradient
    mode, the default before)."""
    try:
        replicas, _ = check_replicas(mods, "local_momentum")
    except UnsupportedError:
        return False
    return replicas is not None


def check_replicas(mods: List[Tuple[str, Any]], mode: str) -> Tuple[Optional[Any], List[Any]]:
    """The replicate group of the modules of ``mods`` (``(name, module)``) sharded over a 2-D
    mesh (None when no module is on one) and their parameter groups, for :func:`take_replicas`;
    changes nothing.

    Raises
    ------
    UnsupportedError
        A mesh that is not exactly ``(replicate, shard)`` (more dims, e.g. with tensor
        parallelism), a shard dim of size 1 (FSDP then makes no reduce-scatter call to carry the
        local momentum), modules on different replicate groups or some on a 1-D mesh, or a module
        with several parameter groups. Nothing is changed then.
    """
    tag = f"compcomm.fsdp.onebit(mode={mode!r})"
    rank = dist.get_rank() if dist.is_initialized() else 0
    found, replicas, flat = [], None, None
    for name, m in mods:
        groups = param_groups(m)
        hsdp = [pg for pg in groups if _replicas_of(pg.mesh_info) is not None]
        if not hsdp:
            flat = flat or (name if groups else None)  # a module with parameters on a 1-D mesh
            continue
        if len(groups) > 1:
            raise UnsupportedError(f"[rank {rank}] {tag}: module {name!r} has {len(groups)} "
                                   "parameter groups on a 2-D mesh (one is supported)", "onebit",
                                   "fsdp")
        mi = hsdp[0].mesh_info
        if mi.mesh.ndim != 2 or getattr(mi, "dp_mesh_dims", None) is not None:
            raise UnsupportedError(f"[rank {rank}] {tag}: argument 'model': module {name!r} is "
                                   f"sharded over a {mi.mesh.ndim}-D mesh with other dims; only "
                                   "FSDP's 2-D (replicate, shard) HSDP mesh is supported",
                                   "onebit", "fsdp")
        if mi.shard_mesh_size < 2:
            raise UnsupportedError(f"[rank {rank}] {tag}: argument 'model': module {name!r} has a "
                                   "shard dim of size 1 on its 2-D mesh (FSDP makes no reduce-"
                                   "scatter call to carry the local momentum): use a 1-D mesh "
                                   "(DDP-like) or mode='gradient'", "onebit", "fsdp")
        rep = _replicas_of(mi)
        if replicas is not None and dist.get_process_group_ranks(rep) != \
                dist.get_process_group_ranks(replicas):
            raise UnsupportedError(f"[rank {rank}] {tag}: argument 'model': module {name!r} has "
                                   "another replicate group than the modules before it", "onebit",
                                   "fsdp")
        replicas = rep if replicas is None else replicas
        found.append(hsdp[0])
    if found and flat is not None:  # its shard would be averaged over the replicas once more
        raise UnsupportedError(f"[rank {rank}] {tag}: argument 'model': module {flat!r} is on a "
                               "1-D mesh, others on a 2-D (HSDP) mesh: shard them all over one "
                               "mesh", "onebit", "fsdp")
    return replicas, found


def take_replicas(groups: List[Any]) -> None:
    """Turn FSDP's own replica all-reduce off on the parameter groups :func:`check_replicas`
    returned: each gets a 1-D mesh info of its mesh's shard dim (see the module docstring)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

    for pg in groups:
        mi = pg.mesh_info
        if getattr(mi, "compcomm_replicas", None) is not None:  # installed before: already off
            continue
        flat = FSDPMeshInfo(mesh=mi.mesh, shard_mesh_dim=mi.shard_mesh_dim)
        flat.reduce_scatter_process_group = mi.reduce_scatter_process_group
        flat.compcomm_replicas = mi.replicate_process_group  # type: ignore[attr-defined]
        if pg.post_forward_mesh_info is mi:  # reshard_after_forward=True: the same mesh info
            pg.post_forward_mesh_info = flat  # (else FSDP would see a post-forward mesh of its own)
        pg.mesh_info = flat


def replicas_summed(module: Any) -> bool:
    """Whether FSDP's HSDP would *sum* the replicas' shards (a gradient divide factor is set:
    FSDP all-reduces with SUM) rather than average them (its default, or a forced SUM reduction
    that post-divides by the shard group's size)."""
    return any(pg.gradient_divide_factor is not None for pg in param_groups(module))
