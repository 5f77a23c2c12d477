"""Rank bodies and their launcher for tests/test_nccl_faults.py: a dead or hung peer on compcomm's
native NCCL communicator, with every rank on ONE GPU.

Emulated hosts. NCCL refuses two ranks of one communicator on the same GPU of the same host
("Duplicate GPU detected"); a host is what NCCL_HOSTID names (NCCL hashes it instead of hostname +
boot id, once per process, at the first communicator). So each rank gets its own NCCL_HOSTID and
NCCL then connects the ranks as separate machines would: sockets over loopback
(NCCL_SOCKET_IFNAME=lo), with InfiniBand, P2P, shared memory and NVLink SHARP off -- as the training
benchmark does over its namespaces (compcomm.bench.netns.Network.nccl_env). The environment is set
before the rank's interpreter starts, so it is in place before anything loads or initialises NCCL.

NCCL_CUMEM_ENABLE. With cuMem off (the default here) NCCL has no run-time connection: every
ring/tree connection is made inside ncclCommInitRank, so a collective whose peer is silent hangs on
the device (its kernel spins) and compcomm's watchdog sees its completion event miss the deadline.
With cuMem on, the first collective of each algorithm connects inside the call, on the host, so a
silent peer leaves the call itself stuck in NCCL: the watchdog must abort it from another thread
(blocking communicator) or the call's polling loop must give up (non-blocking). ``cumem=True``
selects that second path.

Why not compcomm.testing.run_ranks: it cannot tolerate a rank that dies on purpose (it reports the
death and kills the others) and does not report how the ranks exit. :func:`launch` does both: the
rank planned to die may exit without reporting, and every other rank's exit code is returned, so a
test sees a crash at teardown (e.g. -11, a segfault) or a rank that never exits. The ranks
coordinate over a TCPStore held by the launching process (not over a torch process group, whose own
teardown with a dead member is not what is under test); :class:`Side` also bootstraps the NCCL
communicator, as the mpi4py-like ``group`` that ``make_nccl_communicator`` accepts.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

T = 3.0  # seconds: the timeout every faulted call gets
LIMIT = 2 * T  # issue 14: a survivor raises within 2x the timeout
SETUP = 120.0  # seconds for everything that is not the fault under test (init, warm-up, barriers)
SHUTDOWN_LIMIT = 15.0  # seconds shutdown_nccl(timeout=10) may take
N = 1 << 16  # all_reduce elements
N_COMPRESSED = 4099
N_UNSEEN = 1000  # a size the communicator has not run: no earlier header where this call's lands
BIG = 1 << 26  # 256 MiB of float32: an all_reduce still moving when a peer is killed under it
TYPED = ("CommTimeoutError", "BackendError")


def emulated_host_env(rank: int, *, cumem: bool = False, tag: str = "") -> Dict[str, str]:
    """Environment that makes ``rank`` a separate host for NCCL, sharing the local GPU(s)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 1
    return {
        "NCCL_HOSTID": f"compcomm-fault-{tag or os.getpid()}-host{rank}",
        "NCCL_SOCKET_IFNAME": "lo",
        "NCCL_IB_DISABLE": "1",
        "NCCL_P2P_DISABLE": "1",
        "NCCL_SHM_DISABLE": "1",
        "NCCL_NVLS_ENABLE": "0",
        "NCCL_CUMEM_ENABLE": "1" if cumem else "0",
        "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"),  # NCCL's own reason, in the test log
        "LOCAL_RANK": str(rank % max(1, gpus)),
        "OMP_NUM_THREADS": "1",
    }


# ---------------------------------------------------------------------------------------------
# The side channel and the launcher.


class Side:
    """One rank's side channel over the launcher's TCPStore: named barriers, and ``bcast`` so that
    it can bootstrap ``make_nccl_communicator(group=side)`` (duck-typed as an mpi4py communicator:
    ``Get_rank``, ``Get_size``, ``bcast``). It never goes through NCCL or a torch process group."""

    def __init__(self, store: Any, rank: int, world: int) -> None:
        self.store, self.rank, self.world = store, rank, world
        self._bcasts = 0

    def Get_rank(self) -> int:  # noqa: N802  (mpi4py's name)
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.world

    def bcast(self, obj: Any, root: int = 0) -> Any:
        self._bcasts += 1
        key = f"bcast/{self._bcasts}"
        if self.rank == root:
            self.store.set(key, pickle.dumps(obj))
            return obj
        return pickle.loads(self.store.get(key))

    def barrier(self, name: str, count: Optional[int] = None) -> None:
        """Wait until ``count`` ranks (default: all) have reached barrier ``name``."""
        if self.store.add(f"barrier/{name}", 1) == (count or self.world):
            self.store.set(f"barrier/{name}/open", b"1")
        self.store.wait([f"barrier/{name}/open"], datetime.timedelta(seconds=SETUP))


