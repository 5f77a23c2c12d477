"""The native NCCL communicator (cpp/nccl, python/compcomm/_nccl.py).

Needs a build with NCCL (CUDA toolkit and nccl.h found at build time) and, for most tests, a CUDA
device; tests with several ranks need one GPU per rank and skip otherwise. Every collective at
W = 1..4 is checked by tests/conformance (backend "nccl"); here is what only NCCL has. Run on a GPU
machine by bench/run_nccl_gpu.sh.
"""

from __future__ import annotations

import os
import subprocess
import textwrap

import _nccl_cases as cases
import compcomm
import pytest
import torch
from _backends import Ctx, gpu_count, no_cuda_kernels, no_gpu, no_nccl, skip_unless, skipif
from compcomm import _C
from compcomm.errors import BackendError
from compcomm.testing import mpirun_command, run_ranks
from conformance import collective_bodies

GPUS = gpu_count()
needs_gpu = skipif(no_gpu())


def needs_gpus(n: int):
    return skipif(no_gpu(n))


needs_cuda_kernels = skipif(no_cuda_kernels())

pytestmark = skipif(no_nccl())


def _library_or_skip() -> str:
    from compcomm._nccl import load_nccl

    try:
        return load_nccl()
    except compcomm.errors.UnsupportedError as e:
        pytest.skip(f"no loadable libnccl.so.2: {e}")


# ---------------------------------------------------------------------------------------------
# No GPU needed: the run-time library, unique ids, argument checks.


def test_build_info_reports_the_header_version():
    info = compcomm.build_info()
    assert info["nccl"] is True
    major, minor, _patch = (int(x) for x in info["nccl_version"].split("."))
    assert major == 2 and minor >= 14


def test_extension_does_not_link_libnccl():
    out = subprocess.run(["ldd", _C.__file__], capture_output=True, text=True, check=True).stdout
    assert "libnccl" not in out, out


def test_library_loads_at_run_time_and_makes_unique_ids():
    path = _library_or_skip()
    assert os.path.basename(path).startswith("libnccl") and os.path.exists(path)
    assert _C.nccl.loaded()
    assert _C.nccl.runtime_version() >= 21400
    a, b = _C.nccl.unique_id(), _C.nccl.unique_id()
    assert isinstance(a, bytes) and len(a) == _C.nccl.UNIQUE_ID_BYTES == 128
    assert a != b


def test_bad_unique_id_is_a_value_error():
    with pytest.raises(ValueError, match="unique_id must be 128 bytes"):
        _C.NcclCommunicator(b"short", 0, 1, 0)
    with pytest.raises(ValueError, match="size must be >= 1"):
        _C.NcclCommunicator(b"x" * 128, 0, 0, 0)


def test_bootstrap_without_launcher_is_a_world_of_one(monkeypatch):
    from compcomm import _nccl

    for name in _nccl._MPI_ENV:
        monkeypatch.delenv(name, raising=False)
    kind, _, rank, size, share = _nccl._bootstrap(None, 0)
    assert (kind, rank, size) == ("single", 0, 1)
    assert share(b"id") == b"id"


def test_cache_lets_closed_communicators_go(monkeypatch):
    """The cache of native communicators keeps neither a closed communicator nor its group: a
    new one prunes them, and so does dropping the communicators of destroyed process groups
    (a stand-in for _C.NcclCommunicator; the cache logic is the real one)."""
    import gc
    import types
    import weakref

    from compcomm import _comm, _nccl

    class StandIn:
        def __init__(self, *args) -> None:
            self.closed = False

        def destroy(self, timeout: float) -> None:
            self.closed = True

    class Group:
        pass

    monkeypatch.setattr(_nccl, "_cache", {})
    monkeypatch.setattr(_nccl, "_C", types.SimpleNamespace(
        NcclCommunicator=StandIn, nccl=types.SimpleNamespace(unique_id=lambda: b"u")))
    monkeypatch.setattr(_nccl, "load_nccl", lambda: "stand-in")
    monkeypatch.setattr(_nccl, "_device_index", lambda device: 0)
    monkeypatch.setattr(_nccl, "_bootstrap", lambda g, dev: ("torch", g, 0, 1, lambda uid: uid))
    g1, g2 = Group(), Group()
    dead = weakref.ref(g1)
    c1 = _nccl.make_nccl_communicator(g1)
    assert _nccl.make_nccl_communicator(g1) is c1  # cached while open
    c1.destroy(1.0)
    del g1
    c2 = _nccl.make_nccl_communicator(g2)
    gc.collect()
    assert [c for _, c in _nccl._cache.values()] == [c2] and dead() is None
    _comm._release([c2])  # what dropping a destroyed process group's communicator does
    assert c2.closed and not _nccl._cache


