"""OneBitAdam's compressed phase on CPUs whose torch ``sqrt`` the kernels do not compute (an AMD
EPYC's MKL: neither correctly rounded nor Intel's rsqrt14 form): the frozen denominators
``functional.adam_denom(v)`` are computed once by torch and the kernels read them instead of ``v``.

- The list kernels with ``v_is_denom`` against the torch ops given the same denominator, and
  against a float64 reference on every machine.
- OneBitAdam with that path forced (``matches_torch_rules()`` made False, as on such a CPU) at
  W=1 and over gloo at W=2: the kernels run, the bits are the torch-op path's
  (``COMPCOMM_FUSED_OPTIM=0``), and the denominators are computed once and again only when ``v``
  is written or replaced, or eps, beta2 or the bias correction change.
"""

from __future__ import annotations

import copy

import pytest
import torch

from compcomm import _C
from compcomm.optim import OneBitAdam, cpu_adam, cpu_multi
from compcomm.optim import functional as F

SHAPES = [(37, 11), (4099,), (5,), (64, 65)]
GROUP = {"lr": 1e-2, "betas": (0.9, 0.995), "eps": 1e-8, "weight_decay": 0.01,
         "bias_correction": True}


def _tensors(n, seed):
    g = torch.Generator().manual_seed(seed)
    w, m, x = (torch.randn(n, generator=g) for _ in range(3))
    v = torch.rand(n, generator=g) * 1e-2
    v[::7] = 0.0
    return w, m, v, x


@pytest.mark.parametrize("kind", ["local", "compressed"])
@pytest.mark.parametrize("n", [1, 7, 4099, 70001])
def test_list_kernels_read_the_denominator(kind, n):
    w, m, v, x = _tensors(n, n)
    d = F.adam_denom(v, GROUP, 4)
    rw, rm = w.clone(), m.clone()
    if kind == "local":  # x is the local gradient
        F.onebit_momentum(rm, x, GROUP, rm)
    else:  # x is the averaged momentum
        rm.copy_(x)
    rw.add_(F.adam_update(rm, d, rw, GROUP, 9, 4, denom=d), alpha=-GROUP["lr"])
    kw, km = w.clone(), m.clone()
    v_before = v.clone()
    step = cpu_adam.onebit_local_steps_ if kind == "local" else cpu_multi.onebit_compressed_steps_
    step([kw], [km], [d], [x], GROUP, 9, 4, num_threads=2, denom=True)
    assert torch.equal(km, rm)
    if cpu_adam.matches_torch_rules(denom=True):
        assert torch.equal(kw, rw)
    m64 = rm.double()
    u = m64 / d.double() / (1 - 0.9 ** 9) + 0.01 * w.double()
    torch.testing.assert_close(kw.double(), w.double() - 1e-2 * u, rtol=1e-6, atol=1e-7)
    assert torch.equal(v, v_before)


def test_warmup_refuses_a_denominator():
    w, m, v, x = _tensors(8, 1)
    with pytest.raises(ValueError, match="v_is_denom needs a frozen variance"):
        _C.optim.onebit_warmup_steps([8], [w.data_ptr()], [m.data_ptr()], [v.data_ptr()],
                                     [x.data_ptr()], [], [], 1e-3, 0.9, 0.999, 1e-8, 0.0, False,
                                     1, 1, v_is_denom=True)


def _force_denominators(monkeypatch):
    """As on a CPU whose torch sqrt the kernels do not compute."""
    real = cpu_adam.matches_torch_rules
    monkeypatch.setattr(cpu_adam, "matches_torch_rules",
                        lambda denom=False: real(denom=True) if denom else False)
    if not real(denom=True):
        pytest.skip("the kernels do not give the torch ops' bits here even given denominators")


def _count(monkeypatch, mod, name):
    calls = []
    real = getattr(mod, name)
    monkeypatch.setattr(mod, name, lambda *a, **k: (calls.append(a), real(*a, **k))[1])
    return calls


