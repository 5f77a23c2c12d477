"""Backward overlap of the 1-bit optimizers' compressed phase (``overlap_backward=True``).

How it works. Without overlap the optimizer communicates only inside ``step()``: every bucket's
momentum ``b1 m + (1 - b1) g`` is staged, then all buckets travel in one batched exchange, after
the backward has finished. With overlap, the buckets of the step's bucket plan (the same plan, the
same buckets) are cut into a few *groups*, walking the plan from its end, because a backward
produces the gradients of the last-registered parameters first. A hook on every parameter
(``Tensor.register_post_accumulate_grad_hook``) counts the parameters of each group whose gradient
is complete; when a group's count reaches zero, the hook stages that group's momenta and queues
its batched exchange on the communicator's worker thread (on a CUDA device: on a side stream that
waits for the backward's current stream), and the backward goes on while the group is on the
wire. ``step()`` waits for the exchanges, the ranks agree (one 32-byte all-gather) on what was
sent, and the buckets are committed in one commit -- or, if anything speaks against it, nothing
is committed and the step runs the ordinary path on the full gradients. The exchanges write only
their workspaces, so a discarded one leaves no trace; results are bit for bit those of the
ordinary path (same buckets, same kernels, each bucket's compression independent of the others).

When the launched exchanges are discarded (the step then exchanges everything itself):

* a parameter's hook fires a second time after its group was sent (gradient accumulation: several
  backward passes before one step), or a sent gradient changed afterwards (its tensor replaced or
  written in place, e.g. clipped): the overlap then switches itself off for later steps, with one
  warning, since it would discard every step;
* GradScaler's scaled gradients (the scale is known only at ``step()``): switched off likewise;
* the parameters with gradients changed (the bucket plan changes, as without overlap);
* the step is skipped (GradScaler found Inf/NaN).

The ranks decide alike: the hooks fire in the same order on every rank of an SPMD program, and the
agreement all-gather checks it (groups sent, their order, both flags above). If they differ anyway,
every rank raises RankMismatchError and nothing is written. A hook that fails (say, out of memory
while staging) records its error, sends an empty batch in place of its group so that every rank's
exchange of that group fails alike, and lets the backward finish; ``step()`` then raises the error
on that rank and RankMismatchError naming it on the others, nothing written. Ranks whose programs
diverge further (one rank's hooks fire, another's do not) meet collectives of other kinds and raise
RankMismatchError, or wait until the collective timeout (CommTimeoutError); never a silent result.

Group granularity: each group costs one batched exchange (four collectives, and on a GPU two host
synchronisations of the worker thread), paid in latency, while the backward can hide a group's
wire time only if the group is sent early. Groups of at least :data:`GROUP_ELEMENTS` elements
(16 MiB of fp32 momentum, ~1 MiB on the wire per rank) and at most about :data:`MAX_GROUPS` of them
keep the added latency to a few collectives per step, and the first group leaves after about a
quarter of the backward.
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from .._agree import agree_layout, digest
from ..errors import NonFiniteError, RankMismatchError
from ._grads import fp32_grad

__all__ = ["BackwardOverlap", "GROUP_ELEMENTS", "MAX_GROUPS", "plan_groups", "resolve_overlap"]

#: Fewest elements in a group of buckets sent from the backward (the last group may have fewer).
GROUP_ELEMENTS = 1 << 22
#: Groups per plan, about: larger models get larger groups. Measured on the H200 (124M GPT, W=4,
#: 2026-12-02, bench/results/gpu_1202c): 8 groups 1.14x faster at 1 Gbit but 0.74x at 10 Gbit
#: (each group's collectives and host synchronisations), 4 groups 1.09x and 1.08x, 2 groups 1.04x
#: and 1.05x, each against the step without overlap in the same run.
MAX_GROUPS = 4


class _Group:
    """Buckets sent together: their indices in the plan, sizes, device and fill entries."""

    def __init__(self, plan: Any, buckets: List[int]) -> None:
        self.buckets = buckets
        self.numels = [plan.flats[b].numel() for b in buckets]
        self.device = plan.devices[buckets[0]]
        self.flats = [plan.flats[b] for b in buckets]
        self.entries = [e for b in buckets for e in plan.entries[b]]


def resolve_overlap(name: str, value: Any, param_groups: List[Dict[str, Any]]) -> bool:
    """An optimizer's ``overlap_backward`` argument as a bool: True, False, or ``'auto'`` (True
    where the first parameter is on a CUDA device). Anything else raises, naming the argument."""
    if isinstance(value, bool):
        return value
    if value == "auto":
        first = next((p for g in param_groups for p in g["params"]), None)
        return first is not None and first.device.type == "cuda"
    raise ValueError(f"{name}: argument 'overlap_backward' must be True, False or 'auto', got "
                     f"{value!r}")


def plan_groups(plan: Any) -> List[_Group]:
    """The groups of a staged bucket plan (:class:`compcomm.optim._staging.StagedPlan`): the
    buckets from the last to the first, cut where a group reaches its size or the device changes."""
    total = sum(f.numel() for f in plan.flats)
    target = max(GROUP_ELEMENTS, -(-total // MAX_GROUPS))
    cuts: List[List[int]] = []
    count = 0
    for b in reversed(range(len(plan.flats))):
        if not cuts or count >= target or plan.devices[b] != plan.devices[cuts[-1][0]]:
            cuts.append([])
            count = 0
        cuts[-1].append(b)
        count += plan.flats[b].numel()
    return [_Group(plan, c) for c in cuts]


class _Round:
    """What one backward (until the coming ``step()``) did: the hooks' counts and the launches."""

    def __init__(self, plan: Any, groups: List[_Group], make_fill: Callable[..., Any]) -> None:
        self.plan, self.groups, self.make_fill = plan, groups, make_fill
        self.group_of = {id(p): gi for gi, g in enumerate(groups) for _, p, _ in g.entries}
        self.pending = [len(g.entries) for g in groups]
        self.fired: Dict[int, Tuple[torch.Tensor, Any, int]] = {}  # id(p) -> (p, grad, version)
        self.copies: Dict[int, int] = {}  # id(p) -> writes of unchanged values DDP announced
        self.launches: List[Tuple[int, Any]] = []  # (group index, compressor handle), in order
        self.refired = False
        self.error: Optional[BaseException] = None
        self.streams: Dict[torch.device, Any] = {}


