"""Issue 14's target "dead or hung peer: typed error within 2x the timeout" on compcomm's native
NCCL communicator, on a machine with ONE GPU: W = 2, 3, 4 ranks share it as emulated hosts (each
its own NCCL_HOSTID, NCCL over loopback sockets; see tests/_nccl_fault_cases.py).

- hung peer: the last rank stays alive but stops calling; the others' all_reduce and
  compcomm.compressed_allreduce raise CommTimeoutError after T and within 2T (T = the call's
  timeout; with W >= 3 a survivor may see another survivor's abort first, as BackendError, also
  after T), the communicator is closed, the next call raises at once, the tensors are unchanged,
  shutdown is bounded, every process exits 0;
- dead peer: the last rank exits (os._exit) between collectives or is SIGKILLed in the middle of
  one; the others raise CommTimeoutError or BackendError within 2T;
- the default path under torch: init_process_group("nccl"), compressed_allreduce(t, we, se) with
  group=None (compcomm's native NCCL communicator), a hung peer: the same, T being the call's
  ``timeout`` argument.

Needs a CUDA device, a build with NCCL and a loadable libnccl.so.2; skips otherwise (the launcher
itself is checked on CPU). Run on the GPU machine by bench/run_faults_gpu.sh (and
bench/run_nccl_gpu.sh). Gloo and MPI: tests/test_faults.py, tests/test_mpi.py. One GPU per rank,
without emulated hosts: tests/test_nccl.py::test_silent_peer_gives_timeout_then_closed.
"""

from __future__ import annotations

import signal
from typing import Any, Dict, List, Optional

import _nccl_fault_cases as C
import pytest
import torch
from _backends import no_gpu, no_nccl, skip_unless

WORLDS = [2, 3, 4]


def _no_native_nccl() -> Optional[str]:
    """Why the native NCCL communicator cannot run here, or None."""
    why = no_nccl() or no_gpu()
    if why is None:
        import compcomm
        from compcomm._nccl import load_nccl

        try:
            load_nccl()
        except compcomm.errors.UnsupportedError as e:
            why = f"no loadable libnccl.so.2: {e}"
    return why


def _survivors(launch: C.Launch, excluded: int):
    return [(r, res) for r, res in enumerate(launch.results) if r != excluded]


# ---------------------------------------------------------------------------------------------
# Hung peer.


def _check_timeouts(survivors: List[Dict[str, Any]], key: str) -> None:
    """The survivors' error ``key`` of a hung peer: CommTimeoutError after T and before 2T. With
    W >= 3 a survivor may instead see BackendError ("remote process exited or there was a network
    error"): the first survivor to time out aborts its communicator, which closes its sockets under
    the survivors still waiting, and whichever of abort-cascade and own deadline reaches a survivor
    first is what it raises. That still comes after T. At least one survivor times out."""
    assert "CommTimeoutError" in [res[key] for res in survivors], survivors
    for res in survivors:
        assert res[key] in C.TYPED, res
        assert 0.9 * C.T <= res[key + "_s"] < C.LIMIT, res


def _check_hung(launch: C.Launch, world: int, warm: bool) -> None:
    silent = world - 1
    survivors = [res for r, res in _survivors(launch, silent)]
    # all_reduce: a typed error after the timeout (not before: nothing else failed), before 2T
    _check_timeouts(survivors, "all_reduce")
    # compcomm.compressed_allreduce on a fresh communicator: the same
    _check_timeouts(survivors, "compressed")
    for res in survivors:
        if warm:
            assert res["warm_sum"] == float(world), res
        assert res["closed"] is True, res
        # the next call raises at once, the same error, naming the closed communicator
        assert res["after"] == res["all_reduce"] and "closed" in res["after_msg"], res
        assert res["after_s"] < 1.0, res
        assert res["compressed_closed"] is True and res["compressed_unchanged"] is True, res
        assert res["shutdown1_s"] < C.SHUTDOWN_LIMIT and res["shutdown_s"] < C.SHUTDOWN_LIMIT, res
    res = launch.results[silent]
    assert res["shutdown1_s"] < C.SHUTDOWN_LIMIT and res["shutdown_s"] < C.SHUTDOWN_LIMIT, res
    launch.assert_clean_exit()


@pytest.mark.gpu
@pytest.mark.parametrize("world", WORLDS)
def test_hung_peer_times_out_after_warmup(world):
    """Connections made by a warm-up: the faulted collective hangs on the device, the watchdog
    sees its completion event miss the deadline and aborts the communicator."""
    skip_unless(_no_native_nccl())
    launch = C.launch(world, C.hung_peer, True, True, timeout=240)
    _check_hung(launch, world, warm=True)


@pytest.mark.gpu
def test_hung_peer_times_out_after_warmup_nonblocking():
    """The same with a non-blocking NCCL communicator (NCCL launches from its own thread)."""
    skip_unless(_no_native_nccl())
    launch = C.launch(2, C.hung_peer, False, True, timeout=240)
    _check_hung(launch, 2, warm=True)


