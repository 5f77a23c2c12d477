"""compcomm.fsdp.onebit(mode="momentum"): DeepSpeed's 1-bit Adam on FSDP2's shards (the local
momentum averaged with the full compressed allreduce, kept replicated in 1-bit form) with
FrozenVarianceAdam taking its momentum; FSDP2 over gloo, W=2 and 3."""

from __future__ import annotations

import pytest

import _fsdp_momentum_cases as C
from compcomm.testing import run_ranks


@pytest.mark.parametrize("world,dtype,force_sum", [(2, "float32", False), (3, "float32", False),
                                                   (2, "bfloat16", False), (3, "float32", True)])
def test_exact_exchange_equals_frozen_variance_adam(world, dtype, force_sum):
    """With an exact exchange the momentum mode is FrozenVarianceAdam on FSDP's gradients: the
    warm-up bit for bit, then equal to rounding (AVG, or SUM with FSDP's post-division)."""
    for res in run_ranks(world, C.exact_cases, dtype, force_sum, timeout=300):
        assert res["warmup_bitwise"] and res["moved"], res
        assert res["err"] < (1e-5 if dtype == "float32" else 2e-2), res
        assert res["steps"] == [6], res


@pytest.mark.parametrize("world,dtype,limit", [(2, "float32", 16384), (3, "float32", 0),
                                               (3, "bfloat16", None), (2, "float32", 40)])
def test_onebit_momentum_equals_deepspeed_reference(world, dtype, limit):
    """1-bit: the replicated momentum equals the numpy reference of DeepSpeed's algorithm on the
    same local momenta (errors carried, the switch seeded from the warm-up's exp_avg in FSDP's
    rows), identical on every rank; each update follows from this rank's chunk of it."""
    for res in run_ranks(world, C.onebit_cases, dtype, limit, timeout=300):
        assert res["err"] < 1e-5 and res["agree"] and res["packed"], res
        assert res["upd_err"] < (1e-5 if dtype == "float32" else 2e-2), res


@pytest.mark.parametrize("world,dtype", [(2, "float32"), (3, "bfloat16")])
def test_dcp_round_trip_continues_bitwise(tmp_path, world, dtype):
    for res in run_ranks(world, C.dcp_cases, str(tmp_path / "ckpt"), dtype, timeout=300):
        assert res == {"format": "compcomm.fsdp/3", "template_sized": True,
                       "errors_saved": True, "bitwise": True, "moved": True}


def test_bad_arguments():
    for res in run_ranks(2, C.bad_cases, timeout=300):
        assert res["mode"].startswith("ValueError") and "'mode'" in res["mode"], res
        assert res["default_mode"] == "momentum", res
        assert res["beta1"].startswith("ValueError") and "'beta1'" in res["beta1"], res
        assert res["hsdp"].startswith("UnsupportedError") and "replicate_group" in res["hsdp"]
        assert res["betas"].startswith("ValueError") and "'betas'" in res["betas"], res
        assert "ValueError" in res["no_optimizer"] and "[rank " in res["no_optimizer"], res
        assert "freeze_step" in res["no_optimizer"], res
        assert res["old_into_momentum"].startswith("ValueError") and "mode" in res["old_into_momentum"]


@pytest.mark.parametrize("world", [2, 3])
def test_equals_unsharded_onebitadam_where_layouts_coincide(world):
    for res in run_ranks(world, C.unsharded_cases, timeout=300):
        assert res["keys"] == ["<root>#0", "<root>#1"], res
        assert max(res["errs"]) < 1e-5, res


class _Source:
    """The momentum mode's side of FrozenVarianceAdam (bind / take / give), without FSDP."""

    def __init__(self) -> None:
        self.m = {}

    def bind(self, opt, b1) -> None:
        pass

    def take(self, p):
        return self.m.pop(id(p), None)

    def give(self, p, m) -> None:
        self.m[id(p)] = m

    def holds(self, p) -> bool:
        return id(p) in self.m


class _State:
    warmup_steps = 2

    def __init__(self) -> None:
        self.momentum = _Source()


def _given_momentum_run(device):
    """FrozenVarianceAdam(freeze_step=2) on plain tensors whose frozen steps take a given fp32
    momentum (as the momentum mode hands it over): the parameters after each step."""
    import torch

    from compcomm.fsdp import FrozenVarianceAdam

    torch.manual_seed(0)
    ps = [torch.randn(37, 5).to(device), torch.randn(11).to(device)]  # the same values anywhere
    st = _State()
    kw = dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.05)
    opt = FrozenVarianceAdam(ps, freeze_step=st, **kw)
    out, ms = [], []
    g = torch.Generator().manual_seed(1)
    for t in range(5):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g).to(device)
            if t >= 2:
                m = torch.randn(p.shape, generator=g).to(device)
                st.momentum.give(p, m)
                ms.append(m.cpu().double())
        before = [p.detach().cpu().double().clone() for p in ps]
        opt.step()
        out.append(([p.detach().cpu().double().clone() for p in ps], before))
    vs = [opt.state[p]["exp_avg_sq"].cpu().double() for p in ps]
    return out, ms, vs, kw


