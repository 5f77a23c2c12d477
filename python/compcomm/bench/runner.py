"""Launch one benchmark sweep: ``world_size`` worker processes on a network profile; collect rows."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..testing import free_port, mpirun_command
from .netns import PROFILES, SUBNET, Network, Profile

__all__ = ["run_sweep", "run_on_profile", "SweepError"]


class SweepError(RuntimeError):
    """A worker rank failed or the sweep ran past its deadline; the message holds the rank's log."""


def _kill(procs: Sequence[subprocess.Popen], pid_files: Sequence[str] = ()) -> None:
    """End ``procs`` and their process groups: SIGTERM first (mpirun then ends the ranks it
    started), SIGKILL to every group after 5 s; then SIGKILL the processes named in ``pid_files``
    (mpirun's ranks, which live in process groups of their own) that are still alive."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        _signal_group(p.pid, signal.SIGTERM)
    end = time.monotonic() + 5.0
    for p in live:
        try:
            p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:  # a child that ignored SIGTERM may hold rank 0's stdout open
        _signal_group(p.pid, signal.SIGKILL)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    for path in pid_files:
        try:
            with open(path) as f:
                os.kill(int(f.read()), signal.SIGKILL)
        except (OSError, ValueError):  # not written, or already gone
            pass


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _watch(procs: Sequence[subprocess.Popen], deadline: float, stop: threading.Event,
           ended: Optional[Dict[int, float]] = None, killed: Optional[set] = None) -> None:
    """Kill all ``procs`` at ``deadline`` (monotonic) or 2 s after one exits non-zero; until
    ``stop``. Records in ``ended`` when each process was seen to end (index -> monotonic time),
    and in ``killed`` the indices of those still running when it killed them."""
    ended = {} if ended is None else ended
    failed_at: Optional[float] = None
    while not stop.wait(0.05):  # (fine-grained: the order of the exits names the cause)
        now = time.monotonic()
        for i, p in enumerate(procs):
            if i not in ended and p.poll() is not None:
                ended[i] = now
        if failed_at is None and any(procs[i].returncode for i in ended):
            failed_at = now  # let the failing rank's peers print their own error first
        if (failed_at is not None and now - failed_at >= 2.0) or now > deadline:
            if killed is not None:
                killed.update(i for i, p in enumerate(procs) if p.poll() is None)
            _kill(procs)
            return


def _exit_text(rc: Optional[int], by_us: bool) -> str:
    """How a process ended, in words: ``exit 1``, ``killed by SIGKILL``."""
    if rc is None:
        return "still running"
    if rc >= 0:
        return f"exit {rc}"
    try:
        name = signal.Signals(-rc).name
    except ValueError:
        name = f"signal {-rc}"
    return f"killed by {name}" + (" (by the harness, after another failed)" if by_us else "")


def _exit_report(names: Sequence[str], rcs: Sequence[Optional[int]], ended: Dict[int, float],
                 killed: set) -> List[str]:
    """Every process's end, the cause first: the failures in the order they happened (a signal
    first among those seen at once: a peer of a killed rank exits with an error after it), then
    the processes the harness ended, then the clean exits."""
    def key(i: int) -> Tuple[int, float, int, int]:
        rc = rcs[i]
        cat = 2 if rc == 0 else 1 if i in killed else 0
        return cat, ended.get(i, float("inf")), 0 if rc is not None and rc < 0 else 1, i
    return [f"{names[i]}: {_exit_text(rcs[i], i in killed)}"
            for i in sorted(range(len(names)), key=key)]


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the launching process dies (Linux only)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _pid_file(tmp: str, rank: int) -> str:
    return os.path.join(tmp, f"rank{rank}.pid")


#: what mpirun starts: the rank's own script (``_mpirun_launch`` writes one per rank)
_RANK_WRAPPER = ('exec sh "$CCBENCH_RANK_DIR/rank${OMPI_COMM_WORLD_RANK:?not started by Open'
                 ' MPI}.sh" "$@"')

#: the last exec of a rank script (``python -c``, arguments: mpirun's pid, then the command): the
#: rank gets SIGKILL when mpirun dies, as mpirun does when this process dies, so a launcher killed
#: with SIGKILL leaves no rank behind (exec keeps the pid through ``ip netns exec``)
_DIE_WITH_MPIRUN = ("import ctypes, os, signal, sys\n"
                    "ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG\n"
                    "if os.getppid() != int(sys.argv[1]):\n"
                    "    os._exit(137)  # mpirun is already gone\n"
                    "os.execvp(sys.argv[2], sys.argv[2:])\n")


def _mpirun_launch(net: Network, tmp: str, rank_envs: List[Dict[str, str]], logs: List[str],
                   argv: List[str]) -> Tuple[List[str], Dict[str, str]]:
    """One ``mpirun`` that starts every rank in its namespace; returns its argv and environment.

    Each rank runs ``rank<r>.sh``: its environment, its log, then ``argv`` in its namespace. The
    ranks reach mpirun's PMIx server (started in this namespace) through the bridge, and MPI's own
    traffic is TCP over the ranks' links only (no shared memory, no other interface).
    """
    for r, (renv, log) in enumerate(zip(rank_envs, logs)):
        bad = [k for k in renv if not _ENV_NAME.match(k)]
        if bad:
            raise ValueError(f"run_on_profile: environment names {bad} are not shell names")
        prefix = " ".join(map(shlex.quote, net.command_prefix(r)))
        script = [
            "#!/bin/sh",
            *(f"export {k}={shlex.quote(v)}" for k, v in renv.items()),
            f"exec 2>>{shlex.quote(log)}" + ("" if r == 0 else " >&2"),  # rank 0's stdout: mpirun's
            f"echo $$ > {shlex.quote(_pid_file(tmp, r))}",  # exec keeps the pid: see _kill
            f'exec {shlex.quote(sys.executable)} -c {shlex.quote(_DIE_WITH_MPIRUN)} "$PPID"'
            f' {prefix} "$@"',
        ]
        with open(os.path.join(tmp, f"rank{r}.sh"), "w") as f:
            f.write("\n".join(script) + "\n")
    env = dict(os.environ, CCBENCH_RANK_DIR=tmp)
    # no binding: the direct launcher binds nothing either (mpirun binds to cores for np <= 2)
    mca = {"hwloc_base_binding_policy": "none"}
    if net.profile.netns:
        net.host_address()  # mpirun's PMIx server, in this namespace, listens there
        subnet = f"{SUBNET}.0/24"
        mca.update(pml="ob1", btl="self,tcp", btl_tcp_if_include=subnet)
        env.update(PMIX_MCA_ptl_tcp_remote_connections="1", PMIX_MCA_ptl_tcp_if_include=subnet)
    try:
        # early exit allowed: a rank may end with os._exit (gloo's teardown aborts now and then),
        # skipping MPI_Finalize; a non-zero exit still fails the job
        cmd = mpirun_command(net.world_size, "-c", _RANK_WRAPPER, "ccbench-rank", *argv,
                             python="sh", allow_early_exit=True, mca=mca)
    except (FileNotFoundError, ValueError) as e:
        raise SweepError(f"launcher 'mpirun': {e}") from None
    return cmd, env


def run_on_profile(
    profile,
    world_size: int,
    args: Sequence[str],
    *,
    timeout: float = 1800.0,
    on_line: Optional[Callable[[str], None]] = None,
    python: str = sys.executable,
    env: Optional[Dict[str, str]] = None,
    gpus: int = 0,
    launcher: str = "direct",
) -> List[str]:
    """Run ``python *args`` as ``world_size`` rank processes on a network profile.

    Each rank runs in its namespace (for namespace profiles) with the rendezvous environment of
    :meth:`compcomm.bench.netns.Network.env` (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE,
    GLOO_SOCKET_IFNAME) and ``OMP_NUM_THREADS=1``, so it can call
    ``torch.distributed.init_process_group("gloo")`` with no arguments. The namespaces exist for the
    duration of the call only.

    Parameters
    ----------
    profile : Profile or str
        One of :data:`compcomm.bench.netns.PROFILES` (or its name).
    world_size : int
        Number of rank processes.
    args : sequence of str
        Arguments after the interpreter (e.g. ``["-m", "pkg.mod", "--flag"]`` or a script path).
    timeout : float
        Seconds before all ranks are killed (raises :class:`SweepError`).
    on_line : callable, optional
        Called with each line rank 0 prints on stdout, as it arrives.
    python : str
        Interpreter.
    env : dict, optional
        Extra environment for every rank (the rendezvous and NCCL variables above take
        precedence over its entries of the same name).
    gpus : int
        GPUs of this machine the ranks use (0: CPU ranks). With ``gpus > 0`` every rank also gets
        :meth:`compcomm.bench.netns.Network.nccl_env`: its own ``NCCL_HOSTID`` (an emulated host),
        NCCL over sockets on its interface, ``LOCAL_RANK = rank % gpus``.
    launcher : {"direct", "mpirun"}
        ``"direct"``: one process per rank, started here. ``"mpirun"``: one Open MPI ``mpirun``
        starts them (same environment, same namespaces), so the ranks can also use MPI
        (``compcomm.init("mpi")``, mpi4py); on namespace profiles MPI then runs over TCP on the
        ranks' shaped links only (``btl self,tcp`` on the bridge's subnet, no shared memory).

    Rank processes (or mpirun) run in their own session and get SIGKILL when this process dies
    (``PR_SET_PDEATHSIG``); a watchdog kills them all at the deadline even when rank 0 is silent.
    Ranks that mpirun started are ended by mpirun, killed by pid when the call ends, and get
    SIGKILL when mpirun dies, so none outlives this process even when it is killed with SIGKILL.

    Returns
    -------
    list of str
        Rank 0's stdout lines.

    Raises
    ------
    SweepError
        A rank exited non-zero (the message holds every rank's log tail), the deadline passed, or
        ``launcher="mpirun"`` without Open MPI's mpirun.
    """
    if launcher not in ("direct", "mpirun"):
        raise ValueError(f"run_on_profile: argument 'launcher' must be 'direct' or 'mpirun', "
                         f"got {launcher!r}")
    lines: List[str] = []
    with tempfile.TemporaryDirectory(prefix="ccbench-") as tmp, Network(profile, world_size) as net:
        prof = net.profile
        port = free_port()
        logs = [os.path.join(tmp, f"rank{r}.log") for r in range(world_size)]
        rank_envs = []
        for r in range(world_size):
            renv = {**(env or {}), **net.env(r, port), "OMP_NUM_THREADS": "1"}
            if gpus > 0:
                renv.update(net.nccl_env(r, gpus))
            rank_envs.append(renv)
        # (name, argv, environment, log) of each process; the first one's stdout is rank 0's
        pid_files: List[str] = []
        if launcher == "mpirun":
            cmd, menv = _mpirun_launch(net, tmp, rank_envs, logs, [python, *args])
            logs.append(os.path.join(tmp, "mpirun.log"))
            starts = [("mpirun", cmd, menv, logs[-1])]
            pid_files = [_pid_file(tmp, r) for r in range(world_size)]
        else:
            starts = [(f"rank {r}", net.command_prefix(r) + [python, *args],
                       dict(os.environ, **rank_envs[r]), logs[r]) for r in range(world_size)]
        procs: List[subprocess.Popen] = []
        files = []
        watchdog: Optional[threading.Thread] = None
        stop = threading.Event()
        ended: Dict[int, float] = {}  # (the watchdog's: when each process ended)
        killed: set = set()  # (indices of the processes the watchdog ended)
        try:
            for _, cmd, penv, log in starts:
                err = open(log, "a")
                files.append(err)
                procs.append(
                    subprocess.Popen(
                        cmd,
                        env=penv,
                        stdin=subprocess.DEVNULL,  # (mpirun would forward it to rank 0)
                        stdout=subprocess.PIPE if not procs else err,
                        stderr=err,
                        text=True,
                        start_new_session=True,
                        preexec_fn=_die_with_parent,
                    )
                )
            deadline = time.monotonic() + timeout
            # Rank 0 may hang without printing (the loop below would never see the deadline), or
            # wait forever in a collective for a rank that died: the watchdog kills every rank at
            # the deadline or as soon as one of them exits with an error.
            watchdog = threading.Thread(target=_watch, daemon=True,
                                        args=(procs, deadline + 5, stop, ended, killed))
            watchdog.start()
            assert procs[0].stdout is not None
            for line in procs[0].stdout:
                lines.append(line.rstrip("\n"))
                if on_line:
                    on_line(line)
                if time.monotonic() > deadline:
                    raise SweepError(f"{prof.name} W={world_size} ran past {timeout} s")
            if time.monotonic() > deadline:
                raise SweepError(f"{prof.name} W={world_size} ran past {timeout} s (killed)")
            for (name, *_), p in zip(starts, procs):
                left = max(1.0, deadline - time.monotonic())
                try:
                    p.wait(timeout=left)
                except subprocess.TimeoutExpired:
                    raise SweepError(f"{name} did not finish within {timeout} s") from None
            rcs = [p.returncode for p in procs]
            if any(rcs):
                stop.set()  # (its records are complete: every process has ended)
                watchdog.join(timeout=5)
                for f in files:
                    f.flush()
                ends = _exit_report([name for name, *_ in starts], rcs, dict(ended), killed)
                tails = [f"--- {label} log ---\n{_tail(log)}" for label, log in zip(
                    [f"rank {q}" for q in range(world_size)] + ["mpirun"], logs)]
                first = ends[0].replace(": exit ", " exited with ").replace(": killed",
                                                                              " was killed")
                raise SweepError(f"{first} ({prof.name}, W={world_size}); every process: "
                                 + "; ".join(ends) + "\n" + "\n".join(tails))
        finally:
            stop.set()
            _kill(procs, pid_files)
            for f in files:
                f.close()
    return lines


def _tail(path: str, chars: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except FileNotFoundError:
        return "(no log)"


def run_sweep(
    profile: str,
    world_size: int,
    sizes: Sequence[int],
    methods: Sequence[str],
    *,
    target_time: float = 1.0,
    min_iters: int = 3,
    max_iters: int = 1000,
    batches: int = 5,
    timeout: float = 1800.0,
    on_row: Optional[Callable[[Dict[str, Any]], None]] = None,
    python: str = sys.executable,
) -> List[Dict[str, Any]]:
    """Run every (size, method) on ``world_size`` ranks of ``profile``; return rank 0's rows.

    Parameters
    ----------
    profile : str
        A key of :data:`compcomm.bench.netns.PROFILES`.
    world_size : int
        Number of rank processes.
    sizes : sequence of int
        Element counts.
    methods : sequence of str
        Names from :data:`compcomm.bench.worker.ALL_METHODS`. With any of ``MPI_METHODS`` the
        ranks are started by mpirun (``launcher="mpirun"`` of :func:`run_on_profile`).
    target_time : float
        Seconds of timed calls per measurement (rank 0 sets the iteration count from it).
    min_iters, max_iters : int
        Bounds on that count.
    batches : int
        Timed batches the iterations are split into (``time_s`` is the median batch).
    timeout : float
        Seconds before the whole sweep is killed (raises :class:`SweepError`).
    on_row : callable, optional
        Called with each row as it arrives (progress bars).

    Returns
    -------
    list of dict
        One row per measurement, see :mod:`compcomm.bench.worker`.
    """
    from .worker import MPI_METHODS  # (the worker imports torch; the launcher needs none)

    prof: Profile = PROFILES[profile]
    cfg = dict(
        profile=profile,
        sizes=[int(s) for s in sizes],
        methods=list(methods),
        target_time=target_time,
        min_iters=min_iters,
        max_iters=max_iters,
        batches=batches,
        timeout=min(timeout, 600),
    )
    rows: List[Dict[str, Any]] = []

    def on_line(line: str) -> None:
        if line.startswith("ROW "):
            row = json.loads(line[4:])
            rows.append(row)
            if on_row:
                on_row(row)

    with tempfile.TemporaryDirectory(prefix="ccbench-") as tmp:
        cfg_path = os.path.join(tmp, "config.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        run_on_profile(
            prof,
            world_size,
            ["-m", "compcomm.bench.worker", "--config", cfg_path],
            timeout=timeout,
            on_line=on_line,
            python=python,
            launcher="mpirun" if set(methods) & set(MPI_METHODS) else "direct",
        )
    return rows