def _run(steps, poke=None):
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    opt = OneBitAdam([{"params": params[:2]}, {"params": params[2:], "bias_correction": True}],
                     lr=1e-2, freeze_step=2, weight_decay=0.01)
    out = []
    for step in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        if poke is not None:
            poke(step, opt, params)
        opt.step()
        out.append([p.detach().clone() for p in params]
                   + [opt.state[p]["exp_avg"].clone() for p in params])
    return out


def _poke(step, opt, params):
    """Step 5: v written in place (its version moves); step 6: the first group's eps changes;
    step 7: a reload (new v tensors); step 8: v given new storage through ``.data`` (the version
    stays); step 9: the second group's beta2 changes; step 10: the first group's bias
    correction is switched on."""
    if step == 4:
        opt.state[params[0]]["exp_avg_sq"].mul_(2.0)
    if step == 5:
        opt.param_groups[0]["eps"] = 1e-6
    if step == 6:
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    if step == 7:
        v = opt.state[params[1]]["exp_avg_sq"]
        v.data = v.data * 3.0
    if step == 8:
        opt.param_groups[1]["betas"] = (0.9, 0.99)
    if step == 9:
        opt.param_groups[0]["bias_correction"] = True


def test_onebit_adam_w1_denominators_keep_the_bits(monkeypatch):
    _force_denominators(monkeypatch)
    local = _count(monkeypatch, cpu_adam, "onebit_local_steps_")
    denoms = _count(monkeypatch, F, "adam_denom")
    fast = _run(11, _poke)
    n = len(SHAPES)
    # compressed steps 3..11: one kernel call per param group per step, reading denominators
    assert len(local) == 9 * 2
    # made at step 3, then for params[0] (v written), group 0 (eps), all (reload), params[1]
    # (new storage), group 1 (beta2), group 0 (bias correction)
    assert len(denoms) == n + 1 + 2 + n + 1 + 2 + 2
    monkeypatch.setenv("COMPCOMM_FUSED_OPTIM", "0")
    del local[:]
    ref = _run(11, _poke)
    assert not local
    for step, (a, b) in enumerate(zip(fast, ref)):
        for i, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"step {step + 1}, tensor {i}"


def test_inference_mode_state_gets_fresh_denominators(monkeypatch):
    """State made under inference_mode has no version counter: the denominators are made anew
    every compressed step, still the torch ops' bits."""
    _force_denominators(monkeypatch)
    denoms = _count(monkeypatch, F, "adam_denom")
    with torch.inference_mode():
        fast = _run(5)
    assert len(denoms) == 3 * len(SHAPES)  # compressed steps 3..5
    monkeypatch.setenv("COMPCOMM_FUSED_OPTIM", "0")
    with torch.inference_mode():
        ref = _run(5)
    for a, b in zip(fast, ref):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def _w2(rank, world):
    """OneBitAdam over gloo with the denominators forced, then with the torch ops."""
    import os

    real = cpu_adam.matches_torch_rules
    cpu_adam.matches_torch_rules = lambda denom=False: real(denom=True) if denom else False
    calls = []
    steps = cpu_multi.onebit_compressed_steps_
    cpu_multi.onebit_compressed_steps_ = lambda *a, **k: (calls.append(k.get("denom")),
                                                          steps(*a, **k))[1]
    out = {}
    for env in ("1", "0"):
        os.environ["COMPCOMM_FUSED_OPTIM"] = env
        gen = torch.Generator().manual_seed(7 + rank)
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(1)))
                  for s in SHAPES]
        opt = OneBitAdam(params, lr=1e-2, freeze_step=2, weight_decay=0.01)
        traj = []
        for _ in range(5):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
            traj.append([p.detach().clone() for p in params])
        out[env] = traj
    return out, calls, real(denom=True)


def test_onebit_adam_gloo_denominators_keep_the_bits():
    from compcomm.testing import run_ranks

    for trajs, calls, exact in run_ranks(2, _w2, timeout=240):
        if not exact:
            pytest.skip("the kernels do not give the torch ops' bits here even given denominators")
        assert calls == [True] * 3  # compressed steps 3..5, one param group
        for step, (a, b) in enumerate(zip(trajs["1"], trajs["0"])):
            for x, y in zip(a, b):
                assert torch.equal(x, y), f"step {step + 1}"
