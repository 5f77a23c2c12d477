"""compcomm.fsdp.FrozenVarianceAdam: AdamW on FSDP2's DTensor shards with the variance frozen from
``freeze_step`` (the optimizer of compcomm.fsdp.onebit's 1-bit phase)."""

from __future__ import annotations

import pytest
import torch

import _fsdp_optim_cases as C
from compcomm.fsdp import FrozenVarianceAdam
from compcomm.testing import run_ranks


@pytest.mark.parametrize("world,dtype", [(2, "float32"), (3, "float32"), (2, "bfloat16")])
def test_warmup_is_adamw_then_variance_frozen(world, dtype):
    for res in run_ranks(world, C.optim_cases, dtype, timeout=300):
        assert res["warmup_bitwise"] and res["then_differs"], res
        assert res["v_frozen"] and res["v_moved"] and res["states_are_dtensors"], res
        # float64 reference fed with the same gradients: fp32 (bf16) rounding over 6 steps
        assert res["ref_err"] < (1e-5 if dtype == "float32" else 3e-2), res


def test_onebit_pairing_dcp_round_trip(tmp_path):
    for res in run_ranks(2, C.onebit_dcp_cases, str(tmp_path / "ckpt"), timeout=300):
        assert res == {"freeze_step": 2, "loaded_freeze_step": 2, "bitwise": True,
                       "moved": True}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_plain_tensors_warmup_equals_adamw(dtype):
    """Without FSDP (plain tensors, one process): the warm-up is torch.optim.AdamW bit for bit,
    including a parameter that skips a step (no gradient)."""
    torch.manual_seed(0)
    ps = [torch.randn(37, 5).to(dtype), torch.randn(11).to(dtype)]
    qs = [p.clone() for p in ps]
    kw = dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.05)
    ref = torch.optim.AdamW(ps, **kw)
    opt = FrozenVarianceAdam(qs, freeze_step=4, **kw)
    for t in range(4):
        for i, (p, q) in enumerate(zip(ps, qs)):
            g = torch.randn(p.shape).to(dtype) if not (i == 1 and t == 2) else None
            p.grad, q.grad = g, (None if g is None else g.clone())
        ref.step()
        opt.step()
        for p, q in zip(ps, qs):
            assert torch.equal(p, q)
    assert float(opt.state[qs[0]]["step"]) == 4 and float(opt.state[qs[1]]["step"]) == 3
    assert opt.variance_frozen(qs[0]) and not opt.variance_frozen(qs[1])
    v = opt.state[qs[0]]["exp_avg_sq"].clone()
    qs[0].grad = torch.randn(qs[0].shape).to(dtype)
    qs[1].grad = None
    opt.step()
    assert torch.equal(v, opt.state[qs[0]]["exp_avg_sq"])


def test_bad_arguments():
    p = [torch.zeros(3, requires_grad=True)]
    with pytest.raises(TypeError, match="freeze_step"):
        FrozenVarianceAdam(p, freeze_step=None)
    with pytest.raises(ValueError, match="freeze_step"):
        FrozenVarianceAdam(p, freeze_step=0)
    with pytest.raises(TypeError, match="freeze_step"):
        FrozenVarianceAdam(p, freeze_step=True)
    with pytest.raises(ValueError, match="'lr'"):
        FrozenVarianceAdam(p, lr=-1.0, freeze_step=1)
    with pytest.raises(ValueError, match=r"betas\[1\]"):
        FrozenVarianceAdam(p, betas=(0.9, 1.0), freeze_step=1)
    with pytest.raises(TypeError, match="betas"):
        FrozenVarianceAdam(p, betas=0.9, freeze_step=1)
    with pytest.raises(ValueError, match="weight_decay"):
        FrozenVarianceAdam(p, weight_decay=-0.1, freeze_step=1)
    with pytest.raises(TypeError, match="'eps'"):
        FrozenVarianceAdam(p, eps=float("nan"), freeze_step=1)
    with pytest.raises(TypeError, match="params"):
        FrozenVarianceAdam([torch.zeros(3, dtype=torch.int64)], freeze_step=1)
    with pytest.raises(ValueError, match="freeze_step"):
        FrozenVarianceAdam([{"params": p, "freeze_step": -2}], freeze_step=1)
    with pytest.raises(ValueError, match="'p'"):
        FrozenVarianceAdam(p, freeze_step=1).variance_frozen(torch.zeros(1))

    class State:  # what compcomm.fsdp.onebit returns, as far as the optimizer reads it
        warmup_steps = 7
    assert FrozenVarianceAdam(p, freeze_step=State()).param_groups[0]["freeze_step"] == 7


