"""compcomm.optim: OneBitAdam, ZeroOneAdam, OneBitLamb against step-by-step numpy references of
ONEBIT_SPEC.md (W = 1..4), AdamW equivalence of the warm-up, masks, schedules, checkpoints in both
modes, GradScaler, fp16/bf16 and the DDP hook. Multi-rank cases are batched: one spawn per world
size (tests/_optim_cases.py holds the rank bodies)."""

from __future__ import annotations

import functools
import io
import warnings

import numpy as np
import pytest
import torch

import _optim_cases as C
import optim_reference as R
from compcomm.errors import UnsupportedError
from compcomm.optim import OneBitAdam, OneBitLamb, ZeroOneAdam
from compcomm.testing import run_ranks

WORLDS = [1, 2, 3, 4]
EXTRAS_WORLD = 2  # checkpoint, GradScaler, dtype and DDP cases run at this world size
TRAJ_ATOL = 5e-5  # params are O(1); float32 rounding differences accumulate over the steps


@functools.lru_cache(maxsize=None)
def results(world: int):
    if world == 1:
        return [C.all_cases(0, 1, False)]
    return run_ranks(world, C.all_cases, world == EXTRAS_WORLD, timeout=240)


def max_diff(per_rank, ref):
    return max(float(np.max(np.abs(a - b)))
               for r, traj in enumerate(per_rank) for t, ps in enumerate(traj)
               for a, b in zip(ps, ref[t][r]))


@pytest.mark.parametrize("world", WORLDS)
def test_onebit_adam_matches_reference(world):
    outs = results(world)
    ref = R.onebit_adam(C.make_params(), C.make_grads(10, world), lr=0.01, freeze_step=4,
                        wd=0.01, masks=C.masks_for())
    assert max_diff([o["traj"]["adam"] for o in outs], ref) < TRAJ_ATOL
    # the compressed phase moved the parameters away from plain Adam (compression is real)
    if world > 1:
        plain = R.onebit_adam(C.make_params(), C.make_grads(10, world), lr=0.01, freeze_step=100,
                              wd=0.01)
        assert max_diff([o["traj"]["adam"] for o in outs], plain) > 1e-4
    for o in outs:  # exp_avg_mask zeroes the masked momentum rows; state is fp32
        assert np.all(o["traj"]["adam_m0"][2:4] == 0)
        assert np.any(o["traj"]["adam_m0"][:2] != 0)
        assert o["traj"]["adam_dtype"] == "torch.float32"


@pytest.mark.parametrize("world", WORLDS)
def test_fused_onebit_adam_matches_reference(world):
    outs = results(world)
    ref = R.onebit_adam(C.make_params(), C.make_grads(10, world), lr=0.01, freeze_step=4,
                        fused=True)
    assert max_diff([o["traj"]["adam_fused"] for o in outs], ref) < TRAJ_ATOL
    if world > 1:  # fused differs from per-parameter compression (different scales)
        per_param = R.onebit_adam(C.make_params(), C.make_grads(10, world), lr=0.01,
                                  freeze_step=4)
        assert max_diff([o["traj"]["adam_fused"] for o in outs], per_param) > 1e-6
    ref_z, _ = R.zero_one_adam(C.make_params(), C.make_grads(14, world, seed=2), lr=0.01,
                               fused=True, **C.Z1)
    assert max_diff([o["traj"]["zoadam_fused"] for o in outs], ref_z) < TRAJ_ATOL


@pytest.mark.parametrize("world", WORLDS)
def test_bucketed_layouts_match_reference(world):
    """The default layout (buckets of reduce_bucket_size elements) equals the numpy reference
    compressing each bucket as one tensor; per_parameter=True equals per-tensor compression."""
    outs = results(world)
    params, grads = C.make_params(), C.make_grads(10, world)
    fused = R.onebit_adam(params, grads, lr=0.01, freeze_step=4, fused=True)
    assert max_diff([o["traj"]["adam_default"] for o in outs], fused) < TRAJ_ATOL
    b40 = R.onebit_adam(params, grads, lr=0.01, freeze_step=4, buckets=[[0], [1, 2]])
    assert max_diff([o["traj"]["adam_buckets40"] for o in outs], b40) < TRAJ_ATOL
    per = R.onebit_adam(params, grads, lr=0.01, freeze_step=4)
    assert max_diff([o["traj"]["adam_per_param"] for o in outs], per) < TRAJ_ATOL
    if world > 1:  # the layouts really differ (different scales per bucket)
        assert max_diff([o["traj"]["adam_buckets40"] for o in outs], fused) > 1e-6
        assert max_diff([o["traj"]["adam_buckets40"] for o in outs], per) > 1e-6
    ref_z, _ = R.zero_one_adam(params, C.make_grads(14, world, seed=2), lr=0.01,
                               buckets=[[0], [1, 2]], **C.Z1)
    assert max_diff([o["traj"]["zoadam_buckets40"] for o in outs], ref_z) < TRAJ_ATOL


