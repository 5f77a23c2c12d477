"""The multi-tensor CUDA kernels of 1-bit Adam's update (compcomm.optim._fused) against a float32
numpy evaluation of functional.py's op sequence, and OneBitAdam's fused path against its foreach
path and its CPU run.

The kernels are compiled with -fmad=false, divide and take square roots IEEE-rounded, and round
their scalars to fp32 as torch does: every operation is one fp32 rounding in the reference's order,
so results must be bit-identical (0 ulp). Low-precision outputs must equal torch's CPU rounding of
the fp32 result. Memory around misaligned views must stay untouched. The trajectory tests compare
with torch's own CUDA ops, which contract ``a + alpha*b`` into FMAs and divide by a scalar through
its reciprocal, so they agree to a few ulps only.
"""

from __future__ import annotations

import math
import random
from typing import List, Optional

import numpy as np
import pytest
import torch

from compcomm.errors import UnsupportedError
from compcomm.optim import OneBitAdam
from compcomm.optim import _fused
from _backends import no_cuda_kernels, no_gpu, skipif



def gpu(fn):
    """Marks a test that needs a CUDA device and the CUDA kernels (else skipped, with why)."""
    return pytest.mark.gpu(skipif(no_gpu() or no_cuda_kernels())(fn))


DEV = "cuda"
f32 = np.float32


# ---------------------------------------------------------------------------------------------
# The oracle: functional.py's op sequence in float32 numpy (true division, no FMA).


def ref_momentum(m: Optional[np.ndarray], g: np.ndarray, b1: float) -> np.ndarray:
    m = np.zeros_like(g) if m is None else m
    return m * f32(b1) + f32(1 - b1) * g


def ref_step(m, v, w, group, bc1_t: int, bc2_t: int) -> np.ndarray:
    b1, b2 = group["betas"]
    denom = np.sqrt(v)
    if group["bias_correction"]:
        denom = denom / f32(math.sqrt(1.0 - b2 ** bc2_t) if bc2_t > 0 else 1.0)
    denom = denom + f32(group["eps"])
    u = m / denom
    if group["bias_correction"]:
        u = u / f32(1.0 - b1 ** bc1_t)
    if group["weight_decay"] > 0:
        u = u + f32(group["weight_decay"]) * w
    return w + f32(-group["lr"]) * u


def ref_moments(m, v, g, group):
    b1, b2 = group["betas"]
    return m * f32(b1) + f32(1 - b1) * g, v * f32(b2) + (f32(1 - b2) * g) * g


def ulps(a: np.ndarray, b: np.ndarray) -> int:
    """Largest distance in units in the last place between two float32 arrays (0: same bits)."""
    def ordered(x):
        i = np.ascontiguousarray(x, dtype=np.float32).view(np.int32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)
    if a.size == 0:
        return 0
    return int(np.max(np.abs(ordered(a) - ordered(b))))


GROUPS = {
    "plain": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, bias_correction=False),
    "bc_wd": dict(lr=3e-2, betas=(0.85, 0.98), eps=1e-6, weight_decay=0.01, bias_correction=True),
}


# ---------------------------------------------------------------------------------------------
# Tensor lists: sizes, and aligned or misaligned views (with poisoned surroundings).


class Lists:
    """``n`` fp32 lists of tensors of ``sizes`` on the GPU: contiguous tensors, or views at an
    element offset (``offsets[k]`` for list k) into larger buffers whose rest must stay as it
    was."""

    def __init__(self, sizes: List[int], n: int, offsets=None, gen=None):
        self.sizes, self.bases, self.lists = sizes, [], []
        for k in range(n):
            off = 0 if offsets is None else offsets[k]
            base = torch.randn(sum(sizes) + off * len(sizes) + 1, generator=gen).to(DEV)
            views, pos = [], 0
            for s in sizes:
                pos += off
                views.append(base[pos:pos + s])
                pos += s
            self.bases.append((base, base.clone()))
            self.lists.append(views)

    def outside_unchanged(self, k: int) -> bool:
        """Whether list k's buffer is unchanged outside its views."""
        base, before = self.bases[k]
        mask = torch.ones(base.numel(), dtype=torch.bool, device=DEV)
        for t in self.lists[k]:
            start = t.data_ptr() // 4 - base.data_ptr() // 4
            mask[start:start + t.numel()] = False
        return torch.equal(base[mask], before[mask])


