"""The local-momentum mode of :func:`compcomm.fsdp.onebit`: 1-bit Adam on FSDP2's shards with only
the reduce-scatter phase on the wire.

Why. The momentum mode (:mod:`compcomm.fsdp_momentum`, DeepSpeed's 1-bit Adam) averages every
rank's local momentum with the full compressed allreduce: a 1-bit reduce-scatter (``P/8`` bytes)
and a 1-bit all-gather of the server-compressed result (``P/8`` more), and keeps the new momentum
replicated. Under FSDP each rank only needs its own shard of the momentum, so here each rank keeps
its *own* fp32 momentum of the whole module, ``m_i = b1 m_i + (1 - b1) c g_i`` (its local
gradient, ``c`` as in the momentum mode), and reduce-scatters ``m_i`` with the gradient mode's
1-bit exchange (:func:`compcomm.fsdp_exchange.reduce_scatter_segments`, worker error feedback):
no all-gather, no replicated momentum. Momentum is linear, so the average of the local momenta is
the momentum of the averaged gradient; the shard owner receives an error-fed 1-bit estimate of it
-- DeepSpeed's algorithm without its second (server) compression.

The result before the server compression. The compressed reduce-scatter ends with the server
step ``c' = c + e_s``, ``out = tau s(c')``, ``e_s = c' - tau s(c')``, where ``c`` is the average
of the ranks' decompressed chunks. With ``e_s`` zeroed before each call, ``out + e_s`` is ``c`` (to
one fp32 rounding): that is what this mode hands to
:class:`~compcomm.fsdp_optim.FrozenVarianceAdam` (fp32, :meth:`MomentumState.give
<compcomm.fsdp_momentum.MomentumState.give>`), and FSDP's gradient carries the same values. The
server step only costs arithmetic on the ``P/W`` chunk; its bytes are not sent.

Layout, memory, switch. A segment's rows are the gradient mode's (``ceil(n/8)*8`` fp32 elements
per rank, ``W`` rows): the local momentum takes 4 bytes per element of the whole (padded) module on
every rank, as the worker error buffer does. At the first 1-bit call the local momentum of every
rank is the warm-up's, gathered from the optimizer's ``exp_avg`` shards (the momentum mode's seed),
so all ranks start identical. Checkpoints hold it per rank, like the error buffers; on another
world size both are reset and the momentum is seeded again from ``exp_avg``.

HSDP by hand (``replicate_group``) and on FSDP's own 2-D mesh (:mod:`compcomm.fsdp_hsdp`, which
turns FSDP's full-precision replica all-reduce off): the reduce-scatter leaves this rank's fp32
shard in ``pending``; FSDP's all-reduce hook (:func:`replica_hook`) averages it across the replicas with
:func:`compcomm.compressed_allreduce` per segment (the gradient mode's replica keys and buffers)
and only then hands it to the optimizer.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .collectives import compressed_allreduce, padded_numel
from .errors import UnsupportedError
from .fsdp_exchange import reduce_scatter_segments
from .fsdp_hsdp import param_groups
from .fsdp_momentum import MomentumReduceScatter, MomentumState

__all__ = ["LocalMomentumReduceScatter", "replica_hook", "local_state_dict", "local_fits",
           "load_local"]


class LocalMomentumReduceScatter(MomentumReduceScatter):
    """FSDP2 ``ReduceScatter`` of one module in the local-momentum mode (see the module
    docstring): FSDP's own reduce-scatter during the warm-up, then the 1-bit reduce-scatter of
    this rank's local momentum. The checks, the seed and the hand-over are the momentum mode's.
    With ``replicate_group`` the shard is left in ``pending`` for :func:`replica_hook`."""

    #: (fp32 shard, FSDP's post-division, [(key, new local momentum)]): committed by the hook
    pending: Optional[Tuple[torch.Tensor, float, List[Tuple[str, torch.Tensor]]]] = None
    #: FSDP's own 2-D mesh (:mod:`compcomm.fsdp_hsdp`): whether its HSDP would sum the replicas
    #: (a divide factor); the gradient is then scaled by the replicas' count here, so that the
    #: replicas' *average* of the momenta is FSDP's sum (and the seed, exp_avg, fits as it is)
    summed: Optional[Callable[[], bool]] = None

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 op: Any, async_op: bool = False) -> Optional[dist.Work]:
        warm, work = self.warmup(output_tensor, input_tensor, group, op, async_op)
        if warm:
            return work
        state, world, rank = self.state, group.size(), group.rank()
        mom: MomentumState = state.momentum
        scale, post, b1, segs, keys = self.prepare(output_tensor, input_tensor, group, op)
        s = output_tensor.numel()
        dev = input_tensor.device
        rows = [-(-n // 8) * 8 for n in segs]  # as the gradient mode: chunk j is rank j's row
        seed = self._seed(keys, rows, world, group, dev)
        src = input_tensor.view(world, s)
        c = scale / post
        if self.summed is not None and self.summed():
            c *= dist.get_world_size(state.replicate_group)
        # the exchange overwrites its input: the new momenta are staged into a copy
        staged = torch.empty(world * sum(rows), dtype=torch.float32, device=dev)
        out = torch.zeros(sum(rows), dtype=torch.float32, device=dev)
        news: List[torch.Tensor] = []
        segments, outs = [], []
        o = o8 = 0
        for n, r, k in zip(segs, rows, keys):
            new = torch.mul(seed[k] if k in seed else mom.full[k].to(dev), b1)
            v = new.view(world, r)
            g = src[:, o: o + n].float()
            v[:, :n].add_(g if c == 1.0 else g * c, alpha=1 - b1)
            v[:, n:].zero_()  # row padding: no parameter there
            news.append(new)
            segments.append(staged[world * o8: world * (o8 + r)])
            segments[-1].copy_(new)
            outs.append(out[o8: o8 + r])
            o, o8 = o + n, o8 + r
        if mom.exact:  # test hook: a full-precision reduce-scatter (IdentityCompressor)
            comp = mom.compressor(group)
            for k, seg, o_ in zip(keys, segments, outs):
                comp.reduce_scatter_(k, seg, o_)
        else:
            bufs = [state.errors(k, world * r, world, dev) for k, r in zip(keys, rows)]
            for _, se in bufs:  # scratch here: zero, so that out + se is the server's sum
                se.zero_()
            reduce_scatter_segments(state, keys, segments, bufs, outs, group, dev)
            for (_, se), o_ in zip(bufs, outs):
                o_.add_(se)
                se.zero_()  # scratch, not state: checkpoints hold zeros
        mine = torch.empty(s, dtype=torch.float32, device=dev)
        o = o8 = 0
        for n, r in zip(segs, rows):
            mine[o: o + n].copy_(out[o8: o8 + n])
            o, o8 = o + n, o8 + r
        output_tensor.copy_(mine if post == 1.0 else mine * post)
        if state.replicate_group is not None:  # HSDP: committed after the replicas' average
            self.pending = (mine, post, list(zip(keys, news)))
            return None
        self.commit((mine, post, list(zip(keys, news))), rank)
        return None

    def commit(self, got: Tuple[torch.Tensor, float, List[Tuple[str, torch.Tensor]]],
               rank: int) -> None:
        """Every exchange succeeded: commit the local momenta, hand the chunks over, count the
        step (with HSDP, from the hook after the replicas' reduction)."""
        mine, _, news = got
        for k, new in news:
            self.state.momentum.full[k] = new
        self.give_all(mine, rank)
        self.state.steps[self.name] = self.state.steps.get(self.name, 0) + 1


def replica_hook(state: Any, rs: "LocalMomentumReduceScatter",
                 warmup: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """FSDP's all-reduce hook of a module in the local-momentum mode with ``replicate_group``
    (HSDP by hand): ``warmup`` (the gradient mode's hook: full precision) during the warm-up, then
    the average across replicas of this rank's momentum shard (fp32, left by ``rs``'s
    reduce-scatter) with :func:`compcomm.compressed_allreduce`, one call per segment with its own
    error buffers (keys ``"<module>/replicas#<k>"``), handed to the optimizer and written to the
    gradient. Without ``replicate_group`` or a 2-D mesh ``onebit`` does not install it."""
    key = rs.name + "/replicas"

    def hook(reduce_output: torch.Tensor) -> None:
        m = rs.module()
        if m is not None and not all(getattr(pg, "all_reduce_grads", True)
                                     for pg in param_groups(m)):
            # FSDP's HSDP accumulation idiom: this hook would average every micro-batch (and
            # count each as a warm-up step), then find a second reduction in the 1-bit phase
            raise UnsupportedError(f"[rank {dist.get_rank()}] compcomm.fsdp.onebit(mode="
                                   f"'local_momentum'): module {rs.name!r} has "
                                   "set_requires_all_reduce(False), which this mode does not "
                                   "take (leave it True, or use mode='gradient')",
                                   "all_reduce_hook", "fsdp")
        if not state.compressing(key):
            warmup(reduce_output)  # counts the step
            return
        got = getattr(rs, "pending", None)
        if got is None:  # FSDP skips the reduce-scatter call on a shard group of one rank
            raise UnsupportedError(f"[rank {dist.get_rank()}] compcomm.fsdp.onebit(mode="
                                   f"'local_momentum'): module {rs.name!r} made no 1-bit reduce-"
                                   "scatter before its replica all-reduce (a shard group of one "
                                   "rank?): use mode='gradient' there", "all_reduce_hook", "fsdp")
        mine, post, _ = got
        rs.pending = None
        group = state.replicate_group
        world = dist.get_world_size(group)
        if state.momentum.exact:  # test hook: the exact average
            dist.all_reduce(mine, group=group)
            mine.div_(world)
        else:
            segs, keys = state.segments_for(key, mine.numel())
            o = 0
            for n, k in zip(segs, keys):
                we, se = state.errors(k, padded_numel(n, world), world, mine.device)
                compressed_allreduce(mine[o: o + n], we, se, group)
                o += n
        reduce_output.copy_(mine if post == 1.0 else mine * post)
        rs.commit(got, dist.get_rank())  # only now: if the exchange raised, the momenta stay
        state.steps[key] = state.steps.get(key, 0) + 1

    return hook


def local_state_dict(sizes: Dict[str, Tuple[int, int]],
                     mom: MomentumState) -> Dict[str, torch.Tensor]:
    """This rank's local momentum of every segment (CPU copies; zeros of the planned ``sizes[k][0]``
    elements before the switch: a fresh state's is the template ``torch.distributed.checkpoint``
    fills)."""
    out = {k: torch.zeros(w) for k, (w, _) in sizes.items()
           if not k.split("#")[0].endswith("/replicas")}  # the replicas' keys: errors only
    out.update({k: v.detach().cpu().clone() for k, v in mom.full.items()})
    return out


def local_fits(sd: Dict[str, Any], sizes: Dict[str, Tuple[int, int]]) -> bool:
    """Whether ``sd``'s local momenta and error buffers have the planned sizes (``sizes``: key ->
    (elements, server elements)); another layout (e.g. another split of the world) does not.
    ValueError when ``sd`` lacks its momenta."""
    local = sd.get("local_momentum")
    if not isinstance(local, dict) or not all(isinstance(v, torch.Tensor) for v in local.values()):
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise ValueError(f"[rank {rank}] compcomm.fsdp: load_state_dict: argument 'sd' lacks "
                         "'local_momentum'")
    return all(v.numel() == sizes[k][0] for k, v in local.items() if k in sizes) \
        and all(v[0].numel() == sizes[k][0] for k, v in sd["errors"].items() if k in sizes)


def load_local(sd: Dict[str, Any], steps: Dict[str, int], warmup_steps: int, same: bool,
               mom: MomentumState) -> Dict[str, List[torch.Tensor]]:
    """Restore a checked (:func:`local_fits`) local-momentum state into ``mom`` and return the
    error buffers to keep: both from ``sd`` when ``same`` (rank, world size, replica count and
    layout match on every rank), else both reset (the momentum is then seeded again from
    ``exp_avg`` at the next step)."""
    errors: Dict[str, List[torch.Tensor]] = {}
    live: Dict[str, torch.Tensor] = {}
    if same:  # a segment has a local momentum once its module took a 1-bit step
        errors = {k: [b.clone() for b in v] for k, v in sd["errors"].items()}
        live = {k: v.clone() for k, v in sd["local_momentum"].items()
                if steps.get(k.split("#")[0], 0) > warmup_steps}
    mom.reset()
    mom.full.update(live)
    return errors
