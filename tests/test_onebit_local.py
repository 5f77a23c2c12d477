"""1-bit Adam's compressed phase where nothing is sent (a world of one rank, or ``step_on``): the
fused C++ pass ``onebit_local_step`` (momentum and step in one pass over memory) and the C++
finiteness check of the gradients.

- The kernel bit for bit against ``functional.onebit_momentum`` then ``functional.adam_step_``
  (where torch's CPU sqrt is known), and against a float64 numpy reference on every path.
- ``all_finite`` against numpy's ``isfinite`` on every path, Inf/NaN at every position class.
- OneBitAdam at W=1 and through ``step_on``: the fast path is taken and gives the bits of the
  torch-op path (``COMPCOMM_FUSED_OPTIM=0``) -- this fails if the fast path changes a bit --, and
  a non-finite gradient skips the step with nothing changed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compcomm import _C
from compcomm._buffers import buffer_of as B
from compcomm.compress import all_finite as compress_all_finite
from compcomm.optim import OneBitAdam
from compcomm.optim import cpu_adam
from compcomm.optim import functional as F
from compcomm.optim.cpu_adam import onebit_local_step_, torch_sqrt_mode
from compcomm.errors import NonFiniteError

K = _C.optim
ISAS = [pytest.param(i, marks=pytest.mark.skipif(not K.isa_supported(i),
                                                 reason=f"this CPU or build has no {i} path"))
        for i in ("generic", "avx2", "avx512")]
SQRT = torch_sqrt_mode()
EXACT = SQRT is not None


def _group(lr=2e-3, betas=(0.9, 0.999), eps=1e-8, wd=0.0, bc=True):
    return {"lr": lr, "betas": betas, "eps": eps, "weight_decay": wd, "bias_correction": bc}


def _state(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g)
    m = torch.randn(n, generator=g) * 0.1
    v = torch.rand(n, generator=g) * 1e-2
    v[::7] = 0.0
    v[1::11] = 1e-40
    return w, m, v, g


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [1, 7, 4099, 2**20 + 3])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bc,wd", [(True, 0.01), (False, 0.0)])
def test_onebit_local_bit_identical(n, isa, bc, wd, threads):
    if not EXACT:
        pytest.skip("torch's CPU sqrt here is unknown: no bit-identical claim")
    w, m, v, g = _state(n, n + 3)
    group = _group(betas=(0.85, 0.995), wd=wd, bc=bc)
    kw, km, kv = w.clone(), m.clone(), v.clone()
    v0 = v.clone()
    for t in (11, 12):  # variance frozen after step 10
        grad = torch.randn(n, generator=g)
        avg = torch.empty(n)
        F.onebit_momentum(m, grad, group, avg)  # what OneBitAdam stages at W=1
        m.copy_(avg)
        F.adam_step_(w, m, v, group, t, 10)
        b1, b2 = group["betas"]
        K.onebit_local_step(B(kw), B(km), B(kv), B(grad), group["lr"], b1, b2, group["eps"], wd,
                            bc, t, 10, None, threads, isa, SQRT)
        assert torch.equal(km, m) and torch.equal(kw, w)
    assert torch.equal(kv, v0)


@pytest.mark.parametrize("isa", ISAS)
def test_late_steps_skip_unit_corrections_bit_for_bit(isa):
    """At late steps the corrections round to 1 and the kernels skip those divisions: same bits."""
    if not EXACT:
        pytest.skip("torch's CPU sqrt here is unknown: no bit-identical claim")
    n = 4099
    group = _group(wd=0.01)
    b1, b2 = group["betas"]
    for t, bc2_t in ((400, 30000), (400, 50), (60, 30000)):  # both 1, only bc1, only bc2
        w, m, v, g = _state(n, t + bc2_t)
        grad = torch.randn(n, generator=g)
        rw, rm, rv = w.clone(), m.clone(), v.clone()
        F.onebit_momentum(rm, grad, group, rm)
        F.adam_step_(rw, rm, rv, group, t, bc2_t)
        K.onebit_local_step(B(w), B(m), B(v), B(grad), group["lr"], b1, b2, group["eps"], 0.01,
                            True, t, bc2_t, None, 1, isa, SQRT)
        assert torch.equal(w, rw) and torch.equal(m, rm), (t, bc2_t)
        rw, rm, rv = w.clone(), m.clone(), v.clone()
        F.adam_moments_(rm, rv, grad, group)
        F.adam_step_(rw, rm, rv, group, t, bc2_t)
        K.onebit_warmup_step(B(w), B(m), B(v), B(grad), group["lr"], b1, b2, group["eps"], 0.01,
                             True, t, bc2_t, None, 1, isa, SQRT)
        assert torch.equal(w, rw) and torch.equal(m, rm) and torch.equal(v, rv), (t, bc2_t)


@pytest.mark.parametrize("isa", ISAS)
def test_onebit_local_numpy_reference(isa):
    n = 4099
    w, m, v, g = _state(n, 5)
    v.add_(1e-6)  # no zero variance: m / eps would magnify m's rounding beyond the tolerance
    grad = torch.randn(n, generator=g)
    lr, b1, b2, eps, wd, t = 1e-2, 0.9, 0.999, 1e-8, 0.05, 7
    W, M, V, G = (x.numpy().astype(np.float64) for x in (w, m, v, grad))
    M = b1 * M + (1 - b1) * G
    W = W - lr * ((M / (np.sqrt(V) / np.sqrt(1 - b2**3) + eps)) / (1 - b1**t) + wd * W)
    kw, km, kv = w.clone(), m.clone(), v.clone()
    out = torch.empty(n, dtype=torch.bfloat16)
    K.onebit_local_step(B(kw), B(km), B(kv), B(grad), lr, b1, b2, eps, wd, True, t, 3, B(out), 1,
                        isa)
    assert torch.equal(kv, v)
    np.testing.assert_allclose(km.numpy(), M, rtol=1e-6, atol=3e-8)
    np.testing.assert_allclose(kw.numpy(), W, rtol=1e-6, atol=1e-7)
    assert torch.equal(out, kw.to(torch.bfloat16))


def test_onebit_local_wrapper_arguments():
    w, m, v, g = _state(16, 1)
    grad = torch.randn(16, generator=g)
    group = _group()
    with pytest.raises(ValueError, match="g has 15 elements"):
        onebit_local_step_(w, m, v, grad[:15], group, 3, 2)
    with pytest.raises(TypeError, match="m must be float32"):
        onebit_local_step_(w, m.double(), v, grad, group, 3, 2)
    with pytest.raises(ValueError, match="overlap"):
        onebit_local_step_(w, w, v, grad, group, 3, 2)
    with pytest.raises(ValueError, match="bc1_t and bc2_t"):
        K.onebit_local_step(B(w), B(m), B(v), B(grad), 1e-3, 0.9, 0.999, 1e-8, 0.0, True, -1, 2)


@pytest.mark.parametrize("lowp", [None, torch.bfloat16, torch.float16])
def test_onebit_local_steps_list_equals_one_by_one(lowp):
    group = _group(wd=0.01)
    sizes = [1, 7, 4099, 0, 70001]
    states = [_state(n, 20 + i) for i, n in enumerate(sizes)]
    gs = [torch.randn(n, generator=st[3]) for n, st in zip(sizes, states)]
    one = [[t.clone() for t in st[:3]] for st in states]
    many = [[t.clone() for t in st[:3]] for st in states]
    outs1 = [None if lowp is None else torch.empty(n, dtype=lowp) for n in sizes]
    outs2 = [None if lowp is None else torch.empty(n, dtype=lowp) for n in sizes]
    for (w, m, v), g, o in zip(one, gs, outs1):
        onebit_local_step_(w, m, v, g, group, 9, 4, param_out=o)
    cpu_adam.onebit_local_steps_([x[0] for x in many], [x[1] for x in many],
                                 [x[2] for x in many], gs, group, 9, 4,
                                 None if lowp is None else outs2)
    for a, b in zip(one, many):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    if lowp is not None:
        assert all(torch.equal(x, y) for x, y in zip(outs1, outs2))


def test_onebit_local_steps_arguments():
    w, m, v, g = _state(16, 2)
    grad = torch.randn(16, generator=g)
    with pytest.raises(ValueError, match="one length"):
        cpu_adam.onebit_local_steps_([w], [m], [v], [], _group(), 3, 2)
    with pytest.raises(ValueError, match=r"onebit_local_steps_\[0\]: g has 15 elements"):
        cpu_adam.onebit_local_steps_([w], [m], [v], [grad[:15]], _group(), 3, 2)
    with pytest.raises(ValueError, match="null pointer"):
        K.onebit_local_steps([4], [0], [0], [0], [0], [], [], 1e-3, 0.9, 0.999, 1e-8, 0.0,
                             False, 1, 1)
    with pytest.raises(ValueError, match="must hold 2 pointers"):
        K.onebit_local_steps([4, 4], [w.data_ptr()], [m.data_ptr()], [v.data_ptr()],
                             [grad.data_ptr()], [], [], 1e-3, 0.9, 0.999, 1e-8, 0.0, False, 1, 1)


def _positions(n):
    """Every position of a short array; else both ends of each of the check's four read streams
    (quarters of the whole vectors of width 1, 8 or 16) and the tail."""
    if n <= 160:
        return range(n)
    qs = {n // (4 * w) * w for w in (1, 8, 16)}
    return sorted({0, n - 1, max(0, n - 17)} | {k * q + d for q in qs for k in range(1, 5)
                                                 for d in (-1, 0) if k * q + d < n})


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n", [0, 1, 7, 15, 16, 17, 63, 64, 65, 127, 129, 4099, 5000])
def test_all_finite_matches_numpy(isa, n):
    gen = torch.Generator().manual_seed(n)
    base = torch.randn(n, generator=gen) * 1e30  # large finite values, also 3.4e38
    if n:
        base[0] = torch.finfo(torch.float32).max
    assert K.all_finite([B(base)], isa) is True
    for bad in (float("inf"), float("-inf"), float("nan")):
        for pos in _positions(n):
            x = base.clone()
            x[pos] = bad
            want = bool(np.isfinite(x.numpy()).all())
            assert want is False
            assert K.all_finite([B(base), B(x)], isa) is want, (bad, pos)
    assert K.all_finite([], isa) is True


def test_all_finite_ptrs_matches_buffers_and_checks_arguments():
    xs = [torch.randn(n) for n in (0, 1, 17, 4099)]
    ptrs = lambda ts: [t.data_ptr() for t in ts]  # noqa: E731
    assert K.all_finite_ptrs([t.numel() for t in xs], ptrs(xs)) is True
    for bad in (float("inf"), float("nan")):
        ys = [t.clone() for t in xs]
        ys[3][4098] = bad
        assert K.all_finite_ptrs([t.numel() for t in ys], ptrs(ys)) is False
        assert K.all_finite([B(t) for t in ys]) is False
    assert K.all_finite_ptrs([], []) is True
    with pytest.raises(ValueError, match="must hold 2 pointers"):
        K.all_finite_ptrs([1, 2], [xs[1].data_ptr()])
    with pytest.raises(ValueError, match="null pointer"):
        K.all_finite_ptrs([3], [0])
    with pytest.raises(ValueError, match="negative"):
        K.all_finite_ptrs([-1], [xs[1].data_ptr()])


def test_all_finite_wrappers():
    ok = [torch.randn(100), torch.randn(3, 5)]
    bad = ok + [torch.tensor([1.0, float("nan")])]
    assert cpu_adam.all_finite(ok) and not cpu_adam.all_finite(bad)
    assert compress_all_finite(ok) and not compress_all_finite(bad)
    # not fp32 / not contiguous: torch's path in compress.all_finite
    assert not compress_all_finite([torch.tensor([float("inf")], dtype=torch.float64)])
    assert not compress_all_finite([torch.tensor([[1.0, float("inf")], [0, 0]]).t()])
    with pytest.raises(TypeError, match=r"tensors\[0\] must be float32"):
        cpu_adam.all_finite([torch.zeros(3, dtype=torch.float64)])
    with pytest.raises(TypeError, match="float32"):
        K.all_finite([B(torch.zeros(3, dtype=torch.float64))])


# ------------------------------------------------------------------------------------------------
# OneBitAdam: the fast path gives the torch-op path's bits
# ------------------------------------------------------------------------------------------------
SHAPES = [(37, 11), (4099,), (5,), (64, 65), (1,)]


def _trajectory(steps, lowp=False, nan_at=None, on=False):
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    if lowp:
        params[1] = torch.nn.Parameter(params[1].detach().to(torch.bfloat16))
    opt = OneBitAdam([{"params": params[:3], "weight_decay": 0.01},
                      {"params": params[3:], "bias_correction": True}], lr=1e-2, freeze_step=2)
    out = []
    for step in range(steps):
        grads = [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]
        if step == nan_at:
            grads[3].view(-1)[7] = float("nan")
        if on and step == nan_at:
            with pytest.raises(NonFiniteError, match="non-finite"):
                opt.step_on(params, grads, opt.schedule.next_kind())
        elif on:
            opt.step_on(params, grads, opt.schedule.next_kind())
        else:
            for p, g in zip(params, grads):
                p.grad = g
            if step == nan_at:
                with pytest.warns(RuntimeWarning, match="step skipped"):
                    opt.step()
            else:
                opt.step()
        out.append([p.detach().clone() for p in params]
                   + [opt.state[p]["exp_avg"].clone() for p in params])
    return out, opt


def _count_local_steps(monkeypatch) -> list:
    """Record the number of tensors of every onebit_local_steps_ call (the fast path's). The
    kernels' one-time probes (``matches_torch_rules``) call it too: they run first."""
    cpu_adam.matches_torch_rules()
    cpu_adam.matches_torch_rules(denom=True)
    calls = []
    real = cpu_adam.onebit_local_steps_
    monkeypatch.setattr(cpu_adam, "onebit_local_steps_", lambda ws, *a, **k: (
        calls.append(len(ws)), real(ws, *a, **k)))
    return calls


@pytest.mark.parametrize("on", [False, True], ids=["step", "step_on"])
@pytest.mark.parametrize("lowp", [False, True], ids=["fp32", "bf16"])
def test_onebit_adam_w1_fast_path_keeps_the_bits(monkeypatch, lowp, on):
    if not cpu_adam.matches_torch_rules(denom=True):
        pytest.skip("the CPU kernels do not reproduce torch's ops here: no kernel path at all")
    calls = _count_local_steps(monkeypatch)
    fast, _ = _trajectory(6, lowp, on=on)
    assert sum(calls) == 4 * len(SHAPES) and len(calls) == 4 * 2  # steps 3..6: a call per group
    monkeypatch.setenv("COMPCOMM_FUSED_OPTIM", "0")  # the torch ops, staged momentum
    ref, _ = _trajectory(6, lowp, on=on)
    assert sum(calls) == 4 * len(SHAPES)
    for step, (a, b) in enumerate(zip(fast, ref)):
        for i, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"step {step + 1}, tensor {i}"


def _scaled_trajectory(steps, freeze_step, scale):
    """OneBitAdam at W=1 driven as GradScaler drives it (grad_scale / found_inf set, gradients
    scaled); the gradients' values after each step are returned too (they must stay as given)."""
    gen = torch.Generator().manual_seed(11)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    opt = OneBitAdam(params, lr=1e-2, freeze_step=freeze_step, weight_decay=0.01)
    out = []
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * scale
        given = [p.grad.clone() for p in params]
        if scale != 1.0:
            opt.grad_scale = torch.tensor(scale)
            opt.found_inf = torch.tensor(0.0)
        opt.step()
        assert all(torch.equal(p.grad, g) for p, g in zip(params, given))
        out.append([p.detach().clone() for p in params]
                   + [opt.state[p]["exp_avg"].clone() for p in params])
    return out


@pytest.mark.parametrize("freeze_step,scale", [(2, 1024.0), (0, 1.0), (0, 8.0)])
def test_onebit_adam_w1_fast_path_scaled_and_stateless_starts(monkeypatch, freeze_step, scale):
    """GradScaler's scaled gradients (unscaled into copies, p.grad untouched) and a compressed
    phase from step 1 (no momentum yet: the general path makes it, the fast path follows): the
    torch ops' bits."""
    if not cpu_adam.matches_torch_rules(denom=True):
        pytest.skip("the CPU kernels do not reproduce torch's ops here: no kernel path at all")
    calls = _count_local_steps(monkeypatch)
    fast = _scaled_trajectory(5, freeze_step, scale)
    # steps freeze_step+1 .. 5 compressed; with freeze_step 0 the first has no momentum yet
    assert len(calls) == 5 - max(freeze_step, 1)
    monkeypatch.setenv("COMPCOMM_FUSED_OPTIM", "0")
    ref = _scaled_trajectory(5, freeze_step, scale)
    for step, (a, b) in enumerate(zip(fast, ref)):
        for i, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"step {step + 1}, tensor {i}"


def test_fast_path_checks_decline_what_the_kernels_cannot_take(monkeypatch):
    """The kernels take pointers on trust: ``_fits`` rejects each way a tensor can differ from
    what they read, and a state tensor that fails it sends the step down the general path,
    whose checks raise before anything is written (nothing reaches the C++ pass)."""
    from compcomm.optim.adam import _fits
    cpu, x = torch.device("cpu"), torch.zeros(12)
    assert _fits(x, 12, cpu) and _fits(x.bfloat16(), 12, cpu, (torch.bfloat16,))
    for bad, n in ((None, 12), (x, 11), (x.double(), 12), (x.bfloat16(), 12),
                   (x.view(3, 4).t(), 12), (torch.zeros(12, device="meta"), 12)):
        assert not _fits(bad, n, cpu)
    assert not _fits(x, 12, torch.device("cuda", 0))
    if not cpu_adam.matches_torch_rules(denom=True):
        pytest.skip("the CPU kernels do not reproduce torch's ops here: no kernel path at all")
    calls = _count_local_steps(monkeypatch)
    gen = torch.Generator().manual_seed(5)
    ps = [torch.nn.Parameter(torch.randn(6, 4, generator=gen)) for _ in range(2)]
    opt = OneBitAdam(ps, lr=1e-2, freeze_step=1)
    for _ in range(2):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    assert len(calls) == 1  # step 2
    st = opt.state[ps[1]]
    st["exp_avg"] = st["exp_avg"].t().contiguous().t()  # same values, strides (1, 6)
    before = [t.clone() for t in ps + [opt.state[p]["exp_avg"] for p in ps]]
    with pytest.raises(ValueError, match=r"\[1\]: m must be a contiguous"):
        opt.step()  # the general path's checks name it; the fast path took no pointer
    assert len(calls) == 1, "a non-contiguous momentum went to the C++ pass"
    assert opt.schedule.step == 2 and all(opt.state[p]["step"] == 2 for p in ps)
    for a, b in zip(before, ps + [opt.state[p]["exp_avg"] for p in ps]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("on", [False, True], ids=["step", "step_on"])
def test_onebit_adam_w1_nonfinite_gradient_changes_nothing(on):
    before, _ = _trajectory(3, on=on)
    after, opt = _trajectory(4, nan_at=3, on=on)
    assert opt.schedule.step == 3 and opt.skipped_steps == (0 if on else 1)
    for x, y in zip(before[-1], after[-1]):
        assert torch.equal(x, y)


# ------------------------------------------------------------------------------------------------
# W > 1: the momentum a rank compresses, one C++ pass instead of two torch ops
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [1, 7, 4099, 2**20 + 3])
@pytest.mark.parametrize("isa", ISAS)
def test_onebit_momentum_kernel_bit_identical(n, isa, threads):
    w, m, v, g = _state(n, n + 9)
    grad = torch.randn(n, generator=g)
    group = _group(betas=(0.85, 0.999))
    want = torch.empty(n)
    F.onebit_momentum(m, grad, group, want)
    out = torch.full((n,), float("nan"))
    K.onebit_momentum(B(m), B(grad), B(out), 0.85, threads, isa)
    if cpu_adam.matches_torch_rules():  # torch's mul/add_ here are the kernels' ops
        assert torch.equal(out, want)
    want64 = 0.85 * m.double() + (1 - 0.85) * grad.double()
    torch.testing.assert_close(out.double(), want64, rtol=1e-6, atol=1e-7)
    K.onebit_momentum(B(m), B(grad), B(m), 0.85, threads, isa)  # in place
    assert torch.equal(m, out)


def test_onebit_momentum_wrapper_arguments():
    m, g = torch.randn(8), torch.randn(8)
    with pytest.raises(ValueError, match="g has 7 elements"):
        cpu_adam.onebit_momentum_(m, g[:7], _group(), torch.empty(8))
    with pytest.raises(TypeError, match="out must be float32"):
        cpu_adam.onebit_momentum_(m, g, _group(), torch.empty(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="partly overlaps"):
        K.onebit_momentum(B(m[:7]), B(g[:7]), B(m[1:]), 0.9)


def _w2_trajectories(rank, world):
    """OneBitAdam over gloo with the C++ momentum (and the kernels), then with the torch ops."""
    import os

    from compcomm.optim import cpu_multi

    calls = []  # tensors through the C++ momentum (the list form: one call per bucket run)
    real = cpu_multi.onebit_momentums_
    cpu_multi.onebit_momentums_ = lambda *a, **k: (calls.append(len(a[0])), real(*a, **k))
    out = {}
    for env in ("1", "0"):
        os.environ["COMPCOMM_FUSED_OPTIM"] = env
        gen = torch.Generator().manual_seed(7)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
        opt = OneBitAdam(params, lr=1e-2, freeze_step=2, weight_decay=0.01, reduce_bucket_size=5000)
        traj = []
        for _ in range(6):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen) * (1 + rank)
            opt.step()
            traj.append([p.detach().clone() for p in params])
        out[env] = traj
        out["calls" + env] = sum(calls)
    return out, cpu_adam.matches_torch_rules(denom=True)


@pytest.mark.parametrize("world", [2, 3])
def test_onebit_adam_gloo_momentum_kernel_keeps_the_bits(world):
    from compcomm.testing import run_ranks

    for (trajs, exact) in run_ranks(world, _w2_trajectories, timeout=240):
        # steps 3..6 of every tensor took the C++ momentum, and only with the kernels switched on
        assert trajs["calls1"] == trajs["calls0"] == (4 * len(SHAPES) if exact else 0)
        for step, (a, b) in enumerate(zip(trajs["1"], trajs["0"])):
            for x, y in zip(a, b):
                if exact:
                    assert torch.equal(x, y), f"step {step + 1}"
                else:  # no kernels here: both runs are the torch ops
                    torch.testing.assert_close(x, y, rtol=0, atol=0)
