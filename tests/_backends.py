"""What tests/ can run on here, and how to run one rank body on W ranks of each backend.

A rank body is a module-level function ``body(ctx, *args)`` named ``"module:function"`` (importable
with tests/ on ``sys.path``). It gets a :class:`Ctx` (the communicator, the device its buffers live
on, the call options) and asserts what it checks itself: a failing case raises on the rank, and the
launcher re-raises it in pytest with the rank's traceback. The same body runs on every backend:

- ``local``: in this process, a world of one (``compcomm.LocalCommunicator``);
- ``torch:gloo``: W spawned processes joined by gloo (:func:`compcomm.testing.run_ranks`);
- ``mpi``: ``mpirun -np W tests/mpi/runner.py module:function`` on ``compcomm.init("mpi")``;
- ``nccl``: W spawned processes, one GPU each, on compcomm's native NCCL communicator.

The skip helpers here are the one place that decides "no GPU", "no mpirun", "not built".
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch

import compcomm
from compcomm import _C
from compcomm._init import make_communicator as _make

TESTS = Path(__file__).resolve().parent
RUNNER = TESTS / "mpi" / "runner.py"
WORLDS = (1, 2, 3, 4)
CALL_TIMEOUT = 120.0  # seconds one collective may take: generous on an oversubscribed 2-core machine


# ---------------------------------------------------------------------------------------------
# Skip reasons: None when the thing is there.


@functools.lru_cache(maxsize=None)
def gpu_count() -> int:
    """CUDA devices visible to torch (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def no_gpu(n: int = 1) -> Optional[str]:
    """Why fewer than ``n`` CUDA devices are usable here, or None."""
    have = gpu_count()
    if have >= n:
        return None
    if have == 0:
        return "no CUDA device (torch.cuda.is_available() is False)"
    return f"needs {n} CUDA devices (one per rank), {have} visible"


def no_cuda_kernels() -> Optional[str]:
    if not _C.build_info()["cuda"]:
        return "compcomm was built without CUDA kernels (no CUDA toolkit found)"
    return None


def no_mpi() -> Optional[str]:
    """Why MPI tests cannot run here (not built, or no launcher), or None."""
    if not compcomm.build_info()["mpi"]:
        return "compcomm was built without MPI (build_info()['mpi'] is False)"
    if shutil.which("mpirun") is None and shutil.which("mpiexec") is None:
        return "no mpirun or mpiexec on PATH (install Open MPI)"
    return None


def no_mpi_gpu() -> Optional[str]:
    """Why MPI on CUDA buffers cannot run here, or None."""
    why = no_mpi() or no_gpu()
    if why is None and not _C.mpi_cuda_built():
        why = "compcomm's MPI backend was built without the CUDA runtime"
    return why


def no_nccl() -> Optional[str]:
    if not _C.build_info()["nccl"]:
        return "this build has no NCCL communicator (no CUDA toolkit or nccl.h at build time)"
    return None


def skipif(reason: Optional[str]) -> pytest.MarkDecorator:
    """``pytest.mark.skipif`` from a reason helper above (skip when it returned a reason)."""
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def skip_unless(reason: Optional[str]) -> None:
    """Skip the running test when a reason helper above returned a reason."""
    if reason is not None:
        pytest.skip(reason)


# ---------------------------------------------------------------------------------------------
# What a rank body gets.


@dataclass
class Ctx:
    """One rank's view: the communicator under test, where its buffers live, and how to call it."""

    comm: Any
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    timeout: float = CALL_TIMEOUT

    @property
    def rank(self) -> int:
        return self.comm.rank()

    @property
    def world(self) -> int:
        return self.comm.size()

    @property
    def backend(self) -> str:
        return self.comm.backend_name()

    def kw(self) -> Dict[str, Any]:
        """Keyword arguments of every collective call: the timeout, and on a GPU the current stream."""
        if self.device.type == "cuda":
            return {"timeout_s": self.timeout, "stream": torch.cuda.current_stream(self.device).cuda_stream}
        return {"timeout_s": self.timeout}

    def sync(self) -> None:
        """Wait until the collectives issued so far are done (a no-op on CPU buffers)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def resolve_body(ref: str) -> Callable[..., Any]:
    """The function named ``"package.module:function"``."""
    module, _, name = ref.partition(":")
    if not name:
        raise ValueError(f"body {ref!r} must be 'module:function'")
    return getattr(importlib.import_module(module), name)


# ---------------------------------------------------------------------------------------------
# Launchers: run_body(backend, world, "module:function", *args) on each backend.


def _local(world: int, ref: str, args: Tuple[Any, ...], timeout: float) -> None:
    assert world == 1, "the local backend is a world of one"
    resolve_body(ref)(Ctx(_make("local")), *args)


def _gloo_rank(rank: int, world: int, ref: str, args: Tuple[Any, ...]) -> None:
    comm = _make("torch")
    assert (comm.rank(), comm.size()) == (rank, world)
    resolve_body(ref)(Ctx(comm), *args)


def _gloo(world: int, ref: str, args: Tuple[Any, ...], timeout: float) -> None:
    from compcomm.testing import run_ranks

    run_ranks(world, _gloo_rank, ref, args, backend="gloo", timeout=timeout)


def _nccl_rank(rank: int, world: int, ref: str, args: Tuple[Any, ...]) -> None:
    from compcomm._nccl import make_nccl_communicator, shutdown_nccl

    torch.cuda.set_device(rank % torch.cuda.device_count())
    comm = make_nccl_communicator(device=torch.cuda.current_device(), timeout=CALL_TIMEOUT)
    assert (comm.rank(), comm.size()) == (rank, world)
    try:
        resolve_body(ref)(Ctx(comm, torch.device("cuda", comm.device)), *args)
    finally:
        shutdown_nccl()


def _nccl(world: int, ref: str, args: Tuple[Any, ...], timeout: float) -> None:
    from compcomm.testing import run_ranks

    # gloo only bootstraps: the NCCL unique id travels over it.
    run_ranks(world, _nccl_rank, ref, args, backend="gloo", timeout=timeout)


def mpirun(np: int, script: Path, *args: str, timeout: float, **kw: Any) -> str:
    """Run ``script`` on ``np`` MPI ranks; fail the test (with the output, where the failing rank's
    traceback is) unless every rank exits 0. Returns stdout + stderr."""
    from compcomm.testing import mpirun_command

    cmd = mpirun_command(np, str(script), *args, **kw)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} hung for {timeout} s:\n{e.stdout}\n{e.stderr}")
    text = out.stdout + out.stderr
    if out.returncode != 0:
        # The first failing rank's traceback (tests/mpi/runner.py marks it) first, then the output.
        first = re.search(r"^--- .* failed on MPI rank .*?^--- end of rank's traceback ---$", text,
                          re.S | re.M)
        pytest.fail(f"{' '.join(cmd)} exited with {out.returncode}\n"
                    + (first.group(0) + "\n\nfull output:\n" if first else "") + text[-12000:],
                    pytrace=False)
    return text


def _mpi(world: int, ref: str, args: Tuple[Any, ...], timeout: float) -> None:
    mpirun(world, RUNNER, ref, json.dumps(list(args)), timeout=timeout)


@dataclass(frozen=True)
class Backend:
    """A backend of compcomm's registry as the tests see it."""

    name: str  # test id and backend_name() of its communicators: "local", "torch:gloo", "mpi", "nccl"
    registry: str  # its name in compcomm's backend registry (compcomm.init(registry))
    launch: Callable[[int, str, Tuple[Any, ...], float], None]
    worlds: Tuple[int, ...]
    skip: Callable[[int], Optional[str]]  # why world W cannot run here, or None
    marks: Tuple[str, ...] = ()

    def run(self, world: int, ref: str, *args: Any, timeout: float = 300.0) -> None:
        """Run body ``ref`` on ``world`` ranks of this backend; re-raise the first rank's failure."""
        self.launch(world, ref, args, timeout)


# One launcher per registry entry. A backend registered in compcomm without one here makes
# tests/conformance fail (see backends()), so that a new backend gets the suite.
LAUNCHERS: Dict[str, Backend] = {
    "local": Backend("local", "local", _local, (1,), lambda w: None),
    "torch": Backend("torch:gloo", "torch", _gloo, WORLDS,
                     lambda w: None if torch.distributed.is_available() else "no torch.distributed"),
    "mpi": Backend("mpi", "mpi", _mpi, WORLDS, lambda w: no_mpi(), ("mpi",)),
    "nccl": Backend("nccl", "nccl", _nccl, WORLDS, lambda w: no_nccl() or no_gpu(w), ("gpu",)),
}


def registered() -> List[str]:
    """Backend names in compcomm's registry (what ``compcomm.init`` accepts)."""
    from compcomm import _init

    return sorted(_init._FACTORIES)


def _no_launcher(name: str) -> Backend:
    def launch(world: int, ref: str, args: Tuple[Any, ...], timeout: float) -> None:
        raise AssertionError(f"backend {name!r} is in compcomm's registry but tests/_backends.py has "
                             "no launcher for it: add one to LAUNCHERS so the conformance suite runs on it")

    return Backend(name, name, launch, (1,), lambda w: None)


def backends() -> List[Backend]:
    """Every backend of compcomm's registry, as the tests run it."""
    return [LAUNCHERS.get(name) or _no_launcher(name) for name in registered()]


# ``@worlds`` on a test taking ``world``: W = 1, 2, 3, 4 (STYLE.md item 9).
worlds = pytest.mark.parametrize("world", WORLDS)


def no_netns() -> Optional[str]:
    """Why network namespaces cannot be made here (not root, no ``ip netns``), or None."""
    from compcomm.bench import netns

    try:
        netns.check_privileges()
    except netns.NetnsError as e:
        return str(e)
    return None


#: Skip marker for tests that need the namespace profiles (eth1g, ...).
needs_netns = pytest.mark.skipif(bool(no_netns()),
                                 reason=f"network namespaces unavailable: {no_netns()}")