# ---------------------------------------------------------------------------------------------
# One GPU, world size 1.


@pytest.fixture(scope="module")
def comm():
    from compcomm._nccl import make_nccl_communicator, shutdown_nccl

    skip_unless(no_gpu())
    _library_or_skip()
    c = make_nccl_communicator(device=0, timeout=60)
    yield c
    shutdown_nccl()


@needs_gpu
def test_make_is_cached_per_group_and_device(comm):
    from compcomm._nccl import make_nccl_communicator

    assert make_nccl_communicator(device=0) is comm
    assert (comm.rank(), comm.size(), comm.backend_name(), comm.device) == (0, 1, "nccl", 0)


@needs_gpu
def test_every_op_single_rank_nonblocking_communicator(tmp_path):
    """The conformance collectives on a non-blocking NCCL communicator (the suite's nccl backend
    uses blocking ones)."""
    _library_or_skip()
    c = _C.NcclCommunicator(_C.nccl.unique_id(), 0, 1, 0, 60.0, False)
    try:
        assert not c.blocking
        collective_bodies.collectives(Ctx(c, torch.device("cuda", c.device)), str(tmp_path))
    finally:
        c.destroy()


@needs_gpu
def test_ops_run_on_the_callers_stream(comm):
    # A long kernel on stream s, then the collective on s: it must read the kernel's output.
    from compcomm._buffers import buffer_of

    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        a = torch.randn(1 << 22, device="cuda")
        for _ in range(20):
            a = a * 1.0001
        out = torch.empty_like(a)
        comm.all_gather(buffer_of(a), buffer_of(out), stream=s.cuda_stream)
    s.synchronize()
    assert torch.equal(out, a)


@needs_gpu
@needs_cuda_kernels
@pytest.mark.parametrize("n", [1, 1000, 4099, 1 << 20])
def test_compressed_allreduce_single_rank_equals_cpu(comm, n):
    pairs = cases.compressed_pairs(comm, compcomm.LocalCommunicator(), n, steps=3, seed=5)
    for gpu, cpu in pairs:
        torch.testing.assert_close(gpu, cpu, rtol=1e-5, atol=1e-6)


@needs_gpu
@pytest.mark.parametrize("blocking", [False, True], ids=["nonblocking", "blocking"])
def test_graph_capture_and_replay(blocking):
    from compcomm._buffers import buffer_of

    _library_or_skip()
    comm = _C.NcclCommunicator(_C.nccl.unique_id(), 0, 1, 0, 60.0, blocking)
    n = 4099
    gen = torch.Generator(device="cuda").manual_seed(3)
    src = torch.randn(n, device="cuda", generator=gen)
    gathered, a2a, rs, red = (torch.empty(n, device="cuda") for _ in range(4))

    def step(stream):
        comm.all_gather(buffer_of(src), buffer_of(gathered), stream=stream)
        comm.all_to_all(buffer_of(src), buffer_of(a2a), stream=stream)
        comm.reduce_scatter(buffer_of(src), buffer_of(rs), stream=stream)
        red.copy_(src)
        comm.all_reduce(buffer_of(red), stream=stream)
        red.mul_(2)
        comm.broadcast(buffer_of(red), 0, stream=stream)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture
        step(side.cuda_stream)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(torch.cuda.current_stream().cuda_stream)
    for _ in range(3):
        src.copy_(torch.randn(n, device="cuda", generator=gen))
        for t in (gathered, a2a, rs, red):
            t.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(gathered, src) and torch.equal(a2a, src) and torch.equal(rs, src)
        assert torch.equal(red, 2 * src)
    assert not comm.closed
    comm.barrier(timeout_s=30)  # still usable eagerly after capture
    del graph
    comm.destroy()


@needs_gpu
def test_nccl_error_is_a_backend_error_with_nccls_text():
    _library_or_skip()
    with pytest.raises(BackendError) as info:
        _C.NcclCommunicator(_C.nccl.unique_id(), 5, 2, 0, 10.0)  # rank 5 of 2: NCCL rejects it
    e = info.value
    assert e.backend == "nccl" and e.call == "init" and e.rank == 5
    assert e.code == 4 and "invalid argument" in str(e).lower()  # ncclInvalidArgument's string


