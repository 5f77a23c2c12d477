"""A DistributedDataParallel communication hook for the compcomm optimizers."""

# no `from __future__ import annotations`: DDP checks the hook's annotations as objects
from typing import Any, Callable, Dict, Tuple

import torch
import torch.distributed as dist

from . import _C
from ._agree import LayoutCheck, digest, schedule_fields
from ._comm import TorchCommunicator

__all__ = ["OneBitHookState", "ddp_comm_hook", "onebit_hook"]


def ddp_comm_hook(optimizer: Any) -> Callable[[Any, Any], torch.futures.Future]:
    """A hook for ``DistributedDataParallel.register_comm_hook`` driven by a compcomm optimizer.

    When the optimizer's next step needs averaged gradients (OneBitAdam/OneBitLamb warm-up,
    ZeroOneAdam variance-update steps) the hook averages each bucket with a full-precision
    allreduce, as DDP's default, and tells the optimizer so it does not average again. Otherwise
    it communicates nothing and hands DDP the local gradients; the optimizer then communicates
    the compressed momentum (or 1-bit gradient / local-step update) itself.

    Parameters
    ----------
    optimizer : OneBitAdam, ZeroOneAdam or OneBitLamb
        Built over the DDP module's parameters and the same process group.

    Returns
    -------
    callable
        ``hook(state, bucket)``; register with ``ddp.register_comm_hook(None, hook)`` (the
        process group is the optimizer's).

    Examples
    --------
    >>> ddp = torch.nn.parallel.DistributedDataParallel(model)            # doctest: +SKIP
    >>> opt = compcomm.optim.OneBitAdam(ddp.parameters(), freeze_step=1000)  # doctest: +SKIP
    >>> ddp.register_comm_hook(None, compcomm.ddp_comm_hook(opt))          # doctest: +SKIP
    """
    if not hasattr(optimizer, "next_step_averages"):
        raise TypeError("ddp_comm_hook: argument 'optimizer' must be a compcomm.optim optimizer, "
                        f"got {type(optimizer).__name__}")
    # the torch process group DDP's warm-up allreduce runs on: the optimizer's (its communicator
    # may be compcomm's native NCCL one, which DDP cannot use)
    group = getattr(optimizer, "process_group", None)
    group = getattr(group, "group", None) if isinstance(group, _C.Communicator) else group
    world = optimizer.world_size
    check = LayoutCheck()

    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        averages = optimizer.next_step_averages()
        if world > 1:  # a bucket seen for the first time: the ranks agree on it before sending
            # (again after the optimizer loaded a state: a rank resumed at another step would
            # average here while its peers do not, and wait in that all-reduce)
            _agree_bucket(check, group, "ddp_comm_hook", bucket, buf,
                          schedule_fields(optimizer.schedule),
                          getattr(optimizer, "state_loads", 0),
                          getattr(optimizer, "overlap", None))
        optimizer.mark_grads_averaged(averages)  # world 1: local == average
        if averages and world > 1:
            buf.div_(world)
            work = dist.all_reduce(buf, group=group, async_op=True)
            return work.get_future().then(lambda f: f.value()[0])
        if not averages and hasattr(optimizer, "expect_grad_copy"):
            # DDP copies buf back into the gradients: the same values, no change for the overlap
            optimizer.expect_grad_copy(bucket.parameters())
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(buf)
        return fut

    return hook


def _agree_bucket(check: LayoutCheck, group: Any, call: str, bucket: Any, buf: torch.Tensor,
                  extra: Any, epoch: int = 0, overlap: Any = None) -> None:
    """RankMismatchError on every rank if the ranks' DDP bucket ``bucket.index()`` differs (size,
    dtype; different ``bucket_cap_mb`` or parameters) or the ``extra`` fields do, checked the first
    time this rank sees the bucket in this ``epoch`` (DDP hands buckets to the hook in index order
    on every rank).

    The check runs over the torch process group ``group`` itself (the torch adapter), not over
    compcomm's native NCCL communicator: torch orders it after the group's earlier all-reduces and
    after the work on the current stream, where two NCCL communicators could run side by side.
    The optimizer's backward ``overlap`` sends over that group from its worker thread: what it
    sent in this backward is waited for and dropped first (DDP's rebuilt buckets, in the second
    backward, are new), so that the check never meets those exchanges in another order."""
    if check.torch_comm is None:
        check.torch_comm = TorchCommunicator(group)
    key = (bucket.index(), buf.numel(), buf.dtype, buf.device, epoch)
    if overlap is not None and not check.known(key):
        overlap.on_shared()
    check.agree(check.torch_comm, f"{call} (DDP bucket {bucket.index()})", key,
                lambda: [("bucket index", bucket.index(), False),
                         ("bucket elements", buf.numel(), False),
                         ("bucket dtype", digest(str(buf.dtype)), True),
                         ("bucket parameter shapes", digest([tuple(p.shape)
                                                             for p in bucket.parameters()]), True),
                         *extra], buf.device)


