"""The per-bucket cost of the 1-bit optimizers' compressed step, cut without changing a bit
(issues 12 and 13):

- the list forms of the CPU updates (``compcomm.optim.cpu_multi``: one C++ call per list) give
  the bits of the single forms, and name the bad tensor;
- the staging of a bucket plan (``optim/_staging.py``) is kept while the plan and the
  parameters' shapes are, rebuilt when they change, and fills all buckets at once only where the
  compressor stages ahead;
- over gloo (W=2), OneBitAdam and ZeroOneAdam with one bucket per parameter step bit for bit as
  with the compressor's per-bucket path (``batched=False``: a fill per bucket, an exchange per
  bucket), through a change of the parameters with gradients and a reset of the compressor.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any, Dict, List

import pytest
import torch

from compcomm.compress import OneBitCompressor
from compcomm.optim import cpu_adam, cpu_multi
from compcomm.optim._staging import StagedPlan, staged_plan
from compcomm.testing import mirrored_peers, run_ranks

SIZES = [1, 7, 4099, 300]


def _group(bc: bool = True) -> Dict[str, Any]:
    return {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
            "bias_correction": bc}


def _tensors(seed: int, low: bool) -> List[List[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    ws = [torch.randn(n, generator=gen) for n in SIZES]
    ms = [torch.randn(n, generator=gen) for n in SIZES]
    vs = [torch.rand(n, generator=gen) for n in SIZES]
    gs = [torch.randn(n, generator=gen) for n in SIZES]
    outs = [torch.empty(n, dtype=torch.bfloat16) if low and i % 2 else None
            for i, n in enumerate(SIZES)]
    return [ws, ms, vs, gs, outs]


@pytest.mark.parametrize("rule", ["warmup", "compressed", "local"])
@pytest.mark.parametrize("low", [False, True])
def test_list_forms_give_the_bits_of_the_single_forms(rule, low):
    single = {"warmup": cpu_adam.onebit_warmup_step_,
              "compressed": cpu_adam.onebit_compressed_step_,
              "local": cpu_adam.onebit_local_step_}[rule]
    multi = {"warmup": cpu_multi.onebit_warmup_steps_,
             "compressed": cpu_multi.onebit_compressed_steps_,
             "local": cpu_adam.onebit_local_steps_}[rule]
    group = _group()
    want = _tensors(1, low)
    got = [[t if t is None else t.clone() for t in col] for col in want]
    for ws, ms, vs, gs, outs in (want,):
        for w, m, v, g, o in zip(ws, ms, vs, gs, outs):
            single(w, m, v, g, group, 5, 3, param_out=o)
    multi(*got[:4], group, 5, 3, got[4])
    for a, b in zip(want, got):
        assert all(x is None or torch.equal(x, y) for x, y in zip(a, b))


def test_momentum_list_form_gives_the_bits_of_the_single_form():
    ws, ms, vs, gs, _ = _tensors(2, False)
    want = [torch.empty_like(m) for m in ms]
    for m, g, o in zip(ms, gs, want):
        cpu_adam.onebit_momentum_(m, g, _group(), o)
    got = [torch.empty_like(m) for m in ms]
    cpu_multi.onebit_momentums_(ms, gs, _group(), got)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    inplace = [m.clone() for m in ms]  # out may be m itself
    cpu_multi.onebit_momentums_(inplace, gs, _group(), inplace)
    assert all(torch.equal(a, b) for a, b in zip(want, inplace))


def test_list_forms_name_the_bad_tensor_and_write_nothing():
    ws, ms, vs, gs, _ = _tensors(3, False)
    before = [w.clone() for w in ws]
    bad = list(ms)
    bad[1] = bad[1].double()
    with pytest.raises(TypeError, match=r"onebit_compressed_steps_\[1\]: m must be float32"):
        cpu_multi.onebit_compressed_steps_(ws, bad, vs, gs, _group(), 2, 2)
    short = list(gs)
    short[2] = short[2][:-1]
    with pytest.raises(ValueError, match=r"onebit_warmup_steps_\[2\]: g has 4098 elements"):
        cpu_multi.onebit_warmup_steps_(ws, ms, vs, short, _group(), 2, 2)
    with pytest.raises(ValueError, match="one length"):
        cpu_multi.onebit_compressed_steps_(ws, ms[:2], vs, gs, _group(), 2, 2)
    strided = list(gs)
    strided[3] = torch.randn(600)[::2]
    with pytest.raises(ValueError, match=r"onebit_momentums_\[3\]: g must be a contiguous"):
        cpu_multi.onebit_momentums_(ms, strided, _group(), [torch.empty_like(m) for m in ms])
    assert all(torch.equal(a, b) for a, b in zip(before, ws))


def _items(shapes):
    group = {"params": []}
    ps = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    return group, [(group, p) for p in ps]


def test_staged_plan_is_kept_and_rebuilt_when_the_plan_or_a_shape_changes():
    group, items = _items([(3, 2), (5,), (4,)])
    key, buckets, staging = ("k",), [[0, 1], [2]], {}
    plan = staged_plan(None, key, items, buckets, staging)
    assert [f.numel() for f in plan.flats] == [11, 4] and staging[0] is plan.flats[0]
    assert plan.views[items[0][1]].shape == (3, 2)
    assert plan.views[items[1][1]].data_ptr() == plan.flats[0][6:].data_ptr()
    assert staged_plan(plan, key, items, buckets, staging) is plan
    assert staged_plan(plan, tuple(["k"]), items, buckets, staging) is not plan  # a new key object
    items[1][1].data = torch.zeros(5, 1)  # same numel, another shape: new views
    again = staged_plan(plan, key, items, buckets, staging)
    assert again is not plan and again.views[items[1][1]].shape == (5, 1)
    assert again.flats[0] is plan.flats[0]  # the buffers still fit: kept


@pytest.mark.parametrize("ahead", [False, True])
def test_staged_plan_fills_per_bucket_or_all_at_once(ahead):
    _, items = _items([(2,), (3,), (4,)])
    plan = StagedPlan(("k",), items, [[0], [1, 2]], {})
    (dev, idx, numels, entries), = plan.by_device
    assert idx == [0, 1] and numels == [2, 7] and len(entries) == 3
    fills = []
    stage = plan.stage_fn(idx, entries, lambda es: fills.append([p.numel() for _, p, _ in es]),
                          ahead)
    assert stage(0) is plan.flats[0] and stage(1) is plan.flats[1]
    assert fills == ([[2, 3, 4]] if ahead else [[2], [3, 4]])


def _trajectories(rank: int, world: int, name: str) -> Dict[str, Any]:
    from compcomm.compress import OneBitCompressor
    from compcomm.optim import OneBitAdam, ZeroOneAdam

    out: Dict[str, Any] = {}
    for batched in (True, False):
        gen = torch.Generator().manual_seed(5)
        params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (7, 300, 64, 1031)]
        kw = dict(lr=1e-2, per_parameter=True, weight_decay=0.01,
                  compressor=lambda comm, b=batched: OneBitCompressor(comm, batched=b))
        if name == "OneBitAdam":
            opt = OneBitAdam(params, freeze_step=2, **kw)
        else:
            opt = ZeroOneAdam(params, var_freeze_step=4, var_update_scaler=1, **kw)
        traj, preps = [], []
        for step in range(10):
            gen_r = torch.Generator().manual_seed(100 * step + rank)
            for i, p in enumerate(params):  # step 6: parameter 1 has no gradient (a new plan)
                p.grad = None if (step == 6 and i == 1) else torch.randn(p.shape, generator=gen_r)
            if step == 9:
                opt.compressor.reset()  # error buffers restart: the kept core views must too
            opt.step()
            traj.append([p.detach().clone() for p in params])
            preps.append(opt.compressor._prep)
        out[batched] = traj
        # whether step i + 1 reused step i's core views
        out[f"kept{batched}"] = [a is b and a is not None for a, b in zip(preps, preps[1:])]
    return out


@pytest.mark.parametrize("name", ["OneBitAdam", "ZeroOneAdam"])
def test_batched_per_parameter_steps_equal_the_per_bucket_path(name):
    for res in run_ranks(2, _trajectories, name, timeout=240):
        for step, (a, b) in enumerate(zip(res[True], res[False])):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"step {step + 1}"
        if name == "OneBitAdam":  # steps 3..6 compressed with one plan: the core views kept
            kept = res["keptTrue"]
            # steps 7 and 8: new plans (a parameter without gradient, then with); 10: a reset
            assert kept[2:] == [True, True, True, False, False, True, False]


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                         reason="no CUDA device"))])
@pytest.mark.parametrize("name", ["OneBitAdam", "ZeroOneAdam"])
def test_staged_at_once_equals_per_bucket_with_mirrored_peers(device, name):
    """One process, W=2 with mirrored peers: per-parameter buckets staged all at once and
    exchanged in one batch equal, bit for bit, a fill and an exchange per bucket (on CUDA: the
    fused momentum over all buckets' views, the batched commits on the stream)."""
    from compcomm.compress import OneBitCompressor
    from compcomm.optim import OneBitAdam, ZeroOneAdam

    runs = {}
    for batched in (True, False):
        gen = torch.Generator().manual_seed(9)
        params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(device))
                  for n in (7, 300, 64, 1031)]
        kw = dict(lr=1e-2, per_parameter=True, weight_decay=0.01, process_group=mirrored_peers(2),
                  compressor=lambda comm, b=batched: OneBitCompressor(comm, batched=b))
        opt = (OneBitAdam(params, freeze_step=2, **kw) if name == "OneBitAdam" else
               ZeroOneAdam(params, var_freeze_step=4, var_update_scaler=1, **kw))
        traj = []
        for step in range(7):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(device)
            opt.step()
            traj.append([p.detach().cpu().clone() for p in params])
        runs[batched] = traj
    for step, (a, b) in enumerate(zip(runs[True], runs[False])):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"step {step + 1}"