def _np(ts) -> List[np.ndarray]:
    return [t.detach().cpu().numpy().copy() for t in ts]


SIZE_CASES = {
    "1": [1],
    "3": [3],
    "4099": [4099],
    "2^20+5": [2**20 + 5],
    "300_small": None,  # filled in below, seeded
    "with_empty": [0, 5, 0, 64, 0],
    # 45 tensors (over one launch's tensor slots), then one over one launch's 320 blocks of 64Ki
    "launch_edges": [100] * 45 + [320 * 65536 + 3 * 65536 + 5] + [7] * 70,
}
_rng = random.Random(3)
SIZE_CASES["300_small"] = [_rng.randint(1, 700) for _ in range(300)]
ALIGN = {"aligned": None, "misaligned": [1, 3, 0, 2]}


def _positive(ts):
    """Variances: squares, some exact zeros."""
    for t in ts:
        t.mul_(t)
        if t.numel() > 10:
            t[:: 7] = 0.0


# ---------------------------------------------------------------------------------------------
# Kernels against the oracle.


def _cases(*variants):
    """(case, align, variant) for every size case and alignment; the 21M-element case only with
    the first variant (it crosses a launch's 320 blocks; once per alignment is enough)."""
    return [(c, a, v) for c in SIZE_CASES for a in ALIGN for v in variants
            if c != "launch_edges" or v == variants[0]]


@pytest.mark.parametrize("case,align,m_kind", _cases("m", "none", "alias"))
@gpu
def test_onebit_momentum_bit_exact(case, align, m_kind):
    sizes = SIZE_CASES[case]
    gen = torch.Generator().manual_seed(1)
    L = Lists(sizes, 3, ALIGN[align], gen)
    outs, ms, gs = L.lists
    if m_kind == "alias":
        for o, m in zip(outs, ms):
            o.copy_(m)
        ms = outs
    m_in = _np(ms) if m_kind != "none" else [None] * len(sizes)
    g_in = _np(gs)
    b1 = 0.9
    _fused.onebit_momentum(ms if m_kind != "none" else [None] * len(sizes), gs,
                           {"betas": (b1, 0.999)}, outs)
    torch.cuda.synchronize()
    for o, m, g in zip(outs, m_in, g_in):
        assert ulps(o.cpu().numpy(), ref_momentum(m, g, b1)) == 0
    if m_kind == "m":
        for m, before in zip(ms, m_in):
            assert np.array_equal(m.cpu().numpy(), before)  # m is only read
    for k in range(3):
        assert L.outside_unchanged(k)


def _lowp_list(ws, pattern):
    """Low-precision parameter tensors for some of ``ws``: ``pattern`` cycles over None/dtypes."""
    out = []
    for i, w in enumerate(ws):
        dt = pattern[i % len(pattern)]
        out.append(None if dt is None else torch.full_like(w, 7.0, dtype=dt))
    return out


LOWP = {"fp32": [None], "bf16": [torch.bfloat16], "fp16": [torch.float16],
        "mixed": [torch.bfloat16, None, torch.float16]}


@pytest.mark.parametrize("case,align,variant", _cases("bc_wd/mixed", "plain/fp32", "plain/bf16",
                                                      "bc_wd/fp16"))
