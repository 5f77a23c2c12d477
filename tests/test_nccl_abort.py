"""Issue 14, "nothing half-done", for a peer that dies in the MIDDLE of a compressed allreduce.

On native NCCL the survivors' commit kernels are enqueued on their stream right behind the
all_to_all and all_gather that wait for the dead peer; the watchdog's abort releases those
collectives without their data, and the stream then runs the commit. The commit gate
(kernels::commit_gate, reading the communicator's abort flag that every abort sets first)
makes that commit write nothing. Here:

- the gate kernel against a numpy reference (CPU twin; the CUDA kernel against it on a GPU), and
  with the commit kernels' guard: a raised flag leaves every buffer untouched;
- native NCCL, W = 2, 3 ranks sharing one GPU as emulated hosts (tests/_nccl_fault_cases.py): the
  last rank exits after its header (COMPCOMM_TEST_FAULT=exit_after_header); the survivors' call
  returns (commit enqueued), their synchronize raises a typed error within 2T, and tensor,
  worker_error and server_error are bit-identical to before; the next call raises at once. The same
  with the gate left out (COMPCOMM_TEST_FAULT=no_commit_gate) shows the check catches its absence;
- gloo (CPU): the same fault gives a typed error and unchanged tensors, and the broken process
  group makes the next call raise at once (also after a hung peer's timeout).
"""

from __future__ import annotations

import math

import _nccl_abort_cases as A
import _nccl_fault_cases as C
import numpy as np
import pytest
import torch
from _backends import no_gpu, skip_unless
from compcomm import _C
from compcomm._buffers import buffer_of
from compcomm.collectives import compressed_reduce_scatter
from compcomm.testing import cancelling_peer
from test_nccl_faults import _no_native_nccl

# ---------------------------------------------------------------------------------------------
# The gate kernel.


def _gate_reference(flag: int, scales: np.ndarray, stride: int, world: int) -> np.ndarray:
    out = scales.copy()
    if flag:
        out[: world * stride : stride] = np.nan
    return out


def _gate(flag: int, scales: torch.Tensor, stride: int, world: int) -> torch.Tensor:
    f = torch.tensor([flag], dtype=torch.int32, device=scales.device)
    out = scales.clone()
    _C.kernels.commit_gate(buffer_of(f), buffer_of(out), stride, world)
    if out.is_cuda:
        torch.cuda.synchronize(out.device)
    return out.cpu()


@pytest.mark.parametrize("flag", [0, 1, -7])
@pytest.mark.parametrize("stride,world", [(1, 1), (4, 3), (7, 4)])
def test_commit_gate_matches_reference(flag, stride, world):
    scales = torch.randn(world * stride + 2)
    got = _gate(flag, scales, stride, world).numpy()
    want = _gate_reference(flag, scales.numpy(), stride, world)
    np.testing.assert_array_equal(got, want)  # NaN where it must be, every other bit unchanged


@pytest.mark.gpu
@pytest.mark.parametrize("flag", [0, 1])
def test_commit_gate_cuda_matches_cpu(flag):
    skip_unless(no_gpu())
    scales = torch.randn(4 * 3 + 2)
    np.testing.assert_array_equal(_gate(flag, scales.cuda(), 4, 3).numpy(),
                                  _gate(flag, scales, 4, 3).numpy())


def test_commit_gate_rejects_bad_arguments():
    f = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="flag must be int32"):
        _C.kernels.commit_gate(buffer_of(f.float()), buffer_of(torch.zeros(4)), 1, 2)
    with pytest.raises(ValueError, match="scales must be float32"):
        _C.kernels.commit_gate(buffer_of(f), buffer_of(torch.zeros(4)), 2, 3)
    # where flag lives is checked before any kernel runs (these "cuda:0" buffers are never read)
    s = torch.zeros(4)
    cuda_flag = _C.Buffer(f.data_ptr(), 1, _C.DType.int32, 0)
    cuda_scales = _C.Buffer(s.data_ptr(), 4, _C.DType.float32, 0)
    with pytest.raises(ValueError, match=r"flag must be on the same device as scales \(cuda:0 vs host"):
        _C.kernels.commit_gate(cuda_flag, buffer_of(s), 1, 2)
    with pytest.raises(ValueError, match=r"flag must be on the same device as scales \(host vs cuda:0"):
        _C.kernels.commit_gate(buffer_of(f), cuda_scales, 1, 2)


