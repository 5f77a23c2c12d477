"""The backward overlap on CUDA (tests/test_overlap.py runs the same bodies on the CPU): ranks
sharing the GPU(s) as emulated NCCL hosts (their own NCCL_HOSTID, sockets over loopback), a torch
NCCL group, so the optimizer runs compcomm's native NCCL communicator where the build has it. The
hooks stage on the backward's stream and send on a side stream; the results must equal those
without overlap bit for bit (fp32 and bf16 parameters), gradient accumulation must switch the
overlap off, and a step without backward must send every group itself."""

from __future__ import annotations

import pytest

import _overlap_cases as C
from _backends import no_gpu, skipif
from compcomm.testing import run_ranks

pytestmark = [pytest.mark.gpu, skipif(no_gpu())]

NCCL_ENV = {"NCCL_IB_DISABLE": "1", "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1",
            "NCCL_NVLS_ENABLE": "0", "NCCL_SOCKET_IFNAME": "lo",
            "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # both runs' gradients: the same bits


def test_overlap_on_cuda_is_bit_identical():
    outs = run_ranks(2, C.gpu_scenarios, timeout=300, env=NCCL_ENV)
    for rank, out in enumerate(outs):
        for key in ("plain_float32", "plain_bfloat16"):
            run = out[key]
            assert C.identical(run), (rank, key)
            assert run[True]["overlapped"] == C.STEPS - C.FREEZE, (rank, key)
            assert run[True]["from_backward"] >= 2 * (C.STEPS - C.FREEZE), (rank, key)
            assert run[True]["enabled"] and not run[True]["warnings"], (rank, key)
        acc = out["accumulate_float32"]
        assert C.identical(acc) and acc[True]["enabled"] is False, rank
        nob = out["no_backward_float32"]
        assert C.identical(nob) and nob[True]["overlapped"] == C.STEPS - C.FREEZE, rank