@pytest.mark.parametrize("world", WORLDS)
def test_zero_one_adam_matches_reference_and_schedule(world):
    outs = results(world)
    # The defaults are the spec's (DeepSpeed's) numerics: weight decay kept in the rebuilt momentum.
    ref, kinds = R.zero_one_adam(C.make_params(), C.make_grads(14, world, seed=2), lr=0.01,
                                 wd=0.01, **C.Z1)
    # the spec's timeline for this config (DeepSpeed user steps; step 1 = init call there)
    assert kinds == ["var", "var", "grad1bit", "var", "grad1bit", "sync", "local", "sync",
                     "local", "sync", "local", "sync", "local", "sync"]
    for o in outs:
        assert o["traj"]["zoadam_kinds"] == kinds
    assert max_diff([o["traj"]["zoadam"] for o in outs], ref) < TRAJ_ATOL
    # wd_in_momentum=False: the weight-decay term is taken out of the rebuilt momentum.
    ref_fixed, _ = R.zero_one_adam(C.make_params(), C.make_grads(14, world, seed=2), lr=0.01,
                                   wd=0.01, wd_in_momentum=False, **C.Z1)
    assert max_diff([o["traj"]["zoadam_wd_fixed"] for o in outs], ref_fixed) < TRAJ_ATOL
    assert max_diff([o["traj"]["zoadam"] for o in outs], ref_fixed) > 20 * TRAJ_ATOL


