"""The C++ CPU Adam / AdamW step and the 1-bit Adam update kernels (``compcomm._C.optim``,
``compcomm.optim.cpu_adam``).

- Every instruction-set path (generic, AVX2, AVX-512 where the CPU has them) at 1 and 2 threads,
  sizes 1, 7, 4099 and 2^20 + 3.
- ``adam_step`` / :class:`CPUAdam` against ``torch.optim.AdamW`` / ``Adam`` (foreach=False) over
  several steps: bit for bit where torch's CPU sqrt is known (:func:`torch_sqrt_mode`), else to
  fp32 rounding; bf16/fp16 parameters against AdamW on an fp32 copy.
- The 1-bit rules bit for bit (``torch.equal``) against ``compcomm.optim.functional``.
- One step of each rule against a float64 numpy reference.
- The square root: the kernels' two modes against numpy and against torch's CPU sqrt.
- Bad arguments: TypeError / ValueError naming the argument.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compcomm import _C
from compcomm._buffers import buffer_of as B
from compcomm.optim import CPUAdam
from compcomm.optim import functional as F
from compcomm.optim import cpu_adam
from compcomm.optim.cpu_adam import (
    adam_step_,
    kernel_isa,
    onebit_compressed_step_,
    onebit_warmup_step_,
    torch_sqrt_mode,
)

K = _C.optim
ISAS = [pytest.param(i, marks=pytest.mark.skipif(not K.isa_supported(i),
                                                 reason=f"this CPU or build has no {i} path"))
        for i in ("generic", "avx2", "avx512")]
SIZES = [1, 7, 4099, 2**20 + 3]
THREADS = [1, 2]
LOW = [torch.bfloat16, torch.float16]
SQRT = torch_sqrt_mode()
EXACT = SQRT is not None  # the kernels then reproduce torch's CPU ops bit for bit


def _group(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, wd=0.0, bc=True):
    return {"lr": lr, "betas": betas, "eps": eps, "weight_decay": wd, "bias_correction": bc}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal bit for bit where torch's sqrt is known, else within fp32 rounding."""
    if EXACT:
        assert torch.equal(a, b), f"max |diff| {(a.double() - b.double()).abs().max().item()}"
    else:
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)


# ------------------------------------------------------------------------------------------------
# the square root
# ------------------------------------------------------------------------------------------------
def _sqrt_inputs() -> torch.Tensor:
    g = _gen(1)
    in14 = torch.arange(0, 2**24, 61, dtype=torch.int64).add_(127 << 23).to(torch.int32)
    spread = (1 + 3 * torch.rand(20000, generator=g)) * torch.pow(
        4.0, torch.randint(-74, 63, (20000,), generator=g).double()).float()
    denormal = torch.randint(1, 2**23, (5000,), generator=g, dtype=torch.int32).view(torch.float32)
    special = torch.tensor([0.0, -0.0, 1.0, 4.0, 0.25, 2.0, float("inf"), 3.4028235e38, 1.1754944e-38,
                            1e-45, 2.0**-64, 2.0**-64 * (1 - 2**-24), 2.0**-64 * (1 + 2**-23)])
    return torch.cat([in14.view(torch.float32), spread, denormal, special])


@pytest.mark.parametrize("isa", ISAS)
def test_sqrt_ieee_is_numpy(isa):
    x = _sqrt_inputs()
    out = torch.empty_like(x)
    K.sqrt(B(x), B(out), "ieee", isa)
    assert np.array_equal(out.numpy(), np.sqrt(x.numpy()))


@pytest.mark.parametrize("isa", ISAS)
def test_sqrt_rsqrt14_matches_torch(isa):
    """The rsqrt14 mode is torch's CPU sqrt where torch uses MKL on AVX-512; on every path."""
    x = _sqrt_inputs()
    out = torch.empty_like(x)
    K.sqrt(B(x), B(out), "rsqrt14", isa)
    ref = torch.empty_like(x)
    K.sqrt(B(x), B(ref), "rsqrt14", "generic")
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))
    # correctly rounded or the other neighbour, never further
    exact = np.sqrt(x.numpy())
    assert np.all(np.abs(out.numpy().view(np.int32) - exact.view(np.int32)) <= 1)
    if SQRT != "rsqrt14":
        pytest.skip(f"torch's CPU sqrt here is {SQRT!r}, not MKL's AVX-512 one")
    assert torch.equal(out, x.sqrt())


