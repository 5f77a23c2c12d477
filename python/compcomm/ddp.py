"""A DistributedDataParallel communication hook for the compcomm optimizers."""

# no `from __future__ import annotations`: DDP checks the hook's annotations as objects
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import _C

__all__ = ["ddp_comm_hook"]


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

    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        averages = optimizer.next_step_averages()
        optimizer.mark_grads_averaged(averages)  # world 1: local == average
        if averages and world > 1:
            buf.div_(world)
            work = dist.all_reduce(buf, group=group, async_op=True)
            return work.get_future().then(lambda f: f.value()[0])
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(buf)
        return fut

    return hook
