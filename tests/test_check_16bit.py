"""bf16/fp16 gradients in 1-bit Adam's W=1 compressed step on the CPU: checked and read in their own
dtype (2 bytes per element), not copied to fp32 first.

- ``all_finite_ptrs`` with ``dtypes`` against torch's ``isfinite`` for every 16-bit pattern of both
  dtypes, at every lane and tail position, and its argument errors.
- ``onebit_local_steps_`` with 16-bit gradients: the bits of the same call on their exact fp32
  conversions; the compressed rule refuses a 16-bit average.
- OneBitAdam at W=1 with bf16/fp16 parameters: the fast path gets the gradients themselves and
  keeps the torch-op path's bits; Inf/NaN in a 16-bit gradient skips the step with nothing changed
  (``step``: a warning; ``step_on``: NonFiniteError naming the rank).
"""

from __future__ import annotations

import pytest
import torch

from compcomm import _C
from compcomm._buffers import DTYPES
from compcomm.compress import all_finite as compress_all_finite
from compcomm.errors import NonFiniteError
from compcomm.optim import OneBitAdam, cpu_adam, cpu_multi

K = _C.optim
HALF = [torch.bfloat16, torch.float16]


def _ptr_check(ts):
    return K.all_finite_ptrs([t.numel() for t in ts], [t.data_ptr() for t in ts],
                             dtypes=[DTYPES[t.dtype] for t in ts])


@pytest.mark.parametrize("dtype", HALF)
def test_all_finite_16_every_pattern(dtype):
    """Each of the 65536 bit patterns alone in an array of 9 (at position pattern % 9: every SWAR
    lane and the scalar tail), and all of them in one array (each non-finite one found)."""
    patterns = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    values = patterns.view(dtype)
    want = torch.isfinite(values.float())
    zeros = torch.zeros(9, dtype=dtype)
    wrong = []
    for k in range(65536):
        x = zeros.clone()
        x[k % 9] = values[k]
        if _ptr_check([x]) is not bool(want[k]):
            wrong.append(hex(int(patterns[k]) & 0xFFFF))
    assert not wrong, wrong[:10]
    finite = values[want]
    assert _ptr_check([finite]) is True
    assert _ptr_check([values]) is False


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("n", [0, 1, 3, 4, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 97, 4099, 5000])
def test_all_finite_16_positions(dtype, n):
    gen = torch.Generator().manual_seed(n)
    base = (torch.randn(n, generator=gen) * 100).to(dtype)
    if n:
        base[0] = torch.finfo(dtype).max
        base[n - 1] = -torch.finfo(dtype).tiny / 4  # subnormal
    assert _ptr_check([base]) is True
    assert cpu_adam.all_finite([base]) and compress_all_finite([base])
    for bad in (float("inf"), float("-inf"), float("nan")):
        # every position of a short array; else the ends of the four read streams and the tail
        q = n // 32 * 8
        for pos in range(n) if n <= 100 else sorted(
                {0, n - 1, max(0, n - 9)} | {k * q + d for k in range(1, 5) for d in (-1, 0)
                                             if k * q + d < n}):
            x = base.clone()
            x[pos] = bad
            assert _ptr_check([base, x]) is False, (bad, pos)
            assert not cpu_adam.all_finite([base, x]) and not compress_all_finite([x, base])


def test_all_finite_ptrs_mixed_dtypes_and_arguments():
    xs = [torch.randn(17), torch.randn(33).bfloat16(), torch.randn(5).half()]
    assert _ptr_check(xs) is True
    assert cpu_adam.all_finite(xs) and compress_all_finite(xs)
    for i in range(3):
        ys = [t.clone() for t in xs]
        ys[i][-1] = float("nan")
        assert _ptr_check(ys) is False and not cpu_adam.all_finite(ys)
    ptrs = [t.data_ptr() for t in xs]
    with pytest.raises(ValueError, match="dtypes must be empty"):
        K.all_finite_ptrs([17, 33, 5], ptrs, dtypes=[DTYPES[torch.float32]])
    with pytest.raises(TypeError, match=r"dtypes\[1\] must be float32, float16 or bfloat16"):
        K.all_finite_ptrs([17, 33, 5], ptrs, dtypes=[DTYPES[torch.float32],
                                                      DTYPES[torch.int32],
                                                      DTYPES[torch.float16]])
    with pytest.raises(TypeError, match=r"tensors\[0\] must be float32, float16, bfloat16"):
        cpu_adam.all_finite([torch.zeros(3, dtype=torch.float64)])