def test_sqrt_negative_and_nan():
    x = torch.tensor([-1.0, -1e-40, float("-inf"), float("nan")])
    for mode in ("ieee", "rsqrt14"):
        out = torch.zeros_like(x)
        K.sqrt(B(x), B(out), mode)
        assert torch.isnan(out).all()


def test_torch_sqrt_mode_is_torchs():
    assert kernel_isa() in ("generic", "avx2", "avx512")
    if SQRT is None:
        pytest.skip("torch's CPU sqrt is neither correctly rounded nor MKL's AVX-512 one")
    x = torch.rand(100003, generator=_gen(2)) * 10
    out = torch.empty_like(x)
    K.sqrt(B(x), B(out), SQRT)
    assert torch.equal(out, x.sqrt())


# ------------------------------------------------------------------------------------------------
# (a) Adam / AdamW against torch
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("adamw_mode", [True, False])
def test_cpuadam_matches_torch(n, wd, adamw_mode, threads):
    g = _gen(n)
    p0 = torch.randn(n, generator=g)
    pa, pb = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    ref = cls([pa], lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=wd, foreach=False)
    opt = CPUAdam([pb], lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=wd,
                  adamw_mode=adamw_mode, num_threads=threads)
    for _ in range(4):
        grad = torch.randn(n, generator=g)
        grad[::5] = 0.0
        pa.grad, pb.grad = grad.clone(), grad.clone()
        ref.step()
        opt.step()
    _same(pb.data, pa.data)
    for k in ("exp_avg", "exp_avg_sq"):
        _same(opt.state[pb][k], ref.state[pa][k])
    assert opt.state[pb]["step"].item() == ref.state[pa]["step"].item() == 4


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n", [7, 4099])
def test_adam_step_without_bias_correction(isa, n):
    """bias_correction=False (DeepSpeed's switch): torch's op sequence with step size lr."""
    g = _gen(3)
    w, m, v = torch.randn(n, generator=g), torch.randn(n, generator=g), torch.rand(n, generator=g)
    grad = torch.randn(n, generator=g)
    rw, rm, rv = w.clone(), m.clone(), v.clone()
    lr, wd, b1, b2, eps = 3e-3, 0.05, 0.9, 0.999, 1e-8
    rw.mul_(1 - lr * wd)
    rm.lerp_(grad, 1 - b1)
    rv.mul_(b2).addcmul_(grad, grad, value=1 - b2)
    rw.addcdiv_(rm, (rv.sqrt() / 1.0).add_(eps), value=-lr)
    K.adam_step(B(w), B(m), B(v), B(grad), lr, b1, b2, eps, wd, 7, True, False, None, 1, isa,
                SQRT or "ieee")
    _same(w, rw)
    _same(m, rm)
    _same(v, rv)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("threads", THREADS)
