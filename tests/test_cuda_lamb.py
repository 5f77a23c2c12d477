"""1-bit LAMB's CUDA passes (``cpp/kernels/cuda_lamb.cu``) against their CPU twins.

With the correctly rounded square root on both (the GPU's; the CPU passes' 'ieee' mode) the new
momentum, the old one, the fresh variance, the weights and the max ratio are the CPU passes' bits;
the norms are fp64 sums in another order, equal to fp32 rounding almost always and to 1e-6 always.
Lists of more tensors than one launch holds and a tensor longer than one launch's chunks check the
host-side packing. OneBitLamb on a GPU runs the passes and follows its torch ops.
"""

from __future__ import annotations

import pytest
import torch

from compcomm.optim import OneBitLamb, lamb_passes
from _backends import no_cuda_kernels, no_gpu, skipif

pytestmark = [pytest.mark.gpu, skipif(no_gpu() or no_cuda_kernels())]

# 40 tensors (more than one launch's 32) of odd sizes, one of 2^25 + 5 (more than a launch's 320
# chunks of 64K)
SIZES = [1, 7, 4099, 70001, 2**20 + 3] * 7 + [3, 5, 9, 2**25 + 5, 11]


def _group(bc, wd):
    return {"lr": 3e-3, "betas": (0.9, 0.995), "eps": 1e-8, "weight_decay": wd,
            "bias_correction": bc}


def _tensors(seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in SIZES:
        w, m, grad = (torch.randn(n, generator=g) for _ in range(3))
        v, vf = (torch.rand(n, generator=g) * 1e-2 for _ in range(2))
        v[::7] = 0.0
        out.append([w, m, grad, v, vf])
    return out


def _run(cols, group, device, local, scale=1.3):
    cols = [[x.to(device, copy=True) for x in c] for c in cols]
    ws, ms, gs, vs, vfs = (list(z) for z in zip(*cols))
    lasts = [torch.empty_like(m) for m in ms]
    c = lamb_passes.coeffs(group, 9, 4, False, "ieee")
    scales = [scale * (1 + i % 3) for i in range(len(ms))]
    if local:
        stats = lamb_passes.stats_(c, ms, None, vs, vfs, ws, scales, 1, gs=gs)
        lasts = []
    else:
        lamb_passes.momentums_(c, ms, gs, lasts, scales, 1)
        stats = lamb_passes.stats_(c, ms, lasts, vs, vfs, ws, scales, 1)
    lamb_passes.applies_(c, ms, vs, ws, [-1e-3 * (1 + i % 5) for i in range(len(ms))], 1)
    return [[x.cpu() for x in t] for t in (ms, lasts, vfs, ws)], stats


@pytest.mark.parametrize("local", [False, True], ids=["exchange", "one_rank"])
@pytest.mark.parametrize("bc,wd", [(False, 0.0), (True, 0.01)])
def test_cuda_passes_equal_the_cpu_passes(local, bc, wd):
    group = _group(bc, wd)
    cols = _tensors(3)
    cpu, cpu_stats = _run(cols, group, "cpu", local)
    gpu, gpu_stats = _run(cols, group, "cuda", local)
    for name, a_list, b_list in zip(("m", "last", "v_fresh", "w"), cpu, gpu):
        for i, (a, b) in enumerate(zip(a_list, b_list)):
            assert torch.equal(a, b), (name, i, SIZES[i])
    for i, ((r, u, d), (gr, gu, gd)) in enumerate(zip(cpu_stats, gpu_stats)):
        assert gr == r, i
        assert gu == pytest.approx(u, rel=1e-6) and gd == pytest.approx(d, rel=1e-6), i


def test_cuda_statistics_are_deterministic_and_keep_nan():
    group = _group(True, 0.01)
    cols = _tensors(4)
    _, a = _run(cols, group, "cuda", False)
    _, b = _run(cols, group, "cuda", False)
    assert a == b
    cols[2][3][1234] = float("nan")  # a NaN variance: that tensor's max and norms are NaN
    _, c = _run(cols, group, "cuda", False)
    assert all(x != x for x in c[2]) and c[3] == a[3]


def test_onebit_lamb_on_cuda_runs_the_passes(monkeypatch):
    calls = []
    real = lamb_passes.stats_
    monkeypatch.setattr(lamb_passes, "stats_", lambda *a, **k: calls.append(1) or real(*a, **k))
    finals = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("COMPCOMM_FUSED_OPTIM", fused)
        g = torch.Generator().manual_seed(7)
        shapes = [(33, 17), (129,), (5,), (70001,)]
        ps = [torch.nn.Parameter(torch.randn(s, generator=g).cuda()) for s in shapes]
        grads = [[torch.randn(s, generator=g).cuda() for s in shapes] for _ in range(8)]
        opt = OneBitLamb(ps, lr=1e-2, freeze_step=3, weight_decay=0.01)
        for step_grads in grads:
            for p, gr in zip(ps, step_grads):
                p.grad = gr
            opt.step()
        finals[fused] = [p.detach().cpu() for p in ps]
        assert len(calls) == (5 if fused == "1" else 0)
        calls.clear()
    for a, b in zip(finals["1"], finals["0"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
