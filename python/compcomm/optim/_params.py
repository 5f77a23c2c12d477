"""Per-parameter optimizer state of the 1-bit optimizers: fp32 master copies of low-precision
parameters, the moments, and the groups' ``exp_avg_mask`` on the right device."""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .functional import masked_

__all__ = ["master", "write_back", "write_back_multi", "moments", "group_mask", "mask_",
           "group_chunks", "has_grads", "match_state_shapes", "CHUNK_ELEMENTS"]

#: Most elements per list of a multi-tensor update (bounds its temporaries: 4 x 256 MiB fp32).
CHUNK_ELEMENTS = 1 << 26


def master(p: torch.Tensor, state: Dict[str, Any]) -> torch.Tensor:
    """The fp32 tensor the update is applied to: ``p`` itself if fp32, else a kept fp32 copy."""
    if p.dtype == torch.float32:
        return p.data
    m = state.get("master_param")
    if m is None:
        m = p.detach().to(torch.float32).clone()
        state["master_param"] = m
    return m


def write_back(p: torch.Tensor, state: Dict[str, Any]) -> None:
    """Copy the fp32 master copy into a low-precision ``p`` (round to nearest)."""
    if p.dtype != torch.float32:
        p.data.copy_(state["master_param"])


def write_back_multi(ps: Sequence[torch.Tensor], states: Sequence[Dict[str, Any]]) -> None:
    """:func:`write_back` over lists (one multi-tensor copy for the low-precision parameters)."""
    low = [(p.data, s["master_param"]) for p, s in zip(ps, states) if p.dtype != torch.float32]
    if low:
        torch._foreach_copy_([d for d, _ in low], [m for _, m in low])


def group_chunks(items: Sequence[Tuple[Any, ...]], limit: int = CHUNK_ELEMENTS
                 ) -> Iterator[Tuple[Dict[str, Any], List[Tuple[Any, ...]]]]:
    """``items`` (tuples ``(group, parameter, ...)``) cut into runs of one group's parameters on one
    device, at most ``limit`` elements each (a larger parameter alone): yields ``(group, run)``,
    the lists a multi-tensor update takes."""
    run: List[Tuple[Any, ...]] = []
    key: Any = None
    count = 0
    for item in items:
        group, p = item[0], item[1]
        k = (id(group), p.device)
        if run and (k != key or count + p.numel() > limit):
            yield run[0][0], run
            run, count = [], 0
        key = k
        run.append(item)
        count += p.numel()
    if run:
        yield run[0][0], run


def group_mask(group: Dict[str, Any], like: torch.Tensor) -> Optional[torch.Tensor]:
    """The group's ``exp_avg_mask`` on ``like``'s device and dtype (moved once, kept in the
    group), or None."""
    mask = group.get("exp_avg_mask")
    if mask is not None and (mask.device != like.device or mask.dtype != like.dtype):
        mask = mask.to(device=like.device, dtype=like.dtype)
        group["exp_avg_mask"] = mask
    return mask


def mask_(t: torch.Tensor, group: Dict[str, Any]) -> None:
    """Multiply ``t`` by the group's ``exp_avg_mask`` (moved to ``t``'s device once)."""
    masked_(t, group_mask(group, t))


def moments(p: torch.Tensor, state: Dict[str, Any]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``p``'s fp32 first and second moments (``exp_avg``, ``exp_avg_sq``), zeros on first use."""
    if "exp_avg" not in state:
        state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
    return state["exp_avg"], state["exp_avg_sq"]


def match_state_shapes(state: Dict[Any, Dict[str, Any]], param_groups: List[Dict[str, Any]],
                       who: str) -> None:
    """A parameter whose ``.data`` was replaced by a tensor of another shape since its state was
    made: with as many elements, its per-element state is viewed in the new shape (read in memory
    order, as the one-pass kernels read it); with another number, ValueError naming the parameter
    (``who``: "[rank r] Optimizer.step"), before the caller writes anything."""
    for gi, group in enumerate(param_groups):
        for i, p in enumerate(group["params"]):
            st = state.get(p)  # not state[p]: a defaultdict would grow an entry
            m = st.get("exp_avg") if st else None
            if m is None or m.shape == p.shape:
                continue
            if m.numel() != p.numel():
                raise ValueError(
                    f"{who}: param_groups[{gi}]['params'][{i}] has shape {tuple(p.shape)} but its "
                    f"optimizer state was made for {tuple(m.shape)} (its .data was replaced); "
                    "nothing was changed: give it a fresh state (del optimizer.state[p]) or load "
                    "a checkpoint")
            old = m.shape
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.shape == old:
                    st[k] = v.view(p.shape)


def has_grads(param_groups: List[Dict[str, Any]]) -> Tuple[bool, ...]:
    """Which parameters have a gradient (the ranks must agree on it)."""
    return tuple(p.grad is not None for g in param_groups for p in g["params"])