@contextlib.contextmanager
def _environ(env: Dict[str, str]) -> Iterator[None]:
    """``env`` in os.environ for the block (a child spawned in it starts with it)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _rank_main(rank: int, world: int, port: int, pg_backend: Optional[str],
               fn: Callable[..., Any], args: tuple, results: Any) -> None:
    try:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=SETUP))
        if pg_backend is not None:
            dist.init_process_group(pg_backend, store=dist.PrefixStore("pg/", store), rank=rank,
                                    world_size=world, timeout=datetime.timedelta(seconds=SETUP))
        out = fn(Side(store, rank, world), *args)
        results.put((rank, True, pickle.dumps(out)))  # plain pickle: no shared-memory fds
    except BaseException as e:  # report everything, SystemExit included
        tb = traceback.format_exc()
        try:
            payload = pickle.dumps((e, tb))
        except Exception:  # the exception itself does not pickle
            payload = pickle.dumps((RuntimeError(f"{type(e).__name__}: {e}"), tb))
        results.put((rank, False, payload))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


@dataclass
class Launch:
    """What :func:`launch` saw: each rank's result (None where it reported nothing) and exit code
    (None: it had not exited ``exit_timeout`` s after the last report and was killed)."""

    results: List[Any]
    exitcodes: List[Optional[int]]
    reported: List[bool]
    dies: Optional[int]

    def assert_clean_exit(self, dying_codes: tuple = (0, -signal.SIGKILL)) -> None:
        """Every rank but the dying one exited 0 by itself (no crash at teardown, no hang); the
        dying one reported nothing and exited with one of ``dying_codes``."""
        for r, code in enumerate(self.exitcodes):
            if r == self.dies:
                assert not self.reported[r], f"rank {r} was to die but reported {self.results[r]}"
                assert code in dying_codes, f"dying rank {r} exited with {code}, not {dying_codes}"
            else:
                assert code == 0, (
                    f"rank {r} exited with {code} after reporting (None: did not exit in time and "
                    f"was killed; negative: killed by that signal, -11 a segfault, -6 an abort)")


def launch(world: int, fn: Callable[..., Any], *args: Any, pg_backend: Optional[str] = None,
           dies: Optional[int] = None, cumem: bool = False, timeout: float = 180.0,
           exit_timeout: float = 40.0) -> Launch:
    """Run ``fn(side, *args)`` on ``world`` fresh processes, each an emulated NCCL host.

    Rank ``dies`` may exit without reporting (that is the fault under test); any other rank that
    raises has its exception re-raised here with its traceback as a note, and one that exits
    without reporting (a crash) or has not reported within ``timeout`` s fails the launch. Then
    each rank gets ``exit_timeout`` s to exit by itself; what is still running is killed.
    ``pg_backend``: also ``torch.distributed.init_process_group(pg_backend)`` on every rank.
    """
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=SETUP),
                          wait_for_workers=False)
    tag = f"{os.getpid()}-{store.port}"
    procs = []
    for r in range(world):
        p = ctx.Process(target=_rank_main, daemon=True,
                        args=(r, world, store.port, pg_backend, fn, args, results))
        with _environ(emulated_host_env(r, cumem=cumem, tag=tag)):
            p.start()
        procs.append(p)
    out: Dict[int, Any] = {}
    need = set(range(world)) - {dies}
    deadline = time.monotonic() + timeout
    try:
        while not need <= set(out):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"launch: rank(s) {sorted(need - set(out))} did not report "
                                   f"within {timeout} s (hung)")
            try:
                rank, ok, payload = results.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                gone = [r for r in sorted(need - set(out)) if procs[r].exitcode is not None]
                if gone:
                    try:  # what it wrote before exiting may still be in the pipe
                        rank, ok, payload = results.get(timeout=2.0)
                    except queue_mod.Empty:
                        codes = [procs[r].exitcode for r in gone]
                        raise RuntimeError(
                            f"launch: rank(s) {gone} exited with {codes} without reporting "
                            "(negative: killed by that signal, -11 a segfault)") from None
                else:
                    continue
            value = pickle.loads(payload)
            if not ok:
                exc, tb = value
                if hasattr(exc, "add_note"):
                    exc.add_note(f"--- raised on rank {rank} ---\n{tb}")
                raise exc
            out[rank] = value
        end = time.monotonic() + exit_timeout
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
        return Launch([out.get(r) for r in range(world)], [p.exitcode for p in procs],
                      [r in out for r in range(world)], dies)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        del store


# ---------------------------------------------------------------------------------------------
# Rank bodies: each returns a dict of what it saw; the tests assert on it.


def _attempt(res: Dict[str, Any], key: str, call: Callable[[], Any]) -> None:
    """Run ``call``; record under ``key`` the type name of what it raised (None: nothing), under
    ``key_s`` the seconds it took, under ``key_msg`` the message."""
    t0 = time.monotonic()
    try:
        call()
        res[key] = None
    except Exception as e:  # noqa: BLE001  (the type is what the test checks)
        res[key] = type(e).__name__
        res[key + "_msg"] = str(e)[:600]
    res[key + "_s"] = time.monotonic() - t0


def _timed(call: Callable[[], Any]) -> float:
    t0 = time.monotonic()
    call()
    return time.monotonic() - t0


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _stream(dev: torch.device) -> int:
    return torch.cuda.current_stream(dev).cuda_stream


def _native(side: Side, blocking: bool = True) -> Any:
    """compcomm's NCCL communicator over the side channel, on this rank's GPU."""
    from compcomm._nccl import make_nccl_communicator

    return make_nccl_communicator(side, device=torch.cuda.current_device(), timeout=SETUP,
                                  blocking=blocking)


def _compressed_inputs(rank: int, dev: torch.device, comm: Any = None,
                       n: int = N_COMPRESSED) -> List[torch.Tensor]:
    import compcomm

    g = torch.Generator().manual_seed(100 + rank)
    t = torch.randn(n, generator=g).to(dev)
    we, se = compcomm.error_buffers(t, group=comm)
    return [t, we, se]


def hung_peer(side: Side, blocking: bool, warm: bool) -> Dict[str, Any]:
    """The last rank stays alive but stops calling NCCL (it waits in the side channel, as a rank
    stuck in a data loader or sleeping would); the others call the communicator's all_reduce, then
    -- on a fresh communicator -- compcomm.compressed_allreduce, each with timeout T. Each must
    raise CommTimeoutError within 2T (or, W >= 3, BackendError when another survivor's abort
    reaches it before its own deadline), find the communicator closed, raise at once on the next
    call, leave the compressed call's tensors unchanged, and shut down in bounded time. ``warm``:
    the ranks run each operation together once first (connections made; the fault is on the
    device); else the faulted call is the first one. The faulted compressed call has a size the
    warm-up did not: the headers it reads back after the watchdog's abort were never received, and
    stale ones of another size would read as "ranks passed different sizes" were the abort not
    checked first (Communicator::check_open)."""
    import compcomm
    from compcomm._buffers import buffer_of
    from compcomm._nccl import shutdown_nccl

    silent = side.world - 1
    res: Dict[str, Any] = {"rank": side.rank}
    dev = _device()
    st = _stream(dev)

    # 1. The communicator's all_reduce.
    comm = _native(side, blocking)
    buf = torch.ones(N, device=dev)
    if warm:
        comm.all_reduce(buffer_of(buf), timeout_s=SETUP, stream=st)
        comm.synchronize(SETUP)
        res["warm_sum"] = float(buf[0].item())
    side.barrier("hung/1")
    if side.rank != silent:

        def all_reduce() -> None:
            comm.all_reduce(buffer_of(buf), timeout_s=T, stream=st)
            comm.synchronize(10 * T)  # the call only enqueues: the error surfaces here

        _attempt(res, "all_reduce", all_reduce)
        res["closed"] = comm.closed
        _attempt(res, "after", lambda: comm.all_reduce(buffer_of(buf), timeout_s=T, stream=st))
    side.barrier("hung/2")  # the silent rank waits here, alive, while the others time out
    res["shutdown1_s"] = _timed(lambda: shutdown_nccl(timeout=10.0))

    # 2. compcomm.compressed_allreduce on a fresh communicator (every rank makes it).
    comm = _native(side, blocking)
    if warm:
        compcomm.compressed_allreduce(*_compressed_inputs(side.rank, dev, comm), group=comm,
                                      timeout=SETUP)
        torch.cuda.synchronize(dev)
    t, we, se = _compressed_inputs(side.rank, dev, comm, n=N_UNSEEN)
    side.barrier("hung/3")
    if side.rank != silent:
        before = [x.clone() for x in (t, we, se)]

        def compressed() -> None:
            compcomm.compressed_allreduce(t, we, se, group=comm, timeout=T)
            comm.synchronize(10 * T)

        _attempt(res, "compressed", compressed)
        res["compressed_closed"] = comm.closed
        torch.cuda.synchronize(dev)
        res["compressed_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, (t, we, se)))
    side.barrier("hung/4")
    res["shutdown_s"] = _timed(lambda: shutdown_nccl(timeout=10.0))
    return res


def dead_peer(side: Side, how: str) -> Dict[str, Any]:
    """The last rank's process dies after a warm-up in which every rank ran an all_reduce and a
    compressed allreduce together (so every connection exists). ``how``:

    - ``"exit_between"``: it calls ``os._exit(0)`` between collectives; a second later the others
      call compcomm.compressed_allreduce (then the communicator's all_reduce);
    - ``"kill_during"``: every rank starts a 256 MiB all_reduce and the last rank SIGKILLs itself
      right after enqueuing its part, mid-collective; the others wait for theirs (then call
      compcomm.compressed_allreduce).

    Each survivor's first faulted call must raise a typed error (CommTimeoutError, or BackendError
    when NCCL sees the closed socket first) within 2T, the second at once, the compressed call
    must leave its tensors unchanged, and shutdown must be bounded."""
    import compcomm
    from compcomm._buffers import buffer_of
    from compcomm._nccl import shutdown_nccl

    dying = side.world - 1
    res: Dict[str, Any] = {"rank": side.rank}
    dev = _device()
    st = _stream(dev)
    comm = _native(side)
    buf = torch.ones(BIG if how == "kill_during" else N, device=dev)
    t, we, se = _compressed_inputs(side.rank, dev, comm)
    comm.all_reduce(buffer_of(buf), timeout_s=SETUP, stream=st)
    compcomm.compressed_allreduce(t, we, se, group=comm, timeout=SETUP)
    comm.synchronize(SETUP)
    torch.cuda.synchronize(dev)
    res["warm_sum"] = float(buf[0].item())
    side.barrier("dead/warm")
    before = [x.clone() for x in (t, we, se)]

    def all_reduce() -> None:
        comm.all_reduce(buffer_of(buf), timeout_s=T, stream=st)
        if side.rank == dying and how == "kill_during":
            os.kill(os.getpid(), signal.SIGKILL)
        comm.synchronize(10 * T)

    def compressed() -> None:
        compcomm.compressed_allreduce(t, we, se, group=comm, timeout=T)
        comm.synchronize(10 * T)

    if how == "exit_between":
        if side.rank == dying:
            os._exit(0)  # no atexit, no NCCL teardown: its sockets close under the others
        time.sleep(1.0)
        _attempt(res, "first", compressed)
        _attempt(res, "second", all_reduce)
    elif how == "kill_during":
        _attempt(res, "first", all_reduce)
        _attempt(res, "second", compressed)
    else:
        raise ValueError(f"dead_peer: unknown how={how!r}")
    res["closed"] = comm.closed
    torch.cuda.synchronize(dev)
    res["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, (t, we, se)))
    res["shutdown_s"] = _timed(lambda: shutdown_nccl(timeout=10.0))
    return res


def torch_default_hung(side: Side) -> Dict[str, Any]:
    """Under ``torch.distributed.init_process_group("nccl")`` (the launcher's pg_backend): the
    default path, ``compcomm.compressed_allreduce(t, we, se)`` with group=None, which resolves to
    compcomm's native NCCL communicator made from torch's default group. After a warm-up call by
    all ranks the last rank stops calling; the others' call with ``timeout=T`` must raise
    CommTimeoutError within 2T (as in hung_peer), leave the tensors unchanged and close the
    communicator; compcomm.shutdown() is bounded. The knob is the call's ``timeout`` argument: it
    bounds each collective of the native communicator, whose watchdog aborts it; the process
    group's own timeout only bounds torch's collectives (here the unique-id broadcast)."""
    import compcomm
    from compcomm import _C
    from compcomm._comm import resolve

    silent = side.world - 1
    res: Dict[str, Any] = {"rank": side.rank}
    dev = _device()
    t, we, se = _compressed_inputs(side.rank, dev)  # group=None: torch's default group
    compcomm.compressed_allreduce(t, we, se)  # warm-up, also makes the native communicator
    torch.cuda.synchronize(dev)
    comm = resolve(None)
    res["communicator"] = type(comm).__name__
    res["native"] = isinstance(comm, _C.NcclCommunicator)
    side.barrier("torch/1")
    if side.rank != silent:
        before = [x.clone() for x in (t, we, se)]
        _attempt(res, "compressed", lambda: compcomm.compressed_allreduce(t, we, se, timeout=T))
        res["closed"] = getattr(comm, "closed", None)
        torch.cuda.synchronize(dev)
        res["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, (t, we, se)))
        # No second call here: group=None would now make a NEW native communicator (the closed one
        # is replaced), a collective over torch's group that the silent rank never joins.
    side.barrier("torch/2")
    res["shutdown_s"] = _timed(compcomm.shutdown)
    return res


def one_rank_rejects(side: Side) -> Dict[str, Any]:
    """The default path under init_process_group("nccl"): the last rank passes a bad argument (a
    float64 CUDA tensor, a CPU tensor, then all three on the CPU), the others good ones. The last rank raises its own
    TypeError/ValueError, the others RankMismatchError, each well within the timeout T (the
    rejecting rank sends a record saying so in the header all-gather, on the GPU); nothing
    changes; the next call pairs correctly (a constant input without padding is averaged
    exactly)."""
    import compcomm

    odd = side.rank == side.world - 1
    res: Dict[str, Any] = {"rank": side.rank}
    dev = _device()
    t, we, se = _compressed_inputs(side.rank, dev)
    compcomm.compressed_allreduce(t, we, se)  # warm-up: makes the native communicator
    torch.cuda.synchronize(dev)
    res["exact"] = []
    cases = (("float64", lambda: (t.double(), we, se)), ("cpu", lambda: (t.cpu(), we, se)),
             ("all_cpu", lambda: (t.cpu(), we.cpu(), se.cpu())))  # (the core refused that one)
    for case, bad in cases:
        before = [x.clone() for x in (t, we, se)]
        args = bad() if odd else (t, we, se)
        _attempt(res, case, lambda: compcomm.compressed_allreduce(*args, timeout=T))
        torch.cuda.synchronize(dev)
        res[case + "_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, (t, we, se)))
        u = torch.full((compcomm.padded_numel(1000, side.world),), float(side.rank + 1), device=dev)
        ue, us = compcomm.error_buffers(u)
        compcomm.compressed_allreduce(u, ue, us, timeout=T)
        res["exact"].append(bool(torch.equal(u, torch.full_like(u, (side.world + 1) / 2))))
    side.barrier("reject/done")
    compcomm.shutdown()
    return res


# ---------------------------------------------------------------------------------------------
# CPU check of the launcher itself (no NCCL, no GPU).


def launcher_check(side: Side, how: str) -> Dict[str, Any]:
    """The last rank dies (``how``: "exit" or "kill") or raises ("raise") after a barrier; the
    others meet again without it and report."""
    side.barrier("all")
    if side.rank == side.world - 1:
        if how == "exit":
            os._exit(0)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError(f"rank {side.rank} raised on purpose")
    side.barrier("survivors", side.world - 1)
    env = os.environ
    return {"rank": side.rank, "hostid": env.get("NCCL_HOSTID"),
            "ifname": env.get("NCCL_SOCKET_IFNAME"), "cumem": env.get("NCCL_CUMEM_ENABLE")}
