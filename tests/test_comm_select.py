"""Which communicator ``group=None`` (or a passed torch process group) means: the torch adapter for
gloo, compcomm's native NCCL communicator for an ``nccl`` group when built (created once, cached),
the adapter again when native NCCL is switched off or cannot load. NCCL needs a GPU, so the
``nccl`` backend name and the native communicator are stood in for here; the GPU machine runs the
real thing (bench/run_device.sh)."""

from __future__ import annotations

import os
import types
import tempfile

import pytest
import torch
import torch.distributed as dist

import compcomm
from compcomm import _C, _comm
from compcomm.optim import OneBitAdam
from compcomm.errors import BackendError, UnsupportedError


@pytest.fixture
def gloo_world():
    fd, path = tempfile.mkstemp()
    os.close(fd)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    _comm.forget_process_groups()
    yield
    _comm.forget_process_groups()
    dist.destroy_process_group()
    if os.path.exists(path):  # the file store may have removed it
        os.unlink(path)


@pytest.fixture
def as_nccl(monkeypatch):
    """The world group reports backend 'nccl', the build has NCCL, and the native communicator
    is a LocalCommunicator whose creations are counted."""
    made = []

    def fake_make(group=None, *a, **k):
        made.append(group)
        return _C.LocalCommunicator()

    info = dict(_C.build_info(), nccl=True)
    monkeypatch.setattr(_comm.dist, "get_backend", lambda pg=None: "nccl")
    monkeypatch.setattr(_comm._C, "build_info", lambda: info)
    monkeypatch.setattr(_comm._nccl, "make_nccl_communicator", fake_make)
    return made


def test_gloo_group_uses_the_torch_adapter(gloo_world):
    comm = compcomm.get_communicator(None)
    assert isinstance(comm, compcomm.TorchCommunicator)
    assert compcomm.get_communicator(dist.group.WORLD) is comm  # one cached adapter per group


def test_nccl_group_uses_native_nccl_once(gloo_world, as_nccl):
    comm = compcomm.get_communicator(None)
    assert isinstance(comm, _C.LocalCommunicator) and as_nccl == [None]
    assert compcomm.get_communicator(None) is comm  # cached: made once per process group
    assert compcomm.get_communicator(dist.group.WORLD) is comm and as_nccl == [None]
    opt = OneBitAdam([torch_param()], freeze_step=1)
    assert opt.comm is comm  # the optimizers (and so the DDP hook) get it with no change
    from compcomm.zero import ZeroOptimizer

    assert ZeroOptimizer([torch_param()], torch.optim.Adam, stage=2).comm is comm  # and ZeRO


def test_native_nccl_switched_off(gloo_world, as_nccl, monkeypatch):
    monkeypatch.setenv("COMPCOMM_NATIVE_NCCL", "0")
    assert isinstance(compcomm.get_communicator(None), compcomm.TorchCommunicator)
    assert as_nccl == []


def test_native_nccl_unloadable_falls_back_with_warning(gloo_world, as_nccl, monkeypatch):
    def broken(*a, **k):
        raise UnsupportedError("no libnccl.so.2", "load", "nccl")

    monkeypatch.setattr(_comm._nccl, "make_nccl_communicator", broken)
    with pytest.warns(RuntimeWarning, match="native NCCL unavailable"):
        comm = compcomm.get_communicator(None)
    assert isinstance(comm, compcomm.TorchCommunicator)


def test_init_overrides_and_no_torch_means_local():
    assert not dist.is_initialized()
    assert isinstance(compcomm.get_communicator(None), _C.LocalCommunicator)
    local = compcomm.init("local")
    try:
        assert compcomm.get_communicator(None) is local
    finally:
        compcomm.shutdown()


def torch_param():
    import torch

    return torch.nn.Parameter(torch.zeros(3))


def test_local_start_error_leaves_group_usable(gloo_world):
    """gloo refusing a call's arguments at the start (mismatched dtypes) raises a typed error
    but the group stays usable; a transport failure at the start, or a failed wait, breaks it."""
    comm = _comm.TorchCommunicator()
    opts = types.SimpleNamespace(timeout_s=60.0)  # all _run reads
    with pytest.raises(BackendError, match="rank 0"):  # gloo: "invalid tensor type" (RuntimeError)
        comm._run("all_gather", opts, False, lambda: dist.all_gather_into_tensor(
            torch.zeros(2, dtype=torch.float64), torch.zeros(2), async_op=True))
    assert comm.broken is None
    x = torch.ones(3)
    comm._run("all_reduce", opts, False, lambda: dist.all_reduce(x, async_op=True))
    assert comm.broken is None and x.tolist() == [1.0, 1.0, 1.0]

    def peer_gone():
        raise RuntimeError("[pair.cc:534] Connection closed by peer [127.0.0.1]:4242")

    with pytest.raises(BackendError):
        comm._run("all_reduce", opts, False, peer_gone)
    assert "Connection closed by peer" in comm.broken
    with pytest.raises(BackendError, match="cannot be used again"):
        comm._run("all_reduce", opts, False, lambda: dist.all_reduce(x, async_op=True))


