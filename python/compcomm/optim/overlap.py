"""Backward overlap of the 1-bit optimizers' compressed phase (``overlap_backward``).

How it works. Without overlap the optimizer communicates only inside ``step()``: every bucket's
momentum ``b1 m + (1 - b1) g`` is staged, then all buckets travel in one batched exchange, after
the backward has finished. With overlap, the buckets of the step's bucket plan (the same plan, the
same buckets) are cut into a few *groups*, walking the plan from its end, because a backward
produces the gradients of the last-registered parameters first. A hook on every parameter
(``Tensor.register_post_accumulate_grad_hook``) counts the parameters of each group whose gradient
is complete. Groups leave strictly in plan order: when the next group's count reaches zero, the
hook stages its momenta and queues its batched exchange on the communicator's worker thread (on a
CUDA device with compcomm's own communicators: on a side stream that waits for the backward's
current stream), then the group after it if that one is complete too. ``step()`` stages and
launches the groups still waiting, in the same order, so every rank issues the same sequence of
exchanges whichever hooks fired (DDP's ``find_unused_parameters`` writes gradients without them).
It waits, checks by value that the staged momenta are still those of the current gradients, and
the ranks agree (one 32-byte all-gather: the groups, a hook's failure, and the OR of every rank's
verdict); then the buckets are committed in one commit -- or, if any rank's verdict speaks against
it, nothing is committed on any rank and the step runs the ordinary path on the full gradients.
The exchanges write only their workspaces, so a discarded one leaves no trace; results are bit
for bit those of the ordinary path (same buckets, same kernels, each bucket's compression
independent of the others).

The value check. A gradient can change after its group was sent without a trace in its version
counter (``p.grad.data.mul_``, ``torch._foreach_mul_`` on ``.data``, raw kernels, GradScaler's
``unscale_``). ``step()`` stages each group sent from the backward again from the current
gradients into a scratch buffer and compares it with the momenta sent, bit for bit (integer
views). Exact by construction: it compares the very bits the ordinary path would send, so it can
neither miss a change that matters (no checksum collision) nor take a rewrite of the same values
for a change (DDP's copy back, ``gradient_as_bucket_view``). Its cost is one staging pass and one
compare of what the backward sent, in ``step()``, nothing in the backward; memory: one scratch
buffer of the largest group. A gradient fingerprint taken in the hooks would read less, but a
checksum can collide and a copy costs a gradient's memory.

When the launched exchanges are discarded (the step then exchanges everything itself):

* a parameter's hook fires a second time (gradient accumulation): switched off for later steps
  at once, with one warning, since it would discard every step;
* a staged momentum differs from the current gradients' (clipping, a hook, ``.data`` writes):
  one warning; the second time it happens the overlap switches itself off;
* GradScaler's scaled gradients (the scale is known only at ``step()``): switched off;
* a parameter's gradient is gone (the bucket plan changes, as without overlap);
* the step is skipped (GradScaler found Inf/NaN, non-finite values).

Every rank decides alike: the verdicts are OR-ed in the agreement, so a change on one rank
discards (and counts) on all. A hook that fails (say, out of memory while staging) records its
error, sends an empty batch in place of its group so every rank's exchange of it fails alike, and
lets the backward finish; ``step()`` then raises the error on that rank and RankMismatchError
naming it on the others, nothing written.

Group granularity: each group costs one batched exchange (four collectives, and on a GPU two host
synchronisations of the worker thread), paid in latency, while the backward can hide a group's
wire time only if the group is sent early. Groups of at least :data:`GROUP_ELEMENTS` elements
and at most about :data:`MAX_GROUPS` of them keep the added latency to a few collectives per step.
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

import numpy as np
import torch

from .._agree import agree_layout, digest
from .._comm_users import is_shared, join, recheck, watch
from ..errors import NonFiniteError, RankMismatchError
from ._grads import fp32_grad
from ._overlap_parts import Group, join_streams

__all__ = ["BackwardOverlap", "GROUP_ELEMENTS", "MAX_GROUPS", "plan_groups", "resolve_overlap",
           "auto_safe", "join_streams"]

#: Fewest elements in a group of buckets sent from the backward (the last group may have fewer).
GROUP_ELEMENTS = 1 << 22
#: Groups per plan, about: larger models get larger groups. Measured on the H200 (124M GPT, W=4,
#: 2026-12-02, bench/results/gpu_1202c): 8 groups 1.14x faster at 1 Gbit but 0.74x at 10 Gbit
#: (each group's collectives and host synchronisations), 4 groups 1.09x and 1.08x, 2 groups 1.04x
#: and 1.05x, each against the step without overlap in the same run.
MAX_GROUPS = 4

# the verdict bits the ranks OR in the agreement
_REFIRED, _CHANGED, _INCOMPLETE, _CHECK_FAILED = 1, 2, 4, 8


def auto_safe(comm: Any) -> bool:
    """Whether ``overlap_backward='auto'`` may turn the overlap on over ``comm``: compcomm's native
    NCCL communicator only. It is an NCCL communicator of its own, so the worker thread's exchanges
    never share a queue with torch collectives the user runs on the same process group during the
    backward (plain DDP); over the torch adapter they would, in an order that may differ by rank."""
    return (comm is not None and type(comm).__module__ == "compcomm._C"
            and type(comm).__name__ != "Communicator" and comm.backend_name() == "nccl")


def resolve_overlap(name: str, value: Any, param_groups: List[Dict[str, Any]],
                    comm: Any = None) -> bool:
    """An optimizer's ``overlap_backward`` argument as a bool: True, False, or ``'auto'`` (True
    where the first parameter is on a CUDA device and ``comm`` passes :func:`auto_safe`).
    Anything else raises, naming the argument."""
    if isinstance(value, bool):
        return value
    if value == "auto":
        first = next((p for g in param_groups for p in g["params"]), None)
        return first is not None and first.device.type == "cuda" and auto_safe(comm)
    raise ValueError(f"{name}: argument 'overlap_backward' must be True, False or 'auto', got "
                     f"{value!r}")


def plan_groups(plan: Any) -> List[Group]:
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
    return [Group(plan, c) for c in cuts]


class _Round:
    """What one backward (until the coming ``step()``) did: the hooks' counts and the launches."""

    def __init__(self, plan: Any, groups: List[Group], make_fill: Callable[..., Any]) -> None:
        self.plan, self.groups, self.make_fill = plan, groups, make_fill
        self.group_of = {id(p): gi for gi, g in enumerate(groups) for _, p, _ in g.entries}
        self.pending = [len(g.entries) for g in groups]
        self.fired: Set[int] = set()  # id(p) of the parameters whose hook fired
        self.next = 0  # the next group to launch: groups leave in plan order only
        self.launches: List[Tuple[int, Any]] = []  # (group index, compressor handle), in order
        self.hooked: List[int] = []  # groups a hook staged (the value check redoes them)
        self.refired = False
        self.cancelled = False  # a state was loaded: everything is sent unstaged and dropped
        self.incomplete = False  # a group launched unstaged: a gradient is gone (plan changes)
        self.error: Optional[BaseException] = None
        self.streams: Dict[torch.device, Any] = {}  # side stream per device
        self.users: Dict[torch.device, Dict[int, Any]] = {}  # launching streams per device


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
    warn_shared : bool
        Warn when the overlap is switched off because another compcomm optimizer or compressor
        uses ``comm`` (``overlap_backward=True``; ``'auto'`` is switched off silently).
    """

    def __init__(self, name: str, params: Iterable[torch.Tensor], compressor: Any,
                 comm: Any, warn_shared: bool = False) -> None:
        self.name, self.compressor, self.comm = name, compressor, comm
        #: False once switched off (by the user or by :meth:`settle`, with a warning)
        self.enabled = True
        #: steps whose buckets were committed from the exchanges sent in the backward
        self.steps_overlapped = 0
        #: groups whose exchange a backward hook sent (the others were sent by step())
        self.groups_from_backward = 0
        #: steps whose launches were discarded because a gradient changed after its group was
        #: sent (on any rank); the second switches the overlap off
        self.changed_steps = 0
        self._lock = threading.Lock()
        self._round: Optional[_Round] = None  # armed for the coming backward
        self._ready: Optional[Tuple[_Round, Optional[BaseException]]] = None  # settled launches
        self._groups: Tuple[Any, List[Group]] = (None, [])
        self._streams: Dict[torch.device, Any] = {}
        self._scratch: Dict[torch.device, torch.Tensor] = {}  # the value check's, per device
        self._skip_arm = False  # set by cancel()
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

        self._hook, self._warn_shared = hook, warn_shared
        params = [p for p in params if p.requires_grad]
        self._hooked = {id(p) for p in params}  # arm() hooks the plan's others (added, unfrozen)
        self._handles = [p.register_post_accumulate_grad_hook(hook) for p in params]
        # the hooks go with this object (or when it switches itself off), not with the parameters
        self._unhook = weakref.finalize(self, _remove, self._handles)
        join(comm, compressor)  # (a compressor that is not a OneBitCompressor joins here)
        watch(comm, self)  # shared: arm() switches the overlap off (compcomm._comm_users)

    # -- the backward side ----------------------------------------------------------------
    def arm(self, plan: Any, make_fill: Callable[[Dict[torch.Tensor, torch.Tensor]], Any]) -> None:
        """Prepare the coming backward to send the groups of ``plan`` (a staged bucket plan);
        ``make_fill()(grads)`` returns the fill of ``_compressed_average`` over ``{p: fp32 grad}``
        (``make_fill`` is a :class:`weakref.WeakMethod` of the optimizer's)."""
        if not self.enabled:
            return
        if is_shared(self.comm) and recheck(self.comm):  # (a step: every rank alike)
            self.disable("another compcomm optimizer or compressor uses the same communicator "
                         "(two worker threads must not send on one communicator at once)",
                         warn=self._warn_shared)
            return
        if self._skip_arm:  # the first backward after a state was loaded
            self._skip_arm = False
            return
        if self._groups[0] is not plan:
            self._groups = (plan, plan_groups(plan))
            for g in self._groups[1]:
                for _, p, _ in g.entries:
                    if id(p) not in self._hooked and p.requires_grad:  # (a grad set by hand)
                        self._hooked.add(id(p))
                        self._handles.append(p.register_post_accumulate_grad_hook(self._hook))
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
            r.fired.add(id(p))
            r.pending[gi] -= 1
            # strictly in plan order: a group waits for the ones before it (a gradient written
            # without a hook, e.g. by DDP, holds it and the later ones until step())
            while not (r.refired or r.cancelled) and r.next < len(r.groups) and r.pending[r.next] == 0:
                self._launch(r, r.next, hooked=True)

    def _launch(self, r: _Round, gi: int, hooked: bool = False, stage: bool = True) -> None:
        g = r.groups[gi]
        r.next = gi + 1
        try:
            if r.error is not None:
                raise r.error
            stream, before = _current(g.device), None
            if stage:
                with torch.no_grad():
                    grads = {p: fp32_grad(p, copy=False) for _, p, _ in g.entries}
                    make_fill = r.make_fill()  # a WeakMethod: None once the optimizer is gone
                    if make_fill is None:
                        raise RuntimeError("overlap_backward: the optimizer was deleted")
                    make_fill(grads)(g.entries)
            if g.device.type == "cuda":
                cur = torch.cuda.current_stream(g.device)
                r.users.setdefault(g.device, {})[cur.cuda_stream] = cur
                if self._side:  # NCCL's kernels must not hold up the backward's: on a side
                    # stream, after the staging and the buffers launch_ makes
                    side = self._streams.get(g.device)
                    if side is None:
                        side = self._streams[g.device] = torch.cuda.Stream(g.device)
                    r.streams[g.device] = side
                    stream = side.cuda_stream
                    before = functools.partial(side.wait_stream, cur)
            handle = self.compressor.launch_(g.buckets, g.numels, g.flats, g.device, stream,
                                             before)
            if hooked:
                self.groups_from_backward += 1
            if hooked and stage:
                r.hooked.append(gi)
        except Exception as e:  # noqa: BLE001 -- raised at step(), on every rank
            if r.error is None:
                r.error = e
            try:  # an empty batch: every rank's exchange of this group fails alike
                handle = self.compressor.launch_(g.buckets, g.numels, None, g.device, 0)
            except Exception:  # noqa: BLE001 -- the peers will time out; r.error says why
                return
        r.launches.append((gi, handle))

    def _launch_rest(self, r: _Round, stage: bool = True) -> None:
        """Launch the groups no hook sent, in plan order (every rank then has issued all of
        them): staged from the current gradients, or as they are where a gradient is gone (the
        plan changes; what they carry is dropped) or ``stage`` is False."""
        while r.next < len(r.groups):
            has = all(p.grad is not None for _, p, _ in r.groups[r.next].entries)
            r.incomplete |= stage and not has
            # (after an accumulation everything is dropped anyway: no staging)
            self._launch(r, r.next, stage=stage and has and not r.refired)

    def expect_copy(self, params: Iterable[torch.Tensor]) -> None:
        """Kept for callers of earlier versions (compcomm.ddp_comm_hook): a write of unchanged
        values into the gradients needs no notice, the check at ``step()`` compares values."""

    # -- the step side -------------------------------------------------------------------
    def settle(self, device: torch.device, has_grads: Tuple[bool, ...] = ()) -> None:
        """At the start of ``step()`` (before any other collective): launch the groups no hook
        sent, wait for every exchange, check the staged momenta against the current gradients
        and agree with the other ranks (``has_grads``: which parameters have gradients; a rank
        whose layout was agreed before sends nothing else before it commits). Raises a hook's
        error (on its rank; RankMismatchError on the others) with nothing written; otherwise the
        launches are kept for :meth:`complete` or discarded on every rank alike."""
        self.discard()
        with self._lock:
            r, self._round = self._round, None
        if r is None:
            return
        if r.cancelled:
            self._drain(r)
            return
        self._launch_rest(r)
        handles = [h for _, h in r.launches]
        error = self.compressor.wait_launched(handles)
        self._join_streams(r)
        if error is not None and not isinstance(error, (NonFiniteError, RankMismatchError)):
            self.compressor.drop_launched(handles)
            raise error  # a timeout or a lost peer: every rank raises its own
        # a gradient set to None after its group was sent: the plan changes, as without overlap
        r.incomplete |= any(p.grad is None for gi in r.hooked for _, p, _ in r.groups[gi].entries)
        flags = _REFIRED * r.refired | _INCOMPLETE * r.incomplete
        # a non-finite value sent may have been cleaned since (nan_to_num_): check it too
        if not flags and r.error is None and (error is None or isinstance(error, NonFiniteError)):
            try:
                flags |= _CHANGED * self._changed(r)
            except Exception:  # noqa: BLE001 -- e.g. no memory for the scratch: the ordinary
                self._scratch.clear()  # path still works; switched off on every rank
                flags |= _CHANGED | _CHECK_FAILED
        order = [gi for gi, _ in r.launches]
        fields = [("overlap: groups sent", len(order), False),
                  ("overlap: the order they were sent in", digest(order), True),
                  ("overlap: a backward hook failed", int(r.error is not None), False),
                  ("overlap: which parameters have gradients", digest(has_grads), True)]
        try:
            verdict = agree_layout(self.comm, f"{self.name}.step (overlap_backward)", fields,
                                   device, flags=flags)
        except RankMismatchError as mismatch:
            self.compressor.drop_launched(handles)
            if r.error is not None:
                raise r.error from mismatch
            raise
        if r.error is not None:  # every rank failed alike (the empty batches)
            self.compressor.drop_launched(handles)
            raise r.error
        if verdict:
            self.compressor.drop_launched(handles)
            if verdict & _REFIRED:
                self.disable("a parameter's gradient was accumulated again after its group was "
                             "sent (gradient accumulation)")
            elif verdict & _CHECK_FAILED:
                self.disable("the value check failed on a rank (out of memory?)")
            elif verdict & _CHANGED:
                self.changed_steps += 1
                if self.changed_steps == 1:
                    _warn(f"{self.name}: overlap_backward: a gradient changed after its group was "
                          "sent (clipping, a hook, a write through .data); this step exchanged "
                          "its buckets in step() (the same results); the next time the overlap "
                          "switches itself off")
                else:
                    self.disable("gradients changed after their groups were sent", warn=False)
            return
        self._ready = (r, error)

    def _changed(self, r: _Round) -> bool:
        """Whether a group a hook staged differs, in any bit, from the momenta of the current
        gradients (see the module's "The value check")."""
        make_fill = r.make_fill()
        if make_fill is None:
            raise RuntimeError("overlap_backward: the optimizer was deleted")
        flags = []
        with torch.no_grad():
            for gi in r.hooked:
                g = r.groups[gi]
                staged = g.staged()
                # every output at the address of the one it is compared with, modulo 64 bytes:
                # the kernels then take the same (vector or scalar) path for each element
                shift = (staged.data_ptr() % 64) // 4
                scratch = self._scratch.get(g.device)
                if scratch is None or scratch.numel() < g.numel + 16:
                    need = max(h.numel for h in r.groups if h.device == g.device) + 16
                    scratch = self._scratch[g.device] = torch.empty(
                        need, dtype=torch.float32, device=g.device)
                grads = {p: fp32_grad(p, copy=False) for _, p, _ in g.entries}
                make_fill(grads)(g.scratch_entries(scratch, shift))
                again = scratch[shift:shift + g.numel].view(torch.int32)
                if g.device.type == "cpu":  # numpy's compare: 2x torch.equal's speed here
                    if not np.array_equal(staged.view(torch.int32).numpy(), again.numpy()):
                        return True
                    continue
                flags.append(torch.ne(staged.view(torch.int32), again).any())  # one sync for all
        return bool(torch.stack(flags).any().item()) if flags else False

    def complete(self, plan: Any, scaled: bool) -> bool:
        """In the compressed average of ``step()``: if settled launches for ``plan`` are ready
        (every group was sent by then), commit every bucket; True then. False where the
        ordinary path must run (launches discarded)."""
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
        """A state dict was loaded (local: nothing is sent here): the round the backward started
        is marked cancelled, and the next :meth:`settle` sends the groups no hook sent (unstaged:
        every rank issues every group), waits for everything and drops it; that step runs the
        ordinary path. The backward after that step is not armed either: compcomm.ddp_comm_hook
        checks its buckets again in it, over the optimizer's process group, where exchanges sent
        from the backward over the torch adapter would meet that check in a different order on
        different ranks."""
        self._skip_arm = True
        self.discard()
        with self._lock:
            if self._round is not None:
                self._round.cancelled = True

    def on_shared(self) -> None:
        """Another sender needs this communicator, on every rank alike: another compcomm
        optimizer or compressor joined it (:mod:`compcomm._comm_users`; the next :meth:`arm`
        switches the overlap off if it is still shared), or compcomm.ddp_comm_hook checks a new
        DDP bucket over it. What the backward sent is waited for and dropped now, before the other
        sends (two threads must not issue collectives on one communicator); the step then runs the
        ordinary path."""
        with self._lock:
            r, self._round = self._round, None
        if r is not None:
            self._drain(r)

    def _drain(self, r: _Round) -> None:
        """Send the groups of ``r`` no hook sent, unstaged, wait for every exchange, drop all."""
        self._launch_rest(r, stage=False)
        handles = [h for _, h in r.launches]
        self.compressor.wait_launched(handles)
        self._join_streams(r)
        self.compressor.drop_launched(handles)

    def disable(self, why: str, warn: bool = True) -> None:
        """Switch the overlap off for good (hooks removed), with one warning saying ``why``."""
        if not self.enabled:
            return
        self.enabled = False
        self._unhook()
        self._scratch.clear()
        self._groups = (None, [])  # their value-check entries hold the scratch
        if warn:
            _warn(f"{self.name}: overlap_backward switched off: {why}; every later step "
                  "exchanges its buckets in step() (the results are the same)")

    @staticmethod
    def _join_streams(r: _Round) -> None:
        for dev in set(r.users) | set(r.streams):
            join_streams(torch.cuda.current_stream(dev), r.users.get(dev, {}).values(),
                         r.streams.get(dev))


def _warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=5)


def _remove(handles: List[Any]) -> None:
    for h in handles:
        h.remove()


def _current(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