def test_cpuadam_low_precision_params(dtype, threads):
    """bf16/fp16 parameters: the fp32 master follows AdamW on an fp32 copy given the same
    gradients; the parameter is the master rounded to nearest even."""
    n = 2**20 + 3
    g = _gen(5)
    master = torch.nn.Parameter(torch.randn(n, generator=g))
    p = torch.nn.Parameter(master.detach().to(dtype))
    master.data.copy_(p.detach().float())
    ref = torch.optim.AdamW([master], lr=1e-2, weight_decay=0.01, foreach=False)
    opt = CPUAdam([p], lr=1e-2, weight_decay=0.01, num_threads=threads)
    for _ in range(3):
        grad = torch.randn(n, generator=g).to(dtype)
        p.grad = grad
        master.grad = grad.float()
        ref.step()
        opt.step()
    st = opt.state[p]
    assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == st["master_param"].dtype == torch.float32
    _same(st["master_param"], master.data)
    assert torch.equal(p.data, st["master_param"].to(dtype))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_param_out_rounds_like_torch(isa, out_dtype):
    """With lr = 0 the step leaves w as it is, so param_out is w's conversion: every class of
    value (ties, fp16 subnormals and overflow, bf16 rounding carries into the exponent)."""
    g = _gen(6)
    bits = torch.randint(-2**31, 2**31 - 1, (100003,), generator=g, dtype=torch.int64)
    w = bits.to(torch.int32).view(torch.float32)
    w = torch.where(torch.isfinite(w), w, torch.zeros(()))
    ties = torch.arange(1, 4097, dtype=torch.int32).mul_(2**16).add_(2**15).view(torch.float32)
    small = torch.randn(4096, generator=g) * 1e-6  # fp16 subnormal range
    big = torch.tensor([65504.0, 65519.0, 65520.0, 7e4, -7e4, 3.4e38, -0.0, 0.0])
    w = torch.cat([w, ties, small, big]).contiguous()
    n = w.numel()
    m, v, grad = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=out_dtype)
    w0 = w.clone()
    K.onebit_warmup_step(B(w), B(m), B(v), B(grad), 0.0, 0.9, 0.999, 1e-8, 0.0, False, 1, 1,
                         B(out), 1, isa)
    assert torch.equal(w, w0)
    assert torch.equal(out, w0.to(out_dtype))


# ------------------------------------------------------------------------------------------------
# (b) the 1-bit rules bit for bit against compcomm.optim.functional
# ------------------------------------------------------------------------------------------------
def _state(n: int, seed: int):
    g = _gen(seed)
    w = torch.randn(n, generator=g)
    m = torch.randn(n, generator=g) * 0.1
    v = torch.rand(n, generator=g) * 1e-2
    v[::7] = 0.0
    v[1::11] = 1e-40  # denormal variance: sqrt's scaled path
    return w, m, v, g


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bc,wd", [(True, 0.01), (False, 0.0), (True, 0.0)])
def test_onebit_warmup_bit_identical(n, isa, bc, wd, threads):
    if not EXACT:
        pytest.skip("torch's CPU sqrt here is unknown: no bit-identical claim")
    w, m, v, g = _state(n, n)
    group = _group(lr=3e-3, betas=(0.85, 0.995), eps=1e-8, wd=wd, bc=bc)
    kw, km, kv = w.clone(), m.clone(), v.clone()
    for t in (1, 2, 3):
        grad = torch.randn(n, generator=g)
        F.adam_moments_(m, v, grad, group)
        F.adam_step_(w, m, v, group, t, t)
        b1, b2 = group["betas"]
        K.onebit_warmup_step(B(kw), B(km), B(kv), B(grad), group["lr"], b1, b2, group["eps"], wd,
                             bc, t, t, None, threads, isa, SQRT)
        assert torch.equal(km, m) and torch.equal(kv, v) and torch.equal(kw, w)


