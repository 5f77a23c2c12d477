"""Test helpers: run a function on W real processes joined by a torch.distributed process group."""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import shutil
import socket
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

__all__ = ["run_ranks", "free_port", "mpirun_command", "mirrored_peers"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when ``parent`` (the process that started it) dies, also of SIGTERM or
    SIGKILL, which run no cleanup there (Linux ``PR_SET_PDEATHSIG``; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        return
    if os.getppid() != parent:  # it died before the prctl: nothing will signal us
        os._exit(137)


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    fn: Callable[..., Any],
    args: tuple,
    env: Dict[str, str],
    results: Any,
    parent: int = 0,
) -> None:
    if parent:
        _die_with_parent(parent)
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    try:
        import datetime

        import torch.distributed as dist

        if backend != "none":
            dist.init_process_group(
                backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120)
            )
        out = fn(rank, world_size, *args)
        results.put((rank, True, pickle.dumps(out)))  # plain pickle: no shared-memory fds
    except BaseException as e:  # report everything, including SystemExit from the body
        tb = traceback.format_exc()
        try:
            results.put((rank, False, (e, tb)))
        except Exception:  # the exception itself does not pickle
            results.put((rank, False, (RuntimeError(f"{type(e).__name__}: {e}"), tb)))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    backend: str = "gloo",
    timeout: float = 300.0,
    env: Optional[Dict[str, str]] = None,
) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes; return their results.

    Each process joins a ``torch.distributed`` group with ``backend`` (``"none"``: no group) on a
    free localhost port. ``fn`` and ``args`` must pickle (a module-level function). If a rank
    raises, the other ranks are killed and that rank's exception is re-raised here with the rank's
    traceback attached as a note; if ranks are still running after ``timeout`` seconds, they are
    killed and ``TimeoutError`` names them. The ranks get SIGKILL when this process dies (Linux:
    ``PR_SET_PDEATHSIG``), so killing the launcher, even with SIGTERM or SIGKILL, leaves none.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(r, world_size, port, backend, fn, args, dict(env or {}), results, os.getpid()),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: Dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(out))
                raise TimeoutError(f"run_ranks: rank(s) {missing} did not finish within {timeout} s")
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(
                        f"run_ranks: rank(s) {dead} died (exit codes "
                        f"{[procs[r].exitcode for r in dead]}) without reporting"
                    ) from None
                continue
            if not ok:
                exc, tb = value
                if hasattr(exc, "add_note"):
                    exc.add_note(f"--- raised on rank {rank} ---\n{tb}")
                raise exc
            out[rank] = pickle.loads(value)
    finally:
        for p in procs:
            if p.is_alive():
                p.join(timeout=5 if len(out) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world_size)]


@functools.lru_cache(maxsize=None)
def _mpirun_flavour(mpirun: str) -> str:
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    text = out.stdout + out.stderr
    return "openmpi" if "Open MPI" in text or "OpenRTE" in text else "other"


def mpirun_command(
    np: int,
    script: str,
    *args: str,
    python: Optional[str] = None,
    allow_early_exit: bool = False,
    mca: Optional[Dict[str, str]] = None,
) -> List[str]:
    """The command line that runs ``python script args...`` on ``np`` MPI ranks of this machine.

    The one place that knows the launcher's flags. For Open MPI: ``--oversubscribe`` (more ranks
    than cores is normal in tests and on shared machines) and ``--allow-run-as-root`` (containers
    run as root; harmless otherwise); shared-memory transport works as is in the containers tried
    (Debian Open MPI 4.1), so no ``--mca`` settings are forced. Other launchers get ``-n np``.

    Parameters
    ----------
    np : int
        Number of ranks.
    script : str
        Path of the Python script each rank runs (the first argument after the interpreter).
    python : str, optional
        Interpreter (default: ``sys.executable``).
    allow_early_exit : bool
        Let a rank exit without ``MPI_Finalize`` without mpirun killing the others (Open MPI:
        ``--mca orte_allowed_exit_without_sync 1``), to test how survivors see a dead peer.
    mca : dict, optional
        Further Open MPI MCA settings (``--mca key value``).

    Raises
    ------
    FileNotFoundError
        No ``mpirun`` (or ``mpiexec``) on ``PATH``.
    ValueError
        ``mca`` given and the launcher is not Open MPI's.
    """
    if np < 1:
        raise ValueError(f"mpirun_command: argument 'np' must be >= 1, got {np}")
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        raise FileNotFoundError("mpirun_command: no mpirun or mpiexec on PATH (install Open MPI)")
    cmd = [mpirun]
    if _mpirun_flavour(mpirun) == "openmpi":
        cmd += ["--allow-run-as-root", "--oversubscribe", "-np", str(np)]
        if allow_early_exit:
            cmd += ["--mca", "orte_allowed_exit_without_sync", "1"]
        for key, value in (mca or {}).items():
            cmd += ["--mca", key, value]
    elif mca:
        raise ValueError(f"mpirun_command: argument 'mca' needs Open MPI's mpirun, not {mpirun}")
    else:
        cmd += ["-n", str(np)]
    return cmd + [python or sys.executable, script, *map(str, args)]


