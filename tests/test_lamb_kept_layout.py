"""OneBitLamb's one-rank kernel step on a kept layout (``OneBitLamb._kept_step``): after one full
check, later compressed steps re-check only the gradients and that each state tensor is the same
one at the same address (:class:`compcomm.optim._kept_layout.KeptLayout`). These tests hold it to
the fully checked step bit for bit through every change that must send a step back to the full
check, and show that a declined step writes nothing."""

from __future__ import annotations

import pytest
import torch

from compcomm.optim import OneBitLamb, lamb_passes
from compcomm.optim import _kept_layout, lamb

SHAPES = [(33,), (7, 5), (4099,), (16, 9), (1,)]
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device")])]


def _kernels_here(device: str) -> None:
    if device == "cpu" and not lamb_passes.kernels_match_torch():
        pytest.skip("the CPU passes do not reproduce torch's ops here: no kernel path at all")
    if device == "cuda" and not lamb_passes.usable([torch.zeros(1, device="cuda")], []):
        pytest.skip("this build has no CUDA passes")


def _opt(params, **kw):
    return OneBitLamb([{"params": params[:3], "weight_decay": 0.01},
                       {"params": params[3:], "bias_correction": True}], lr=1e-2, freeze_step=2,
                      **kw)


def _trajectory(monkeypatch, device: str, keep: bool):
    """20 steps of OneBitLamb at W=1 (2 warm-up) with something changed before most compressed
    steps; ``keep`` False: the layout is never kept (every step fully checked). Returns what
    each step left and how often a kept layout was asked and served."""
    served = []
    real = _kept_layout.KeptLayout.runs
    monkeypatch.setattr(_kept_layout.KeptLayout, "runs", lambda self, *a: (
        lambda got: (served.append(got is not None), got)[1])(real(self, *a)))
    if not keep:
        monkeypatch.setattr(OneBitLamb, "_keep_layout", lambda self, works: None)
    gen = torch.Generator().manual_seed(11)
    rand = lambda shape: torch.randn(shape, generator=gen).to(device)  # noqa: E731
    params = [torch.nn.Parameter(rand(s)) for s in SHAPES]
    opt = _opt(params)
    st = lambda i: opt.state[params[i]]  # noqa: E731
    disturb = {
        4: lambda: setattr(params[0], "data", params[0].detach().clone()),  # new storage
        5: lambda: opt.param_groups[1].__setitem__("lr", 5e-3),  # read at every step
        6: lambda: st(3).__setitem__("exp_avg", st(3)["exp_avg"].clone()),  # flat rebuilt
        7: lambda: st(4)["exp_avg_sq"].set_(st(4)["exp_avg_sq"].clone()),  # same tensor, moved
        8: lambda: setattr(params[2], "grad", None),  # no gradient: the torch ops this step
        9: lambda: setattr(params[3], "grad", params[3].grad.t().contiguous().t()),  # strided
        10: lambda: opt.param_groups[0].__setitem__("weight_decay", 0.0),
        11: lambda: st(1).__setitem__("exp_avg_sq_fresh", st(1)["exp_avg_sq_fresh"].clone()),
        13: lambda: opt.load_state_dict(opt.state_dict()),
        15: lambda: opt.param_groups[0].__setitem__("exp_avg_mask", torch.ones(1, device=device)),
        16: lambda: opt.param_groups[0].pop("exp_avg_mask"),
        18: lambda: setattr(params[0], "data", rand(SHAPES[0])),
    }
    out = []
    for step in range(20):
        for p in params:
            p.grad = rand(p.shape)
        if step in disturb:
            disturb[step]()
        opt.step()
        out.append([p.detach().cpu().clone() for p in params]
                   + [opt.state[p][k].cpu().clone() for p in params
                      for k in ("exp_avg", "exp_avg_sq_fresh")]
                   + [torch.tensor([opt.state[p]["last_factor"] for p in params]
                                   + opt.get_lamb_coeffs(), dtype=torch.float64)])
    return out, served


