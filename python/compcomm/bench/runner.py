"""Launch one benchmark sweep: ``world_size`` worker processes on a network profile; collect rows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from .netns import PROFILES, Network, Profile

__all__ = ["run_sweep", "SweepError"]


class SweepError(RuntimeError):
    """A worker rank failed or the sweep ran past its deadline; the message holds the rank's log."""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    with tempfile.TemporaryDirectory(prefix="ccbench-") as tmp, Network(prof, world_size) as net:
        cfg_path = os.path.join(tmp, "config.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        port = _free_port()
        procs: List[subprocess.Popen] = []
        logs = []
        try:
            for r in range(world_size):
                env = dict(os.environ, **net.env(r, port), OMP_NUM_THREADS="1")
                log = open(os.path.join(tmp, f"rank{r}.log"), "w+")
                logs.append(log)
                cmd = net.command_prefix(r) + [
                    python,
                    "-m",
                    "compcomm.bench.worker",
                    "--config",
                    cfg_path,
                ]
                procs.append(
                    subprocess.Popen(
                        cmd,
                        env=env,
                        stdout=subprocess.PIPE if r == 0 else log,
                        stderr=log,
                        text=True,
                        start_new_session=True,
                    )
                )
            deadline = time.monotonic() + timeout
            assert procs[0].stdout is not None
            for line in procs[0].stdout:
                if line.startswith("ROW "):
                    row = json.loads(line[4:])
                    rows.append(row)
                    if on_row:
                        on_row(row)
                if time.monotonic() > deadline:
                    raise SweepError(f"sweep {profile} W={world_size} ran past {timeout} s")
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
                        f"rank {r} exited with {rc} ({profile}, W={world_size}):\n"
                        + "\n".join(tails)
                    )
        finally:
            _kill(procs)
            for log in logs:
                log.close()
    return rows