class BackwardOverlap:
    """Sends the groups of a 1-bit optimizer's compressed phase from the backward.

    Parameters
    ----------
    name : str
        The optimizer's name (messages).
    params : iterable of Tensor
        The parameters to hook (those that require gradients).
    compressor : OneBitCompressor
        Must have ``launch_``, ``wait_launched``, ``commit_launched``, ``drop_launched``.
    comm : compcomm Communicator
        The optimizer's (the agreement all-gather runs on it).
    """

    def __init__(self, name: str, params: Iterable[torch.Tensor], compressor: Any,
                 comm: Any) -> None:
        self.name, self.compressor, self.comm = name, compressor, comm
        #: False once switched off (by the user or by :meth:`settle`, with a warning)
        self.enabled = True
        #: steps whose buckets were committed from the exchanges sent in the backward
        self.steps_overlapped = 0
        #: groups whose exchange a backward hook sent (the others were sent by step())
        self.groups_from_backward = 0
        self._lock = threading.Lock()
        self._round: Optional[_Round] = None  # armed for the coming backward
        self._ready: Optional[Tuple[_Round, Optional[BaseException]]] = None  # settled launches
        self._groups: Tuple[Any, List[_Group]] = (None, [])
        self._streams: Dict[torch.device, Any] = {}
        # a side stream only for the core's communicators (native NCCL, MPI), which run on the
        # stream they are given; the torch adapter runs torch's collectives, which order
        # themselves after the worker thread's current stream, so it gets the backward's
        self._side = (type(comm).__module__ == "compcomm._C"
                      and type(comm).__name__ != "Communicator")
        ref = weakref.ref(self)  # the parameters must not keep the optimizer alive

        def hook(p: torch.Tensor) -> None:
            me = ref()
            if me is not None:
                me._on_grad(p)

        handles = [p.register_post_accumulate_grad_hook(hook) for p in params if p.requires_grad]
        # the hooks go with this object (or when it switches itself off), not with the parameters
        self._unhook = weakref.finalize(self, _remove, handles)

    # -- the backward side ----------------------------------------------------------------
    def arm(self, plan: Any, make_fill: Callable[[Dict[torch.Tensor, torch.Tensor]], Any]) -> None:
        """Prepare the coming backward to send the groups of ``plan`` (a staged bucket plan);
        ``make_fill()(grads)`` returns the fill of ``_compressed_average`` over ``{p: fp32 grad}``
        (``make_fill`` is a :class:`weakref.WeakMethod` of the optimizer's)."""
        if not self.enabled:
            return
        if self._groups[0] is not plan:
            self._groups = (plan, plan_groups(plan))
        with self._lock:
            self._round = _Round(plan, self._groups[1], make_fill)

    def _on_grad(self, p: torch.Tensor) -> None:
        with self._lock:
            r = self._round
            if r is None:
                return
            gi = r.group_of.get(id(p))
            if gi is None:  # outside the plan: the plan changes at step(), nothing sent is used
                return
            if id(p) in r.fired:
                r.refired = True
                return
            r.fired[id(p)] = (p, p.grad, p.grad._version)
            r.pending[gi] -= 1
            if r.pending[gi] == 0 and not r.refired:
                self._launch(r, gi)

    def _launch(self, r: _Round, gi: int) -> None:
        g = r.groups[gi]
        try:
            if r.error is not None:
                raise r.error
            stream, before = _current(g.device), None
            with torch.no_grad():
                grads = {p: fp32_grad(p, copy=False) for _, p, _ in g.entries}
                make_fill = r.make_fill()  # a WeakMethod: None once the optimizer is gone
                if make_fill is None:
                    raise RuntimeError("overlap_backward: the optimizer was deleted")
                make_fill(grads)(g.entries)
            if g.device.type == "cuda" and self._side:  # NCCL's kernels must not hold up the
                # backward's: on a side stream, after the staging and the buffers launch_ makes
                side = self._streams.get(g.device)
                if side is None:
                    side = self._streams[g.device] = torch.cuda.Stream(g.device)
                r.streams[g.device] = side
                stream = side.cuda_stream
                cur = torch.cuda.current_stream(g.device)
                before = functools.partial(side.wait_stream, cur)
            handle = self.compressor.launch_(g.buckets, g.numels, g.flats, g.device, stream,
                                             before)
            self.groups_from_backward += 1
        except Exception as e:  # noqa: BLE001 -- raised at step(), on every rank
            if r.error is None:
                r.error = e
            try:  # an empty batch: every rank's exchange of this group fails alike
                handle = self.compressor.launch_(g.buckets, g.numels, None, g.device, 0)
            except Exception:  # noqa: BLE001 -- the peers will time out; r.error says why
                return
        r.launches.append((gi, handle))

    def expect_copy(self, params: Iterable[torch.Tensor]) -> None:
        """Each of ``params``' gradients will be written once more in this backward with the
        values it has (DDP copies its bucket back after compcomm.ddp_comm_hook handed it back
        unchanged): not a change. Any other write still is."""
        with self._lock:
            r = self._round
            if r is not None:
                for p in params:
                    r.copies[id(p)] = r.copies.get(id(p), 0) + 1

    # -- the step side -------------------------------------------------------------------
    def settle(self, device: torch.device) -> None:
        """At the start of ``step()`` (before any other collective): wait for the exchanges sent
        from the backward and agree with the other ranks on them. Raises a hook's error (on its
        rank; RankMismatchError on the others) with nothing written; otherwise the launches are
        kept for :meth:`complete` or discarded."""
        self.discard()
        with self._lock:
            r, self._round = self._round, None
        if r is None:
            return
        handles = [h for _, h in r.launches]
        error = self.compressor.wait_launched(handles)
        self._join_streams(r)
        if error is not None and not isinstance(error, (NonFiniteError, RankMismatchError)):
            self.compressor.drop_launched(handles)
            raise error  # a timeout or a lost peer: every rank raises its own
        changed = any(p.grad is not g or g._version != v + r.copies.get(i, 0)
                      for i, (p, g, v) in r.fired.items())
        order = [gi for gi, _ in r.launches]
        fields = [("overlap: groups sent from the backward", len(order), False),
                  ("overlap: the order they were sent in", digest(order), True),
                  ("overlap: a gradient changed after its group was sent",
                   int(r.refired or changed), False),
                  ("overlap: a backward hook failed", int(r.error is not None), False)]
        try:
            agree_layout(self.comm, f"{self.name}.step (overlap_backward)", fields, device)
        except RankMismatchError as mismatch:
            self.compressor.drop_launched(handles)
            if r.error is not None:
                raise r.error from mismatch
            raise
        if r.error is not None:  # every rank failed alike (the empty batches)
            self.compressor.drop_launched(handles)
            raise r.error
        if r.refired or changed:
            self.compressor.drop_launched(handles)
            self.disable("a parameter's gradient was accumulated again or changed after its "
                         "group was sent (gradient accumulation, clipping or another hook)")
            return
        self._ready = (r, error)

    def complete(self, plan: Any, fill: Callable[[List[Any]], None], scaled: bool) -> bool:
        """In the compressed average of ``step()``: if launches for ``plan`` are ready, send the
        groups the backward did not (their gradients came without it), wait, and commit every
        bucket; True then. False where the ordinary path must run (launches discarded)."""
        ready, self._ready = self._ready, None
        if ready is None:
            return False
        r, error = ready
        handles = [h for _, h in r.launches]
        if r.plan is not plan or scaled:
            self.compressor.drop_launched(handles)
            if scaled:
                self.disable("GradScaler scales the gradients until step()")
            return False
        if error is not None:
            self.compressor.drop_launched(handles)
            raise error
        launched = {gi for gi, _ in r.launches}
        failed: Optional[BaseException] = None
        for gi, g in enumerate(r.groups):
            if gi in launched:
                continue
            h = None
            if failed is None:  # a failure here is this rank's alone
                try:
                    fill(g.entries)
                    h = self.compressor.launch_(g.buckets, g.numels, g.flats, g.device,
                                                _current(g.device))
                except Exception as e:  # noqa: BLE001 -- raised below, after the exchanges
                    failed = e
            if h is None:  # empty batches: every rank's exchanges fail alike, in step
                try:
                    h = self.compressor.launch_(g.buckets, g.numels, None, g.device, 0)
                except Exception:  # noqa: BLE001 -- the peers will time out
                    continue
            r.launches.append((gi, h))
        handles = [h for _, h in r.launches]
        error = failed or self.compressor.wait_launched(handles)
        if failed is not None:
            self.compressor.wait_launched(handles)
        if error is not None:
            self.compressor.drop_launched(handles)
            raise error
        by_device: Dict[torch.device, List[Any]] = {}
        for gi, h in r.launches:
            by_device.setdefault(r.groups[gi].device, []).append(h)
        for dev, hs in by_device.items():
            self.compressor.commit_launched(hs, _current(dev))
        self.steps_overlapped += 1
        return True

    def discard(self) -> None:
        """Drop launches that were settled but not used (a skipped or failed step)."""
        ready, self._ready = self._ready, None
        if ready is not None:
            self.compressor.drop_launched([h for _, h in ready[0].launches])

    def cancel(self) -> None:
        """Wait for and drop everything sent from the backward, and disarm (a state dict was
        loaded: the next step runs the ordinary path and arms again)."""
        self.discard()
        with self._lock:
            r, self._round = self._round, None
        if r is not None:
            handles = [h for _, h in r.launches]
            self.compressor.wait_launched(handles)
            self._join_streams(r)
            self.compressor.drop_launched(handles)

    def disable(self, why: str) -> None:
        """Switch the overlap off for good (hooks removed), with one warning saying ``why``."""
        if not self.enabled:
            return
        self.enabled = False
        self._unhook()
        warnings.warn(f"{self.name}: overlap_backward switched off: {why}; every later step "
                      "exchanges its buckets in step() (the results are the same)", RuntimeWarning,
                      stacklevel=4)

    @staticmethod
    def _join_streams(r: _Round) -> None:
        for dev, side in r.streams.items():  # later work (commit, frees) after the exchanges
            torch.cuda.current_stream(dev).wait_stream(side)


def _remove(handles: List[Any]) -> None:
    for h in handles:
        h.remove()


def _current(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
