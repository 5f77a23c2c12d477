"""The Python API's argument checks (each names the argument and rank, changes nothing) and metadata."""

from __future__ import annotations

import pytest
import torch

import compcomm
from compcomm import errors


def _bufs(n=100):
    t = torch.randn(n)
    we, se = compcomm.error_buffers(t)
    return t, we, se


def _unchanged_after(exc_type, match, t, we, se, **kw):
    def real(xs):
        return [x for x in xs if isinstance(x, torch.Tensor) and x.device.type != "meta"]

    before = [x.clone() for x in real((t, we, se))]
    with pytest.raises(exc_type, match=match):
        compcomm.compressed_allreduce(t, we, se, **kw)
    after = real((t, we, se))
    for a, b in zip(before, after):
        assert torch.equal(a, b)


def test_rejects_bad_tensor():
    t, we, se = _bufs()
    _unchanged_after(TypeError, r"\[rank 0\].*'tensor'.*torch.Tensor", t.numpy(), we, se)
    _unchanged_after(TypeError, r"'tensor'.*float32, float16 or bfloat16.*int32", t.int(), we, se)
    nc = torch.randn(100, 2)[:, 0]
    _unchanged_after(ValueError, r"'tensor'.*contiguous", nc, we, se)


def test_rejects_bad_error_buffers():
    t, we, se = _bufs()
    _unchanged_after(TypeError, r"'worker_error'.*float32.*float64", t, we.double(), se)
    _unchanged_after(ValueError, r"'worker_error'.*multiple of 8\*world_size", t, we[:50], se)
    _unchanged_after(ValueError, r"'worker_error'.*multiple of 8\*world_size", t, torch.zeros(101), se)
    _unchanged_after(ValueError, r"'server_error'.*expected 104", t, we, se[:8])
    _unchanged_after(TypeError, r"'server_error'.*float32", t, we, se.half())
    _unchanged_after(ValueError, r"'worker_error'.*contiguous", t, torch.zeros(208)[::2], se)
    _unchanged_after(ValueError, r"'server_error' is on meta", t, we, torch.zeros(104, device="meta"))
    _unchanged_after(ValueError, r"'timeout'", t, we, se, timeout=0)


def test_nonfinite_raises_and_changes_nothing():
    t, we, se = _bufs()
    t[5] = float("inf")
    _unchanged_after(errors.NonFiniteError, r"rank\(s\) 0", t, we, se)
    t, we, se = _bufs()
    we[-1] = float("nan")  # in the padding: still caught
    before = [x.clone() for x in (t, we, se)]
    with pytest.raises(errors.NonFiniteError):
        compcomm.compressed_allreduce(t, we, se)
    for a, b in zip(before, (t, we, se)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_error_classes_pickle_and_inherit():
    import pickle

    e = errors.CommTimeoutError("late", "all_gather", "torch:gloo", 0, 3)
    e2 = pickle.loads(pickle.dumps(e))
    assert (e2.call, e2.backend, e2.rank, str(e2)) == ("all_gather", "torch:gloo", 3, "late")
    assert isinstance(e2, TimeoutError) and isinstance(e2, errors.CommError)
    assert issubclass(errors.RankMismatchError, ValueError)
    assert issubclass(errors.NonFiniteError, ValueError)
    assert issubclass(errors.UnsupportedError, NotImplementedError)


def test_build_info_and_backends():
    info = compcomm.build_info()
    for key in ("cuda", "nccl", "mpi"):
        assert isinstance(info[key], bool)
    for key in ("cuda_version", "nccl_version", "mpi_version", "version", "torch_version"):
        assert key in info
    backends = compcomm.available_backends()
    assert backends[:2] == ["local", "torch"]
    assert ("mpi" in backends) == info["mpi"]


def test_public_api_documented():
    for name in compcomm.__all__:
        obj = getattr(compcomm, name)
        if callable(obj) and not isinstance(obj, type):
            assert obj.__doc__ and len(obj.__doc__) > 40, name


def test_error_buffers_and_wire_bytes():
    we, se = compcomm.error_buffers(1000)
    assert we.dtype == torch.float32 and we.numel() == 1000 and se.numel() == 1000
    assert compcomm.error_buffers(torch.zeros(3, 5, dtype=torch.bfloat16))[0].numel() == 16
    assert compcomm.padded_numel(1000, 3) == 1008  # multiple of 3*lcm(3,8) = 72
    assert compcomm.wire_bytes(1000, 1) == 0
    assert compcomm.allreduce_wire_bytes(1000, 4) == 6000
    # ~32x fewer bytes than an fp32 ring allreduce for large tensors.
    n = 2**24
    ratio = compcomm.allreduce_wire_bytes(n, 4) / compcomm.wire_bytes(n, 4)
    assert 31.9 < ratio <= 32.0


def test_buffer_keeps_its_tensor_alive():
    """A Buffer made from a temporary holds it: the memory is still the tensor's when used."""
    import gc

    from compcomm._buffers import buffer_of, tensor_of

    b = buffer_of(torch.full((4096,), 3.0))
    gc.collect()
    _ = [torch.zeros(4096) for _ in range(8)]  # would reuse freed memory
    assert isinstance(b.owner, torch.Tensor)
    assert torch.equal(tensor_of(b), torch.full((4096,), 3.0))
