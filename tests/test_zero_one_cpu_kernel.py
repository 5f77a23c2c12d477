"""ZeroOneAdam's local step on the CPU as one C++ pass (``cpu_multi.zero_one_local_steps_``).

- The list kernel against ``functional.zero_one_local_multi_`` (the torch ops) bit for bit on every
  instruction set, with the variance or with torch's frozen denominators, and against a float64
  reference on every machine; argument errors.
- ZeroOneAdam at W=1 (natural path, and denominators forced as on a CPU whose torch sqrt the
  kernels do not compute) and over gloo at W=2: the kernel runs on the local steps and the
  trajectory is the torch-op path's (``COMPCOMM_FUSED_OPTIM=0``) bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch

from compcomm import _C
from compcomm.optim import ZeroOneAdam, cpu_adam, cpu_multi
from compcomm.optim import functional as F

K = _C.optim
ISAS = [pytest.param(i, marks=pytest.mark.skipif(not K.isa_supported(i),
                                                 reason=f"this CPU or build has no {i} path"))
        for i in ("generic", "avx2", "avx512")]
SHAPES = [(37, 11), (4099,), (5,), (64, 65)]


def _group(bc, wd):
    return {"lr": 3e-3, "betas": (0.9, 0.995), "eps": 1e-8, "weight_decay": wd,
            "bias_correction": bc}


def _tensors(n, seed):
    g = torch.Generator().manual_seed(seed)
    w, m, x, acc = (torch.randn(n, generator=g) for _ in range(4))
    v = torch.rand(n, generator=g) * 1e-2
    v[::7] = 0.0
    return w, m, v, x, acc


def _call(ws, ms, vs, gs, accs, group, denom, isa):
    b1, b2 = group["betas"]
    K.zero_one_local_steps([w.numel() for w in ws], [w.data_ptr() for w in ws],
                           [m.data_ptr() for m in ms], [v.data_ptr() for v in vs],
                           [g.data_ptr() for g in gs], [], [], group["lr"], b1, b2, group["eps"],
                           group["weight_decay"], group["bias_correction"], 9, 4, 1, isa,
                           cpu_adam.torch_sqrt_mode() or "ieee", [], denom,
                           [a.data_ptr() for a in accs])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bc,wd", [(False, 0.0), (True, 0.01)])
@pytest.mark.parametrize("denom", [False, True])
def test_list_kernel_matches_torch_ops(isa, bc, wd, denom):
    group = _group(bc, wd)
    cols = [_tensors(n, n) for n in (1, 7, 17, 4099, 70001)]
    ref = [[t.clone() for t in c] for c in cols]
    ws, ms, vs, gs, accs = map(list, zip(*ref))
    F.zero_one_local_multi_(ws, ms, vs, gs, group, 9, 4, update_variance=False, accs=accs)
    got = [[t.clone() for t in c] for c in cols]
    kw, km, kv, kg, ka = map(list, zip(*got))
    ds = [F.adam_denom(v, group, 4) for v in kv] if denom else kv
    _call(kw, km, ds, kg, ka, group, denom, isa)
    exact = cpu_adam.matches_torch_rules(denom=True) if denom else cpu_adam.matches_torch_rules()
    for i, (r, k, c) in enumerate(zip(ref, got, cols)):
        assert torch.equal(k[1], r[1]), f"m of tensor {i}"  # no square root in the momentum
        assert torch.equal(k[2], c[2]), "v is only read"
        if exact:
            assert torch.equal(k[0], r[0]) and torch.equal(k[4], r[4]), f"w/acc of tensor {i}"
        # float64: s = -lr * (m / d / bc1 + wd * w); w += s; acc += s
        w0, v0, a0 = (c[j].double() for j in (0, 2, 4))
        d = v0.sqrt() / ((1 - 0.995 ** 4) ** 0.5 if bc else 1.0) + 1e-8
        s = -3e-3 * (r[1].double() / d / ((1 - 0.9 ** 9) if bc else 1.0) + wd * w0)
        # two roundings (s, then w + s): half an ulp of w (|w| < 8) and of s
        torch.testing.assert_close(k[0].double(), w0 + s, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(k[4].double(), a0 + s, rtol=1e-6, atol=1e-6)


def test_arguments():
    group = _group(True, 0.01)
    w, m, v, g, acc = _tensors(8, 1)
    with pytest.raises(ValueError, match="accs must hold 1 tensors"):
        cpu_multi.zero_one_local_steps_([w], [m], [v], [g], [], group, 3, 2)
    with pytest.raises(ValueError, match="must not share memory"):
        cpu_multi.zero_one_local_steps_([w], [m], [v], [g], [m], group, 3, 2)
    with pytest.raises(TypeError, match="acc"):
        cpu_multi.zero_one_local_steps_([w], [m], [v], [g], [acc.double()], group, 3, 2)
    with pytest.raises(ValueError, match="acc"):
        cpu_multi.zero_one_local_steps_([w], [m], [v], [g], [acc[:5]], group, 3, 2)
    ptrs = [[t.data_ptr()] for t in (w, m, v, g)]
    with pytest.raises(ValueError, match="accs must hold 1 pointers"):
        K.zero_one_local_steps([8], *ptrs, [], [], 1e-3, 0.9, 0.999, 1e-8, 0.0, False, 1, 1)
    with pytest.raises(ValueError, match="accs is only for zero_one_local_steps"):
        K.onebit_local_steps([8], *ptrs, [], [], 1e-3, 0.9, 0.999, 1e-8, 0.0, False, 1, 1,
                             accs=[acc.data_ptr()])
    with pytest.raises(ValueError, match="null pointer"):
        K.zero_one_local_steps([8], *ptrs, [], [], 1e-3, 0.9, 0.999, 1e-8, 0.0, False, 1, 1,
                               accs=[0])


def _run(steps, seed=0, gen_seed=3):
    gen = torch.Generator().manual_seed(gen_seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(seed)))
              for s in SHAPES]
    opt = ZeroOneAdam([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}],
                      lr=1e-2, var_freeze_step=2, local_step_scaler=1, local_step_clipper=4,
                      weight_decay=0.01, bias_correction=True)
    out, kinds = [], []
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        kinds.append(opt.step_kind())
        opt.step()
        out.append([p.detach().clone() for p in params]
                   + [opt.state[p]["exp_avg"].clone() for p in params])
    return out, kinds


def _count(monkeypatch):
    calls = []
    real = cpu_multi.zero_one_local_steps_
    monkeypatch.setattr(cpu_multi, "zero_one_local_steps_",
                        lambda *a, **k: (calls.append(k.get("denom")), real(*a, **k))[1])
    return calls


@pytest.mark.parametrize("forced", [False, True])
def test_zero_one_adam_w1_kernel_keeps_the_bits(monkeypatch, forced):
    real = cpu_adam.matches_torch_rules
    if forced:  # as on a CPU whose torch sqrt the kernels do not compute
        monkeypatch.setattr(cpu_adam, "matches_torch_rules",
                            lambda denom=False: real(denom=True) if denom else False)
    if not cpu_adam.matches_torch_rules(denom=True):
        pytest.skip("the kernels do not give the torch ops' bits here even given denominators")
    calls = _count(monkeypatch)
    fast, kinds = _run(16)
    locals_ = kinds.count("local")
    assert locals_ >= 8 and "sync" in kinds
    assert calls == [not cpu_adam.matches_torch_rules()] * (2 * locals_)  # per param group
    monkeypatch.setenv("COMPCOMM_FUSED_OPTIM", "0")
    del calls[:]
    ref, _ = _run(16)
    assert not calls
    for step, (a, b) in enumerate(zip(fast, ref)):
        for i, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"step {step + 1} ({kinds[step]}), tensor {i}"


def _w2(rank, world):
    """ZeroOneAdam over gloo with the kernels, then with the torch ops."""
    calls = []
    steps = cpu_multi.zero_one_local_steps_
    cpu_multi.zero_one_local_steps_ = lambda *a, **k: (calls.append(1), steps(*a, **k))[1]
    out = {}
    for env in ("1", "0"):
        os.environ["COMPCOMM_FUSED_OPTIM"] = env
        out[env], kinds = _run(12, gen_seed=7 + rank)
    return out, len(calls), kinds.count("local"), cpu_adam.matches_torch_rules(denom=True)


def test_zero_one_adam_gloo_kernel_keeps_the_bits():
    from compcomm.testing import run_ranks

    for trajs, calls, locals_, exact in run_ranks(2, _w2, timeout=240):
        if not exact:
            pytest.skip("the kernels do not give the torch ops' bits here even given denominators")
        assert locals_ >= 5 and calls == 2 * locals_
        for step, (a, b) in enumerate(zip(trajs["1"], trajs["0"])):
            for x, y in zip(a, b):
                assert torch.equal(x, y), f"step {step + 1}"