@pytest.mark.parametrize("grad_dtype", LOW)
def test_onebit_warmup_low_precision_grad(grad_dtype):
    """A bf16/fp16 gradient is read as torch's type promotion reads it (exactly)."""
    if not EXACT:
        pytest.skip("torch's CPU sqrt here is unknown")
    n = 4099
    w, m, v, g = _state(n, 8)
    group = _group(wd=0.01)
    grad = torch.randn(n, generator=g).to(grad_dtype)
    kw, km, kv = w.clone(), m.clone(), v.clone()
    F.adam_moments_(m, v, grad, group)
    F.adam_step_(w, m, v, group, 4, 4)
    out = torch.empty(n, dtype=grad_dtype)
    onebit_warmup_step_(kw, km, kv, grad, group, 4, 4, param_out=out)
    assert torch.equal(km, m) and torch.equal(kv, v) and torch.equal(kw, w)
    assert torch.equal(out, w.to(grad_dtype))


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("bc,wd", [(True, 0.01), (False, 0.0)])
def test_onebit_compressed_bit_identical(n, isa, masked, bc, wd, threads):
    if not EXACT:
        pytest.skip("torch's CPU sqrt here is unknown: no bit-identical claim")
    w, m, v, g = _state(n, n + 1)
    group = _group(lr=2e-3, betas=(0.9, 0.999), eps=1e-8, wd=wd, bc=bc)
    mask = (torch.rand(n, generator=g) > 0.3).float() if masked else None
    kw, km, kv = w.clone(), m.clone(), v.clone()
    v0 = v.clone()
    for t in (11, 12):  # variance frozen after step 10
        averaged = torch.randn(n, generator=g) * 0.05
        m.copy_(averaged)
        F.masked_(m, mask)
        F.adam_step_(w, m, v, group, t, 10)
        b1, b2 = group["betas"]
        K.onebit_compressed_step(B(kw), B(km), B(kv), B(averaged),
                                 None if mask is None else B(mask), group["lr"], b1, b2,
                                 group["eps"], wd, bc, t, 10, None, threads, isa, SQRT)
        assert torch.equal(km, m) and torch.equal(kw, w)
    assert torch.equal(kv, v0)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("offset", [0, 1, 5])
def test_misaligned_views(isa, offset):
    """Views starting off a vector boundary: the written-only arrays (m in the compressed phase,
    the parameter copy) are streamed once aligned, with a partial vector first."""
    if not EXACT:
        pytest.skip("torch's CPU sqrt here is unknown")
    n = 2**17 + 9
    w, m0, v, g = _state(n + 16, 13)
    w, v = w[offset:offset + n], v[3:3 + n]
    mbuf = torch.zeros(n + 16)
    km = mbuf[offset + 2:offset + 2 + n]
    averaged = torch.randn(n, generator=g)
    obuf = torch.zeros(n + 16, dtype=torch.bfloat16)
    out = obuf[offset + 1:offset + 1 + n]
    group = _group(wd=0.01)
    kw = w.clone()
    m = torch.empty(n)
    m.copy_(averaged)
    F.adam_step_(w, m, v, group, 5, 5)
    K.onebit_compressed_step(B(kw), B(km), B(v), B(averaged), None, group["lr"], 0.9, 0.999,
                             group["eps"], group["weight_decay"], True, 5, 5, B(out), 1, isa, SQRT)
    assert torch.equal(kw, w) and torch.equal(km, m)
    assert torch.equal(out, w.to(torch.bfloat16))
    assert not mbuf[:offset + 2].any() and not mbuf[offset + 2 + n:].any()
    assert not obuf[:offset + 1].any() and not obuf[offset + 1 + n:].any()


def test_onebit_compressed_wrapper_mask_broadcast_and_alias():
    """The Python wrapper: a mask broadcast against a 2-D parameter, a bf16 copy of the result,
    and ``averaged`` being ``m`` itself (already averaged in place)."""
    if not EXACT:
        pytest.skip("torch's CPU sqrt here is unknown")
    g = _gen(9)
    w = torch.randn(37, 113, generator=g)
    m = torch.randn(37, 113, generator=g)
    v = torch.rand(37, 113, generator=g)
    mask = (torch.rand(1, 113, generator=g) > 0.5).to(torch.bfloat16)
    group = _group(wd=0.1)
    kw, km, kv = w.clone(), m.clone(), v.clone()
    F.masked_(m, mask.float())
    F.adam_step_(w, m, v, group, 20, 10)
    out = torch.empty(37, 113, dtype=torch.bfloat16)
    onebit_compressed_step_(kw, km, kv, km, group, 20, 10, mask=mask, param_out=out)
    assert torch.equal(km, m) and torch.equal(kw, w)
    assert torch.equal(out, w.to(torch.bfloat16))


# ------------------------------------------------------------------------------------------------
# one step against a float64 numpy reference
# ------------------------------------------------------------------------------------------------
def _np(*ts):
    return [t.numpy().astype(np.float64) for t in ts]


