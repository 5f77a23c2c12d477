"""Launch one benchmark sweep: ``world_size`` worker processes on a network profile; collect rows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..testing import free_port
from .netns import PROFILES, Network, Profile

__all__ = ["run_sweep", "run_on_profile", "SweepError"]


class SweepError(RuntimeError):
    """A worker rank failed or the sweep ran past its deadline; the message holds the rank's log."""


def _kill(procs: Sequence[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                p.kill()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _watch(procs: Sequence[subprocess.Popen], deadline: float, stop: threading.Event) -> None:
    """Kill all ``procs`` at ``deadline`` (monotonic) or when one exits non-zero; until ``stop``."""
    while not stop.wait(0.5):
        failed = any(p.poll() not in (None, 0) for p in procs)
        if failed:
            stop.wait(2.0)  # let the failing rank's peers print their own error first
        if failed or time.monotonic() > deadline:
            _kill(procs)
            return


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the launching process dies (Linux only)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


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
        Extra environment for every rank.
    gpus : int
        GPUs of this machine the ranks use (0: CPU ranks). With ``gpus > 0`` every rank also gets
        :meth:`compcomm.bench.netns.Network.nccl_env`: its own ``NCCL_HOSTID`` (an emulated host),
        NCCL over sockets on its interface, ``LOCAL_RANK = rank % gpus``.

    Rank processes run in their own session and get SIGKILL when this process dies
    (``PR_SET_PDEATHSIG``); a watchdog kills them all at the deadline even when rank 0 is silent.

    Returns
    -------
    list of str
        Rank 0's stdout lines.

    Raises
    ------
    SweepError
        A rank exited non-zero (the message holds every rank's log tail) or the deadline passed.
    """
    lines: List[str] = []
    with tempfile.TemporaryDirectory(prefix="ccbench-") as tmp, Network(profile, world_size) as net:
        prof = net.profile
        port = free_port()
        procs: List[subprocess.Popen] = []
        logs = []
        watchdog: Optional[threading.Thread] = None
        stop = threading.Event()
        try:
            for r in range(world_size):
                renv = dict(os.environ, **(env or {}), **net.env(r, port), OMP_NUM_THREADS="1")
                if gpus > 0:
                    renv.update(net.nccl_env(r, gpus))
                log = open(os.path.join(tmp, f"rank{r}.log"), "w+")
                logs.append(log)
                cmd = net.command_prefix(r) + [python, *args]
                procs.append(
                    subprocess.Popen(
                        cmd,
                        env=renv,
                        stdout=subprocess.PIPE if r == 0 else log,
                        stderr=log,
                        text=True,
                        start_new_session=True,
                        preexec_fn=_die_with_parent,
                    )
                )
            deadline = time.monotonic() + timeout
            # Rank 0 may hang without printing (the loop below would never see the deadline), or
            # wait forever in a collective for a rank that died: the watchdog kills every rank at
            # the deadline or as soon as one of them exits with an error.
            watchdog = threading.Thread(target=_watch, args=(procs, deadline + 5, stop), daemon=True)
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
            for r, p in enumerate(procs):
                left = max(1.0, deadline - time.monotonic())
                try:
                    rc = p.wait(timeout=left)
                except subprocess.TimeoutExpired:
                    raise SweepError(f"rank {r} did not finish within {timeout} s") from None
                if rc != 0:
                    tails = []
                    for q, log in enumerate(logs):
                        log.flush()
                        log.seek(0)
                        tails.append(f"--- rank {q} log ---\n{log.read()[-3000:]}")
                    raise SweepError(
                        f"rank {r} exited with {rc} ({prof.name}, W={world_size}):\n"
                        + "\n".join(tails)
                    )
        finally:
            stop.set()
            _kill(procs)
            for log in logs:
                log.close()
    return lines


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
        Names from :data:`compcomm.bench.worker.METHODS`.
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
        )
    return rows