@pytest.mark.parametrize("flag", [0, 1])
def test_gate_then_commit_kernels_write_nothing_when_raised(flag):
    """The commit as run_compressed does it on a cancellable communicator: the gate on the
    received scales, then server_update and worker_update_decompress guarded by them."""
    world, chunk = 2, 16
    padded = world * chunk
    stride = 4  # scales inside 16-byte records
    g = torch.Generator().manual_seed(1)
    scales = torch.rand(world * stride, generator=g) + 0.5
    signs = torch.randint(0, 256, (world * chunk // 8,), dtype=torch.uint8, generator=g)
    serr = torch.randn(chunk, generator=g)
    m = torch.randn(padded - 3, generator=g)
    e = torch.randn(padded, generator=g)
    out_signs = torch.randint(0, 256, (world * stride * 4,), dtype=torch.uint8, generator=g)
    own = torch.tensor([0.7])
    taus = scales.clone()
    before = [x.clone() for x in (serr, m, e)]
    f = torch.tensor([flag], dtype=torch.int32)
    _C.kernels.commit_gate(buffer_of(f), buffer_of(taus), stride, world)
    _C.kernels.server_update(buffer_of(signs), buffer_of(scales), stride, world, buffer_of(serr),
                             buffer_of(own), guard=buffer_of(taus), guard_stride=stride)
    _C.kernels.worker_update_decompress(buffer_of(m), buffer_of(e), buffer_of(own), buffer_of(taus),
                                        stride, buffer_of(out_signs), stride * 4, world,
                                        guard=buffer_of(taus), guard_stride=stride)
    same = [torch.equal(a, b) for a, b in zip(before, (serr, m, e))]
    assert same == ([True] * 3 if flag else [False] * 3)
    if not flag:
        assert all(math.isfinite(v) for v in m.tolist())


def test_host_communicators_have_no_abort_flag():
    """Host backends complete or fail each call on the host: no flag, no gate kernel."""
    assert _C.LocalCommunicator().abort_flag == 0


# ---------------------------------------------------------------------------------------------
# The gate inside compressed_allreduce / compressed_reduce_scatter, on the CPU.


def _run(op: str, comm, seed: int = 3):
    import compcomm

    g = torch.Generator().manual_seed(seed)
    t = torch.randn(1003, generator=g)
    we, se = compcomm.error_buffers(t, group=comm)
    we.copy_(0.1 * torch.randn(we.numel(), generator=g))
    se.copy_(0.1 * torch.randn(se.numel(), generator=g))
    before = [x.clone() for x in (t, we, se)]
    if op == "allreduce":
        compcomm.compressed_allreduce(t, we, se, group=comm)
        return before, [t, we, se]
    out = torch.full((se.numel(),), 5.0)
    before.append(out.clone())
    compressed_reduce_scatter(t, we, se, out, group=comm)
    return before, [t, we, se, out]


# Collectives of one call: 1 the header all_gather, 2 the signs' all_to_all, 3 (allreduce only)
# the records' all_gather. Cancelling the header is caught by its own check (a BackendError).
CANCELLED = [("allreduce", 2), ("allreduce", 3), ("reduce_scatter", 2)]


@pytest.mark.parametrize("op,cancel_at", CANCELLED)
def test_cancelled_exchange_commits_nothing(op, cancel_at):
    comm = cancelling_peer(cancel_at)
    assert comm.abort_flag == comm.flag.data_ptr()
    before, after = _run(op, comm)
    assert comm.flag.item() == 1  # the cancellation happened, inside the call
    for a, b in zip(before, after):
        assert torch.equal(a, b)  # bit for bit: nothing was written


@pytest.mark.parametrize("op,cancel_at", CANCELLED)
def test_cancelled_exchange_without_gate_changes_state(op, cancel_at, monkeypatch):
    """COMPCOMM_TEST_FAULT=no_commit_gate: the same cancellation then writes garbage-derived
    values, which the test above would catch."""
    monkeypatch.setenv("COMPCOMM_TEST_FAULT", "no_commit_gate")
    before, after = _run(op, cancelling_peer(cancel_at))
    assert not all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("op", ["allreduce", "reduce_scatter"])
def test_uncancelled_calls_match_the_local_communicator(op):
    """With the flag never set, the gate changes nothing: the results are those of a plain world
    of one rank, bit for bit."""
    _, got = _run(op, cancelling_peer(0))
    _, want = _run(op, _C.LocalCommunicator())
    for a, b in zip(got, want):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# Native NCCL: a peer dies after its header.


def _check_survivors(launch: C.Launch, world: int, gate: bool) -> None:
    dying = world - 1
    for r, res in enumerate(launch.results):
        if r == dying:
            continue
        assert res["flag"] is True, res  # the communicator has a abort flag
        # past the header check: the commit was enqueued behind the collectives that never end
        assert res.get("returned") is True, res
        assert res["error"] in C.TYPED and res["error_s"] < C.LIMIT, res
        assert res["closed"] is True, res
        assert res["second"] in C.TYPED and res["second_s"] < 1.0, res
        assert res["shutdown_s"] < C.SHUTDOWN_LIMIT, res
        if gate:
            assert res["unchanged"] == [True, True, True], res  # tensor, worker_error, server_error
    if not gate:  # the mutation the gated runs guard against: some survivor's state changed
        changed = [res["unchanged"] for r, res in enumerate(launch.results) if r != dying]
        assert any(not all(u) for u in changed), changed
    launch.assert_clean_exit(dying_codes=(0,))


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 3])
def test_nccl_peer_dies_after_header_changes_nothing(world):
    skip_unless(_no_native_nccl())
    launch = C.launch(world, A.nccl_dies_after_header, True, dies=world - 1, timeout=240)
    _check_survivors(launch, world, gate=True)