def mirrored_peers(world: int) -> Any:
    """A Communicator for rank 0 of a ``world``-rank group whose peers send exactly what it sends
    (copies on its own device): a W-rank compressed step in one process, on the CPU or one GPU,
    with no network (the per-bucket overhead benchmark and its tests). Its all-reduce of a sum
    multiplies by ``world`` (W equal summands); reduce-scatter is not provided."""
    from . import _C
    from ._buffers import tensor_of

    class MirroredPeers(_C.Communicator):
        def __init__(self) -> None:
            _C.Communicator.__init__(self)

        def rank(self) -> int:
            return 0

        def size(self) -> int:
            return world

        def backend_name(self) -> str:
            return "test:mirror"

        def do_all_to_all(self, send, recv, opts) -> None:  # type: ignore[no-untyped-def]
            s, r = tensor_of(send), tensor_of(recv)
            row = s.numel() // world
            r.view(world, row).copy_(s[:row].expand(world, row))

        def do_all_gather(self, send, recv, opts) -> None:  # type: ignore[no-untyped-def]
            tensor_of(recv).view(world, -1).copy_(tensor_of(send).expand(world, -1))

        def do_all_reduce(self, buf, op, opts) -> None:  # type: ignore[no-untyped-def]
            if op == _C.ReduceOp.sum:
                tensor_of(buf).mul_(world)

        def do_reduce_scatter(self, send, recv, op, opts) -> None:  # type: ignore[no-untyped-def]
            raise NotImplementedError("mirrored_peers has no reduce-scatter")

        def do_broadcast(self, buf, root, opts) -> None:  # type: ignore[no-untyped-def]
            pass

        def do_barrier(self, opts) -> None:  # type: ignore[no-untyped-def]
            pass

    return MirroredPeers()


def cancelling_peer(cancel_at: int) -> Any:
    """A Communicator for a world of one rank whose ``cancel_at``-th collective (all-to-all or
    all-gather; 0: none) is "cancelled" the way an aborted NCCL collective is, seen from the stream
    that runs on behind it: the abort flag (host memory, ``.flag``) is set first, then the
    collective returns with no error and finite garbage (0x3F bytes) in its receive buffer, so only
    the commit gate can catch it (the gate tests)."""
    import torch

    from . import _C
    from ._buffers import tensor_of

    class CancellingPeer(_C.Communicator):
        def __init__(self) -> None:
            _C.Communicator.__init__(self)
            self.flag = torch.zeros(1, dtype=torch.int32)
            self.cancel_at, self.calls = cancel_at, 0

        def rank(self) -> int:
            return 0

        def size(self) -> int:
            return 1

        def backend_name(self) -> str:
            return "test:cancelling"

        def do_abort_flag(self) -> int:
            return self.flag.data_ptr()

        def _collective(self, send, recv) -> None:  # type: ignore[no-untyped-def]
            if send.data != recv.data:
                tensor_of(recv).copy_(tensor_of(send))
            self.calls += 1
            if self.calls == self.cancel_at:
                self.flag.fill_(1)
                tensor_of(recv).view(torch.uint8).fill_(0x3F)  # 0x3F3F3F3F: 0.747 as a float

        def do_all_to_all(self, send, recv, opts) -> None:  # type: ignore[no-untyped-def]
            self._collective(send, recv)

        def do_all_gather(self, send, recv, opts) -> None:  # type: ignore[no-untyped-def]
            self._collective(send, recv)

    return CancellingPeer()