@pytest.mark.parametrize("kind", ["compressed", "warmup", "local"])
@gpu
def test_step_bit_exact(kind, case, align, variant):
    group, lowp = variant.split("/")
    sizes, hp = SIZE_CASES[case], GROUPS[group]
    gen = torch.Generator().manual_seed(2)
    L = Lists(sizes, 4, ALIGN[align], gen)
    xs, ms, vs, ws = L.lists  # xs: averaged momenta (compressed) or gradients (warm-up, local)
    _positive(vs)
    lowps = _lowp_list(ws, LOWP[lowp])
    if align == "misaligned":  # odd 2-byte offsets: the scalar path for the low-precision output
        lowps = [None if t is None else torch.zeros(t.numel() + 1, dtype=t.dtype, device=DEV)[1:]
                 for t in lowps]
    x0, m0, v0, w0 = (_np(t) for t in (xs, ms, vs, ws))
    t1, t2 = 7, (7 if kind == "warmup" else 3)  # the variance frozen at step 3
    step = {"compressed": _fused.onebit_compressed_step_, "warmup": _fused.adam_warmup_step_,
            "local": _fused.onebit_local_step_}[kind]
    step(ws, ms, vs, xs, hp, t1, t2, lowps)
    torch.cuda.synchronize()
    for i in range(len(sizes)):
        if kind == "compressed":
            m_ref, v_ref = x0[i], v0[i]
        elif kind == "local":  # the momentum, then the compressed step with it as the average
            m_ref, v_ref = ref_momentum(m0[i], x0[i], hp["betas"][0]), v0[i]
        else:
            m_ref, v_ref = ref_moments(m0[i], v0[i], x0[i], hp)
        w_ref = ref_step(m_ref, v_ref, w0[i], hp, t1, t2)
        assert ulps(ms[i].cpu().numpy(), m_ref) == 0, i
        assert ulps(vs[i].cpu().numpy(), v_ref) == 0, i
        assert ulps(ws[i].cpu().numpy(), w_ref) == 0, i
        assert np.array_equal(xs[i].cpu().numpy(), x0[i])  # read only
        if lowps[i] is not None:
            want = torch.from_numpy(w_ref).to(lowps[i].dtype)
            assert torch.equal(lowps[i].cpu().view(torch.int16), want.view(torch.int16)), i
    for k in range(4):
        assert L.outside_unchanged(k)


@gpu
def test_nothing_to_do_and_bad_arguments_raise():
    hp = GROUPS["plain"]
    _fused.onebit_compressed_step_([], [], [], [], hp, 1, 1)  # no tensors: nothing launched
    a = [torch.ones(5, device=DEV)]
    with pytest.raises(TypeError, match="'ms'.*float32"):
        _fused.onebit_compressed_step_(a, [torch.ones(5, device=DEV, dtype=torch.float64)], a, a,
                                       hp, 1, 1)
    with pytest.raises(ValueError, match="'vs'.*contiguous"):
        _fused.onebit_compressed_step_(a, a, [torch.ones(5, 2, device=DEV).t()[0]], a, hp, 1, 1)
    with pytest.raises(ValueError, match="'avgs'.*elements"):
        _fused.onebit_compressed_step_(a, a, a, [torch.ones(4, device=DEV)], hp, 1, 1)
    with pytest.raises(ValueError, match="'gs' must hold CUDA tensors"):
        _fused.onebit_momentum(a, [torch.ones(5)], hp, a)
    with pytest.raises(TypeError, match="'lowps'"):
        _fused.adam_warmup_step_(a, a, a, a, hp, 1, 1, [torch.ones(5, device=DEV)])
    with pytest.raises(ValueError, match="must hold 1 tensors"):
        _fused.onebit_momentum(a, a, hp, a + a)


def test_cpu_tensors_are_refused_and_usable_says_no():
    """Runs everywhere: CPU tensors never take the fused path and the API names the argument."""
    hp = GROUPS["plain"]
    cpu = [torch.ones(3)]
    assert not _fused.supported(cpu)
    assert not _fused.usable(hp, cpu)
    # without CUDA kernels: UnsupportedError; with them: the argument is named
    with pytest.raises((ValueError, UnsupportedError), match="CUDA"):
        _fused.onebit_momentum(cpu, cpu, hp, cpu)


# ---------------------------------------------------------------------------------------------
# OneBitAdam: fused vs foreach vs CPU at W=1.