@needs_gpu
def test_buffers_must_be_on_the_communicators_device(comm):
    from compcomm._buffers import buffer_of

    host = torch.zeros(8)
    with pytest.raises(ValueError, match="host memory"):
        comm.all_reduce(buffer_of(host))
    if GPUS > 1:
        other = torch.zeros(8, device="cuda:1")
        with pytest.raises(ValueError, match="cuda:1"):
            comm.all_reduce(buffer_of(other))


@needs_gpu
def test_no_use_after_abort_or_destroy():
    from compcomm._buffers import buffer_of

    _library_or_skip()
    buf = torch.ones(16, device="cuda")
    for end in ("abort", "destroy"):
        c = _C.NcclCommunicator(_C.nccl.unique_id(), 0, 1, 0, 30.0)
        c.all_reduce(buffer_of(buf))
        getattr(c, end)()
        assert c.closed
        with pytest.raises(BackendError, match="closed"):
            c.all_reduce(buffer_of(buf))
        with pytest.raises(BackendError, match="closed"):
            c.barrier()
        c.destroy()  # idempotent


# ---------------------------------------------------------------------------------------------
# Several ranks, one GPU each.


@needs_cuda_kernels
@pytest.mark.parametrize("world", [2, 4])
def test_compressed_allreduce_multi_rank_equals_cpu(world):
    skip_unless(no_gpu(world))
    results = run_ranks(world, cases.compressed_case, 4099, 3, timeout=300)
    for pairs in results:
        for gpu, cpu in pairs:
            torch.testing.assert_close(gpu, cpu, rtol=1e-5, atol=1e-6)


@needs_gpus(2)
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
@pytest.mark.parametrize("warm", [True, False], ids=["after_warmup", "first_call"])
def test_silent_peer_gives_timeout_then_closed(warm, blocking):
    # after_warmup: the kernel spins on the device (event watchdog); first_call: the call itself
    # waits inside NCCL for the peer's connection (stuck-call watchdog, or polling when non-blocking).
    res = run_ranks(2, cases.timeout_case, warm, blocking, timeout=180)[0]
    if warm:
        assert res["warm_sum"] == 2.0, res
    assert res["first"] == "timeout", res
    assert res["seconds"] < 30, res
    assert res["closed"] is True
    assert res["after"] == "timeout" and "closed" in res["after_msg"], res
    assert res["shutdown_seconds"] < 15, res


@pytest.mark.mpi
@needs_gpu
def test_bootstrap_from_mpirun(tmp_path):
    world = min(GPUS, 2)
    script = tmp_path / "boot.py"
    try:
        cmd = mpirun_command(world, str(script))
    except FileNotFoundError:
        pytest.skip("mpirun not found")
    pytest.importorskip("mpi4py")
    script.write_text(
        textwrap.dedent(
            """
            import torch
            from compcomm._buffers import buffer_of
            from compcomm._nccl import make_nccl_communicator, shutdown_nccl
            c = make_nccl_communicator()
            x = torch.ones(10, device=f"cuda:{c.device}")
            c.all_reduce(buffer_of(x), stream=torch.cuda.current_stream(c.device).cuda_stream)
            torch.cuda.synchronize(c.device)
            print("RESULT", c.rank(), c.size(), int(x[0].item()), flush=True)
            shutdown_nccl()
            """
        )
    )
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = sorted(line.split()[1:] for line in p.stdout.splitlines() if line.startswith("RESULT"))
    assert lines == [[str(r), str(world), str(world)] for r in range(world)], p.stdout


@needs_gpu
def test_init_backend_nccl_sets_the_default_and_shutdown_destroys_it():
    from compcomm._buffers import buffer_of

    _library_or_skip()
    comm = compcomm.init(backend="nccl")
    try:
        assert isinstance(comm, _C.NcclCommunicator) and comm.backend_name() == "nccl"
        assert compcomm.get_communicator(None) is comm
        assert compcomm.init(backend="nccl") is comm  # cached per (group, device): not destroyed
        assert not comm.closed
        x = torch.full((10,), 3.0, device=f"cuda:{comm.device}")
        comm.all_reduce(buffer_of(x), stream=torch.cuda.current_stream(comm.device).cuda_stream)
        torch.cuda.synchronize(comm.device)
        assert torch.equal(x, torch.full_like(x, 3.0))
    finally:
        compcomm.shutdown()
    assert comm.closed
    assert compcomm.get_communicator(None) is not comm


def test_init_backend_nccl_without_nccl_build_is_unsupported(monkeypatch):
    from compcomm import _init

    info = {**_C.build_info(), "nccl": False}
    monkeypatch.setattr(_init._C, "build_info", lambda: info)
    with pytest.raises(compcomm.errors.UnsupportedError, match="native NCCL"):
        _init.make_communicator("nccl")