def test_failed_step_changes_no_group():
    """Momentum mode: a frozen parameter of group 1 has no momentum: step() raises and group 0,
    whose momentum was there, is not updated either (it was); the momentum is given back, so the
    step succeeds once the other one arrives."""
    from compcomm.fsdp import OneBitFSDP

    ctrl = OneBitFSDP(warmup_steps=1, mode="momentum")
    p0, p1 = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    opt = FrozenVarianceAdam([{"params": [p0]}, {"params": [p1], "weight_decay": 0.0}], lr=0.1,
                             freeze_step=ctrl)
    for p in (p0, p1):
        p.grad = torch.full((4,), 0.5)
    opt.step()  # the warm-up step
    before = [(p.detach().clone(), opt.state[p]["exp_avg"].clone(), float(opt.state[p]["step"]))
              for p in (p0, p1)]
    ctrl.momentum.give(p0, torch.full((4,), 0.3))
    with pytest.raises(RuntimeError, match="parameter 0 of param group 1 has no momentum"):
        opt.step()
    for p, (w, m, t) in zip((p0, p1), before):
        assert torch.equal(p.detach(), w) and torch.equal(opt.state[p]["exp_avg"], m)
        assert float(opt.state[p]["step"]) == t
    ctrl.momentum.give(p1, torch.full((4,), 0.3))
    opt.step()
    assert not torch.equal(p0.detach(), before[0][0]) and float(opt.state[p1]["step"]) == 2


def test_add_param_group_checks_the_group():
    """add_param_group takes the OneBitFSDP state as freeze_step (as the constructor does) and
    refuses a bad group before it is added, not in a later step() after other groups moved."""
    from compcomm.fsdp import OneBitFSDP

    ctrl = OneBitFSDP(warmup_steps=3)
    p0, p1 = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    opt = FrozenVarianceAdam([p0], lr=0.1, freeze_step=ctrl)
    opt.add_param_group({"params": [p1], "freeze_step": ctrl})
    assert opt.param_groups[1]["freeze_step"] == 3
    for bad, err in (({"params": [torch.zeros(2, dtype=torch.int32)]}, TypeError),
                     ({"params": [torch.zeros(2)], "freeze_step": 0}, ValueError)):
        with pytest.raises(err):
            opt.add_param_group(bad)
    assert len(opt.param_groups) == 2
    for p in (p0, p1):
        p.grad = torch.full((4,), 0.5)
    opt.step()
    mom = FrozenVarianceAdam([torch.nn.Parameter(torch.ones(2))], freeze_step=OneBitFSDP(
        warmup_steps=2, mode="momentum"))
    with pytest.raises(ValueError, match="b1"):
        mom.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], "betas": (0.8, 0.9)})
    with pytest.raises(ValueError, match="freeze_step=5"):
        mom.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], "freeze_step": 5})
    assert len(mom.param_groups) == 1


@pytest.mark.parametrize("world,dtype,limit", [(2, "float32", 0), (3, "float32", 0),
                                               (2, "bfloat16", 0), (3, "float32", 100),
                                               (2, "float32", None)])