def _run_single(cls, kw, steps=40, seed=5):
    """One rank: a quadratic-ish problem with fresh gradients every step; the parameters after
    every step (float64 copies)."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(64, generator=gen))
    target = torch.randn(64, generator=gen)
    opt = cls([p], **kw)
    out = []
    for _ in range(steps):
        noise = 0.1 * torch.randn(64, generator=gen)
        p.grad = (p.detach() - target) + noise
        opt.step()
        out.append(p.detach().double().clone())
    return torch.stack(out)


def test_zero_one_adam_syncing_every_step_is_onebit_adam_with_weight_decay():
    # One rank (compression is the identity), variance updated every step of the variance phase
    # (last variance step: var_freeze_step+1), then local steps that sync every step: 0/1 Adam is
    # then exactly 1-bit Adam frozen after the same step -- weight decay included. DeepSpeed's sync
    # rebuilt the momentum with the weight-decay term in it (~10x the decay at beta1=0.9).
    # (bias_correction=False: with True, ZeroOneAdam freezes the momentum's correction factor too.)
    common = dict(lr=0.05, weight_decay=0.2)
    zo = dict(var_freeze_step=9, var_update_scaler=10**6, local_step_scaler=10**6,
              local_step_clipper=1, **common)
    ref = _run_single(OneBitAdam, dict(freeze_step=10, **common))
    got = _run_single(ZeroOneAdam, dict(zo, wd_in_momentum=False))
    assert float((got - ref).abs().max()) < 1e-5
    ds = _run_single(ZeroOneAdam, zo)  # the default: DeepSpeed's sync
    assert float((ds - ref).abs().max()) > 1e-3


@pytest.mark.parametrize("world", WORLDS)
def test_onebit_lamb_matches_reference(world):
    outs = results(world)
    ref = R.onebit_lamb(C.make_params(), C.make_grads(10, world, seed=3), lr=0.01, freeze_step=4,
                        wd=0.01)
    assert max_diff([o["traj"]["lamb"] for o in outs], ref) < TRAJ_ATOL
    for o in outs:
        assert len(o["traj"]["lamb_coeffs"]) == len(C.SHAPES)
        assert all(np.isfinite(o["traj"]["lamb_coeffs"]))


@pytest.mark.parametrize("world", WORLDS)
def test_bias_corrected_warmup_equals_adamw(world):
    for worst in (o["adamw"] for o in results(world)):
        assert worst < 2e-6


def test_zero_one_schedule_defaults_timeline():
    # spec c: with the defaults, variance every step for steps 2..17, then every 2nd step
    kinds = R.zero_one_schedule(60, 100000, 16, 32678, 16)
    var_steps = [t for t, k in enumerate(kinds, 1) if k == "var"]
    assert var_steps[:18] == list(range(1, 18)) + [18]
    assert var_steps[17:33] == list(range(18, 49, 2))  # 16 updates at interval 2
    assert var_steps[33:35] == [52, 56]
    opt = ZeroOneAdam([torch.nn.Parameter(torch.zeros(3))])
    seen = []
    for _ in range(60):
        seen.append(opt.step_kind())
        opt.param_groups[0]["params"][0].grad = torch.ones(3)
        opt.step()
    assert seen == kinds


def test_exact_resume_reproduces_uninterrupted_run():
    for o in results(EXTRAS_WORLD):
        ck = o["ckpt"]
        for name in ("adam", "zoadam", "lamb"):
            assert ck[f"{name}_exact_maxdiff"] == 0.0, name
            assert not ck[f"{name}_default_saved_errors"], name
            assert ck[f"{name}_default_sched_restored"], name
            assert ck[f"{name}_default_finite"], name
        assert ck["mask_new_wins"] and ck["mask_dropped"] and ck["freeze_key_after_load"]


def test_lamb_state_dict_right_after_a_load_is_the_loaded_one():
    """OneBitLamb keeps its fused momentum's padding for exact resume; saved again before any
    step, the checkpoint still holds it (a regression: 'fused_pad' is dropped, so a resume from
    the re-saved file is not exact)."""
    assert run_ranks(2, C.lamb_resave, timeout=120) == [True, True]


def test_exact_checkpoint_on_other_world_size_warns_and_resets():
    blob = results(EXTRAS_WORLD)[0]["ckpt"]["adam_exact_sd_rank0"]
    sd = torch.load(io.BytesIO(blob), weights_only=False)
    assert sd["compcomm"]["bucket_errors"] and sd["compcomm"]["bucket_plan"] == [[(0, 0), (0, 1),
                                                                                   (0, 2)]]
    ps = [torch.nn.Parameter(torch.tensor(p)) for p in C.make_params()]
    opt = OneBitAdam(ps, lr=0.01, freeze_step=3, exact_resume=True)
    with pytest.warns(RuntimeWarning, match="reset"):
        opt.load_state_dict(sd)
    assert not opt.compressor.keys() and opt._loaded_errors is None
    assert opt.sched["step"] == 7 and opt.adam_freeze_key


@pytest.mark.parametrize("world", [1, 3])
def test_nonfinite_on_one_rank_skips_every_phase(world):
    """Issue 14: a NaN on one rank in warm-up, compressed, variance, 1-bit-gradient, local and sync
    steps skips the step on every rank with nothing changed; the run goes on as if the step never
    happened."""
    outs = [C.nonfinite_skips(0, 1)] if world == 1 else run_ranks(world, C.nonfinite_skips,
                                                                     timeout=240)
    for res in outs:
        assert res["zoadam_var_kind"] == "var" and res["zoadam_grad1bit_kind"] == "grad1bit"
        assert res["zoadam_sync_kind"] == "sync" and res["zoadam_local_kind"] == "local"
        for key, value in res.items():
            if key.endswith("_unchanged"):
                assert value is True, key
            elif key.endswith("_then_clean"):
                assert value == 0.0, (key, value)


def test_checkpoint_without_schedule_resumes_zero_one_adam_exactly():
    """A checkpoint without compcomm's schedule (DeepSpeed style: only the step counts) resumes
    0/1 Adam exactly: the schedule is replayed from the step count (it restarted in the variance
    phase, rewriting the frozen variance)."""
    def make():
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(8))
        return p, ZeroOneAdam([p], lr=1e-2, var_freeze_step=2, local_step_scaler=1,
                              local_step_clipper=4)

    def grad(p, t):
        p.grad = torch.randn(8, generator=torch.Generator().manual_seed(t))

    p, opt = make()
    for t in range(10):
        grad(p, t)
        opt.step()
    straight = p.detach().clone()
    p, opt = make()
    for t in range(5):
        grad(p, t)
        opt.step()
    sd = opt.state_dict()
    del sd["compcomm"]["sched"]
    q, opt2 = make()
    with torch.no_grad():
        q.copy_(p)
    opt2.load_state_dict(sd)
    assert opt2.sched == opt.sched
    for t in range(5, 10):
        grad(q, t)
        opt2.step()
    assert torch.equal(q.detach(), straight)


def test_skipped_step_that_changes_the_plan_keeps_the_errors():
    """A skipped step (NaN on one rank) where a parameter had no gradient: the error buffers
    survive (the new bucket plan had reset them before the exchange failed)."""
    for res in run_ranks(2, C.skip_while_the_plan_changes, timeout=240):
        assert res == {"adam_unchanged": True, "adam_then_clean": 0.0, "zoadam_unchanged": True,
                       "zoadam_then_clean": 0.0}, res


def test_exact_resume_just_before_the_freeze():
    for diffs in run_ranks(2, C.resume_across_freeze, timeout=120):
        assert diffs == [0.0, 0.0, 0.0], diffs


def test_local_failure_while_staging_breaks_nothing_and_refuses_after():
    res = run_ranks(2, C.staging_failure, timeout=120)
    assert res[0]["raised"] == "MemoryError" and res[1]["raised"] in ("CommTimeoutError", "BackendError")
    assert all(r["unchanged"] and r["no_errors_kept"] for r in res)
    assert res[0]["again"] == "CommError"


def test_checkpoint_of_the_per_parameter_layout_still_loads():
    for res in run_ranks(2, C.legacy_checkpoint, timeout=120):
        assert res["restored"] == res["want"] and len(res["want"]) == 3
        assert res["equal"] and res["reset_warned"]


def test_grad_scaler_overflow_skips_on_all_ranks():
    for o in results(EXTRAS_WORLD):
        amp = o["amp"]
        assert amp["skipped_params_same"] and amp["skipped_errors_same"]
        assert amp["skipped_step_same"] and amp["next_step_ran"]


@pytest.mark.parametrize("name", ["OneBitAdam", "ZeroOneAdam", "OneBitLamb"])
def test_low_precision_params_keep_fp32_state(name):
    for o in results(EXTRAS_WORLD):
        amp = o["amp"]
        for dt, tol in (("torch.bfloat16", 0.05), ("torch.float16", 0.01)):
            assert amp[f"{name}_{dt}_state_fp32"]
            assert amp[f"{name}_{dt}_close_to_fp32"] < tol


def test_ddp_hook_matches_optimizer_averaging():
    for o in results(EXTRAS_WORLD):
        d = o["ddp"]
        for name in ("OneBitAdam", "ZeroOneAdam"):
            assert d[f"{name}_maxdiff"] < 1e-6
            assert d[f"{name}_local_grads"]


# ---------------------------------------------------------------------------------------------
# single process: arguments and edge cases
# ---------------------------------------------------------------------------------------------
def _p(*shape):
    return torch.nn.Parameter(torch.randn(*shape))


@pytest.mark.parametrize("cls", [OneBitAdam, ZeroOneAdam, OneBitLamb])
def test_bad_arguments_raise(cls):
    with pytest.raises(ValueError, match="'lr'"):
        cls([_p(3)], lr=-1.0)
    with pytest.raises(UnsupportedError, match="amsgrad"):
        cls([_p(3)], amsgrad=True)
    with pytest.raises(ValueError, match="betas"):
        cls([_p(3)], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="exp_avg_mask"):
        cls([{"params": [_p(3, 4)], "exp_avg_mask": torch.ones(5)}])
    with pytest.raises(ValueError, match="comm_backend_name"):
        cls([_p(3)], comm_backend_name="carrier-pigeon")
    # the rank is named; non-finite values, a bare number for betas, per-group values, unknown
    # keys and float64 parameters are refused when the optimizer is built (before any step)
    with pytest.raises(ValueError,
                       match=rf"^\[rank 0\] {cls.__name__}: argument 'lr' must be a finite"):
        cls([_p(3)], lr=float("inf"))
    with pytest.raises(ValueError, match="argument 'weight_decay' must be a finite"):
        cls([_p(3)], weight_decay=float("inf"))
    with pytest.raises(TypeError, match=r"\[rank 0\].*argument 'betas' must be a pair"):
        cls([_p(3)], betas=0.9)
    with pytest.raises(TypeError, match="argument 'eps' must be a number"):
        cls([_p(3)], eps="1e-8")
    with pytest.raises(ValueError,
                       match=r"param group 1: 'lr' must be a finite number >= 0, got -0.5"):
        cls([{"params": [_p(3)]}, {"params": [_p(2)], "lr": -0.5}])
    with pytest.raises(ValueError, match=r"param group 0: 'betas' must be two numbers"):
        cls([{"params": [_p(3)], "betas": (0.9, 0.999, 0.5)}])
    with pytest.raises(ValueError, match=r"param group 0 has key 'weight_decy': did you mean "
                       r"'weight_decay'\?"):
        cls([{"params": [_p(3)], "weight_decy": 0.1}])
    cls([{"params": [_p(3)], "lr_scale": 0.5, "max_lr": 1.0}])  # keys of the caller's: allowed
    with pytest.raises(TypeError, match=r"param group 0: parameter 1 is torch.float64"):
        cls([_p(3), torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))])
    opt = cls([_p(3)])  # add_param_group after construction: checked too, nothing added on error
    with pytest.raises(TypeError, match=r"param group 1: parameter 0 is torch.float64"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))]})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [_p(2)], "lr": 0.5, "name": "head"})
    assert len(opt.param_groups) == 2


def test_bad_schedule_arguments_raise():
    with pytest.raises(ValueError, match="'freeze_step'"):
        OneBitAdam([_p(3)], freeze_step=-1)
    with pytest.raises(ValueError, match="'freeze_step'"):
        OneBitLamb([_p(3)], freeze_step=-1)
    with pytest.raises(ValueError, match="'var_freeze_step'"):
        ZeroOneAdam([_p(3)], var_freeze_step=-1)
    with pytest.raises(ValueError, match="'local_step_clipper'"):
        ZeroOneAdam([_p(3)], local_step_clipper=0)
    with pytest.raises(ValueError, match="'min_coeff'"):
        OneBitLamb([_p(3)], min_coeff=2.0, max_coeff=1.0)
    with pytest.raises(ValueError, match="'max_coeff' must be a finite number > 0"):
        OneBitLamb([_p(3)], max_coeff=float("inf"))
    with pytest.raises(TypeError, match="'coeff_beta' must be a number"):
        OneBitLamb([_p(3)], coeff_beta="0.9")
    with pytest.raises(ValueError, match="'factor_threshold' must be a finite number"):
        OneBitLamb([_p(3)], factor_threshold=float("nan"))


def test_unavailable_backend_raises_unsupported():
    import compcomm

    for name in ("mpi", "nccl"):
        if name not in compcomm.available_backends() or not hasattr(compcomm, "init"):
            with pytest.raises(UnsupportedError, match=name):
                OneBitAdam([_p(3)], comm_backend_name=name)


def test_first_step_is_a_real_step_and_empty_params_are_skipped():
    for cls in (OneBitAdam, ZeroOneAdam, OneBitLamb):
        p, e = _p(4), torch.nn.Parameter(torch.zeros(0))
        before = p.detach().clone()
        opt = cls([p, e], lr=0.1)
        p.grad, e.grad = torch.ones(4), torch.zeros(0)
        opt.step()
        assert not torch.equal(before, p.detach()), cls.__name__
        assert e.numel() == 0


def test_lamb_zero_momentum_gets_scaling_coeff_one():
    p, z = _p(8), torch.nn.Parameter(torch.ones(5))
    opt = OneBitLamb([p, z], lr=0.01, freeze_step=2)
    for _ in range(4):
        p.grad, z.grad = torch.randn(8), torch.zeros(5)
        opt.step()
    assert opt.state[z]["scaling_coeff"] == 1.0
    assert all(np.isfinite(opt.get_lamb_coeffs()))
    assert torch.isfinite(p).all() and torch.isfinite(z).all()


def test_added_param_group_mask_is_checked_and_kept_through_a_load():
    """add_param_group checks the group's exp_avg_mask (a bad one raises and adds nothing: the
    step used to fail inside that group after updating the others), and load_state_dict keeps the
    mask of a group added after construction (it was dropped: the resumed run differed)."""
    def build():
        g = torch.Generator().manual_seed(0)
        a = torch.nn.Parameter(torch.randn(8, generator=g))
        c = torch.nn.Parameter(torch.randn(8, generator=g))
        opt = OneBitAdam([a], lr=1e-2, freeze_step=2)
        opt.add_param_group({"params": [c], "exp_avg_mask": (torch.arange(8) < 4).float()})
        return a, c, opt

    def grads(a, c, t):
        g = torch.Generator().manual_seed(t)
        a.grad, c.grad = torch.randn(8, generator=g), torch.randn(8, generator=g)

    a, c, opt = build()
    with pytest.raises(ValueError, match="param group 2: 'exp_avg_mask' of shape"):
        opt.add_param_group({"params": [_p(8)], "exp_avg_mask": torch.ones(5)})
    assert len(opt.param_groups) == 2
    for t in range(8):
        grads(a, c, t)
        opt.step()
    straight = c.detach().clone()
    a, c, opt = build()
    for t in range(4):
        grads(a, c, t)
        opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    a2, c2, opt2 = build()
    with torch.no_grad():
        a2.copy_(a)
        c2.copy_(c)
    opt2.load_state_dict(torch.load(buf, weights_only=False))
    assert "exp_avg_mask" in opt2.param_groups[1]
    for t in range(4, 8):
        grads(a2, c2, t)
        opt2.step()
    assert torch.equal(c2.detach(), straight)


def test_lamb_param_group_added_after_the_freeze_steps():
    """A parameter added in the compressed phase gets its own scaling coefficient: the steps run
    (they raised KeyError after updating the first group). The new parameter has no frozen LAMB
    coefficient (0, as in DeepSpeed, whose warm-up sets it), so only the first one moves."""
    a = _p(8)
    opt = OneBitLamb([a], lr=0.01, freeze_step=2)
    for _ in range(3):
        a.grad = torch.randn(8)
        opt.step()
    coeff_a = opt.state[a]["scaling_coeff"]
    c = _p(8)
    with pytest.warns(RuntimeWarning, match="added after the variance froze"):
        opt.add_param_group({"params": [c], "lr": 1e-3})
    for _ in range(2):
        a_before, c_before = a.detach().clone(), c.detach().clone()
        a.grad, c.grad = torch.randn(8), torch.randn(8)
        opt.step()
        assert not torch.equal(a, a_before) and torch.equal(c, c_before)
    assert opt.state[a]["scaling_coeff"] == coeff_a  # frozen once, not recomputed
    assert np.isfinite(opt.state[c]["scaling_coeff"]) and opt.sched["step"] == 5


def test_lamb_momentum_without_gradient_is_kept():
    """A compressed step where a parameter has no gradient leaves its momentum as it was (it was
    divided by its scaling coefficient without having been multiplied by it)."""
    a, b = _p(8), _p(8)
    opt = OneBitLamb([a, b], lr=0.01, freeze_step=2)
    for _ in range(3):
        a.grad, b.grad = torch.randn(8), torch.randn(8)
        opt.step()
    assert opt.state[b]["scaling_coeff"] != 1.0
    m_b, p_b = opt.state[b]["exp_avg"].clone(), b.detach().clone()
    a.grad, b.grad = torch.randn(8), None
    opt.step()
    assert torch.equal(opt.state[b]["exp_avg"], m_b) and torch.equal(b, p_b)


def test_default_state_dict_has_no_error_buffers_and_loads_into_fresh_optimizer():
    p = _p(6)
    opt = OneBitAdam([p], lr=0.01, freeze_step=1)
    for _ in range(3):
        p.grad = torch.randn(6)
        opt.step()
    sd = opt.state_dict()
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = OneBitAdam([q], lr=0.01, freeze_step=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt2.load_state_dict(sd)
    assert opt2.sched == opt.sched and opt2.adam_freeze_key
    assert torch.equal(opt2.state[q]["exp_avg"], opt.state[p]["exp_avg"])


def test_exact_checkpoint_with_resized_error_buffers_warns():
    for messages in run_ranks(2, C.resized_error_buffers, timeout=120):
        assert any("not of their buckets' sizes" in m for m in messages), messages


def test_lamb_trust_ratio_clamp_is_per_group():
    """DeepSpeed reads max_coeff/min_coeff from each param group; a group's own clamp was kept in
    the group but never read (the optimizer-wide one clamped every group)."""
    from compcomm.optim import OneBitLamb

    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(64) * 10)  # ||p|| / ||update|| is large: ratio ~ 3
    b = torch.nn.Parameter(torch.randn(64) * 10)
    opt = OneBitLamb([{"params": [a], "max_coeff": 0.3}, {"params": [b]}], lr=1e-2,
                     freeze_step=5)
    a.grad = b.grad = torch.randn(64)
    opt.step()
    ca, cb = opt.lamb_coeffs
    assert ca == 0.3 and cb > 1.0
    with pytest.raises(ValueError, match="param group 2: 'min_coeff'"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], "min_coeff": 20.0})