@pytest.mark.gpu
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
def test_hung_peer_times_out_on_first_call(blocking):
    """No warm-up, NCCL's cuMem (run-time connection) on: the faulted call itself waits inside NCCL
    for the silent peer's connection. Blocking: the watchdog aborts the communicator from its
    thread while the call is inside NCCL; non-blocking: the call's polling loop gives up."""
    skip_unless(_no_native_nccl())
    launch = C.launch(2, C.hung_peer, blocking, False, cumem=True, timeout=240)
    _check_hung(launch, 2, warm=False)


# ---------------------------------------------------------------------------------------------
# Dead peer.


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["exit_between", "kill_during"])
@pytest.mark.parametrize("world", WORLDS)
def test_dead_peer_gives_typed_error(world, how):
    skip_unless(_no_native_nccl())
    dying = world - 1
    launch = C.launch(world, C.dead_peer, how, dies=dying, timeout=240)
    for r, res in _survivors(launch, dying):
        assert res["warm_sum"] == float(world), res
        assert res["first"] in C.TYPED and res["first_s"] < C.LIMIT, res
        assert res["second"] in C.TYPED and res["second_s"] < 1.0, res
        assert res["closed"] is True and res["unchanged"] is True, res
        assert res["shutdown_s"] < C.SHUTDOWN_LIMIT, res
    launch.assert_clean_exit(dying_codes=(0,) if how == "exit_between" else (-signal.SIGKILL,))


# ---------------------------------------------------------------------------------------------
# The default path under torch.distributed.


@pytest.mark.gpu
@pytest.mark.parametrize("world", WORLDS)
def test_default_path_under_torch_hung_peer_times_out(world):
    """group=None under init_process_group("nccl") is compcomm's native NCCL communicator; the
    timeout that applies is compressed_allreduce's ``timeout`` argument (per collective, enforced
    by that communicator's watchdog), not the process group's."""
    skip_unless(_no_native_nccl())
    if not torch.distributed.is_nccl_available():
        pytest.skip("torch was built without NCCL (torch.distributed.is_nccl_available() is False)")
    silent = world - 1
    launch = C.launch(world, C.torch_default_hung, pg_backend="nccl", timeout=240)
    survivors = [res for r, res in _survivors(launch, silent)]
    _check_timeouts(survivors, "compressed")
    for res in survivors:
        assert res["native"] is True, res  # not the TorchCommunicator adapter
        assert res["closed"] is True and res["unchanged"] is True, res
    for res in launch.results:
        assert res["shutdown_s"] < 35.0, res  # compcomm.shutdown(): destroy(timeout=30)
    launch.assert_clean_exit()


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 3])
def test_one_rank_with_a_bad_argument_makes_every_rank_raise(world):
    """On the native NCCL communicator (the default path under torch): the peers raise
    RankMismatchError at once rather than wait until T or pair with the next call."""
    skip_unless(_no_native_nccl())
    if not torch.distributed.is_nccl_available():
        pytest.skip("torch was built without NCCL (torch.distributed.is_nccl_available() is False)")
    launch = C.launch(world, C.one_rank_rejects, pg_backend="nccl", timeout=240)
    for r, res in enumerate(launch.results):
        for case, want in (("float64", "TypeError"), ("cpu", "ValueError"),
                           ("all_cpu", "ValueError")):
            if r == world - 1:
                assert res[case] == want, res
            else:
                assert res[case] == "RankMismatchError", res
                assert f"rank {world - 1}: rejected its arguments" in res[case + "_msg"], res
            assert res[case + "_s"] < C.T / 2 and res[case + "_unchanged"], res
        assert res["exact"] == [True, True, True], res
    assert "the NCCL communicator is on cuda:" in launch.results[-1]["all_cpu_msg"]
    launch.assert_clean_exit()


# ---------------------------------------------------------------------------------------------
# The launcher, on CPU (runs everywhere: no NCCL, no GPU).


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_fault_launcher_tolerates_the_planned_death(how):
    launch = C.launch(3, C.launcher_check, how, dies=2, timeout=120)
    assert launch.reported == [True, True, False]
    for r in (0, 1):
        res = launch.results[r]
        assert res["rank"] == r and res["ifname"] == "lo" and res["cumem"] == "0", res
    assert launch.results[0]["hostid"] != launch.results[1]["hostid"]
    launch.assert_clean_exit(dying_codes=(0,) if how == "exit" else (-signal.SIGKILL,))


def test_fault_launcher_reraises_a_ranks_error():
    with pytest.raises(ValueError, match="raised on purpose") as info:
        C.launch(2, C.launcher_check, "raise", timeout=120)
    notes = "".join(getattr(info.value, "__notes__", []))
    assert "raised on rank 1" in notes
