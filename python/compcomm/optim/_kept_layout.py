"""The checked layout of an optimizer step whose kernels take raw pointers, kept between steps.

A 1-bit optimizer's kernel step runs over every parameter at once, and at ~150 tensors the Python
that checks what the kernels take on trust (dtype, device, contiguity and size of the weights,
moments and gradients) cost about as much as the kernels themselves on a GPU. The state does not
change between steps, so :class:`KeptLayout` keeps what the full check accepted and re-checks at
each step only what can change cheaply: the gradients (new tensors every step), and that each
state tensor is still the one in the state dict at the same address, size, dtype and layout. It
also holds their storages, so an address cannot be reused by another allocation while the layout
is kept: an unchanged address is the memory the full check accepted.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["KeptLayout", "Entry"]

#: what the full check accepted for one parameter: its state dict; ``(key, tensor)`` pairs that
#: must still be ``state[key]``; the tensors whose addresses the kernels get (the fp32 weight
#: first: ``p`` itself or its master copy); the element count; the gradient's dtype
Entry = Tuple[Dict[str, Any], Tuple[Tuple[str, torch.Tensor], ...], Tuple[torch.Tensor, ...], int,
              torch.dtype]
Group = Dict[str, Any]


def _signature(t: torch.Tensor) -> Tuple[int, int, torch.dtype, bool]:
    """What a kernel takes on trust of a tensor it gets as a pointer (``resize_``, ``set_`` or
    ``.data = view`` may change any of it at the same address)."""
    return t.data_ptr(), t.numel(), t.dtype, t.is_contiguous()


class KeptLayout:
    """What one full check of an optimizer's kernel step accepted, and its per-step re-check.

    Parameters
    ----------
    opt : torch.optim.Optimizer
        The optimizer (its ``state`` and ``param_groups`` at the time of the check).
    groups : list of (group, [(param, Entry or None)])
        Every parameter of every group in order; None for one the step skips (no gradient or
        no elements).
    usable : callable
        ``usable(group)``: the per-group conditions that may change between steps (a mask set,
        kernels switched off), checked at every step.
    payloads : list
        One per group: what the caller keeps for it (its lists of state tensors), returned with
        the group's gradients.
    """

    def __init__(self, opt: torch.optim.Optimizer,
                 groups: Sequence[Tuple[Group, List[Tuple[torch.Tensor, Optional[Entry]]]]],
                 usable: Callable[[Group], bool], payloads: Sequence[Any]) -> None:
        self._state = opt.state
        self._usable = usable
        self._groups = []
        keep = []
        for (group, items), payload in zip(groups, payloads):
            entries = [e for _, e in items]
            # per parameter its size; per kept tensor its address, size, dtype and contiguity
            sigs = [(p.numel(), None if e is None else tuple(_signature(t) for t in e[2]))
                    for p, e in items]
            keep += [t.untyped_storage() for e in entries if e is not None for t in e[2]]
            self._groups.append((group, [p for p, _ in items], entries, sigs, payload))
        self._keep = keep  # the storages: their addresses stay theirs while the layout is kept
        self._device = next((e[2][0].get_device() for _, items in groups for _, e in items if e),
                            -1)  # -1: the CPU

    def runs(self, opt: torch.optim.Optimizer, launch_check: Callable[[List[torch.Tensor]], Any]
             ) -> Optional[Tuple[List[Tuple[Group, Any, List[torch.Tensor]]], Any]]:
        """``([(group, payload, gradients)], launch_check(all gradients))`` for this step
        (groups with a gradient), or None where anything changed (a parameter, a gradient's
        dtype, layout, size or device, a parameter or state tensor replaced, moved, resized or
        re-viewed, a group no longer usable): then nothing was written and the caller checks
        from scratch. The gradients' check is launched between the gradients' and the state's
        checks, so a GPU runs it while the host checks the state."""
        if opt.state is not self._state or len(opt.param_groups) != len(self._groups):
            return None
        dev, state = self._device, self._state
        gss: List[List[torch.Tensor]] = []
        for group, (g0, params, entries, sigs, _) in zip(opt.param_groups, self._groups):
            if group is not g0 or len(group["params"]) != len(params) or not self._usable(group):
                return None
            gs = []
            for p, p0, e, (n, _) in zip(group["params"], params, entries, sigs):
                g = p.grad
                if p is not p0 or p.numel() != n:
                    return None
                if e is None:
                    if g is not None and n:
                        return None
                    continue
                if (g is None or g.dtype is not e[4] or not g.is_contiguous()
                        or g.numel() != e[3] or g.get_device() != dev):
                    return None
                gs.append(g)
            gss.append(gs)
        verdict = launch_check([g for gs in gss for g in gs])
        out = []
        for gs, (group, params, entries, sigs, payload) in zip(gss, self._groups):
            for p, e, (_, sig) in zip(params, entries, sigs):
                if e is None:
                    continue
                st = e[0]
                if state.get(p) is not st:
                    return None
                for key, t in e[1]:
                    if st.get(key) is not t:
                        return None
                for t, kept in zip(e[2], sig):
                    if _signature(t) != kept:
                        return None
            if gs:
                out.append((group, payload, gs))
        return out, verdict
