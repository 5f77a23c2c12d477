"""ZeRO stage 2/3's gradient hooks.

Each parameter's post-accumulate hook hands its gradient to the staging (:mod:`.grad_reducer`) as
soon as autograd has accumulated it, and frees ``p.grad``; a complete bucket is launched in its turn
of the launch order. The first hook of a backward queues a callback on autograd's engine (as DDP's
reducer does) that runs when that backward ends: it launches the buckets still waiting, so every
rank issues the same collectives whichever parameters its backward reached. A backward nested in
a node of the user's (reentrant activation checkpointing recomputes a segment and runs its own
backward) is not the end: its callback moves the wait to the outer backward, through a hook on
that node. The backward passes
since the last ``step()`` are counted (:attr:`GradHooks.micro`): the 1-bit exchanges of an
overlapped step go in the last of ``gradient_accumulation_steps`` micro-steps.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, List

import torch

from .rules import Phase

__all__ = ["GradHooks"]


class GradHooks:
    """Post-accumulate hooks on every parameter of ``groups``.

    ``grads`` stages the gradients; ``onebit`` (a :class:`.onebit_reducer.OneBitReducer` or None)
    exchanges them in 1-bit steps; ``stage3`` (a :class:`.param_gather.ParamGatherer` or None)
    frees the gathered parameters; ``phase()`` is the owner's :attr:`ZeroOptimizer.phase`.
    """

    def __init__(self, groups: List[Any], grads: Any, onebit: Any, stage3: Any, keep_pool: bool,
                 gas: int, phase: Callable[[], Phase]) -> None:
        self.groups, self.grads, self.onebit, self.stage3 = groups, grads, onebit, stage3
        self.keep_pool, self.gas, self.phase = keep_pool, gas, phase
        #: backward passes ended since the last step (see :meth:`new_step`)
        self.micro = 0
        self._queued: set = set()  # autograd graph tasks whose end-of-backward callback is queued
        self._handles: List[Any] = [
            p.register_post_accumulate_grad_hook(functools.partial(self.grad_ready, gi, ti))
            for gi, grp in enumerate(groups) for ti, p in enumerate(grp.params)]

    def grad_ready(self, gi: int, ti: int, p: torch.Tensor) -> None:
        phase = self.phase()
        if p.grad is None or phase is Phase.LOCAL:  # local phase: gradients stay whole and local
            return
        self._queue_end()
        bi = self.groups[gi].tensors[ti].bucket
        if self.onebit is not None:
            self.onebit.check_open(gi, bi)
        complete = self.grads.accumulate(gi, ti, p.grad, phase.compressed, self.keep_pool)
        p.grad = None
        if complete:
            if not phase.compressed:
                self.grads.ready(gi, bi, self.grads.submit)
            elif self.onebit is not None:  # staged: compressed in step(), or now if overlapping
                self.onebit.bucket_complete(gi, bi, last=self.micro == self.gas - 1)
        if self.stage3 is not None:
            self.stage3.after_grad(p)

    def _queue_end(self) -> None:
        """Queue :meth:`backward_done` on the running backward (autograd graph task), once."""
        task = _graph_task()
        if task not in self._queued:
            self._queued.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(self.backward_done)

    def backward_done(self) -> None:
        """The end of a backward that reached the parameters: the buckets not launched yet go, in
        the launch order (:mod:`.grad_reducer`)."""
        self._queued.discard(_graph_task())
        node = _running_node()
        if node is not None:  # a nested backward ended inside this node of an outer one
            handles = []

            def outer_goes_on(*_: Any) -> None:  # runs in the outer backward once node is done
                handles.pop().remove()
                self._queue_end()

            handles.append(node.register_hook(outer_goes_on))
            return
        self.micro += 1
        phase = self.phase()
        if phase is Phase.LOCAL:
            return
        if not phase.compressed:
            self.grads.launch_rest(self.grads.submit)
        elif self.onebit is not None:
            self.onebit.backward_done(last=self.micro == self.gas)

    def new_step(self) -> None:
        """step() or zero_grad(): micro-steps count from 0 again. A backward that raised never
        ran its callback (autograd drops it with the failed graph): the next one queues its own."""
        self.micro = 0
        self._queued.clear()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _graph_task() -> int:
    """The running backward's id (torch's own; -1 outside one or on a torch without it)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task() if task is not None else -1


def _running_node() -> Any:
    """The autograd node whose execution a backward's end-of-backward callback runs inside
    (reentrant checkpointing), or None for a backward of its own."""
    node = getattr(torch._C, "_current_autograd_node", None)
    return node() if node is not None else None