@pytest.mark.parametrize("run_elements", [None, 64], ids=["runs_default", "runs_of_64"])
@pytest.mark.parametrize("device", DEVICES)
def test_onebit_lamb_w1_kept_layout_follows_every_change(monkeypatch, device, run_elements):
    """Each change above makes that step check from scratch (the layout declines), changed
    hyperparameters are read at every step, and the trajectory (weights, momenta, fresh
    variances, factors, coefficients) is that of the fully checked step bit for bit: a stale
    pointer (the old storage of a parameter, a replaced fresh variance) or a stale coefficient
    would differ."""
    _kernels_here(device)
    if run_elements is not None:
        if device == "cuda":
            pytest.skip("a GPU takes one run a group")
        monkeypatch.setattr(lamb, "_RUN_ELEMENTS", run_elements)  # several runs a group
    fast, served = _trajectory(monkeypatch, device, keep=True)
    assert served.count(True) >= 5 and served.count(False) >= 6, served
    ref, never = _trajectory(monkeypatch, device, keep=False)
    assert never == []
    for step, (a, b) in enumerate(zip(fast, ref)):
        for i, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"step {step + 1}, tensor {i}"


def _kept_opt(device: str):
    gen = torch.Generator().manual_seed(8)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in SHAPES]
    spare = torch.nn.Parameter(torch.zeros(0, device=device))  # no elements: skipped
    opt = _opt(params + [spare])

    def grads():
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(device)

    for _ in range(4):  # two warm-up steps, two compressed: the layout is kept
        grads()
        opt.step()
    assert opt._kept is not None
    grads()
    return opt, params, grads


def _st(opt, params, i):
    return opt.state[params[i]]


CHANGES = {
    "param_smaller": lambda o, p: setattr(p[0], "data", torch.randn(7, device=p[0].device)),
    "param_new_storage": lambda o, p: setattr(p[0], "data", p[0].detach().clone()),
    "momentum_replaced": lambda o, p: _st(o, p, 3).__setitem__(
        "exp_avg", _st(o, p, 3)["exp_avg"].clone()),
    "momentum_shorter": lambda o, p: _st(o, p, 3)["exp_avg"].set_(
        torch.zeros(3, device=p[0].device)),
    "variance_moved": lambda o, p: _st(o, p, 4)["exp_avg_sq"].set_(
        _st(o, p, 4)["exp_avg_sq"].clone()),
    "fresh_variance_replaced": lambda o, p: _st(o, p, 2).__setitem__(
        "exp_avg_sq_fresh", _st(o, p, 2)["exp_avg_sq_fresh"].clone()),
    "variance_dropped": lambda o, p: _st(o, p, 4).pop("exp_avg_sq"),
    "scaling_coeff_dropped": lambda o, p: _st(o, p, 1).pop("scaling_coeff"),
    "state_entry_copied": lambda o, p: o.state.__setitem__(p[3], dict(_st(o, p, 3))),
    # same address, other size, dtype or layout: only the tensor's signature tells
    "variance_resized": lambda o, p: _st(o, p, 2)["exp_avg_sq"].resize_(3),
    "fresh_variance_sliced": lambda o, p: setattr(_st(o, p, 2)["exp_avg_sq_fresh"], "data",
                                                  _st(o, p, 2)["exp_avg_sq_fresh"].data[:3]),
    "fresh_variance_int32": lambda o, p: setattr(_st(o, p, 2)["exp_avg_sq_fresh"], "data",
                                                 _st(o, p, 2)["exp_avg_sq_fresh"].data.view(
                                                     torch.int32)),
    "variance_transposed": lambda o, p: setattr(_st(o, p, 3)["exp_avg_sq"], "data",
                                                _st(o, p, 3)["exp_avg_sq"].data.t()),
    "param_sliced": lambda o, p: setattr(p[2], "data", p[2].data[:7]),
    "empty_param_grown": lambda o, p: setattr(o.param_groups[1]["params"][-1], "data",
                                              torch.ones(6, device=p[0].device)),
    "state_swapped": lambda o, p: setattr(o, "state", type(o.state)(dict, o.state)),
    "grad_none": lambda o, p: setattr(p[2], "grad", None),
    "grad_strided": lambda o, p: setattr(p[3], "grad", p[3].grad.t().contiguous().t()),
    "grad_fp64": lambda o, p: setattr(p[0].grad, "data", p[0].grad.double()),
    "grad_short": lambda o, p: setattr(p[0].grad, "data", torch.zeros(3, device=p[0].device)),
    "state_reloaded": lambda o, p: o.load_state_dict(o.state_dict()),
    "flat_dropped": lambda o, p: setattr(o, "_flat", None),
    "group_added": lambda o, p: o.add_param_group(
        {"params": [torch.nn.Parameter(torch.ones(3, device=p[0].device))]}),
    "param_list_changed": lambda o, p: o.param_groups[1]["params"].__setitem__(0, p[0]),
    "mask_set": lambda o, p: o.param_groups[0].__setitem__("exp_avg_mask", torch.ones(1)),
    "kernels_off": None,
    "step_on": lambda o, p: setattr(o, "_local", {q: q.grad for q in p}),
    "grad_scaled": lambda o, p: setattr(o, "_grad_scale", 2.0),
}


