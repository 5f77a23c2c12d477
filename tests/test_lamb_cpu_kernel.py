"""1-bit LAMB's compressed step on the CPU as C++ passes (``compcomm.optim.lamb_passes``).

- The passes against the torch ops of ``functional.onebit_lamb_update`` (with a correctly rounded
  square root, the kernels' 'ieee' mode) bit for bit on every instruction set: the momentum, the
  unscaled momentum, the fresh variance, the max ratio and the new weights; the norms against
  float64 sums; the same statistics on every instruction set and thread count; the padding lanes
  of a partial vector out of the max and the sums; NaN kept by the max; argument errors.
- OneBitLamb on the CPU runs the passes and follows the torch-op path (``COMPCOMM_FUSED_OPTIM=0``)
  to the last bits of the step coefficients (the norms' order) and, without weight decay where
  the kernels compute torch's square root, bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch

from compcomm import _C
from compcomm.optim import OneBitLamb, lamb_passes
from compcomm.optim import functional as F
from compcomm.optim._cpu_args import torch_sqrt_mode

K = _C.optim
ISAS = [pytest.param(i, marks=pytest.mark.skipif(not K.isa_supported(i),
                                                 reason=f"this CPU or build has no {i} path"))
        for i in ("generic", "avx2", "avx512")]
SIZES = (1, 7, 8, 17, 4099, 70001, 140003)  # partial vectors; several stats blocks of 65536


def _group(bc, wd):
    return {"lr": 3e-3, "betas": (0.9, 0.995), "eps": 1e-8, "weight_decay": wd,
            "bias_correction": bc}


def _tensors(n, seed):
    g = torch.Generator().manual_seed(seed)
    w, m, grad = (torch.randn(n, generator=g) for _ in range(3))
    v, vf = (torch.rand(n, generator=g) * 1e-2 for _ in range(2))
    v[::7] = 0.0
    return w, m, grad, v, vf


def _ieee_sqrt(x):  # correctly rounded (a float64 sqrt rounds to the right float32)
    return x.double().sqrt().float()


def _reference(w, m, grad, v, vf, group, t, freeze, scale, neg):
    """The torch ops of OneBitLamb's compressed step (momentum, unscale, onebit_lamb_update's
    elementwise part, the step) with a correctly rounded sqrt; returns the new tensors and the
    max ratio, ||u||, ||update|| (float64)."""
    b1, b2 = group["betas"]
    last = m.clone()
    m = m.clone().mul_(b1).add_(grad, alpha=1 - b1).mul_(scale)
    moved = m.clone()
    m.div_(scale)
    ghat = (m - last * b1) / (1 - b1)
    vf = vf.clone().mul_(b2).addcmul_(ghat, ghat, value=1 - b2)
    ratio = float(((_ieee_sqrt(v) + group["eps"]) / (_ieee_sqrt(vf) + group["eps"])).max())
    if group["bias_correction"]:
        u = m / (_ieee_sqrt(v).div_(F.sqrt_bc(b2, freeze)).add_(group["eps"]))
        u.div_(1.0 - b1 ** t)
    else:
        u = m / (_ieee_sqrt(v) + group["eps"])
    upd = u + group["weight_decay"] * w if group["weight_decay"] > 0 else u
    w = w.clone().add_(upd * neg)
    norms = (math.sqrt(float((u.double() ** 2).sum())), math.sqrt(float((upd.double() ** 2).sum())))
    return (last, moved, m, vf, w), (ratio,) + norms


def _passes(ts, group, t, freeze, scale, neg, isa, threads=1, v_is_sqrt=False):
    w, m, grad, v, vf = (x.clone() for x in ts)
    last = torch.empty_like(m)
    c = lamb_passes.coeffs(group, t, freeze, v_is_sqrt, "ieee")
    n = [m.numel()]
    K.lamb_momentums(c, n, [m.data_ptr()], [grad.data_ptr()], [last.data_ptr()], [scale],
                     threads, isa)
    moved = m.clone()
    vv = _ieee_sqrt(v) if v_is_sqrt else v
    (stats,) = K.lamb_stats(c, n, [m.data_ptr()], [last.data_ptr()], [vv.data_ptr()],
                            [vf.data_ptr()], [w.data_ptr()], [scale], threads, isa)
    K.lamb_applies(c, n, [m.data_ptr()], [vv.data_ptr()], [w.data_ptr()], [neg], threads, isa)
    return (last, moved, m, vf, w), stats


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bc,wd", [(False, 0.0), (True, 0.01), (False, 0.1)])
@pytest.mark.parametrize("scale", [1.0, 1.7])
@pytest.mark.parametrize("v_is_sqrt", [False, True])
def test_passes_match_torch_ops(isa, bc, wd, scale, v_is_sqrt):
    group = _group(bc, wd)
    for n in SIZES:
        ts = _tensors(n, n)
        want, (ratio, un, dn) = _reference(*ts, group, 9, 4, scale, -2e-3)
        got, (r, u, d) = _passes(ts, group, 9, 4, scale, -2e-3, isa, v_is_sqrt=v_is_sqrt)
        for name, a, b in zip(("last", "momentum", "unscaled", "v_fresh", "w"), got, want):
            assert torch.equal(a, b), (n, name)
        assert r == ratio, n
        # fp64 sums of exact squares, rounded to fp32: the float64 reference's value to 1e-6
        assert u == pytest.approx(un, rel=1e-6) and d == pytest.approx(dn, rel=1e-6), n
        if wd == 0.0:
            assert d == u


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("scale", [1.0, 1.7])
def test_one_rank_pass_equals_momentum_then_stats(isa, scale):
    """With one rank the statistics pass takes the gradient and updates the momentum itself: the
    same bits as the momentum pass followed by the statistics pass."""
    group = _group(True, 0.01)
    for n in SIZES:
        ts = _tensors(n, n + 1)
        (_, _, m, vf, w), stats = _passes(ts, group, 9, 4, scale, -2e-3, isa)
        w1, m1, grad, v, vf1 = (x.clone() for x in ts)
        c = lamb_passes.coeffs(group, 9, 4, False, "ieee")
        (s1,) = K.lamb_stats(c, [n], [m1.data_ptr()], [], [v.data_ptr()], [vf1.data_ptr()],
                             [w1.data_ptr()], [scale], 1, isa, gs=[grad.data_ptr()])
        K.lamb_applies(c, [n], [m1.data_ptr()], [v.data_ptr()], [w1.data_ptr()], [-2e-3], 1, isa)
        assert s1 == stats, n
        assert torch.equal(m1, m) and torch.equal(vf1, vf) and torch.equal(w1, w), n


@pytest.mark.parametrize("bc,wd", [(False, 0.0), (True, 0.01)])
def test_stats_are_the_same_on_every_isa_and_thread_count(bc, wd):
    group = _group(bc, wd)
    ts = _tensors(300001, 5)
    seen = {}
    for isa in ("generic", "avx2", "avx512"):
        if not K.isa_supported(isa):
            continue
        for threads in (1, 2, 3):
            got, stats = _passes(ts, group, 9, 4, 1.3, -1e-3, isa, threads)
            seen[(isa, threads)] = (stats, [x.clone() for x in got])
    first_stats, first_t = next(iter(seen.values()))
    for key, (stats, tensors) in seen.items():
        assert stats == first_stats, key
        assert all(torch.equal(a, b) for a, b in zip(tensors, first_t)), key


@pytest.mark.parametrize("isa", ISAS)
def test_padding_lanes_stay_out_of_the_max_and_the_sums(isa):
    """Every ratio below 1 (fresh variance above the frozen one): zero-padded lanes would give
    eps / eps = 1 and must not count; sums of a few elements are exact."""
    group = _group(False, 0.0)
    for n in (1, 3, 9, 21):
        w, m, grad, v, vf = _tensors(n, n)
        v.fill_(1e-4)
        vf.fill_(1.0)
        got, (r, u, _) = _passes((w, m, grad, v, vf), group, 9, 4, 1.0, 0.0, isa)
        assert r < 0.1, n
        _, (ratio, un, _) = _reference(w, m, grad, v, vf, group, 9, 4, 1.0, 0.0)
        assert r == ratio and u == pytest.approx(un, rel=1e-7), n


@pytest.mark.parametrize("isa", ISAS)
def test_nan_propagates_through_the_max(isa):
    group = _group(False, 0.0)
    for pos in (0, 5, 4098):
        w, m, grad, v, vf = _tensors(4099, pos)
        v[pos] = float("nan")
        _, (r, u, _) = _passes((w, m, grad, v, vf), group, 9, 4, 1.0, 0.0, isa)
        assert math.isnan(r) and math.isnan(u), pos


def test_argument_errors():
    c = lamb_passes.coeffs(_group(False, 0.0), 3, 2, False, "ieee")
    x = torch.zeros(4)
    p = x.data_ptr()
    with pytest.raises(ValueError, match="gs must hold 1 pointers"):
        K.lamb_momentums(c, [4], [p], [], [p], [1.0])
    with pytest.raises(ValueError, match="numels\\[0\\] is negative"):
        K.lamb_applies(c, [-1], [p], [p], [p], [1.0])
    with pytest.raises(ValueError, match="vfs\\[0\\] is a null pointer"):
        K.lamb_stats(c, [4], [p], [p], [p], [0], [p], [1.0])
    with pytest.raises(ValueError, match="one scale or step per numel"):
        K.lamb_applies(c, [4], [p], [p], [p], [])
    with pytest.raises(ValueError, match="num_threads"):
        K.lamb_applies(c, [4], [p], [p], [p], [1.0], -1)
    with pytest.raises(ValueError, match="isa must be"):
        K.lamb_applies(c, [4], [p], [p], [p], [1.0], 1, "sse9")
    with pytest.raises(ValueError, match="lasts or gs, not both"):
        K.lamb_stats(c, [4], [p], [p], [p], [p], [p], [1.0], gs=[p])
    with pytest.raises(ValueError, match="gs\\[0\\] is a null pointer"):
        K.lamb_stats(c, [4], [p], [], [p], [p], [p], [1.0], gs=[0])
    with pytest.raises(ValueError, match="sqrt must be"):
        lamb_passes.coeffs(_group(False, 0.0), 3, 2, False, "fast")
    with pytest.raises(TypeError, match="g must be float32"):
        lamb_passes.momentums_(c, [x], [x.double()], [x.clone()], [1.0])
    with pytest.raises(ValueError, match="w has 4"):
        lamb_passes.applies_(c, [x], [torch.zeros(3)], [x.clone()], [1.0])
    with pytest.raises(ValueError, match="contiguous"):
        lamb_passes.stats_(c, [x], [x.clone()], [x.clone()], [torch.zeros(8)[::2]], [x.clone()],
                        [1.0])


def test_the_passes_give_torch_bits_here():
    """The probe the optimizer trusts: on x86 the passes must reproduce the torch ops (the
    fallback would hide a broken kernel behind slow steps)."""
    assert lamb_passes.kernels_match_torch()


def _run(monkeypatch, fused, wd, bc, dtype=torch.float32, calls=None):
    monkeypatch.setenv("COMPCOMM_FUSED_OPTIM", "1" if fused else "0")
    g = torch.Generator().manual_seed(0)
    shapes = [(33, 17), (129,), (5,), (70001,)]
    ps = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]
    grads = [[torch.randn(s, generator=g).to(dtype) for s in shapes] for _ in range(9)]
    opt = OneBitLamb(ps, lr=1e-2, freeze_step=3, weight_decay=wd, bias_correction=bc)
    coeffs = []
    for step_grads in grads:
        for p, gr in zip(ps, step_grads):
            p.grad = gr
        opt.step()
        coeffs.append(opt.get_lamb_coeffs())
    return [p.detach().float() for p in ps], coeffs


@pytest.mark.parametrize("bc,wd", [(False, 0.0), (True, 0.0), (False, 0.01), (True, 0.01)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_onebit_lamb_runs_the_passes_and_follows_the_torch_ops(monkeypatch, bc, wd, dtype):
    calls = []
    real = lamb_passes.stats_
    monkeypatch.setattr(lamb_passes, "stats_", lambda *a, **k: calls.append(1) or real(*a, **k))
    fused, c_fused = _run(monkeypatch, True, wd, bc, dtype)
    assert len(calls) == 6  # every compressed step (steps 4..9, one run of tensors each)
    calls.clear()
    ref, c_ref = _run(monkeypatch, False, wd, bc, dtype)
    assert not calls
    for a, b in zip(c_fused, c_ref):
        assert a == pytest.approx(b, rel=1e-6)
    for a, b in zip(fused, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if wd == 0.0 and torch_sqrt_mode() is not None and dtype == torch.float32:
        # no norms, and the max ratio from torch's own square root: the same bits
        assert c_fused == c_ref
        assert all(torch.equal(a, b) for a, b in zip(fused, ref))


def _noncontiguous(x: torch.Tensor) -> torch.Tensor:
    return x.t().contiguous().t() if x.dim() == 2 else x[::1]


@pytest.mark.parametrize("bad", ["v_bf16", "v_fresh_noncontiguous", "v_fresh_short"])
def test_state_the_passes_cannot_take_goes_to_the_torch_ops(monkeypatch, bad):
    """A variance of another dtype, layout or size (e.g. from a checkpoint) is never handed to the
    passes as a raw pointer: that step takes the torch ops, as with COMPCOMM_FUSED_OPTIM=0."""
    calls = []
    real = lamb_passes.stats_
    monkeypatch.setattr(lamb_passes, "stats_", lambda *a, **k: calls.append(1) or real(*a, **k))

    def run(fused):
        monkeypatch.setenv("COMPCOMM_FUSED_OPTIM", "1" if fused else "0")
        g = torch.Generator().manual_seed(3)
        ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(33, 17), (129,)]]
        opt = OneBitLamb(ps, lr=1e-2, freeze_step=1, weight_decay=0.01)
        for step in range(4):  # step 0 warms up; 1, 2 and 3 are compressed
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g)
            if step == 2:  # after one compressed step with the state as the optimizer made it
                st = opt.state[ps[0]]
                if bad == "v_bf16":
                    st["exp_avg_sq"] = st["exp_avg_sq"].to(torch.bfloat16)
                elif bad == "v_fresh_noncontiguous":
                    st["exp_avg_sq_fresh"] = _noncontiguous(st["exp_avg_sq_fresh"])
                    assert not st["exp_avg_sq_fresh"].is_contiguous()
                else:
                    st["exp_avg_sq_fresh"] = st["exp_avg_sq_fresh"].reshape(-1)[:-1]
            if bad == "v_fresh_short" and step >= 2:
                with pytest.raises(RuntimeError):  # the torch ops refuse the size, loudly
                    opt.step()
                return None
            opt.step()
        return [p.detach().clone() for p in ps]

    fused = run(True)
    first = len(calls)
    assert first == 1  # step 1 (compressed, state intact) ran the passes; steps 2 and 3 did not
    ref = run(False)
    assert len(calls) == first
    if fused is not None:
        for a, b in zip(fused, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

