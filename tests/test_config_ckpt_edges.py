"""Config and checkpoint edges (from a review): optimizer flags given as strings, gradient
clipping at stage 0, fp16 scaler settings, the dynamic loss scaler's progress in ZeRO
checkpoints, checkpoint files that would run code when unpickled, consolidating unreadable
shards, optimizer states a step would trip over, and an ambiguous rank-checkpoint directory.
One rank, in process."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import compcomm
from compcomm.amp import LossScaler
from compcomm.optim import (
    OneBitAdam,
    OneBitLamb,
    ZeroOneAdam,
    load_rank_checkpoint,
    save_rank_checkpoint,
)
from compcomm.zero import ZeroOptimizer, consolidate, load_checkpoint, save_checkpoint
from compcomm.zero.checkpoint import load_shard_state_dict, shard_file, shard_state_dict


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batch(i: int):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)


def _train(m, opt, lo: int, hi: int) -> None:
    for i in range(lo, hi):
        x, y = _batch(i)
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()


_BASE = {"train_batch_size": 4}


def _onebit(typ: str, **params):
    return dict(_BASE, optimizer={"type": typ, "params": params})


# -- 1. boolean and numeric optimizer settings ------------------------------------------------
@pytest.mark.parametrize("typ,key", [
    ("OneBitAdam", "exact_resume"), ("OneBitAdam", "fused"), ("OneBitAdam", "per_parameter"),
    ("OneBitAdam", "check_finite"), ("OneBitAdam", "grads_averaged"),
    ("OneBitAdam", "cuda_aware"), ("OneBitAdam", "eps_inside_sqrt"),
    ("ZeroOneAdam", "wd_in_momentum"), ("OneBitLamb", "cuda_aware"),
    ("OneBitLamb", "exact_resume"),
])
def test_string_flags_refused(typ, key):
    with pytest.raises(TypeError, match=f"optimizer.params.{key} must be true or false"):
        compcomm.from_config(_model(), _onebit(typ, **{key: "false"}))


@pytest.mark.parametrize("value,exc", [("x", TypeError), (float("nan"), ValueError),
                                       (float("inf"), ValueError)])
def test_max_grad_norm_must_be_a_number(value, exc):
    with pytest.raises(exc, match="optimizer.params.max_grad_norm"):
        compcomm.from_config(_model(), _onebit("OneBitAdam", max_grad_norm=value))


def test_real_flags_still_accepted():
    s = compcomm.from_config(_model(), _onebit("OneBitAdam", exact_resume=True, fused=None,
                                               check_finite=False, max_grad_norm=1))
    assert s.optimizer.exact_resume is True and s.optimizer.check_finite is False


# -- 2. gradient_clipping at stage 0 ------------------------------------------------------------
def test_clip_stage0_onebit_refused():
    with pytest.raises(ValueError, match="gradient_clipping.*stage >= 1.*clip_grad_norm_"):
        compcomm.from_config(_model(), dict(_onebit("OneBitAdam"), gradient_clipping=1.0))


def test_clip_stage0_torch_optimizer_applied():
    clip = 1e-3
    cfg = dict(_BASE, optimizer={"type": "Adam", "params": {"lr": 1e-2}}, gradient_clipping=clip)
    s = compcomm.from_config(_model(), cfg)
    ref = _model()
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    for i in range(2):
        x, y = _batch(i)
        for m, o in ((s.model, s.optimizer), (ref, ropt)):
            o.zero_grad()
            (1e3 * torch.nn.functional.mse_loss(m(x), y)).backward()
            if o is ropt:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            o.step()
    for a, b in zip(s.model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


# -- 3. fp16 scaler settings, stage, clipping values ------------------------------------------
_ZERO = dict(_BASE, optimizer={"type": "Adam", "params": {"lr": 1e-3}},
             zero_optimization={"stage": 1})


@pytest.mark.parametrize("key,value", [("loss_scale_window", 0), ("min_loss_scale", 0),
                                       ("min_loss_scale", 0.0)])
def test_fp16_scaler_settings(key, value):
    with pytest.raises(ValueError, match=f"fp16.{key}"):
        compcomm.from_config(_model(), dict(_ZERO, fp16={"enabled": True, key: value}))


def test_loss_scaler_arguments():
    with pytest.raises(ValueError, match="loss_scale_window"):
        LossScaler(0.0, window=0)
    with pytest.raises(ValueError, match="min_loss_scale"):
        LossScaler(0.0, min_scale=0.0)


def test_stage_must_be_an_integer():
    with pytest.raises(ValueError, match="zero_optimization.stage"):
        compcomm.from_config(_model(), dict(_ZERO, zero_optimization={"stage": 2.0}))
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
        ZeroOptimizer(list(_model().parameters()), torch.optim.AdamW, stage=2.0)


@pytest.mark.parametrize("clip", [float("nan"), float("inf")])
def test_clip_must_be_finite(clip):
    with pytest.raises(ValueError, match="gradient_clipping"):
        compcomm.from_config(_model(), dict(_ZERO, gradient_clipping=clip))


# -- 4. the dynamic loss scale resumes exactly --------------------------------------------------
_FP16 = dict(_ZERO, fp16={"enabled": True, "loss_scale": 0, "initial_scale_power": 4,
                          "loss_scale_window": 3})


def _fp16_steps(s, lo: int, hi: int, log: list) -> None:
    for i in range(lo, hi):
        x, y = _batch(i)
        loss = torch.nn.functional.mse_loss(s.model(x.half()).float(), y)
        s.optimizer.backward(loss)
        s.optimizer.step()
        log.append(s.optimizer.loss_scale)


def test_fp16_dynamic_scale_resumes_exactly(tmp_path):
    a = compcomm.from_config(_model(), _FP16)
    la: list = []
    _fp16_steps(a, 0, 8, la)
    b = compcomm.from_config(_model(), _FP16)
    lb: list = []
    _fp16_steps(b, 0, 4, lb)
    save_checkpoint(b.optimizer, str(tmp_path))
    c = compcomm.from_config(_model(), _FP16)
    load_checkpoint(c.optimizer, str(tmp_path))
    _fp16_steps(c, 4, 8, lb)
    assert la == lb
    for g, h in zip(a.optimizer.groups, c.optimizer.groups):
        assert torch.equal(g.master, h.master)
    # a shard of the original format (no counter) still loads: the counter restarts at 0
    sd = torch.load(shard_file(str(tmp_path), 0, 1), weights_only=True)
    assert sd.pop("loss_scale_good_steps") == 4  # finite steps since the last overflow
    d = compcomm.from_config(_model(), _FP16)
    d.optimizer.scaler.good_steps = 2
    load_shard_state_dict(d.optimizer, sd)
    assert d.optimizer.scaler.good_steps == 0
    sd["loss_scale_good_steps"] = -1
    with pytest.raises(ValueError, match="loss_scale_good_steps"):
        load_shard_state_dict(d.optimizer, sd)
    for s in (a, b, c, d):
        s.optimizer.close()


# -- 5. checkpoint files are read with weights_only=True ---------------------------------------
class _Evil:
    def __init__(self, mark: str) -> None:
        self.mark = mark

    def __reduce__(self):
        return (open, (self.mark, "w"))


def test_rank_checkpoint_runs_no_code(tmp_path):
    mark = str(tmp_path / "PWNED")
    torch.save({"state": {}, "param_groups": _Evil(mark)}, str(tmp_path / "optim_rank0_of1.pt"))
    m = _model()
    o = OneBitAdam(m.parameters(), lr=1e-2, freeze_step=3)
    with pytest.raises(ValueError, match="optim_rank0_of1.pt"):
        load_rank_checkpoint(o, str(tmp_path))
    assert not os.path.exists(mark)


def test_consolidate_runs_no_code(tmp_path):
    mark = str(tmp_path / "PWNED")
    torch.save({"format": _Evil(mark)}, shard_file(str(tmp_path), 0, 1))
    with pytest.raises(ValueError, match="zero_rank0_of1.pt"):
        consolidate(str(tmp_path))
    assert not os.path.exists(mark)


# -- 6. consolidate reads through the same reader as load_checkpoint ---------------------------
def test_consolidate_bad_files(tmp_path):
    z = compcomm.from_config(_model(), _ZERO).optimizer
    save_checkpoint(z, str(tmp_path))
    z.close()
    path = shard_file(str(tmp_path), 0, 1)
    assert set(consolidate(str(tmp_path))) == {"group0.param0", "group0.param1", "group0.param2",
                                                "group0.param3"}
    data = open(path, "rb").read()
    for bad in (data[: len(data) // 2], b"garbage"):
        with open(path, "wb") as f:
            f.write(bad)
        with pytest.raises(ValueError, match="zero_rank0_of1.pt"):
            consolidate(str(tmp_path))
    torch.save([1, 2], path)
    with pytest.raises(ValueError, match="zero_rank0_of1.pt"):
        consolidate(str(tmp_path))


# -- 7. a state the step needs is checked before anything is replaced -------------------------
_KW = {
    "OneBitAdam": (OneBitAdam, dict(lr=1e-2, freeze_step=3)),
    "ZeroOneAdam": (ZeroOneAdam, dict(lr=1e-2, var_freeze_step=3, var_update_scaler=1,
                                      local_step_scaler=2, local_step_clipper=2)),
    "OneBitLamb": (OneBitLamb, dict(lr=1e-2, freeze_step=3)),
}


def _st0(sd):
    return sd["state"][0]


_MUTATIONS = {
    "exp_avg_sq dropped": (lambda sd: _st0(sd).pop("exp_avg_sq"), "exp_avg_sq"),
    "exp_avg float64": (lambda sd: _st0(sd).__setitem__("exp_avg", _st0(sd)["exp_avg"].double()),
                        "exp_avg"),
    "lamb_coeff_freeze str": (lambda sd: _st0(sd).__setitem__("lamb_coeff_freeze", "x"),
                              "lamb_coeff_freeze"),
    "lamb_coeff_freeze dropped": (lambda sd: _st0(sd).pop("lamb_coeff_freeze"),
                                  "lamb_coeff_freeze"),
    "last_factor str": (lambda sd: _st0(sd).__setitem__("last_factor", "x"), "last_factor"),
    "scaling_coeff nan": (lambda sd: _st0(sd).__setitem__("scaling_coeff", float("nan")),
                          "scaling_coeff"),
    "momentum_accumulator without lrs": (lambda sd: _st0(sd).pop("lrs"), "lrs"),
}
_CASES = [(n, mu) for n in _KW for mu in _MUTATIONS
          if ("lamb" not in mu and "last_factor" not in mu and "scaling" not in mu
              and "momentum_accumulator" not in mu)
          or (n == "OneBitLamb" and ("lamb" in mu or "factor" in mu or "scaling" in mu))
          or (n == "ZeroOneAdam" and "momentum_accumulator" in mu)]


@pytest.mark.parametrize("name,mutation", _CASES)
def test_state_checked_before_load(name, mutation):
    cls, kw = _KW[name]
    m = _model()
    o = cls(m.parameters(), **kw)
    _train(m, o, 0, 5)
    sd = copy.deepcopy(o.state_dict())
    mutate, key = _MUTATIONS[mutation]
    mutate(sd)
    m2 = _model()
    o2 = cls(m2.parameters(), **kw)
    _train(m2, o2, 0, 2)
    before = copy.deepcopy(o2.state_dict())
    with pytest.raises((TypeError, ValueError), match=rf"\['state'\]\[0\].*{key}"):
        o2.load_state_dict(sd)
    after = o2.state_dict()
    for pid, st in before["state"].items():
        for k, v in st.items():
            w = after["state"][pid][k]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w


def test_zero_torch_adam_state_checked():
    s = compcomm.from_config(_model(), _ZERO)
    _train(s.model, s.optimizer, 0, 2)
    sd = copy.deepcopy(shard_state_dict(s.optimizer))
    sd["optimizer"]["state"][0].pop("exp_avg_sq")
    with pytest.raises(ValueError, match=r"\['state'\]\[0\].*exp_avg_sq"):
        load_shard_state_dict(s.optimizer, sd)
    s.optimizer.close()


# -- 8. an ambiguous rank-checkpoint directory ---------------------------------------------------
def test_load_rank_checkpoint_refuses_several_world_sizes(tmp_path):
    cls, kw = _KW["OneBitAdam"]
    m = _model()
    o = cls(m.parameters(), **kw)
    _train(m, o, 0, 2)
    torch.save(o.state_dict(), str(tmp_path / "optim_rank0_of2.pt"))
    torch.save(o.state_dict(), str(tmp_path / "optim_rank0_of16.pt"))
    o2 = cls(_model().parameters(), **kw)
    with pytest.raises(ValueError, match="optim_rank0_of16.pt.*optim_rank0_of2.pt"):
        load_rank_checkpoint(o2, str(tmp_path))
    assert o2.sched["step"] == 0
    os.unlink(str(tmp_path / "optim_rank0_of16.pt"))  # one other world size: its file loads
    assert load_rank_checkpoint(o2, str(tmp_path)).endswith("optim_rank0_of2.pt")
    assert o2.sched["step"] == 2
    save_rank_checkpoint(o2, str(tmp_path))  # this world size's own file wins
    assert load_rank_checkpoint(o2, str(tmp_path)).endswith("optim_rank0_of1.pt")