def test_communicators_of_destroyed_groups_are_dropped(gloo_world, as_nccl, monkeypatch):
    """A cached communicator goes with its process group: after a subgroup is destroyed, the next
    communicator made drops (a native one: destroys) the subgroup's and keeps the world's; with the
    world destroyed, ``group=None`` drops the rest."""
    destroyed = []
    monkeypatch.setattr(_C.LocalCommunicator, "destroy", lambda self, t=30.0: destroyed.append(t),
                        raising=False)
    monkeypatch.setattr(_C.LocalCommunicator, "closed", False, raising=False)
    world = compcomm.get_communicator(None)  # the stood-in native communicator of the world
    sub = dist.new_group([0])
    sub_comm = compcomm.get_communicator(sub)
    assert sub_comm is not world and len(_comm._torch_comms) == 2
    dist.destroy_process_group(sub)
    assert compcomm.get_communicator(None) is world  # the world's stays cached
    other = dist.new_group([0])
    other_comm = compcomm.get_communicator(other)  # a new one: the destroyed group's goes first
    assert [c for _, c in _comm._torch_comms.values()] == [world, other_comm]
    assert destroyed == [30.0]
    dist.destroy_process_group(other)
    dist.destroy_process_group()
    try:
        assert compcomm.get_communicator(None) is _comm._local  # no torch world: one rank
        assert _comm._torch_comms == {} and destroyed == [30.0] * 3  # the world, other
    finally:  # the fixture destroys the world it made
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def test_a_new_world_after_destroy_gets_a_new_adapter(gloo_world):
    old = compcomm.get_communicator(None)
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    new = compcomm.get_communicator(None)
    assert isinstance(new, compcomm.TorchCommunicator) and new is not old
    assert [c for _, c in _comm._torch_comms.values()] == [new]


def test_an_infinite_timeout_waits_and_leaves_the_group_usable(gloo_world):
    """``timeout=inf`` passes the argument checks; converting it for torch's wait used to fail
    after the collective had started, which marked the group broken for good."""
    comm = compcomm.get_communicator(None)
    x = torch.ones(3)
    comm._run("all_reduce", types.SimpleNamespace(timeout_s=float("inf")), False,
              lambda: dist.all_reduce(x, async_op=True))
    assert comm.broken is None and x.tolist() == [1.0, 1.0, 1.0]


def test_bad_group_arguments_name_the_argument(gloo_world):
    with pytest.raises(ValueError, match=r"\[rank 0\].*argument 'group'.*not a member"):
        compcomm.get_communicator(dist.GroupMember.NON_GROUP_MEMBER)
    with pytest.raises(TypeError, match=r"\[rank 0\].*argument 'group' must be"):
        compcomm.get_communicator([0])
    with pytest.raises(TypeError, match="argument 'group'"):
        compcomm.compressed_allreduce(torch.zeros(8), *compcomm.error_buffers(torch.zeros(8)),
                                      group=0)


def test_init_torch_reuses_the_groups_adapter(gloo_world):
    """One adapter per group, whichever way it is reached, so users of the group see each other."""
    comm = compcomm.get_communicator(None)
    try:
        assert compcomm.init("torch") is comm
        assert compcomm.init("torch", comm=dist.group.WORLD) is comm
    finally:
        compcomm.shutdown()


def test_the_adapter_of_a_destroyed_world_refuses(gloo_world):
    """After destroy_process_group() and a new world, an adapter of the old one (init's default,
    or one an optimizer holds) raises a typed error instead of running on the new world with the
    old world's rank and size."""
    old = compcomm.init("torch")
    try:
        dist.destroy_process_group()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        with pytest.raises(BackendError, match="destroyed"):
            old.do_barrier(types.SimpleNamespace(timeout_s=5.0))
        with pytest.raises(ValueError, match="argument 'group'.*destroyed"):
            compcomm.TorchCommunicator(old.group)
    finally:
        compcomm.shutdown()


def test_init_and_shutdown_keep_the_native_communicators_of_groups(gloo_world, as_nccl,
                                                                   monkeypatch):
    """``compcomm.init``/``shutdown`` replace ``group=None``'s default; the native communicator
    made for a torch process group (which an optimizer holds) stays alive, while one that init
    made itself is destroyed."""
    from compcomm import _nccl

    destroyed = []
    monkeypatch.setattr(_C.LocalCommunicator, "destroy",
                        lambda self, t=30.0: destroyed.append(self), raising=False)
    monkeypatch.setattr(_C.LocalCommunicator, "closed", False, raising=False)
    monkeypatch.setattr(_nccl, "_cache", {})

    def cached_make(group=None, *a, **k):  # as make_nccl_communicator: cached in _nccl
        comm = _C.LocalCommunicator()
        _nccl._cache[("torch", id(comm), 0, True)] = (comm, comm)
        return comm

    monkeypatch.setattr(_comm._nccl, "make_nccl_communicator", cached_make)
    held = OneBitAdam([torch_param()], freeze_step=1).comm
    assert held is compcomm.get_communicator(None)
    mine = compcomm.init("nccl")
    compcomm.init("local")
    assert destroyed == [mine]  # init's own, replaced
    compcomm.shutdown()
    assert destroyed == [mine] and compcomm.get_communicator(None) is held


@pytest.mark.skipif(not _C.build_info()["mpi"], reason="built without MPI")
@pytest.mark.parametrize("handle", [0, 2, -1, 1 << 70])
def test_an_integer_that_is_no_mpi_handle_is_refused(handle):
    """A small integer (a Fortran handle from py2f(), say) used to abort the whole job in MPI."""
    with pytest.raises(ValueError, match="argument 'comm'"):
        compcomm.make_communicator("mpi", comm=handle)
