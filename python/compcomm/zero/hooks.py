"""ZeRO stage 2/3's gradient hooks.

Each parameter's post-accumulate hook hands its gradient to the staging (:mod:`.grad_reducer`) as
soon as autograd has accumulated it, and frees ``p.grad``; a complete bucket is launched in its turn
of the launch order. The first hook of a backward queues a callback on autograd's engine (as DDP's
reducer does) that runs when that backward ends: it launches the buckets still waiting, so every
rank issues the same collectives whichever parameters its backward reached. The backward passes
since the last ``step()`` are counted (:attr:`GradHooks.micro`): the 1-bit exchanges of an
overlapped step go in the last of ``gradient_accumulation_steps`` micro-steps.
"""

from __future__ import annotations

import functools
from typing import Any, List

import torch

__all__ = ["GradHooks"]


class GradHooks:
    """The hooks of a ZeroOptimizer (``owner``) on its parameters."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        #: backward passes ended since the last step (see :meth:`new_step`)
        self.micro = 0
        self._queued = False  # this backward's end-of-backward callback is queued
        self._handles: List[Any] = [
            p.register_post_accumulate_grad_hook(functools.partial(self.grad_ready, gi, ti))
            for gi, grp in enumerate(owner.groups) for ti, p in enumerate(grp.params)]

    def grad_ready(self, gi: int, ti: int, p: torch.Tensor) -> None:
        z = self.owner
        if p.grad is None or z.local_phase:  # local phase: gradients stay whole and local
            return
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.backward_done)
            self._queued = True
        bi = z.groups[gi].tensors[ti].bucket
        if z._onebit is not None:
            z._onebit.check_open(gi, bi)
        onebit = z.phase.compressed
        complete = z._grads.accumulate(gi, ti, p.grad, onebit, z._keep_pool)
        p.grad = None
        if complete:
            if not onebit:
                z._grads.ready(gi, bi, z._grads.submit)
            elif z._onebit is not None:  # staged: compressed in step(), or now if overlapping
                z._onebit.bucket_complete(gi, bi, last=self.micro == z.gas - 1)
        if z._stage3 is not None:
            z._stage3.after_grad(p)

    def backward_done(self) -> None:
        """The end of a backward that reached the owner's parameters: the buckets not launched yet
        go, in the launch order (:mod:`.grad_reducer`)."""
        z = self.owner
        self._queued = False
        self.micro += 1
        if z.local_phase:
            return
        if not z.phase.compressed:
            z._grads.launch_rest(z._grads.submit)
        elif z._onebit is not None:
            z._onebit.backward_done(last=self.micro == z.gas)

    def new_step(self) -> None:
        """step() or zero_grad(): micro-steps count from 0 again. A backward that raised never
        ran its callback (autograd drops it with the failed graph): the next one queues its own."""
        self.micro = 0
        self._queued = False

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
