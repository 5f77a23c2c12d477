"""Per-parameter optimizer state of the 1-bit optimizers: fp32 master copies of low-precision
parameters, the moments, and the groups' ``exp_avg_mask`` on the right device."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from .functional import masked_

__all__ = ["master", "write_back", "moments", "group_mask", "mask_"]


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
