"""The checks and the agreement behind :meth:`compcomm.fsdp.OneBitFSDP.load_state_dict`.

A state is checked whole before anything is assigned: a missing or malformed entry raises
ValueError naming its key, and nothing has changed. Whether its buffers are kept (saved on this
rank, world size and replica split) is then agreed by every rank: when every rank loads rank 0's
file, rank 0 alone would keep its momentum while its peers reset and re-seed theirs with an
all-gather that rank 0 does not make -- different collectives at the next step.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["check_state", "all_true"]


def check_state(sd: Any, mode: str, segment_elements: Optional[int], formats: Sequence[str],
                rank: int) -> Dict[str, int]:
    """``sd``'s step counts, once it is a complete state of ``formats`` saved in ``mode`` with
    ``segment_elements``; else ValueError naming the key (the local-momentum mode's momenta are
    :func:`compcomm.fsdp_local.local_fits`'s)."""
    tag = f"[rank {rank}] compcomm.fsdp: load_state_dict: argument 'sd'"
    fmt = sd.get("format") if isinstance(sd, dict) else None
    if fmt not in formats:
        raise ValueError(f"{tag} is not a state dict of OneBitFSDP (format {formats[0]!r})")
    theirs_mode = sd.get("mode", "gradient")  # formats 1 and 2: the gradient mode
    if theirs_mode != mode:
        raise ValueError(f"{tag} was saved in mode {theirs_mode!r}, this state is in mode "
                         f"{mode!r}")
    theirs = sd.get("segment_elements", -1)  # format 1: one segment per module
    if theirs != (-1 if segment_elements is None else segment_elements):
        theirs = None if theirs == -1 else theirs
        raise ValueError(
            f"{tag} was saved with segment_elements={theirs} (format {fmt!r}), this state has "
            f"segment_elements={segment_elements}: its error buffers do not fit; call "
            f"onebit(..., segment_elements={theirs}) to resume it")
    for key in ("rank", "world", "steps", "errors") + (("momentum",) if mode == "momentum" else ()):
        if key not in sd:
            raise ValueError(f"{tag} lacks {key!r}")
    steps = sd["steps"]
    if not isinstance(steps, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in steps.items()):
        raise ValueError(f"{tag}: 'steps' must map names to counts")
    if not isinstance(sd["errors"], dict) or not all(
            isinstance(v, (list, tuple)) and len(v) == 2
            and all(isinstance(b, torch.Tensor) for b in v) for v in sd["errors"].values()):
        raise ValueError(f"{tag}: 'errors' must map keys to [worker_error, server_error] tensors")
    if mode == "momentum" and not (isinstance(sd["momentum"], dict) and all(
            isinstance(d, dict) and all(isinstance(d.get(t), torch.Tensor) and d[t].numel() > 0
                                        for t in ("signs", "scales"))
            for d in sd["momentum"].values())):
        raise ValueError(f"{tag}: 'momentum' must map keys to non-empty 'signs' and 'scales' "
                         "tensors")
    return steps


def all_true(flags: List[bool]) -> List[bool]:
    """Each flag true only where it is true on every rank of the default group (one all-reduce
    of a few ints; nothing without a process group). Every rank must call it."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [bool(f) for f in flags]
    dev = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return [bool(v) for v in t.tolist()]