@pytest.mark.parametrize("isa", ISAS)
def test_numpy_reference_one_step(isa):
    n = 4099
    w, m, v, g = _state(n, 10)
    v[1::11] = 1e-6
    grad = torch.randn(n, generator=g)
    lr, b1, b2, eps, wd, t = 1e-2, 0.9, 0.999, 1e-8, 0.05, 3
    bc1, bc2 = 1 - b1**t, 1 - b2**t

    # AdamW
    W, M, V, G = _np(w, m, v, grad)
    W = W * (1 - lr * wd)
    M = b1 * M + (1 - b1) * G
    V = b2 * V + (1 - b2) * G * G
    W = W - lr / bc1 * M / (np.sqrt(V) / np.sqrt(bc2) + eps)
    kw, km, kv = w.clone(), m.clone(), v.clone()
    K.adam_step(B(kw), B(km), B(kv), B(grad), lr, b1, b2, eps, wd, t, True, True, None, 1, isa)
    np.testing.assert_allclose(km.numpy(), M, rtol=1e-6, atol=3e-8)  # cancellation
    np.testing.assert_allclose(kv.numpy(), V, rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(kw.numpy(), W, rtol=1e-6, atol=1e-7)

    # 1-bit warm-up
    W, M, V, G = _np(w, m, v, grad)
    M = b1 * M + (1 - b1) * G
    V = b2 * V + (1 - b2) * G * G
    W = W - lr * ((M / (np.sqrt(V) / np.sqrt(bc2) + eps)) / bc1 + wd * W)
    kw, km, kv = w.clone(), m.clone(), v.clone()
    K.onebit_warmup_step(B(kw), B(km), B(kv), B(grad), lr, b1, b2, eps, wd, True, t, t, None, 1,
                         isa)
    np.testing.assert_allclose(km.numpy(), M, rtol=1e-6, atol=3e-8)  # cancellation
    np.testing.assert_allclose(kv.numpy(), V, rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(kw.numpy(), W, rtol=1e-6, atol=1e-7)

    # 1-bit compressed phase, masked, variance frozen at step 2
    mask = (torch.rand(n, generator=g) > 0.5).float()
    W, M, V, A, MK = _np(w, m, v, grad, mask)
    M = A * MK
    W = W - lr * ((M / (np.sqrt(V) / np.sqrt(1 - b2**2) + eps)) / bc1 + wd * W)
    kw, km, kv = w.clone(), m.clone(), v.clone()
    K.onebit_compressed_step(B(kw), B(km), B(kv), B(grad), B(mask), lr, b1, b2, eps, wd, True, t, 2,
                             None, 1, isa)
    assert torch.equal(kv, v)
    np.testing.assert_allclose(km.numpy(), M, rtol=0, atol=0)
    np.testing.assert_allclose(kw.numpy(), W, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------------------------
# state dicts
# ------------------------------------------------------------------------------------------------
def test_state_dict_round_trips_with_torch_adamw():
    g = _gen(11)
    p0 = torch.randn(1000, generator=g)
    a, b = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    opt = CPUAdam([a], lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW([b], lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(2):
        grad = torch.randn(1000, generator=g)
        a.grad, b.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    # swap: torch continues from CPUAdam's state, CPUAdam from torch's
    ref2 = torch.optim.AdamW([a], lr=1e-2, weight_decay=0.1, foreach=False)
    ref2.load_state_dict(opt.state_dict())
    opt2 = CPUAdam([b], lr=1e-2, weight_decay=0.1)
    opt2.load_state_dict(ref.state_dict())
    assert set(opt.state_dict()["state"][0]) == set(ref.state_dict()["state"][0])
    grad = torch.randn(1000, generator=g)
    a.grad, b.grad = grad.clone(), grad.clone()
    ref2.step()
    opt2.step()
    _same(a.data, b.data)


def test_state_dict_low_precision_keeps_fp32_state():
    g = _gen(12)
    p = torch.nn.Parameter(torch.randn(300, generator=g).to(torch.bfloat16))
    opt = CPUAdam([p], lr=1e-2)
    p.grad = torch.randn(300, generator=g).to(torch.bfloat16)
    opt.step()
    sd = opt.state_dict()
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = CPUAdam([q], lr=1e-2)
    opt2.load_state_dict(sd)
    for k in ("exp_avg", "exp_avg_sq", "master_param"):
        assert opt2.state[q][k].dtype == torch.float32
        assert torch.equal(opt2.state[q][k], opt.state[p][k])
    p.grad = q.grad = torch.randn(300, generator=g).to(torch.bfloat16)
    opt.step()
    opt2.step()
    assert torch.equal(p, q)


def test_empty_and_gradless_parameters():
    e = torch.nn.Parameter(torch.zeros(0))
    n = torch.nn.Parameter(torch.ones(3))
    opt = CPUAdam([e, n], lr=1e-2)
    e.grad = torch.zeros(0)
    opt.step()
    assert torch.equal(n.data, torch.ones(3)) and n not in opt.state
    assert opt.state[e]["step"].item() == 1


# ------------------------------------------------------------------------------------------------
# bad arguments
# ------------------------------------------------------------------------------------------------
def _four(n=8):
    return torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(n)


def test_wrapper_bad_arguments():
    w, m, v, g = _four()
    grp = _group()
    with pytest.raises(TypeError, match="w must be float32"):
        adam_step_(w.double(), m, v, g, grp, 1)
    with pytest.raises(TypeError, match="g must be"):
        adam_step_(w, m, v, g.to(torch.int32), grp, 1)
    with pytest.raises(TypeError, match="m must be a torch.Tensor"):
        adam_step_(w, m.numpy(), v, g, grp, 1)
    with pytest.raises(ValueError, match="v has 7 elements"):
        adam_step_(w, m, v[:7], g, grp, 1)
    with pytest.raises(ValueError, match="g must be a contiguous"):
        adam_step_(w, m, v, torch.zeros(16)[::2], grp, 1)
    with pytest.raises(ValueError, match="w must be a CPU tensor"):
        adam_step_(torch.zeros(8, device="meta"), m, v, g, grp, 1)
    with pytest.raises(TypeError, match="param_out must be"):
        onebit_warmup_step_(w, m, v, g, grp, 1, 1, param_out=torch.zeros(8, dtype=torch.int8))
    with pytest.raises(TypeError, match="averaged must be float32"):
        onebit_compressed_step_(w, m, v, g.half(), grp, 1, 1)
    with pytest.raises(ValueError, match="does not broadcast"):
        onebit_compressed_step_(w, m, v, g, grp, 1, 1, mask=torch.ones(3))
    with pytest.raises(ValueError, match="sqrt must be"):
        adam_step_(w, m, v, g, grp, 1, sqrt="fast")


def test_binding_bad_arguments():
    w, m, v, g = _four()
    args = (1e-3, 0.9, 0.999, 1e-8, 0.0)
    with pytest.raises(TypeError, match="adam_step: v must be float32"):
        K.adam_step(B(w), B(m), B(v.half()), B(g), *args, 1)
    with pytest.raises(ValueError, match="adam_step: g has 4 elements"):
        K.adam_step(B(w), B(m), B(v), B(g[:4]), *args, 1)
    with pytest.raises(ValueError, match="step must be >= 1"):
        K.adam_step(B(w), B(m), B(v), B(g), *args, 0)
    with pytest.raises(ValueError, match="w and m overlap"):
        K.adam_step(B(w), B(w), B(v), B(g), *args, 1)
    big = torch.zeros(16)
    with pytest.raises(ValueError, match="g partly overlaps"):
        K.adam_step(B(big[:8]), B(m), B(v), B(big[4:12]), *args, 1)
    with pytest.raises(ValueError, match="isa must be"):
        K.adam_step(B(w), B(m), B(v), B(g), *args, 1, isa="sse9")
    with pytest.raises(ValueError, match="sqrt must be"):
        K.adam_step(B(w), B(m), B(v), B(g), *args, 1, sqrt="x")
    with pytest.raises(ValueError, match="bc1_t and bc2_t must be >= 0"):
        K.onebit_warmup_step(B(w), B(m), B(v), B(g), *args, True, -1, 1)
    with pytest.raises(TypeError, match="mask must be float32"):
        K.onebit_compressed_step(B(w), B(m), B(v), B(g), B(g.half()), *args, True, 1, 1)
    # the same memory as a written buffer is allowed for a read-only one (elementwise update)
    K.onebit_compressed_step(B(w), B(m), B(v), B(m), None, *args, True, 1, 1)


def test_cpuadam_bad_arguments():
    p = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match="amsgrad"):
        CPUAdam([p], amsgrad=True)
    with pytest.raises(ValueError, match="'lr'"):
        CPUAdam([p], lr=-1.0)
    with pytest.raises(ValueError, match="'betas'"):
        CPUAdam([p], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="'num_threads'"):
        CPUAdam([p], num_threads=0)
    with pytest.raises(ValueError, match="'sqrt'"):
        CPUAdam([p], sqrt="fast")
    q = torch.nn.Parameter(torch.zeros(4, 4).t())  # not contiguous
    q.grad = torch.zeros(4, 4).t()
    with pytest.raises(ValueError, match="parameter 0 must be a contiguous"):
        CPUAdam([q]).step()
    r = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    r.grad = torch.zeros(4, dtype=torch.float64)
    with pytest.raises(TypeError, match="param group 0 parameter 0 must be float32"):
        CPUAdam([r]).step()
    s = torch.nn.Parameter(torch.zeros(4))
    s.grad = torch.zeros(8)[::2]
    with pytest.raises(ValueError, match="the gradient of param group 0 parameter 0 must be"):
        CPUAdam([s]).step()


# ---------------------------------------------------------------------------------------------
# OneBitAdam on the CPU uses the kernels (where they give torch's bits) with the same trajectory.


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onebitadam_cpu_step_uses_the_kernels_bit_for_bit(monkeypatch, dtype):
    from compcomm.optim import OneBitAdam

    if not cpu_adam.matches_torch_rules(denom=True):
        pytest.skip("the kernels do not give torch's bits on this machine (then unused)")
    cpu_adam.matches_torch_rules()  # its one-time probe runs the kernels too: before counting
    from compcomm.optim import cpu_multi

    calls = {"warmup": 0, "compressed": 0, "local": 0}
    # tensors through the kernels (warm-up and compressed steps: the list forms, one call a chunk)
    for mod, name, key, per_tensor in (
            (cpu_adam, "onebit_warmup_step_", "warmup", True),
            (cpu_multi, "onebit_warmup_steps_", "warmup", False),
            (cpu_adam, "onebit_compressed_step_", "compressed", True),
            (cpu_multi, "onebit_compressed_steps_", "compressed", False),
            (cpu_adam, "onebit_local_steps_", "local", None)):
        real = getattr(mod, name)

        def counted(*a, _real=real, _key=key, _one=per_tensor, **k):
            calls[_key] += 1 if _one in (True, None) else len(a[0])
            return _real(*a, **k)

        monkeypatch.setattr(mod, name, counted)

    def trajectory(env):
        monkeypatch.setenv("COMPCOMM_FUSED_OPTIM", env)
        gen = torch.Generator().manual_seed(3)
        ps = [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in (7, 4099, 300)]
        opt = OneBitAdam(ps, lr=1e-2, freeze_step=2, weight_decay=0.01, bias_correction=True)
        out = []
        for _ in range(5):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen).to(dtype)
            opt.step()
            out.append([p.detach().clone() for p in ps])
        return out

    reference = trajectory("0")
    assert calls == {"warmup": 0, "compressed": 0, "local": 0}
    fused = trajectory("1")
    # a world of one rank: the compressed phase's momentum and step in one pass
    # warm-up: 2 steps of 3 tensors (where the kernels' sqrt is torch's; else torch's ops, and
    # the compressed phase reads the frozen denominators torch computed); local: a call per step
    warm = 2 * 3 if cpu_adam.matches_torch_rules() else 0
    assert calls == {"warmup": warm, "compressed": 0, "local": 3}
    for a, b in zip(reference, fused):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
