"""The CUDA batched kernels (tests/test_batched_kernels.py runs the same bodies on the host): one
launch copies a batch of any sizes and alignments (more jobs than one kernel-argument pack holds
included); compressed_allreduce_exchange_many + compressed_allreduce_commit_many on a GPU give, bit
for bit, the per-call GPU calls (each bucket keeps the blocks of its own launch, so even the fp64
norm sums add in the same order), W = 1..4 over mirrored peers; a bad argument writes nothing."""

from __future__ import annotations

import pytest
import torch

from compcomm import _C
from compcomm._buffers import buffer_of

import _batched_kernel_cases as bk
from _backends import no_cuda_kernels, no_gpu, skipif

pytestmark = [pytest.mark.gpu, skipif(no_gpu() or no_cuda_kernels())]


@pytest.mark.parametrize("count", [1, 13, 300])
def test_batch_copy_equals_a_copy_loop(count):
    out, dsts, srcs = bk.copy_jobs("cuda", count)
    want = out.clone()
    for d, s in zip(dsts, srcs):
        want[d.data_ptr() - out.data_ptr():][: s.numel()].copy_(s)
    _C.kernels.batch_copy([buffer_of(d) for d in dsts], [buffer_of(s) for s in srcs],
                          torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_batched_exchange_and_commit_many_equal_per_call(world):
    assert bk.batched_equals_per_call(world, "cuda") == [[True, True]] * 3


def test_many_buckets_span_several_packs():
    """More buckets than one launch's argument pack holds (commit: ~27): still the per-call bits."""
    saved = bk.BUCKETS
    bk.BUCKETS = [(n, torch.float32, i % 2) for i, n in enumerate([64, 1000, 8, 4099] * 20)]
    try:
        assert bk.batched_equals_per_call(2, "cuda", rounds=2) == [[True, True]] * 2
    finally:
        bk.BUCKETS = saved


def test_commit_many_with_a_bad_argument_writes_nothing():
    kind, msg, unchanged = bk.commit_many_bad_argument_writes_nothing("cuda")
    assert kind == "ValueError" and "workspace has 64 bytes" in msg, (kind, msg)
    assert unchanged


@pytest.mark.parametrize("shift", [0, 1, 6, 12])
def test_batch_copy_of_megabytes_misaligned(shift):
    """Copies past the per-copy block cap (512 blocks of 4 KiB), src and dst misaligned to each
    other by `shift` bytes (narrower words; bytes at the odd shifts)."""
    g = torch.Generator().manual_seed(shift)
    src = torch.randint(0, 256, (3 << 20,), generator=g, dtype=torch.uint8).cuda()
    out = torch.zeros((3 << 20) + 64, dtype=torch.uint8, device="cuda")
    n = (3 << 20) - 37
    dst = out[shift:shift + n]
    _C.kernels.batch_copy([buffer_of(dst), buffer_of(out[-8:])], [buffer_of(src[3:3 + n]), buffer_of(src[:5])],
                          torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    want = torch.zeros_like(out)
    want[shift:shift + n] = src[3:3 + n]
    want[-8:-3] = src[:5]
    assert torch.equal(out, want)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_batched_reduce_scatter_equals_per_call(world):
    """compcomm.fsdp's batched segments (compressed_reduce_scatter_exchange_many + a commit per
    segment) give the bits of one compressed_reduce_scatter per segment: outputs, both errors."""
    assert bk.rs_batched_equals_per_call(world, "cuda") == [True] * 3