def _group(wd=0.01, bc=True):
    return {"lr": 2e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": wd,
            "bias_correction": bc}


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("lowp_out", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_local_steps_16bit_gradients_equal_their_fp32_copies(dtype, lowp_out, threads):
    sizes = [1, 7, 4099, 0, 70001]
    gen = torch.Generator().manual_seed(5)
    state = [(torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.1,
              torch.rand(n, generator=gen) * 1e-2) for n in sizes]
    gs = [(torch.randn(n, generator=gen) * 1e-2).to(dtype) for n in sizes]
    a = [[t.clone() for t in st] for st in state]
    b = [[t.clone() for t in st] for st in state]
    outs_a = [torch.empty(n, dtype=dtype) for n in sizes] if lowp_out else None
    outs_b = [torch.empty(n, dtype=dtype) for n in sizes] if lowp_out else None
    cpu_adam.onebit_local_steps_(*map(list, zip(*a)), gs, _group(), 9, 4, outs_a,
                                 num_threads=threads)
    cpu_adam.onebit_local_steps_(*map(list, zip(*b)), [g.float() for g in gs], _group(), 9, 4,
                                 outs_b, num_threads=threads)
    for x, y in zip(a, b):
        assert all(torch.equal(s, t) for s, t in zip(x, y))
    if lowp_out:
        assert all(torch.equal(s, t) for s, t in zip(outs_a, outs_b))


def test_16bit_gradient_arguments():
    w, m, v = torch.randn(16), torch.zeros(16), torch.rand(16)
    g = torch.randn(16).bfloat16()
    with pytest.raises(TypeError, match=r"onebit_compressed_steps_\[0\]: g must be float32"):
        cpu_multi.onebit_compressed_steps_([w], [m], [v], [g], _group(), 3, 2)
    args = ([16], [w.data_ptr()], [m.data_ptr()], [v.data_ptr()], [g.data_ptr()], [], [],
            1e-3, 0.9, 0.999, 1e-8, 0.0, False, 1, 1)
    with pytest.raises(TypeError, match=r"g_types\[0\] must be float32$"):
        K.onebit_compressed_steps(*args, g_types=[DTYPES[torch.bfloat16]])
    with pytest.raises(TypeError, match=r"g_types\[0\] must be float32, float16 or bfloat16"):
        K.onebit_local_steps(*args, g_types=[DTYPES[torch.int32]])
    with pytest.raises(ValueError, match="g_types must be empty"):
        K.onebit_local_steps(*args, g_types=[DTYPES[torch.bfloat16]] * 2)
    with pytest.raises(TypeError, match=r"onebit_local_steps_\[0\]: g must be float32, float16"):
        cpu_adam.onebit_local_steps_([w], [m], [v], [g.double()], _group(), 3, 2)


# ------------------------------------------------------------------------------------------------
# OneBitAdam at W=1 with 16-bit parameters
# ------------------------------------------------------------------------------------------------
SHAPES = [(37, 11), (4099,), (5,), (64, 65), (1,)]


def _trajectory(dtype, steps, bad=None, on=False, record=None):
    """OneBitAdam (freeze_step 2, two param groups) on 16-bit parameters; ``bad`` = (step, tensor,
    value) puts that value into one gradient at that step."""
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]
    params[2] = torch.nn.Parameter(params[2].detach().float())  # a mixed model
    opt = OneBitAdam([{"params": params[:3], "weight_decay": 0.01},
                      {"params": params[3:], "bias_correction": True}], lr=1e-2, freeze_step=2)
    out = []
    for step in range(steps):
        grads = [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]
        if bad is not None and step == bad[0]:
            grads[bad[1]].view(-1)[-1] = bad[2]
        if record is not None:
            record.clear()
            record.extend(g.data_ptr() for g in grads)
        if on:
            if bad is not None and step == bad[0]:
                with pytest.raises(NonFiniteError, match=r"\[rank 0\].*non-finite"):
                    opt.step_on(params, grads, opt.schedule.next_kind())
            else:
                opt.step_on(params, grads, opt.schedule.next_kind())
        else:
            for p, g in zip(params, grads):
                p.grad = g
            if bad is not None and step == bad[0]:
                with pytest.warns(RuntimeWarning, match="step skipped"):
                    opt.step()
            else:
                opt.step()
        out.append([p.detach().clone() for p in params]
                   + [opt.state[p][k].clone() for p in params
                      for k in ("exp_avg", "exp_avg_sq", "master_param") if k in opt.state[p]])
    return out, opt


@pytest.mark.parametrize("dtype", HALF)
def test_onebit_adam_w1_16bit_gradients_go_down_as_they_are(monkeypatch, dtype):
    if not cpu_adam.matches_torch_rules(denom=True):
        pytest.skip("the CPU kernels do not reproduce torch's ops here: no kernel path at all")
    cpu_adam.matches_torch_rules()  # its one-time probe calls onebit_local_steps_ too: first
    given: list = []
    seen = []
    real = cpu_adam.onebit_local_steps_
    monkeypatch.setattr(cpu_adam, "onebit_local_steps_", lambda ws, ms, vs, gs, *a, **k: (
        seen.append([(g.dtype, g.data_ptr()) for g in gs]), real(ws, ms, vs, gs, *a, **k)))
    fast, _ = _trajectory(dtype, 6, record=given)
    assert len(seen) == 4 * 2  # steps 3..6, a call per param group
    last = seen[-2] + seen[-1]
    assert [p for _, p in last] == given  # the gradients themselves, no fp32 copies
    assert {d for d, _ in last} == {dtype, torch.float32}
    monkeypatch.setenv("COMPCOMM_FUSED_OPTIM", "0")  # the torch ops on fp32 copies
    ref, _ = _trajectory(dtype, 6)
    for step, (a, b) in enumerate(zip(fast, ref)):
        for i, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"step {step + 1}, tensor {i}"


@pytest.mark.parametrize("on", [False, True], ids=["step", "step_on"])
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("tensor", [0, 4])
def test_onebit_adam_w1_nonfinite_16bit_gradient_changes_nothing(on, dtype, value, tensor):
    before, _ = _trajectory(dtype, 4, on=on)
    after, opt = _trajectory(dtype, 5, bad=(4, tensor, value), on=on)
    assert opt.schedule.step == 4 and opt.skipped_steps == (0 if on else 1)
    for i, (x, y) in enumerate(zip(before[-1], after[-1])):
        assert torch.equal(x, y), i
