"""Rank bodies for tests/test_nccl_abort.py: a peer that dies in the middle of a compressed
allreduce's exchange, after the header (so the survivors are already past the host-side check and
have their commit enqueued behind collectives that will never complete).

The dying rank sets ``COMPCOMM_TEST_FAULT=exit_after_header`` just before its call: compcomm then
exits that process (status 0) once its header went out (cpp/compressed_allreduce.cpp,
``fault_point``). The bodies run under :func:`_nccl_fault_cases.launch` (one process per rank,
each an emulated NCCL host on the one GPU; on the CPU a gloo process group).
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, List

import torch
from _nccl_fault_cases import SETUP, Side, T, _attempt, _device, _native

N = 4099  # elements: not a multiple of 8*W, so the padding is exercised too


def _inputs(rank: int, dev: torch.device, comm: Any, seed: int) -> List[torch.Tensor]:
    """A tensor and nonzero error buffers (zeros would hide an update that writes zeros)."""
    import compcomm

    g = torch.Generator().manual_seed(seed + rank)
    t = torch.randn(N, generator=g).to(dev)
    we, se = compcomm.error_buffers(t, group=comm)
    we.copy_((0.1 * torch.randn(we.numel(), generator=g)).to(dev))
    se.copy_((0.1 * torch.randn(se.numel(), generator=g)).to(dev))
    return [t, we, se]


def _fault(side: Side, dying: int, call: Any, res: Dict[str, Any]) -> None:
    """The dying rank makes its call with the exit hook set (and never returns); the others record
    whether their call returned (CUDA: the commit was enqueued) and how long until the error."""
    if side.rank == dying:
        os.environ["COMPCOMM_TEST_FAULT"] = "exit_after_header"
        call()
        raise RuntimeError("COMPCOMM_TEST_FAULT=exit_after_header did not end this process")
    t0 = time.monotonic()
    try:
        call(returned=res)
        res["error"] = None
    except Exception as e:  # noqa: BLE001  (the type is what the test checks)
        res["error"] = type(e).__name__
        res["error_msg"] = str(e)[:600]
    res["error_s"] = time.monotonic() - t0


def nccl_dies_after_header(side: Side, gate: bool) -> Dict[str, Any]:
    """Native NCCL. Every rank warms up with one compressed allreduce of size N (connections made,
    the size's host check done, the workspace holding that call's finite records), then takes fresh
    inputs of the same size; the last rank dies after its header. The survivors' call returns (its
    header check passed; the all_to_all, the records' all_gather and the commit are enqueued), the
    watchdog aborts the communicator at T, and ``synchronize`` raises. ``gate=False`` sets
    ``COMPCOMM_TEST_FAULT=no_commit_gate`` on the survivors: the commit then runs without the gate,
    which is how a test shows the state check would catch a missing gate."""
    import compcomm
    from compcomm._nccl import shutdown_nccl

    dying = side.world - 1
    res: Dict[str, Any] = {"rank": side.rank}
    dev = _device()
    comm = _native(side)
    res["flag"] = comm.abort_flag != 0
    t, we, se = _inputs(side.rank, dev, comm, 100)
    compcomm.compressed_allreduce(t, we, se, group=comm, timeout=SETUP)
    comm.synchronize(SETUP)
    torch.cuda.synchronize(dev)
    t, we, se = _inputs(side.rank, dev, comm, 200)
    if side.rank != dying and not gate:
        os.environ["COMPCOMM_TEST_FAULT"] = "no_commit_gate"
    before = [x.clone() for x in (t, we, se)]
    side.barrier("abort/ready")

    def call(returned: Any = None) -> None:
        compcomm.compressed_allreduce(t, we, se, group=comm, timeout=T)
        if returned is not None:
            returned["returned"] = True  # the commit is enqueued behind the exchange
            comm.synchronize(10 * T)  # the call only enqueues: the error surfaces here

    _fault(side, dying, call, res)
    res["closed"] = comm.closed
    torch.cuda.synchronize(dev)  # the gated (or, gate=False, ungated) commit has run
    res["unchanged"] = [torch.equal(a, b) for a, b in zip(before, (t, we, se))]
    _attempt(res, "second", lambda: compcomm.compressed_allreduce(t, we, se, group=comm, timeout=T))
    res["shutdown_s"] = _time(lambda: shutdown_nccl(timeout=10.0))
    return res


def gloo_dies_after_header(side: Side) -> Dict[str, Any]:
    """gloo (torch process group on the CPU, compcomm's TorchCommunicator): the last rank dies after
    its header; the survivors' call raises a typed error and leaves the tensors unchanged; the next
    call raises at once (the group is marked broken) instead of waiting for a timeout."""
    import compcomm
    from compcomm._comm import resolve

    dying = side.world - 1
    res: Dict[str, Any] = {"rank": side.rank}
    dev = torch.device("cpu")
    t, we, se = _inputs(side.rank, dev, None, 100)
    compcomm.compressed_allreduce(t, we, se, timeout=SETUP)
    t, we, se = _inputs(side.rank, dev, None, 200)
    before = [x.clone() for x in (t, we, se)]
    side.barrier("abort/ready")

    def call(returned: Any = None) -> None:
        compcomm.compressed_allreduce(t, we, se, timeout=T)
        if returned is not None:
            returned["returned"] = True

    _fault(side, dying, call, res)
    res["unchanged"] = [torch.equal(a, b) for a, b in zip(before, (t, we, se))]
    res["broken"] = resolve(None).broken
    _attempt(res, "second", lambda: compcomm.compressed_allreduce(t, we, se, timeout=10 * T))
    res["second_unchanged"] = [torch.equal(a, b) for a, b in zip(before, (t, we, se))]
    return res


def gloo_hung_peer(side: Side) -> Dict[str, Any]:
    """gloo: the last rank stays alive but makes no call; the others' call times out at T
    (CommTimeoutError) and the group is marked broken: the next call raises at once, with the same
    type, rather than waiting another timeout (or pairing with the timed-out op)."""
    import compcomm
    from compcomm._comm import resolve

    silent = side.world - 1
    res: Dict[str, Any] = {"rank": side.rank}
    t, we, se = _inputs(side.rank, torch.device("cpu"), None, 100)
    compcomm.compressed_allreduce(t, we, se, timeout=SETUP)
    before = [x.clone() for x in (t, we, se)]
    side.barrier("hung/ready")
    if side.rank != silent:
        _attempt(res, "error", lambda: compcomm.compressed_allreduce(t, we, se, timeout=T))
        res["broken"] = resolve(None).broken
        _attempt(res, "second", lambda: compcomm.compressed_allreduce(t, we, se, timeout=10 * T))
        res["unchanged"] = [torch.equal(a, b) for a, b in zip(before, (t, we, se))]
    side.barrier("hung/done")  # the silent rank waits here, alive, while the others time out
    return res


def _time(call: Any) -> float:
    t0 = time.monotonic()
    call()
    return time.monotonic() - t0


def _cancellable(rank: int, collective: Any, garbage: float, with_sync: bool) -> Any:
    """A TorchCommunicator over the default group that behaves like a cancellable one (NCCL): it
    has an abort flag (``do_abort_flag``); once ``comm.cancel`` is set, each ``collective``
    ("all_to_all", "reduce_scatter" or "all_gather") sets the flag and leaves finite ``garbage`` in its output,
    raising nothing on the host. With ``with_sync`` it has a ``synchronize`` that raises once the
    flag is set."""
    from compcomm._buffers import tensor_of
    from compcomm._comm import TorchCommunicator
    from compcomm.errors import BackendError

    class Cancellable(TorchCommunicator):
        def __init__(self) -> None:
            super().__init__(None)
            self.flag = torch.zeros(1, dtype=torch.int32)
            self.cancel = False

        def do_abort_flag(self) -> int:
            return self.flag.data_ptr()

        def _cancelled(self, name: str, recv: Any) -> None:
            if self.cancel and name == collective:
                self.flag.fill_(1)
                tensor_of(recv).fill_(garbage)

        def do_all_to_all(self, send: Any, recv: Any, opts: Any) -> None:
            super().do_all_to_all(send, recv, opts)
            self._cancelled("all_to_all", recv)

        def do_reduce_scatter(self, send: Any, recv: Any, op: Any, opts: Any) -> None:
            super().do_reduce_scatter(send, recv, op, opts)
            self._cancelled("reduce_scatter", recv)

        def do_all_gather(self, send: Any, recv: Any, opts: Any) -> None:
            super().do_all_gather(send, recv, opts)
            self._cancelled("all_gather", recv)

    comm = Cancellable()
    if with_sync:
        def synchronize(timeout_s: float) -> None:
            if comm.flag.item():
                raise BackendError(f"[rank {rank}] cancelled", "synchronize", "test", 0, rank)

        comm.synchronize = synchronize
    return comm


def compressor_cancelled(rank: int, world: int, with_sync: bool) -> Dict[str, Any]:
    """OneBitCompressor.average_ (the 1-bit optimizers' step average) over gloo, through a
    TorchCommunicator that behaves like a cancellable one (NCCL): it has an abort flag, and a
    ``synchronize`` that raises once the flag is set. In the second step every all_to_all is
    "cancelled" (flag set, finite garbage received). With ``synchronize`` the average must raise
    before any commit; without it (a cancellable communicator that cannot be asked) the gate still
    leaves everything unchanged, but silently. Either way: buckets and error buffers unchanged."""
    from compcomm.compress import OneBitCompressor

    comm = _cancellable(rank, "all_to_all", 0x3F, with_sync)
    comp = OneBitCompressor(comm, timeout=SETUP)
    g = torch.Generator().manual_seed(rank)
    keys, numels = ["a", "b"], [1000, 77]
    cpu = torch.device("cpu")
    buckets = [torch.randn(n, generator=g) for n in numels]
    comp.average_(keys, numels, lambda i: buckets[i], cpu)  # error buffers now nonzero
    buckets = [torch.randn(n, generator=g) for n in numels]
    before = [b.clone() for b in buckets] + [x.clone() for k in keys for x in comp._buffers[k][:2]]
    comm.cancel = True
    res: Dict[str, Any] = {"rank": rank}
    try:
        comp.average_(keys, numels, lambda i: buckets[i], cpu)
        res["error"] = None
    except Exception as e:  # noqa: BLE001
        res["error"] = type(e).__name__
    after = list(buckets) + [x for k in keys for x in comp._buffers[k][:2]]
    res["unchanged"] = [torch.equal(a, b) for a, b in zip(before, after)]
    return res


def zero_step_cancelled(rank: int, world: int, with_sync: bool,
                        collective: str = "reduce_scatter") -> Dict[str, Any]:
    """ZeroOptimizer (stage 1, Adam) over gloo through a cancellable TorchCommunicator (as in
    :func:`compressor_cancelled`) whose gradient reduce-scatters (``collective``; "all_gather":
    the parameters' all-gather after the update) are "cancelled" in the second
    step: finite garbage arrives, the flag is set, nothing raises on the host. With
    ``synchronize`` the step must raise before the update, parameters and Adam state unchanged;
    without it (the mutation) the step goes on and writes garbage-derived parameters."""
    from compcomm.zero import ZeroOptimizer

    comm = _cancellable(rank, collective, 7.0, with_sync)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    z = ZeroOptimizer(model.parameters(), torch.optim.Adam, stage=1, process_group=comm,
                      module=model, optimizer_kwargs={"lr": 1e-2})
    g = torch.Generator().manual_seed(10 + rank)

    def backward() -> None:
        x, y = torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()

    backward()
    z.step()
    params = [p.detach().clone() for p in model.parameters()]
    state = [v.clone() for s in z.optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor)]
    backward()
    comm.cancel = True
    res: Dict[str, Any] = {"rank": rank}
    try:
        z.step()
        res["error"] = None
    except Exception as e:  # noqa: BLE001
        res["error"] = type(e).__name__
    res["params_unchanged"] = all(torch.equal(a, p) for a, p in zip(params, model.parameters()))
    res["params_garbage"] = any(bool((p == 7.0).any()) for p in model.parameters())
    now = [v for s in z.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    res["state_unchanged"] = len(now) == len(state) and all(
        torch.equal(a, b) for a, b in zip(state, now))
    return res


def compressor_abort_after_wait(rank: int, world: int) -> Dict[str, Any]:
    """OneBitCompressor.average_ on a cancellable communicator whose abort flag is set just after
    the wait for the exchanges' device work found none (an abort after everything arrived): the
    received data is complete, so every bucket must commit -- the result equals the same average
    on a plain communicator. (With the gate still on, the commits would be skipped silently.)"""
    from compcomm._comm import TorchCommunicator
    from compcomm.compress import OneBitCompressor

    comm = _cancellable(rank, None, 0, False)
    comm.synchronize = lambda timeout_s: comm.flag.fill_(1)  # waited: no abort; one comes now
    plain = OneBitCompressor(TorchCommunicator(None), timeout=SETUP)
    late = OneBitCompressor(comm, timeout=SETUP)
    cpu = torch.device("cpu")
    numels = [1000, 77]
    g = torch.Generator().manual_seed(rank)
    same = []
    for step in range(2):
        comm.flag.zero_()
        buckets = [torch.randn(n, generator=g) for n in numels]
        a, b = [x.clone() for x in buckets], [x.clone() for x in buckets]
        plain.average_(["a", "b"], numels, lambda i: a[i], cpu)
        late.average_(["a", "b"], numels, lambda i: b[i], cpu)
        same.append(all(torch.equal(x, y) for x, y in zip(a, b)) and
                    not all(torch.equal(x, y) for x, y in zip(a, buckets)))
    return {"rank": rank, "same": same}
