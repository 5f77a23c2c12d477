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

from compcomm import _C
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


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a == b) | (a.isnan() & b.isnan())).all()) and a.dtype == b.dtype


@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_device_factors_are_the_python_rule_bit_for_bit(wd):
    """``lamb_passes.factors_`` (one thread a tensor, fp64 on the device) against
    ``functional.lamb_factor`` and the step the host would pass (``-lr * (freeze * factor)``,
    rounded to fp32), over the rule's branches: clipped to [min, max] and to last (1 +- threshold)
    from either side, an update norm of 0, ||u|| > ||update||, NaN and Inf statistics, an empty
    tensor's (-inf, 0, 0), and random rows; 300 tensors (several blocks of the kernel)."""
    from compcomm.optim import functional as F

    inf, nan = float("inf"), float("nan")
    rows = [(1.7, 0.3, 0.4), (50.0, 1.0, 1.0), (0.001, 2.0, 1.0), (1.2, 0.0, 0.0), (1.05, 3.0, 0.0),
            (nan, 1.0, 1.0), (inf, 1.0, 2.0), (1.1, inf, inf), (1.1, nan, 1.0), (-inf, 0.0, 0.0),
            (0.97, 1e-30, 3e-30), (1.0, 1.0, 1.0)]
    g = torch.Generator().manual_seed(5)
    n = 300
    rand = torch.stack([torch.rand(n - len(rows), generator=g) * 12,
                        torch.rand(n - len(rows), generator=g),
                        torch.rand(n - len(rows), generator=g) * 2], dim=1)
    stats = torch.cat([torch.tensor(rows, dtype=torch.float32), rand.float()])
    last = (torch.rand(n, generator=g, dtype=torch.float64) * 12 + 0.05).tolist()
    last[:3] = [1.0, 11.0, 0.02]
    freeze = (torch.rand(n, generator=g, dtype=torch.float64) * 3).tolist()
    group = {"lr": 3e-3, "weight_decay": wd}
    for fmin, fmax, th in [(0.01, 10.0, 0.1), (0.5, 2.0, 1.0), (0.0, 100.0, 0.5)]:
        factors, steps = lamb_passes.factors_(stats.cuda(), last, freeze, group, fmin, fmax, th)
        want = [F.lamb_factor(r, u, d, group, lf, fmin, fmax, th)
                for (r, u, d), lf in zip(stats.tolist(), last)]
        assert _bits_equal(factors.cpu(), torch.tensor(want, dtype=torch.float64))
        want_steps = torch.tensor([-group["lr"] * (fr * f) for fr, f in zip(freeze, want)],
                                  dtype=torch.float32)
        assert _bits_equal(steps.cpu(), want_steps)


def test_device_steps_and_a_closed_gate_in_the_apply_pass():
    """The apply pass reading its steps from the device gives the bits of the host list; with a
    closed gate the factors and apply passes write nothing."""
    group = _group(True, 0.01)
    cols = [[x.cuda() for x in c] for c in _tensors(6)]
    ws, ms, _, vs, _ = (list(z) for z in zip(*cols))
    c = lamb_passes.coeffs(group, 9, 4, False, "ieee")
    host_steps = [-1e-3 * (1 + i % 5) for i in range(len(ms))]
    a = [w.clone() for w in ws]
    lamb_passes.applies_(c, ms, vs, a, host_steps)
    b = [w.clone() for w in ws]
    lamb_passes.applies_(c, ms, vs, b, torch.tensor(host_steps, dtype=torch.float32).cuda())
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and not torch.equal(a[3], ws[3])
    closed = torch.zeros((), dtype=torch.bool, device="cuda")
    stats = torch.ones(len(ms), 3, device="cuda")
    prev = torch.ones(2 * len(ms), dtype=torch.float64, device="cuda")
    factors = torch.full((len(ms),), 7.0, dtype=torch.float64, device="cuda")
    steps = torch.full((len(ms),), 7.0, device="cuda")
    _C.optim_cuda.lamb_factors(len(ms), stats.data_ptr(), prev.data_ptr(), factors.data_ptr(),
                               steps.data_ptr(), 0.01, 10.0, 0.1, -1e-3, True,
                               torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream,
                               closed.data_ptr())
    assert bool((factors == 7.0).all()) and bool((steps == 7.0).all())
    c2 = [w.clone() for w in ws]
    lamb_passes.applies_(c, ms, vs, c2, torch.tensor(host_steps).cuda(), gate=closed)
    assert all(torch.equal(x, y) for x, y in zip(c2, ws))
    with pytest.raises(ValueError, match="'neg_steps' must be 40 contiguous float32"):
        lamb_passes.applies_(c, ms, vs, c2, torch.tensor(host_steps[:3]).cuda())
    with pytest.raises(ValueError, match="'stats' must be a \\(40, 3\\) float32"):
        lamb_passes.factors_(stats[:5], [1.0] * len(ms), [1.0] * len(ms), group, 0.01, 10.0, 0.1)