class OneBitHookState:
    """State of :func:`onebit_hook`: the step count and one pair of error buffers per DDP bucket.

    Parameters
    ----------
    process_group : ProcessGroup, optional
        DDP's process group (default: the world).
    warmup_steps : int, default 100
        Steps of DDP's own full-precision averaging before 1-bit compression starts.

    ``state_dict()``/``load_state_dict()`` hold this rank's error buffers (they differ per rank:
    save one file per rank); another world size resets them.
    """

    def __init__(self, process_group: Any = None, warmup_steps: int = 100) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError("OneBitHookState: argument 'warmup_steps' must be an integer >= 0, "
                             f"got {warmup_steps!r}")
        self.process_group = process_group
        self.warmup_steps = warmup_steps
        self.step = 0
        self.errors: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._check = LayoutCheck()

    def state_dict(self) -> Dict[str, Any]:
        """The step count and this rank's error buffers (CPU copies)."""
        return {"format": "compcomm.ddp/1", "step": self.step,
                "world": dist.get_world_size(self.process_group),
                "rank": dist.get_rank(self.process_group),
                "errors": {k: (a.detach().cpu().clone(), b.detach().cpu().clone())
                           for k, (a, b) in self.errors.items()}}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (error buffers only on the same rank of the same world)."""
        if not isinstance(sd, dict) or sd.get("format") != "compcomm.ddp/1":
            raise ValueError("OneBitHookState.load_state_dict: argument 'sd' is not a state dict of "
                             "OneBitHookState (format 'compcomm.ddp/1')")
        if isinstance(sd["step"], bool) or not isinstance(sd["step"], int) or sd["step"] < 0:
            raise ValueError(f"OneBitHookState.load_state_dict: 'step' must be an integer >= 0, "
                             f"got {sd['step']!r}")
        same = (sd["world"] == dist.get_world_size(self.process_group)
                and sd["rank"] == dist.get_rank(self.process_group))
        self.step = sd["step"]
        self._check.forget()  # agree on the loaded step again
        self.errors = {int(k): (a.clone(), b.clone()) for k, (a, b) in sd["errors"].items()} \
            if same else {}


def onebit_hook(state: OneBitHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: 1-bit compressed gradient averaging with error feedback, for any
    optimizer (like ``powerSGD_hook``).

    During ``state.warmup_steps`` steps each bucket is averaged as DDP's default hook does (divide by
    W, all-reduce: bit-identical). Afterwards each bucket is averaged with
    :func:`compcomm.compressed_allreduce` (DeepSpeed's algorithm, ~32x fewer bytes than fp32) with
    that bucket's own error buffers. The call is stream-ordered on GPU and returns a completed
    future.

    Examples
    --------
    >>> state = compcomm.ddp.OneBitHookState(warmup_steps=200)      # doctest: +SKIP
    >>> ddp.register_comm_hook(state, compcomm.ddp.onebit_hook)     # doctest: +SKIP
    """
    from .collectives import compressed_allreduce, error_buffers

    buf = bucket.buffer()
    group = state.process_group
    world = dist.get_world_size(group)
    if world > 1:
        _agree_bucket(state._check, group, "onebit_hook", bucket, buf,
                      [("warmup_steps", state.warmup_steps, False),
                       ("hook step", state.step, False)])
    if state.step < state.warmup_steps or world == 1:
        buf.div_(world)
        work = dist.all_reduce(buf, group=group, async_op=True)
        fut = work.get_future().then(lambda f: f.value()[0])
    else:
        index = bucket.index()
        errs = state.errors.get(index)
        if errs is None or errs[1].numel() * world != errs[0].numel() or errs[0].device != buf.device:
            errs = tuple(e.to(buf.device) for e in errs) if errs is not None and \
                errs[1].numel() * world == errs[0].numel() else error_buffers(buf, group)
            state.errors[index] = errs
        compressed_allreduce(buf, errs[0], errs[1], group)
        fut = torch.futures.Future()
        fut.set_result(buf)
    if bucket.is_last():
        state.step += 1
    return fut