@pytest.mark.parametrize("change", ["nothing"] + list(CHANGES))
def test_kept_step_declines_each_change_and_writes_nothing(monkeypatch, change):
    """``_kept_step`` runs the step while nothing changed, and after any change that would make a
    kept pointer, size, tensor or coefficient wrong returns False having written nothing (the
    full check then runs) -- including changes a launch would survive by reading fresh pointers
    and those it would not (a smaller parameter or momentum: the passes would write past it)."""
    _kernels_here("cpu")
    opt, params, _ = _kept_opt("cpu")
    if change == "kernels_off":
        monkeypatch.setenv("COMPCOMM_FUSED_OPTIM", "0")
    elif change != "nothing":
        CHANGES[change](opt, params)
    before = _snapshot(opt, params)
    ran = opt._kept_step(opt.schedule.step + 1)
    assert ran is (change == "nothing")
    if not ran:
        assert opt._kept is None
        _assert_same(_snapshot(opt, params), before)
    else:
        assert not any(torch.equal(p, b) for p, b in zip(params, before[0]))


def _snapshot(opt, params):
    """The weights, then per parameter its state (tensors copied), then the coefficients."""
    return ([p.detach().clone() for p in params],
            [{k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
             for p in params], opt.get_lamb_coeffs())


def _assert_same(now, before):
    assert all(torch.equal(p, b) for p, b in zip(now[0], before[0]))
    for st, old in zip(now[1], before[1]):
        assert st.keys() == old.keys()
        for k, v in old.items():
            assert (torch.equal(st[k], v) if torch.is_tensor(v) else st[k] == v), k
    assert now[2] == before[2]


@pytest.mark.parametrize("device", DEVICES)
def test_kept_step_nonfinite_gradient_changes_nothing(device):
    """A NaN gradient on the kept layout: the step is skipped before anything is written (its
    finiteness verdict comes before the passes), and the next step runs on the kept layout."""
    _kernels_here(device)
    opt, params, grads = _kept_opt(device)
    params[2].grad[5] = float("nan")
    before = _snapshot(opt, params)
    assert len(before[2]) == len(params)  # the last step's coefficients are kept through a skip
    with pytest.warns(RuntimeWarning, match="skipped"):
        opt.step()
    assert opt.skipped_steps == 1 and opt._kept is not None
    _assert_same(_snapshot(opt, params), before)
    grads()
    assert opt._kept_step(opt.schedule.step + 1)


def test_low_precision_parameters_are_not_kept():
    """bf16 parameters: their gradients are converted to fp32 copies each step, so there is no
    layout to keep; the step still takes the passes."""
    _kernels_here("cpu")
    params = [torch.nn.Parameter(torch.randn(s).to(torch.bfloat16)) for s in SHAPES]
    opt = _opt(params)
    for _ in range(4):
        for p in params:
            p.grad = torch.randn(p.shape).to(torch.bfloat16)
        opt.step()
    assert opt.__dict__.get("_kept") is None