def test_given_momentum_update_rule():
    """The frozen step with a given momentum: p*(1-lr*wd) - lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^2)
    + eps), float64 reference; exp_avg keeps the given values; a missing one raises."""
    import math

    import torch

    from compcomm.fsdp import FrozenVarianceAdam

    out, ms, vs, kw = _given_momentum_run("cpu")
    b1, b2 = kw["betas"]
    for t in (2, 3, 4):
        after, before = out[t]
        for i, (a, b) in enumerate(zip(after, before)):
            m = ms[2 * (t - 2) + i]
            want = b * (1 - kw["lr"] * kw["weight_decay"]) - kw["lr"] / (1 - b1 ** (t + 1)) * m / (
                vs[i].sqrt() / math.sqrt(1 - b2 ** 2) + kw["eps"])
            assert float((a - want).abs().max() / want.abs().max()) < 1e-6
    p = [torch.zeros(3)]
    opt = FrozenVarianceAdam(p, freeze_step=_State())
    for _ in range(2):
        p[0].grad = torch.ones(3)
        opt.step()
    p[0].grad = torch.ones(3)
    with pytest.raises(RuntimeError, match="no momentum"):
        opt.step()


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_cuda_given_momentum_matches_cpu():
    """On a GPU the frozen step with a given momentum takes the foreach path: it agrees with the
    CPU's per-tensor ops to fp32 rounding."""
    cpu, _, _, _ = _given_momentum_run("cpu")
    gpu, _, _, _ = _given_momentum_run("cuda")
    for (a, _), (b, _) in zip(cpu, gpu):
        for x, y in zip(a, b):
            assert float((x - y).abs().max() / x.abs().max()) < 1e-6


def test_review_fixes():
    """Issue 16: several bound optimizers, a parameter in none, accumulation refused before the
    momentum changes, a group's freeze_step checked at construction and at load."""
    for res in run_ranks(2, C.review_cases, timeout=300):
        assert res["two_err"] < 1e-5, res
        assert "[rank " in res["missing"] and "every parameter" in res["missing"], res
        assert "set_requires_gradient_sync" in res["accum"] and "[rank " in res["accum"], res
        assert res["accum_unchanged"], res
        assert "group 0" in res["group"] and "warmup_steps=2" in res["group"], res
        assert "group 0" in res["group_load"], res


def test_default_mode_checks():
    """Issue 16: the momentum mode without a bound FrozenVarianceAdam fails at the first warm-up
    reduction (not at the switch); onebit(optimizer=) must be FrozenVarianceAdam there; FSDP's
    2-D (HSDP) mesh defaults to the gradient mode and refuses the momentum mode."""
    for res in run_ranks(2, C.default_mode_cases, timeout=300):
        assert res["adamw"].startswith("ValueError") and "[rank " in res["adamw"], res
        assert "FrozenVarianceAdam" in res["adamw"] and "mode='gradient'" in res["adamw"], res
        assert res["steps"] == {}, res
        assert res["optimizer"].startswith("ValueError") and "'optimizer'" in res["optimizer"]
        assert res["hsdp_mode"] == "gradient", res
        assert res["hsdp_momentum"].startswith("UnsupportedError"), res


@pytest.mark.parametrize("mode", ["momentum", "local_momentum", "gradient"])
def test_every_rank_loading_rank0s_state_resets_on_every_rank(mode):
    """The ranks agree on keeping a loaded state: before, rank 0 kept its momentum while the
    others reset, and the next step's collectives differed (gloo aborted; NCCL would hang). A
    state that fails its checks on one rank raises on every rank (no rank left waiting)."""
    for rank, res in enumerate(run_ranks(2, C.rank0_load_cases, mode, timeout=300)):
        assert res["bad"].startswith("ValueError") and "[rank " in res["bad"], res
        assert ("'errors'" if rank else "another rank") in res["bad"], res
        assert res["bad_unchanged"] and res["reset"], res
        assert res["step"] == "no error" and res["finite"], res


@pytest.mark.parametrize("mode", ["momentum", "local_momentum"])
def test_parameter_without_a_warmup_gradient_switches_with_its_module(mode):
    for res in run_ranks(2, C.skipped_warmup_cases, mode, timeout=240):
        assert [untaken for _, untaken in res] == [False] * 5, res
        assert [took for took, _ in res[2:]] == [True] * 3, res  # the 1-bit steps
