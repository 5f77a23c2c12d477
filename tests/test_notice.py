"""The notice a checked compressed_allreduce alone waits on (cpp/kernels/notice.h): a stale or torn
notice is never taken for the call's verdict.

The worker kernel posts its header to a per-thread notice under a tag unique to the call (a seqlock:
begin, header, tag). A call that launched its worker but did not read its verdict there (it raised
in between, timed out, or read a torn notice) abandons the notice, so its kernel, if it posts late,
never writes where a later call waits. CPU: the reader's states and the abandonment (the same code
path runs on the host); GPU (skipped without one): the device writer, and a late worker kernel of a
failed call behind a busy stream next to a call with NaN input.
"""

from __future__ import annotations

import pytest
import torch

import compcomm
from compcomm import _C
from compcomm._buffers import buffer_of
from compcomm.errors import BackendError, NonFiniteError
from _backends import no_cuda_kernels, no_gpu, skipif

K = _C.kernels
FAULT = "COMPCOMM_TEST_FAULT"


def _post(notice: torch.Tensor, seq: int, n: int = 7, dev: str = "cpu") -> torch.Tensor:
    """worker_scale_pack_header of a small random tensor, posting to ``notice`` under ``seq``;
    returns the header it wrote."""
    P = compcomm.padded_numel(n, 1)
    m = torch.randn(n, generator=torch.Generator().manual_seed(seq % 1000)).to(dev)
    e = torch.zeros(P, device=dev)
    header = torch.zeros(32, dtype=torch.uint8, device=dev)
    signs = torch.zeros(max(1, P // 8), dtype=torch.uint8, device=dev)
    ws = torch.zeros(K.scale_workspace_bytes(P, dev != "cpu") or 16, dtype=torch.uint8, device=dev)
    K.worker_scale_pack_header(buffer_of(m), buffer_of(e), buffer_of(header), buffer_of(signs),
                               buffer_of(ws), magic=3, notice=buffer_of(notice), seq=seq)
    return header


def _word(notice: torch.Tensor, at: int) -> int:
    return int(notice[at: at + 8].view(torch.int64).item())


def test_read_notice_states() -> None:
    notice = torch.zeros(64, dtype=torch.uint8)
    assert K.read_notice(buffer_of(notice), 1) == "pending"  # fresh memory: no call posted
    seq = 2**41 + 9
    header = _post(notice, seq)
    assert torch.equal(notice[:32], header) and _word(notice, 32) == seq == _word(notice, 40)
    assert K.read_notice(buffer_of(notice), seq) == "ready"
    assert K.read_notice(buffer_of(notice), seq + 1) == "pending"  # a later call: not posted yet
    assert K.read_notice(buffer_of(notice), seq - 1) == "pending"  # an earlier call's tag is gone
    # a late writer of an earlier call began after this call's post: begin holds its tag
    notice[40:48].view(torch.int64)[0] = seq - 1
    assert K.read_notice(buffer_of(notice), seq) == "torn"
    with pytest.raises(ValueError, match="64 bytes"):
        K.read_notice(buffer_of(notice[:32]), seq)


def _state(n: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(n)
    t = torch.randn(n, generator=g).to(device)
    we, se = compcomm.error_buffers(t, group=_C.LocalCommunicator())
    we.copy_(0.1 * torch.randn(we.numel(), generator=g))
    return t, we, se


def _bits(*ts: torch.Tensor) -> list:
    return [t.detach().cpu().view(torch.int32).clone() for t in ts]


def test_call_failing_after_its_worker_abandons_its_notice(monkeypatch) -> None:
    """A call that raises after its worker posted (or may still post) changes nothing and leaves
    its notice behind: this thread's next call waits on a fresh one, and gives the bits of a run
    without the failed call."""
    comm = _C.LocalCommunicator()
    t, we, se = _state(4099)
    ref = [x.clone() for x in (t, we, se)]
    compcomm.compressed_allreduce(t, we, se, comm)
    compcomm.compressed_allreduce(*ref, _C.LocalCommunicator())
    before = K.notice_address(False)
    assert before != 0
    monkeypatch.setenv(FAULT, "raise_after_worker")
    kept = _bits(t, we, se)
    with pytest.raises(BackendError, match="raise_after_worker"):
        compcomm.compressed_allreduce(t, we, se, comm)
    monkeypatch.delenv(FAULT)
    assert all(torch.equal(a, b) for a, b in zip(_bits(t, we, se), kept)), "state changed"
    assert K.notice_address(False) != before, "the notice of the failed call is still in use"
    for x in (t, ref[0]):
        x.add_(0.5)
    compcomm.compressed_allreduce(t, we, se, comm)
    compcomm.compressed_allreduce(*ref, _C.LocalCommunicator())
    assert all(torch.equal(a, b) for a, b in zip(_bits(t, we, se), _bits(*ref)))


# ---- GPU ---------------------------------------------------------------------------------------
NEEDS_GPU = no_gpu() or no_cuda_kernels()


@pytest.mark.gpu
@skipif(NEEDS_GPU)
@pytest.mark.parametrize("n", [0, 7, 2**20 + 3])
def test_device_notice_is_a_seqlock(n: int) -> None:
    notice = torch.full((64,), 0xEE, dtype=torch.uint8, device="cuda")
    seq = 2**35 + n
    header = _post(notice, seq, n, "cuda")
    torch.cuda.synchronize()
    host = notice.cpu()
    assert torch.equal(host[:32], header.cpu()) and _word(host, 32) == seq == _word(host, 40)
    assert bool((host[48:] == 0xEE).all())
    assert K.read_notice(buffer_of(host), seq) == "ready"


@pytest.mark.gpu
@skipif(NEEDS_GPU)
def test_late_worker_of_failed_call_is_not_read(monkeypatch) -> None:
    """A failed call's worker kernel queued behind a busy stream posts after the next call on
    another stream has started: that call (NaN input) still raises NonFiniteError and changes
    nothing, and the calls after it give the bits of a run without the failed call."""
    comm = _C.LocalCommunicator()
    t, we, se = _state(1 << 16, "cuda")
    ref = [x.clone() for x in (t, we, se)]
    compcomm.compressed_allreduce(t, we, se, comm)
    before = K.notice_address(True)
    assert before != 0
    busy, other = torch.cuda.Stream(), torch.cuda.Stream()
    busy.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(busy):
        torch.cuda._sleep(200_000_000)  # ~0.1 s on the GPU: the worker below posts late
        stale = t.clone()
        monkeypatch.setenv(FAULT, "raise_after_worker")
        with pytest.raises(BackendError, match="raise_after_worker"):
            compcomm.compressed_allreduce(stale, we, se, comm)
        monkeypatch.delenv(FAULT)
    assert K.notice_address(True) != before
    other.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(other):
        kept = _bits(t, we, se)
        bad = t.clone()
        bad[5] = float("nan")
        with pytest.raises(NonFiniteError):  # its own communicator: not the stale call's workspace
            compcomm.compressed_allreduce(bad, we, se, _C.LocalCommunicator())
        assert all(torch.equal(a, b) for a, b in zip(_bits(t, we, se), kept))
    torch.cuda.synchronize()
    compcomm.compressed_allreduce(*ref, _C.LocalCommunicator())
    for x in (t, ref[0]):
        x.add_(0.5)
    compcomm.compressed_allreduce(t, we, se, comm)
    compcomm.compressed_allreduce(*ref, _C.LocalCommunicator())
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(_bits(t, we, se), _bits(*ref)))
