"""CPU kernel throughput (GB/s of input) against a torch implementation of the same math, same run.

Run: python -m pytest bench/bench_kernels.py --benchmark-only --benchmark-enable
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compcomm import _C
from compcomm._buffers import buffer_of

K = _C.kernels
N = 2**24  # 64 MiB of fp32


def torch_worker(m: torch.Tensor, e: torch.Tensor):
    """DeepSpeed's worker side as plain torch ops: add, norm, sign, error update, packbits."""
    x = m.float() + e
    scale = x.norm() / np.sqrt(x.numel())
    s = torch.where(x < 0, -1.0, 1.0)
    new_e = x - scale * s
    packed = np.packbits((s > 0).numpy(), bitorder="big")
    return scale, new_e, packed


_medians: dict = {}


@pytest.fixture(scope="module")
def data():
    torch.manual_seed(0)
    m = torch.randn(N)
    e = torch.randn(N) * 0.1
    return m, e


def test_torch_worker(benchmark, data):
    """Runs first (file order): the baseline the compcomm rows are divided by."""
    m, e = data
    benchmark.pedantic(torch_worker, args=(m, e), rounds=3, iterations=1, warmup_rounds=1)
    _medians["torch"] = benchmark.stats["median"]
    benchmark.extra_info["GB/s of input"] = N * 4 / benchmark.stats["median"] / 1e9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compcomm_worker(benchmark, data, dtype):
    m, e = data[0].to(dtype), data[1].clone()
    scale = torch.zeros(1)
    signs = torch.zeros(N // 8, dtype=torch.uint8)
    records = torch.zeros(16 + N // 8, dtype=torch.uint8)
    ws = torch.zeros(1, dtype=torch.uint8)

    def run():  # the worker side of one call: pass 1 and the commit pass
        K.worker_scale_pack(buffer_of(m), buffer_of(e), buffer_of(scale), buffer_of(signs), buffer_of(ws))
        K.worker_update_decompress(buffer_of(m), buffer_of(e), buffer_of(scale),
                                   buffer_of(records.view(torch.float32)), 4,
                                   _C.Buffer(records.data_ptr() + 16, N // 8, _C.DType.uint8, -1),
                                   N // 8, 1)

    benchmark.pedantic(run, rounds=5, iterations=1, warmup_rounds=1)
    median = benchmark.stats["median"]
    _medians[f"compcomm {dtype}"] = median
    benchmark.extra_info["GB/s of input"] = N * m.element_size() / median / 1e9
    benchmark.extra_info["GB/s of fp32-equivalent"] = N * 4 / median / 1e9
    if "torch" in _medians:
        benchmark.extra_info["speedup vs torch ops"] = _medians["torch"] / median
