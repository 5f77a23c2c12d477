"""The 1-bit compressed reduce-scatter of a module's segments: the one exchange of
:func:`compcomm.fsdp.onebit`'s gradient mode and its local-momentum mode.

Each segment is a flat fp32 tensor of ``W`` rows (row ``j``: rank ``j``'s chunk); every segment
is its own compressed reduce-scatter with its own worker/server error buffers and scales
(:func:`compcomm.compressed_reduce_scatter`), either one call per segment or all of a module's
segments in one batched exchange (three collectives) followed by one commit per segment -- the
same bits either way.
"""

from __future__ import annotations

from typing import Any, List, Sequence

import torch

from . import _C
from ._buffers import buffer_of
from ._comm import resolve, wait_cancellable
from ._defaults import DEFAULT_TIMEOUT
from .collectives import compressed_reduce_scatter
from .errors import NonFiniteError

__all__ = ["reduce_scatter_segments"]


def reduce_scatter_segments(state: Any, keys: Sequence[str], segments: Sequence[torch.Tensor],
                            bufs: Sequence[Sequence[torch.Tensor]], outs: Sequence[torch.Tensor],
                            group: Any, device: torch.device) -> None:
    """Reduce-scatter ``segments`` (1-bit, error feedback ``bufs[i] = [worker, server]``): chunk
    ``rank`` of each segment's compressed average into ``outs[i]``.

    ``state`` gives ``batch_segments`` (False: one call per segment) and ``scratch(keys, paddeds,
    world, device)`` (the batched exchange's workspaces and staging). Every segment is overwritten
    (the reduce-scatter's contract). Nothing but the workspaces is written unless every segment's
    exchange succeeded (the commits follow the exchange); one call per segment: a
    ``NonFiniteError`` restores the error buffers of the segments before it (copies made first).
    """
    if len(segments) == 1 or not state.batch_segments:
        # all or nothing as the batched exchange: a segment's NonFiniteError (on every rank, its
        # own buffers unchanged) puts back the error buffers of the segments committed before it
        saved = [[b.clone() for b in pair] for pair in bufs[:-1]]
        try:
            for seg, (we, se), o_ in zip(segments, bufs, outs):
                compressed_reduce_scatter(seg, we, se, out=o_, group=group)
        except NonFiniteError:
            for pair, old in zip(bufs, saved):
                for b, o in zip(pair, old):
                    b.copy_(o)
            raise
        return
    comm = resolve(group)  # every segment in one exchange (three collectives), then each committed
    world = comm.size()
    wss, staging = state.scratch(list(keys), [s.numel() for s in segments], world, device)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    args: List[List[Any]] = [[buffer_of(t) for t in ts] for ts in
                             (segments, [b[0] for b in bufs], [b[1] for b in bufs], outs, wss)]
    _C.zero.compressed_reduce_scatter_exchange_many(
        comm, *args, buffer_of(staging), DEFAULT_TIMEOUT, stream)
    # NCCL: a peer lost in the exchange raises here, before any commit (a gated commit would skip
    # silently and leave this shard unreduced); then no commit skips
    synced = wait_cancellable(comm, DEFAULT_TIMEOUT)
    for call in zip(*args):
        _C.zero.compressed_reduce_scatter_commit(comm, *call, gate=not synced, stream=stream)