def test_compressor_keeps_no_staged_tensor_after_a_call() -> None:
    """Staged buckets are not kept alive between calls (ZeRO's replicated mode stages fresh
    tensors every step: keeping them held a whole model's fp32 momentum), and a stage() that
    returns the same tensors again still gives the same bits."""
    comp = OneBitCompressor(mirrored_peers(2))
    refs = []

    def fresh(i: int) -> torch.Tensor:
        y = torch.randn(1 << 12, generator=torch.Generator().manual_seed(i))
        refs.append(weakref.ref(y))
        return y

    comp.average_([0, 1, 2], [1 << 12] * 3, fresh, torch.device("cpu"))
    gc.collect()
    assert [r() for r in refs] == [None, None, None]
    kept = [torch.randn(1 << 12, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    twins = [t.clone() for t in kept]
    comp, other = OneBitCompressor(mirrored_peers(2)), OneBitCompressor(mirrored_peers(2))
    staged = {}

    def copy_of(i: int) -> torch.Tensor:
        staged[i] = twins[i].clone()
        return staged[i]

    for _ in range(3):  # the cached views of the same tensors, released and taken up again
        comp.average_([0, 1, 2], [1 << 12] * 3, lambda i: kept[i], torch.device("cpu"))
        other.average_([0, 1, 2], [1 << 12] * 3, copy_of, torch.device("cpu"))
        for i in range(3):
            twins[i].copy_(staged[i])
    for a, b in zip(kept, twins):
        assert torch.equal(a, b)