@pytest.mark.gpu
def test_nccl_without_gate_the_check_fails():
    """COMPCOMM_TEST_FAULT=no_commit_gate on the survivors: the same fault then changes their
    state (what the test above would catch without the gate)."""
    skip_unless(_no_native_nccl())
    launch = C.launch(2, A.nccl_dies_after_header, False, dies=1, timeout=240)
    _check_survivors(launch, 2, gate=False)


# ---------------------------------------------------------------------------------------------
# gloo (CPU): the same fault, and a broken group raising at once.


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_peer_dies_after_header_changes_nothing(world):
    dying = world - 1
    launch = C.launch(world, A.gloo_dies_after_header, pg_backend="gloo", dies=dying, timeout=180)
    for r, res in enumerate(launch.results):
        if r == dying:
            continue
        assert res["error"] in C.TYPED and res["error_s"] < C.LIMIT, res
        assert "returned" not in res, res  # host buffers: the call itself raises
        assert res["unchanged"] == [True, True, True], res
        assert res["broken"], res
        assert res["second"] in C.TYPED and res["second_s"] < 1.0, res
        assert "earlier call" in res["second_msg"], res
        assert res["second_unchanged"] == [True, True, True], res
    launch.assert_clean_exit(dying_codes=(0,))


def test_gloo_hung_peer_breaks_the_group():
    launch = C.launch(2, A.gloo_hung_peer, pg_backend="gloo", timeout=180)
    res = launch.results[0]
    assert res["error"] == "CommTimeoutError" and 0.9 * C.T <= res["error_s"] < C.LIMIT, res
    assert res["broken"], res
    assert res["second"] == "CommTimeoutError" and res["second_s"] < 1.0, res
    assert "earlier call" in res["second_msg"], res
    assert res["unchanged"] == [True, True, True], res
    launch.assert_clean_exit()


@pytest.mark.parametrize("with_sync", [True, False], ids=["synchronize", "no_synchronize"])
def test_compressor_step_with_cancelled_exchange(with_sync):
    """The optimizers' average (OneBitCompressor.average_) on a cancellable communicator: with
    ``synchronize`` it raises before committing (so the optimizer step raises, nothing written);
    without, the gate alone keeps buckets and error buffers unchanged."""
    from compcomm.testing import run_ranks

    for res in run_ranks(2, A.compressor_cancelled, with_sync, timeout=240):
        assert res["error"] == ("BackendError" if with_sync else None), res
        assert all(res["unchanged"]), res


@pytest.mark.parametrize("with_sync", [True, False], ids=["synchronize", "no_synchronize"])
def test_zero_step_with_cancelled_reduce_scatter(with_sync):
    """ZeroOptimizer.step on a cancellable communicator: with ``synchronize`` a cancelled gradient
    reduce-scatter raises before the update (parameters, Adam state unchanged); without it the
    step would go on from garbage, which is what the check guards against."""
    from compcomm.testing import run_ranks

    for res in run_ranks(2, A.zero_step_cancelled, with_sync, timeout=240):
        if with_sync:
            assert res["error"] == "BackendError", res
            assert res["params_unchanged"] and res["state_unchanged"], res
        else:
            assert res["error"] is None and not res["params_unchanged"], res


@pytest.mark.parametrize("with_sync", [True, False], ids=["synchronize", "no_synchronize"])
def test_zero_step_with_cancelled_parameter_all_gather(with_sync):
    """A peer lost during the all-gather that follows the update: with ``synchronize`` step()
    raises (the parameters hold garbage, and the caller must not save or use them); without it
    the step returns with garbage in the parameters, silently."""
    from compcomm.testing import run_ranks

    for res in run_ranks(2, A.zero_step_cancelled, with_sync, "all_gather", timeout=240):
        assert res["params_garbage"], res
        assert res["error"] == ("BackendError" if with_sync else None), res


def test_compressor_abort_after_the_wait_still_commits():
    """An abort that comes after the wait for the exchanges' device work found none: the data is
    complete, so every bucket commits (the commits pass gate=False); equal to a plain average."""
    from compcomm.testing import run_ranks

    for res in run_ranks(2, A.compressor_abort_after_wait, timeout=240):
        assert res["same"] == [True, True], res