def test_segments_are_the_chunk_layout(world, dtype, limit):
    """FSDP2's real reduce-scatter input through compcomm.fsdp.onebit's segments: each rank's
    shard equals the numpy reference segment by segment (own scales, own carried errors)."""
    # the parameters in FSDP's order: weight 7x13, bias 7, LayerNorm weight 7 and bias 7, 5x7
    piece = lambda n0, rest: -(-n0 // world) * rest  # noqa: E731
    pieces = [piece(7, 13), piece(7, 1), piece(7, 1), piece(7, 1), piece(5, 7)]
    want = {0: pieces, None: [sum(pieces)],
            100: [pieces[0], sum(pieces[1:])]}[limit]  # 117 > 100 alone; 9+9+9+42 <= 100
    for res in run_ranks(world, C.segment_cases, dtype, limit, timeout=300):
        assert res["segments"] == want, res
        assert res["err"] < (1e-5 if dtype == "float32" else 1e-2), res
        assert res["one_scale_each"] and res["batched_equals_unbatched"], res
        n = len(want)
        assert res["keys"] == (["<root>"] if n == 1 else sorted(f"<root>#{k}" for k in range(n)))


def test_hsdp_replica_hook_segments():
    """The cross-replica all-reduce hook: exact average in the warm-up, then the 1-bit
    compressed allreduce of each segment (W=2 replicas of a 1-rank FSDP shard)."""
    for res in run_ranks(2, C.replica_cases, timeout=300):
        assert res["segments"] == 5 and res["steps"] == {"<root>/replicas": 2}, res
        assert res["warmup_err"] < 1e-6 and res["onebit_err"] < 1e-5, res


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_warmup_equals_adamw_and_frozen_phase_matches_cpu():
    """On a GPU: the warm-up is torch's AdamW (its foreach path) bit for bit; the frozen phase
    (foreach ops there, per-tensor ops on the CPU) agrees with the CPU run to fp32 rounding."""
    torch.manual_seed(0)
    cpu = [torch.randn(300, 7), torch.randn(5)]
    gpu, ref = [p.cuda() for p in cpu], [p.cuda() for p in cpu]
    kw = dict(lr=1e-2, weight_decay=0.1)
    opts = [FrozenVarianceAdam(cpu, freeze_step=3, **kw), FrozenVarianceAdam(gpu, freeze_step=3, **kw),
            torch.optim.AdamW(ref, **kw)]
    for t in range(7):
        gs = [torch.randn(p.shape) for p in cpu]
        for ps in (cpu, gpu, ref):
            for p, g in zip(ps, gs):
                p.grad = g.to(p.device)
        for o in opts[:2] + (opts[2:] if t < 3 else []):
            o.step()
        if t < 3:
            assert all(torch.equal(a, b) for a, b in zip(gpu, ref))
    for a, b in zip(gpu, cpu):
        assert float((a.cpu() - b).abs().max()) <= 1e-5 * float(b.abs().max())


def test_state_format_2_and_format_1_loading():
    """Error buffers per segment are format 2 (3 adds the mode); a format-1 state (one pair per module) loads only
    into a state with one segment per module, else a ValueError that says so (nothing changed)."""
    from compcomm.fsdp import STATE_FORMAT, OneBitFSDP

    old = {"format": "compcomm.fsdp/1", "rank": 0, "world": 1, "steps": {"m": 3},
           "errors": {"m": [torch.ones(16), torch.ones(16)]}}
    seg = OneBitFSDP(2)
    with pytest.raises(ValueError, match="segment_elements=None"):
        seg.load_state_dict(old)
    assert seg.steps == {} and seg.state_dict()["format"] == STATE_FORMAT == "compcomm.fsdp/3"
    flat = OneBitFSDP(2, segment_elements=None)
    flat.load_state_dict(old)
    assert flat.steps == {"m": 3} and torch.equal(flat.state_dict()["errors"]["m"][0], torch.ones(16))
    with pytest.raises(ValueError, match="segment_elements=None"):  # and the other way round
        seg.load_state_dict(flat.state_dict())
    with pytest.raises(ValueError, match="'sd'"):
        seg.load_state_dict({"format": "something else"})
    with pytest.raises(ValueError, match="segment_elements"):
        OneBitFSDP(2, segment_elements=-1)
    with pytest.raises(ValueError, match="segment_elements"):
        OneBitFSDP(2, segment_elements=1.5)


@pytest.mark.parametrize("world", [2, 3])
def test_batched_reduce_scatter_exchange(world):
    """The C++ batched reduce-scatter exchange equals one compressed_reduce_scatter per call, bit
    for bit (outputs and both errors, two rounds); a count mismatch raises on every rank."""
    for res in run_ranks(world, C.batch_rs_cases, timeout=300):
        assert res == {"same": True, "mismatch": True, "untouched": True}, res


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_batched_reduce_scatter_exchange_cuda():
    """On a CUDA device (world size 1, the local communicator): the batched exchange equals one
    compressed_reduce_scatter per call, and its outputs and errors equal the CPU twin's bit for bit."""
    gpu, cpu = C.batch_rs_cases(0, 1, "cuda"), C.batch_rs_cases(0, 1, "cpu")
    assert gpu["same"] and cpu["same"]
    assert all(torch.equal(a, b) for a, b in zip(gpu["outs"], cpu["outs"]))


@pytest.mark.parametrize("world", [2, 3])
def test_gradient_mode_nonfinite_gradient_as_fsdps_own(world):
    """Gradient mode, 1-bit phase: a non-finite gradient (fp16 overflow under a GradScaler) gives
    non-finite gradients, as FSDP's own reduce-scatter does, so the scaler skips the step; before,
    NonFiniteError came out of backward() and left FSDP unsharded. No error buffer moved, also
    with one exchange per segment whose earlier segments had committed."""
    for res in run_ranks(world, C.nonfinite_cases, timeout=300):
        for case, r in res.items():
            assert r == {"finite": False, "steps": True, "errors": True, "moved": True,
                         "next": True}, (case, r)


@pytest.mark.parametrize("mode", ["gradient", "momentum", "local_momentum"])
def test_load_state_dict_checks_everything_before_changing(mode):
    """A state lacking an entry, or with a malformed one, raises ValueError naming the key and
    changes nothing (before: the step counts were replaced, then KeyError or AttributeError)."""
    from compcomm.fsdp import OneBitFSDP

    st = OneBitFSDP(warmup_steps=5, mode=mode)
    st.steps = {"blk": 3}
    good = st.state_dict()
    st.load_state_dict(good)
    cases = [("errors", None), ("errors", {"blk#0": [None, None]}), ("errors", [1]),
             ("steps", None), ("steps", {"blk": -1}), ("rank", None), ("world", None)]
    cases += {"momentum": [("momentum", None), ("momentum", {"blk#0": {"signs": None}})],
              "local_momentum": [("local_momentum", None)], "gradient": []}[mode]
    for key, value in cases:
        bad = {k: v for k, v in good.items() if k != key}
        if value is not None:
            bad[key] = value
        if key != "steps":
            bad["steps"] = {"blk": 100}
        with pytest.raises(ValueError, match=f"'{key}'"):
            st.load_state_dict(bad)
        assert st.steps == {"blk": 3}, (key, value)


def test_momentum_modes_at_one_rank_use_each_parameters_own_momentum():
    assert run_ranks(1, C.one_rank_momentum_cases, timeout=240) == [
        {"None": True, "local_momentum": True}]


def test_parameter_sharded_on_dim_1():
    for res in run_ranks(2, C.shard_dim1_cases, timeout=240):
        assert res["keys"] == ["<root>"] and res["pieces"] == [42, 14], res
        assert res["err"] < 1e-6, res