def _trajectory(device: str, dtype: torch.dtype, steps: int = 5, mask: bool = False):
    """Parameters after each of ``steps`` OneBitAdam steps (2 warm-up, then compressed)."""
    gen = torch.Generator().manual_seed(5)
    shapes = [(33, 17), (4099,), (1,), (64, 64), (3,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device=device, dtype=dtype))
              for s in shapes]
    # |g| in [0.5, 1.5]: no near-zero frozen variance that would blow the updates up (and with
    # them the last-bit differences of the paths)
    grads = [[torch.randn(s, generator=gen).sign() * (0.5 + torch.rand(s, generator=gen))
              for s in shapes] for _ in range(steps)]
    groups = [{"params": params[:3], "weight_decay": 0.01},
              {"params": params[3:4], "bias_correction": True},
              {"params": params[4:], "bias_correction": True, "weight_decay": 0.1}]
    if mask:
        groups[1]["exp_avg_mask"] = (torch.rand(64, 64, generator=gen) > 0.3).float()
    opt = OneBitAdam(groups, lr=1e-2, freeze_step=2)
    out = []
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.to(device=device, dtype=dtype)
        opt.step()
        out.append([p.detach().float().cpu().clone() for p in params])
    moments = [opt.state[p]["exp_avg"].cpu() for p in params]
    return out, moments


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).split(".")[-1])
@gpu
def test_onebit_adam_fused_matches_foreach_and_cpu(dtype, monkeypatch):
    fused, fm = _trajectory(DEV, dtype)
    monkeypatch.setenv("COMPCOMM_FUSED_OPTIM", "0")
    assert not _fused.enabled()
    foreach, em = _trajectory(DEV, dtype)
    cpu, cm = _trajectory("cpu", dtype)
    monkeypatch.delenv("COMPCOMM_FUSED_OPTIM")
    lowp_ulp = 0.0 if dtype == torch.float32 else 2.0 ** -7  # one rounding of bf16/fp16 apart
    for step, (a, b, c) in enumerate(zip(fused, foreach, cpu)):
        for x, y, z in zip(a, b, c):
            # torch's CUDA ops contract into FMAs: a few ulps apart after 5 steps
            tol = dict(rtol=8 * 2.0 ** -23 + lowp_ulp, atol=1e-7)
            torch.testing.assert_close(x, y, **tol, msg=f"fused vs foreach, step {step}")
            torch.testing.assert_close(x, z, **tol, msg=f"fused vs CPU, step {step}")
    for x, y in zip(fm, em):
        torch.testing.assert_close(x, y, rtol=8 * 2.0 ** -23, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16],
                         ids=lambda d: str(d).split(".")[-1])
@gpu
def test_one_rank_compressed_step_is_one_pass_with_the_staged_bits(dtype, monkeypatch):
    """At W=1 the compressed phase runs _fused.onebit_local_step_ (one pass, no staging), and
    the trajectory and moments are the staged path's (momentum kernel, then the compressed
    step) bit for bit."""
    calls = []
    real = _fused.onebit_local_step_
    monkeypatch.setattr(_fused, "onebit_local_step_",
                        lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    one_pass, m1 = _trajectory(DEV, dtype)
    assert len(calls) == 3 * 3  # 3 compressed steps x 3 param groups
    monkeypatch.setattr(OneBitAdam, "_local_runs", lambda self: None)  # the general path
    staged, m2 = _trajectory(DEV, dtype)
    assert len(calls) == 9
    for a, b in zip(one_pass[-1] + m1, staged[-1] + m2):
        assert torch.equal(a, b)


@gpu
def test_onebit_adam_with_mask_keeps_the_foreach_path():
    """A group with exp_avg_mask takes the foreach path, the other group the fused one."""
    a, am = _trajectory(DEV, torch.float32, mask=True)
    b, bm = _trajectory("cpu", torch.float32, mask=True)
    for x, y in zip(a[-1] + am, b[-1] + bm):
        torch.testing.assert_close(x, y, rtol=8 * 2.0 ** -23, atol=1e-7)
    assert torch.equal(am[3] == 0, bm[3] == 0) and (am[3] == 0).sum() > 1000  # masked elements
