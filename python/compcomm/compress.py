"""The compressors of the optimizers: how a set of buckets is averaged across ranks, and the
state that averaging keeps (error-feedback buffers), behind one interface (:class:`Compressor`).

:class:`OneBitCompressor` is the 1-bit compressed average with error feedback;
:class:`IdentityCompressor` is its full-precision twin (no compression, no state), for tests and
benchmarks that need the same optimizer without compression. A new compressor is one class with
the methods of :class:`Compressor`; the optimizers take it as ``compressor=``, and ZeroOptimizer
builds its own from the wrapped optimizer's ``compressor_factory`` (the ``reduce_scatter_*``
methods are ZeRO's sharded form).

The 1-bit compressed average of all buckets is one transaction:

A step of a 1-bit optimizer averages several buckets (flat fp32 tensors: the momenta of a run of
parameters). Each bucket is exchanged (every collective and check of the compressed allreduce; only
the bucket's own workspace is written) on the communicator's worker thread while the caller stages
the next bucket, so staging overlaps the wire. Only when every exchange has succeeded on this rank
are the buckets committed (tensor and both error buffers written). An exchange that fails -- a rank
with non-finite values, sizes that differ between ranks, a dead or hung peer -- fails on every rank,
so either every rank commits every bucket or none commits anything.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch

from . import _C
from ._comm_users import join
from ._agree import LayoutCheck, digest
from ._arguments import reject
from ._bucket_views import PreparedBuckets, check_buckets, check_loaded, check_staged
from ._bucketing import all_finite, plan_buckets
from ._buffers import buffer_of
from ._scratch import stream_of
from ._compressor import Compressor
from ._comm import wait_cancellable
from ._defaults import DEFAULT_TIMEOUT
from .collectives import compressed_reduce_scatter, padded_numel, workspace_bytes
from .errors import CommError
from .identity_compressor import IdentityCompressor

__all__ = ["DEFAULT_BUCKET_ELEMENTS", "Compressor", "IdentityCompressor", "OneBitCompressor",
           "all_finite", "plan_buckets"]

#: Elements per compressed bucket when the optimizer is not told otherwise (``reduce_bucket_size``):
#: tensor-aligned buckets. Every tensor of more than 16384 elements is a bucket of its own, with its
#: own scales; smaller ones (biases, norms) share buckets. One scale shared by tensors of very
#: different magnitudes costs convergence: on the H200 (121M-parameter GPT, W=4, 600 steps) OneBitAdam
#: ended 1.87% below its uncompressed twin with this plan and 2.42% above it with one bucket for all
#: tensors (bench/results/gpu_1202b/README.md). All buckets still travel in one batched exchange of
#: three collectives, and the batched kernels launch once per phase, so the step stayed within 1.01x
#: of the one-bucket step at 10 Gbit there (53.3 against 52.9 ms) and 1.06x at 1 Gbit.
DEFAULT_BUCKET_ELEMENTS = 16384

# Waiting on an exchange: its collectives time out themselves; the buffers they use must outlive it.
_FOREVER = 1e9


class OneBitCompressor:
    """Owns the error-feedback buffers of named buckets and averages buckets with 1-bit compression.

    Parameters
    ----------
    comm : compcomm Communicator
        The group the average runs over.
    timeout : float
        Seconds each collective may wait for peers.
    batched : bool
        Average several buckets in one exchange of three collectives
        (``compressed_allreduce_exchange_many``) instead of three collectives per bucket, each
        bucket pipelined with the staging of the next. The results are the same bits; batching
        wins where a collective's latency (or scheduling ranks that share cores) costs more than
        the overlap of staging with the wire.
    """

    def __init__(self, comm: _C.Communicator, timeout: float = DEFAULT_TIMEOUT,
                 batched: bool = True) -> None:
        self.comm = comm
        self.timeout = float(timeout)
        self.batched = bool(batched)
        # key -> (worker_error, server_error, workspace); zero on creation
        self._buffers: Dict[Hashable, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._staging = torch.zeros(0, dtype=torch.uint8)  # the batched exchange's
        self._async = None
        self._broken = ""  # why this compressor refuses further calls ("" while usable)
        # the last call's buckets as the core takes them (see _prepared); None when stale
        self._prep: Optional[PreparedBuckets] = None
        self._layout = LayoutCheck()  # the bucket layouts the ranks agreed on (batched=False)
        self._groups: Dict[Any, PreparedBuckets] = {}  # launch_'s groups, by keys, numels, device
        join(comm, self)  # a worker thread on comm: no backward overlap shares it (_comm_users)

    @property
    def stages_ahead(self) -> bool:
        """Whether :meth:`average_` stages every bucket before sending any (``batched``)."""
        return self.batched

    def _buffers_for(self, key: Hashable, padded: int, device: torch.device):
        world = self.comm.size()
        bufs = self._buffers.get(key)
        if (bufs is not None and bufs[0].numel() == padded and bufs[0].device == device
                and bufs[2].numel() > 0):
            return bufs
        total = _C.compressed_allreduce_layout(padded, world, device.type == "cuda")["total"]
        if bufs is not None and bufs[0].numel() == padded:  # loaded on another device: move it
            we, se = bufs[0].to(device), bufs[1].to(device)
        else:
            we = torch.zeros(padded, dtype=torch.float32, device=device)
            se = torch.zeros(padded // world, dtype=torch.float32, device=device)
        # zeroed workspace: the GPU norm kernels need a zero scratch on first use
        bufs = (we, se, torch.zeros(max(total, 1), dtype=torch.uint8, device=device))
        self._buffers[key] = bufs
        return bufs

    def average_(self, keys: Sequence[Hashable], numels: Sequence[int],
                 stage: Callable[[int], torch.Tensor], device: torch.device) -> None:
        """1-bit average, in place and on every rank, of the buckets ``stage(0), stage(1), ...``.

        ``stage(i)`` fills and returns bucket ``i`` (a contiguous fp32 tensor of ``numels[i]``
        elements on ``device``, the same numel on every rank); it is called in order, bucket
        ``i + 1`` while bucket ``i`` is on the wire, and should not fail (the caller allocates its
        staging first). The bucket named ``keys[i]`` keeps its
        error buffers across calls; all of them are allocated before the first exchange. All or
        nothing: if any exchange fails (on any rank), no bucket and no error buffer is written and
        the exception (:class:`~compcomm.errors.NonFiniteError`, ``RankMismatchError``,
        ``CommTimeoutError``, ``BackendError``) is raised on every rank. With one rank nothing is
        sent and the buckets keep their values (as DeepSpeed: no compression without peers). On a
        communicator that can cancel work it enqueued (NCCL: ``abort_flag`` nonzero) the device work
        of the exchanges is waited for (``synchronize``) before the first commit, so that a peer
        lost in the last exchange also raises here rather than leave the buckets unaveraged.

        If this rank fails on its own between two exchanges (``stage`` raised), the ranks are out
        of step: the exchanges already queued are waited for, and the compressor refuses every
        later call (:class:`~compcomm.errors.CommError`).

        A key named twice, ``numels`` not counts >= 0 or a ``stage(i)`` that is no contiguous fp32
        tensor of ``numels[i]`` elements on ``device``: TypeError/ValueError naming the bucket and
        the rank, nothing changed; as in :func:`compcomm.compressed_allreduce` the peers raise
        ``RankMismatchError`` (so do they against a rank with no bucket).
        """
        if self._broken:
            raise CommError(f"OneBitCompressor: {self._broken}; make a new optimizer (the ranks' "
                            "collectives are out of step)", "compressed_allreduce", "compress")
        prep = self._prep  # the checks of a call like the last one passed already
        if prep is None or prep.keys != keys or prep.numels != numels:
            try:
                check_buckets(keys, numels, self.comm.rank())
            except (TypeError, ValueError) as e:
                self._reject(device, e)
                raise
        if self.comm.size() == 1:
            for i in range(len(keys)):
                check_staged(stage(i), i, keys[i], numels[i], device, 0)
            return
        if not self.batched:  # before any buffer is made: a mismatch leaves no trace
            self._agree_buckets(numels, device)
        if self._async is None:
            self._async = _C.zero.AsyncComm(self.comm)
        try:
            prep = self._prepared(keys, numels, device)
        except BaseException as e:  # e.g. out of memory: the peers are left waiting, as below
            self._broken = f"this rank failed while preparing its buckets: {e!r}"
            raise
        try:
            self._average_prepared(prep, stage, device)
        finally:
            prep.release()

    def _reject(self, device: torch.device, error: Exception) -> None:
        """Tell the peers, in the collective they are in, that this rank rejected its arguments
        (:func:`compcomm._arguments.reject`); ``error`` is what the caller then raises."""
        reject(self.comm, torch.empty(0, device=device), self.timeout, error)

    def _undo(self, prep: PreparedBuckets) -> None:
        """The error buffers as before the call that made ``prep`` (it failed)."""
        if prep.undo(self._buffers):
            self._prep = None

    def _agree_buckets(self, numels: Sequence[int], device: torch.device) -> None:
        """RankMismatchError on every rank if the ranks' bucket counts or sizes differ. Per-bucket
        exchanges follow each other, so a rank with more buckets would wait in a collective until
        its timeout (a batch sends its count first); one small all-gather per new layout."""
        self._layout.agree(self.comm, "OneBitCompressor.average_ (batched=False)",
                           (tuple(numels), device.type),
                           lambda: [("number of buckets", len(numels), False),
                                    ("bucket sizes", digest(list(numels)), True)],
                           device, self.timeout)

    def _average_prepared(self, prep: "PreparedBuckets", stage: Callable[[int], torch.Tensor],
                          device: torch.device) -> None:
        """:meth:`average_`'s staging, exchange and commit over prepared buckets."""
        keys = prep.keys
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        works, calls, error, bad = [], [], None, None
        batched = self.batched and len(keys) != 1  # no bucket: an empty batch, for the peers
        try:
            for i in range(len(keys)):
                t = stage(i)
                try:
                    buf = prep.tensor_buffer(i, t)
                except (TypeError, ValueError) as e:  # before bucket i's exchange: reject it
                    bad = e
                    break
                args = (buf,) + prep.error_args[i]
                if not batched:  # chained: a bucket that failed everywhere skips the rest
                    works.append(self._async.compressed_allreduce_exchange(
                        *args, self.timeout, stream, works[-1] if works else None))
                calls.append(args)
            if batched and bad is None:  # every bucket staged: one exchange of three collectives
                works.append(self._async.compressed_allreduce_exchange_many(
                    prep.tensors, prep.wes, prep.ses, prep.wss, prep.staging, self.timeout,
                    stream))
        except BaseException as e:
            self._broken = f"this rank failed while staging bucket {len(calls)}: {e!r}"
            error = e
        for w in works:  # every exchange reads our buffers: wait for each, even after a failure
            try:
                w.wait(_FOREVER)  # each collective inside has its own timeout
            except Exception as e:  # noqa: BLE001 -- re-raised below, after the others finished
                error = error or e
        if bad is not None:
            if error is None:  # the peers are in bucket len(calls)'s first collective (or none)
                self._reject(device, bad)
            elif hasattr(bad, "add_note"):
                bad.add_note(f"(an earlier bucket's exchange failed too: {error!r})")
            self._undo(prep)
            raise bad
        synced = False
        if error is None:
            # NCCL may still have the last exchange's collectives on the stream: a peer lost there
            # must raise here, before any commit (the commit gate alone would leave the buckets
            # unaveraged, silently).
            try:
                synced = wait_cancellable(self.comm, self.timeout)
            except Exception as e:  # noqa: BLE001 -- raised below like an exchange's failure
                error = e
        if error is not None:  # a failed call leaves no trace, not even new zero buffers
            self._undo(prep)
            raise error
        prep.created, prep.replaced = [], {}  # they exist now: a later failure must not drop them
        # after a wait that found no abort, every commit writes; all buckets in one C++ call
        _C.zero.compressed_allreduce_commit_many(self.comm, prep.tensors, prep.wes, prep.ses,
                                                 prep.wss, stream, gate=not synced)

    def _prepared(self, keys: Sequence[Hashable], numels: Sequence[int],
                  device: torch.device) -> "PreparedBuckets":
        """The buckets' error buffers and workspaces (made where missing) and their core views,
        kept from the last call while the keys, sizes, device and buffers are the same: a
        step of many small buckets paid ~10 us per bucket re-deriving them."""
        prep = self._prep
        batched = self.batched and len(keys) != 1
        if (prep is not None and prep.device == device and prep.keys == keys
                and prep.numels == numels and (prep.staging is not None) == batched
                and prep.valid(self._buffers)):
            return prep
        created, replaced, bufs = self._make_buffers(keys, numels, device)
        staging = None
        if batched:
            staging = buffer_of(self._staging_for([we.numel() for we, _, _ in bufs], device))
        prep = self._prep = PreparedBuckets(list(keys), list(numels), device, bufs, staging,
                                            created, replaced, self.comm.rank())
        return prep

    def _make_buffers(self, keys: Sequence[Hashable], numels: Sequence[int],
                      device: torch.device) -> Tuple[List[Hashable], Dict[Hashable, Any], list]:
        """Every bucket's buffers, the keys this made and the buffers it replaced (:meth:`_undo`)."""
        world, old = self.comm.size(), {k: self._buffers[k] for k in keys if k in self._buffers}
        bufs = [self._buffers_for(k, padded_numel(n, world), device) for k, n in zip(keys, numels)]
        return ([k for k in keys if k not in old],
                {k: b for k, b in old.items() if self._buffers[k] is not b}, bufs)

    def _staging_for(self, paddeds: List[int], device: torch.device) -> torch.Tensor:
        nbytes = _C.zero.compressed_allreduce_batch_bytes(paddeds, self.comm.size())
        if self._staging.numel() < nbytes or self._staging.device != device:
            self._staging = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self._prep = None
        return self._staging

    # -- groups of buckets exchanged one at a time as they are staged (the optimizers' backward
    #    overlap, compcomm.optim.overlap), then committed all together or not at all

    def launch_(self, keys: Sequence[Hashable], numels: Sequence[int],
                tensors: Optional[Sequence[torch.Tensor]], device: torch.device,
                stream: int = 0, before: Optional[Callable[[], None]] = None
                ) -> Tuple[Any, PreparedBuckets]:
        """Queue the batched exchange of one group of staged buckets on the worker thread
        (``tensors[i]``: bucket ``keys[i]``, ``numels[i]`` fp32 elements on ``device``, left
        unchanged until :meth:`wait_launched`); it writes only the buckets' workspaces, after the
        work queued on ``stream``. Error buffers are made where missing (zero; dropped again unless
        committed). ``tensors=None`` queues an empty batch instead, so that every rank's exchange
        of this group raises RankMismatchError: how a rank that could not stage a group keeps the
        ranks' collectives in step. ``before()`` runs after the buffers are made and before the
        exchange is queued (a side ``stream`` waits there for the caller's, which made them).
        Returns the handle :meth:`wait_launched`, :meth:`commit_launched` and
        :meth:`drop_launched` take."""
        if self._broken:
            raise CommError(f"OneBitCompressor: {self._broken}", "compressed_allreduce", "compress")
        if self._async is None:
            self._async = _C.zero.AsyncComm(self.comm)
        keys, numels = (list(keys), list(numels)) if tensors is not None else ([], [])
        gkey = (tuple(keys), tuple(numels), device)
        prep = self._groups.get(gkey)
        if prep is None or not prep.valid(self._buffers):
            world = self.comm.size()
            check_buckets(keys, numels, self.comm.rank())
            created, replaced, bufs = self._make_buffers(keys, numels, device)
            nbytes = _C.zero.compressed_allreduce_batch_bytes([b[0].numel() for b in bufs], world)
            staging = buffer_of(torch.empty(nbytes, dtype=torch.uint8, device=device))
            prep = PreparedBuckets(keys, numels, device, bufs, staging, created, replaced,
                                   self.comm.rank())
            self._groups[gkey] = prep
        try:
            for i, t in enumerate(tensors or ()):
                prep.tensor_buffer(i, t)  # checks a new tensor
        except BaseException:  # nothing was queued: leave no trace
            self._undo(prep)
            self._groups.pop(gkey, None)
            raise
        if before is not None:
            before()
        work = self._async.compressed_allreduce_exchange_many(
            prep.tensors, prep.wes, prep.ses, prep.wss, prep.staging, self.timeout, stream)
        return work, prep

    def wait_launched(self, launches: Sequence[Tuple[Any, PreparedBuckets]]
                      ) -> Optional[BaseException]:
        """Wait for every exchange of ``launches`` (even after one failed: each reads our buffers)
        and return the first failure (None if all succeeded); nothing is written."""
        error = None
        for work, _ in launches:
            try:
                work.wait(_FOREVER)  # each collective inside has its own timeout
            except Exception as e:  # noqa: BLE001 -- the caller decides
                error = error or e
        return error

    def commit_launched(self, launches: Sequence[Tuple[Any, PreparedBuckets]],
                        stream: int = 0) -> None:
        """Write every bucket of ``launches`` (all exchanged without failure: :meth:`wait_launched`
        returned None) in one commit on ``stream``; a communicator that can still cancel their
        device work (NCCL) is waited for first, and if it raises, nothing is written."""
        try:
            synced = wait_cancellable(self.comm, self.timeout)
        except BaseException:
            self.drop_launched(launches)
            raise
        preps = [prep for _, prep in launches]
        for prep in preps:
            prep.created, prep.replaced = [], {}
        _C.zero.compressed_allreduce_commit_many(
            self.comm, [t for p in preps for t in p.tensors], [b for p in preps for b in p.wes],
            [b for p in preps for b in p.ses], [b for p in preps for b in p.wss], stream,
            gate=not synced)
        for prep in preps:
            prep.release()

    def drop_launched(self, launches: Sequence[Tuple[Any, PreparedBuckets]]) -> None:
        """Forget waited-for ``launches`` without writing anything: the error buffers they made
        are dropped again and those they replaced put back, so the compressor is as before the
        first :meth:`launch_`."""
        for _, prep in reversed(launches):  # the first launch's view of a bucket is the oldest
            self._undo(prep)
            prep.release()

    def packed_average(self, keys: Sequence[Hashable], numels: Sequence[int],
                       stage: Callable[[int], torch.Tensor],
                       device: torch.device) -> Optional[List[Tuple[torch.Tensor, torch.Tensor]]]:
        """:meth:`average_`, then each bucket's result in its 1-bit form, handed back from the
        exchange's records rather than re-derived from the values.

        Returns ``[(signs, scales)]``, one per bucket: uint8 ``P/8`` (``P = padded_numel(numels[i],
        world)``; MSB first, bit 1 = +1) and fp32 ``W`` (the server scale of each chunk of ``P/W``
        elements), new tensors on ``device``; bucket ``i`` then equals ``scales[k // (P/W)] *
        (+-1)`` at every element ``k < numels[i]``, on every rank. None with one rank (nothing is
        compressed, the buckets keep their values). Failures as :meth:`average_` (nothing written).
        """
        self.average_(keys, numels, stage, device)
        world = self.comm.size()
        if world == 1:
            return None
        out = []
        cuda = device.type == "cuda"
        for k, n in zip(keys, numels):
            padded = padded_numel(n, world)
            lay = _C.compressed_allreduce_layout(padded, world, cuda)
            rb, sb, chunk = lay["record_bytes"], lay["record_scale_bytes"], padded // world
            # the commit left the gathered records (server scale, then the chunk's signs) in place
            recs = self._buffers[k][2][lay["record_recv"]: lay["record_recv"] + world * rb]
            recs = recs.view(world, rb)
            signs = torch.empty(padded // 8, dtype=torch.uint8, device=device)
            signs.view(world, chunk // 8).copy_(recs[:, sb: sb + chunk // 8])
            scales = torch.empty(world, dtype=torch.float32, device=device)
            scales.view(torch.uint8).view(world, 4).copy_(recs[:, :4])
            out.append((signs, scales))
        return out

    # -- one bucket's buffers, for a caller that runs a 1-bit collective of its own on them (ZeRO's
    #    compressed reduce-scatter); they are kept, counted, saved and reset as the others

    def error_buffers(self, key: Hashable, padded: int,
                      device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """Bucket ``key``'s ``(worker_error, server_error)``: ``padded`` and ``padded / world``
        fp32 elements on ``device``; zeros when new or when ``padded`` changed, moved to
        ``device`` when loaded elsewhere."""
        bufs = self._buffers.get(key)
        if bufs is None or bufs[0].numel() != padded:
            bufs = (torch.zeros(padded, dtype=torch.float32, device=device),
                    torch.zeros(padded // self.comm.size(), dtype=torch.float32, device=device),
                    torch.zeros(0, dtype=torch.uint8, device=device))
            self._buffers[key] = bufs
        elif bufs[0].device != device:
            bufs = (bufs[0].to(device), bufs[1].to(device), bufs[2].to(device))
            self._buffers[key] = bufs
        return bufs[0], bufs[1]

    def workspace(self, key: Hashable, nbytes: int, device: torch.device) -> torch.Tensor:
        """Bucket ``key``'s exchange workspace of ``nbytes`` bytes on ``device``, zero-filled when
        made (the GPU kernels need a zeroed scratch on first use; every call leaves it so). The
        bucket's error buffers must exist (:meth:`error_buffers`)."""
        we, se, ws = self._buffers[key]
        if ws.numel() != nbytes or ws.device != device:
            ws = torch.zeros(nbytes, dtype=torch.uint8, device=device)
            self._buffers[key] = (we, se, ws)
        return ws

    def reduce_scatter_(self, key: Hashable, tensor: torch.Tensor, out: torch.Tensor) -> None:
        """1-bit reduce-scatter of ``tensor`` (``P`` fp32 elements, ``P = world * out.numel()``,
        overwritten) into this rank's chunk ``out``, with bucket ``key``'s error feedback
        (:func:`compcomm.compressed_reduce_scatter`). If it fails, the bucket's error buffers are
        as before (those of another size too)."""
        old = self._buffers.get(key)
        we, se = self.error_buffers(key, tensor.numel(), tensor.device)
        try:
            compressed_reduce_scatter(tensor, we, se, out=out, group=self.comm,
                                      timeout=self.timeout)
        except BaseException:
            if old is None:
                self._buffers.pop(key, None)
            else:
                self._buffers[key] = old
            raise

    def reduce_scatter_exchange(self, key: Hashable, tensor: torch.Tensor, out: torch.Tensor,
                                async_comm: Any) -> Any:
        """Queue on ``async_comm`` the collective half of :meth:`reduce_scatter_` (writes only
        bucket ``key``'s workspace); returns its work."""
        we, se = self.error_buffers(key, tensor.numel(), tensor.device)
        nbytes = workspace_bytes(tensor.numel(), self.comm.size(), tensor.device.type == "cuda")
        ws = self.workspace(key, nbytes, tensor.device)
        return async_comm.compressed_reduce_scatter_exchange(
            buffer_of(tensor), buffer_of(we), buffer_of(se), buffer_of(out), buffer_of(ws),
            timeout_s=self.timeout, stream=stream_of(tensor))

    def reduce_scatter_commit(self, key: Hashable, tensor: torch.Tensor, out: torch.Tensor,
                              gate: bool = True) -> None:
        """The local writes of an exchanged reduce-scatter: bucket ``key``'s error buffers and
        ``out``. ``gate=False`` once the caller waited for the exchange's device work and found no
        abort (:func:`compcomm._comm.wait_cancellable`): the commit then never skips."""
        we, se, ws = self._buffers[key]
        _C.zero.compressed_reduce_scatter_commit(self.comm, buffer_of(tensor), buffer_of(we),
                                                 buffer_of(se), buffer_of(out), buffer_of(ws),
                                                 gate=gate)

    def nbytes(self) -> Tuple[int, int]:
        """(bytes of error buffers, bytes of exchange workspaces) held now."""
        errors = sum((we.numel() + se.numel()) * 4 for we, se, _ in self._buffers.values())
        staging = self._staging.numel() + sum(p.staging.count for p in self._groups.values())
        return errors, sum(ws.numel() for _, _, ws in self._buffers.values()) + staging

    def keys(self) -> List[Hashable]:
        """The bucket names that have error buffers."""
        return list(self._buffers)

    def reset(self) -> None:
        """Forget every error buffer (they restart at zero on next use)."""
        self._buffers.clear()
        self._prep = None
        self._groups.clear()

    def zero_(self) -> None:
        """Set every error buffer to zero (keeping the allocations)."""
        for we, se, _ in self._buffers.values():
            we.zero_()
            se.zero_()

    def state_dict(self) -> Dict[Hashable, Dict[str, torch.Tensor]]:
        """This rank's error buffers: ``{key: {"worker_error", "server_error"}}`` (copies)."""
        return {k: {"worker_error": we.clone(), "server_error": se.clone()}
                for k, (we, se, _) in self._buffers.items()}

    def load_state_dict(self, state: Dict[Hashable, Dict[str, torch.Tensor]]) -> None:
        """Restore what :meth:`state_dict` returned (same world size). Every bucket is checked
        before anything is loaded: both buffers float32, 1-D, contiguous, on one CPU or CUDA
        device, of ``P`` and ``P / world`` elements (``P`` a multiple of ``8 * world``); else
        TypeError/ValueError naming the bucket and the rank, with nothing loaded."""
        check_loaded(state, self.comm.size(), self.comm.rank())
        self._buffers = {}
        self._prep = None
        self._groups.clear()
        for k, bufs in state.items():
            we, se = bufs["worker_error"], bufs["server_error"]
            self._buffers[k] = (we.detach().clone(), se.detach().clone(),
                                torch.zeros(0, dtype=torch.uint8))  # workspace made on first use

    def close(self) -> None:
        """Stop the worker thread (idempotent)."""
        if self._async is not None:
            self._async.close()
            self._async = None
