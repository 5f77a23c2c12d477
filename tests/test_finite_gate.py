"""The gradients' finiteness verdict as a device gate (``compcomm._bucketing.finite_gate``).

On a GPU the one-rank compressed steps of OneBitAdam and OneBitLamb queue the check, pass its
verdict to the kernels as a device byte and launch at once; a kernel whose gate is 0 writes
nothing, and the host reads the verdict after the launch, before it changes any state of its own.
Tested here: the verdicts (fp32 lists through compcomm's multi-tensor kernel, against numpy and
the CPU twin ``all_finite``; other dtypes through torch's max-norm), that a closed gate leaves
every tensor as it was (and an open one gives the ungated bits), and that a non-finite gradient
skips the optimizer step with nothing written and the later steps' bits unchanged. The argument
checks run on the CPU too.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List

import pytest
import torch

import numpy as np

from compcomm import _C
from compcomm._bucketing import all_finite, finite_gate
from compcomm.optim import OneBitAdam, OneBitLamb, _fused, lamb_passes
from _backends import no_cuda_kernels, no_gpu, skipif



def gpu(fn):
    """Marks a test that needs a CUDA device and the CUDA kernels (else skipped, with why)."""
    return pytest.mark.gpu(skipif(no_gpu() or no_cuda_kernels())(fn))


# 44 tensors (more than one launch's 40 of the Adam kernels and 32 of LAMB's), odd sizes
SIZES = [1, 4099, 70001, 2**20 + 3] * 11
GROUP = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
         "bias_correction": True}


def test_gate_must_be_a_byte_on_the_kernels_device():
    assert _fused.gate_ptr(None, 0) == 0
    with pytest.raises(ValueError, match="'gate' must be a bool or uint8 tensor on cuda:0"):
        _fused.gate_ptr(torch.ones((), dtype=torch.bool), 0)  # on the CPU
    with pytest.raises(ValueError, match="'gate'"):
        _fused.gate_ptr(torch.ones(()), 0)  # not a byte


def test_lamb_statistics_take_a_gate_on_cuda_only():
    ms, gs, vs, vfs, ws = ([torch.rand(5)] for _ in range(5))
    c = lamb_passes.coeffs(GROUP, 9, 4, False, "ieee")
    with pytest.raises(ValueError, match="'gate' is for CUDA tensors only"):
        lamb_passes.stats_(c, ms, None, vs, vfs, ws, [1.0], 1, gs=gs,
                           gate=torch.ones((), dtype=torch.bool))


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_verdicts(dtype):
    dev = torch.device("cuda", torch.cuda.current_device())
    ts = [torch.randn(n, device=dev).to(dtype) for n in (3, 70001, 5)]
    ts[1][7] = torch.finfo(dtype).max  # the largest finite value is finite
    gate, verdict = finite_gate(ts, dev)
    assert verdict() and bool(gate) and gate.device == dev and gate.dtype == torch.bool
    for bad in (float("nan"), float("inf"), float("-inf")):
        ts[2][-1] = bad  # the last element of the last tensor
        gate, verdict = finite_gate(ts + [torch.empty(0, device=dev)], dev)
        assert not verdict() and not bool(gate), bad
        ts[2][-1] = 0.0
    # another dtype in the same list is checked too; no tensor (or only empty ones): finite
    bad16 = torch.tensor([1.0, float("nan")], device=dev, dtype=torch.bfloat16)
    assert not finite_gate([torch.ones(4, device=dev), bad16], dev)[1]()
    for empty in ([], [torch.empty(0, device=dev)]):
        gate, verdict = finite_gate(empty, dev)
        assert verdict() and bool(gate)


def test_the_gate_kernel_checks_its_lists():
    k = getattr(_C, "optim_cuda", None)
    if k is None or not hasattr(k, "finite_gate"):
        pytest.skip("no optim_cuda.finite_gate in this build")
    with pytest.raises(ValueError, match="'x' must hold 1 pointers"):
        k.finite_gate([3], [], 1, 0)
    with pytest.raises(ValueError, match="'gate' must be the address of a device byte"):
        k.finite_gate([], [], 0, 0)


@gpu
def test_the_gate_kernel_matches_numpy_and_the_cpu_twin(monkeypatch):
    """130 fp32 tensors (more than one launch's 96; chunk-crossing, tiny and misaligned ones, whose
    elements take the scalar path): one non-finite value anywhere closes the gate, as numpy's
    isfinite and the CPU check (``all_finite``) say; the fp32 lists go through the kernel."""
    calls = []
    real = _C.optim_cuda.finite_gate
    monkeypatch.setattr(_C.optim_cuda, "finite_gate",
                        lambda *a: calls.append(len(a[0])) or real(*a))
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(3)
    sizes = [1, 3, 4, 5, 65536, 65537, 2 * 65536 + 7, 1000] * 16 + [2**21 + 1, 9]
    host = [torch.randn(n, generator=g) * 1e3 for n in sizes]
    base = torch.randn(4101, generator=g)
    host[-1] = base[1:10]  # a contiguous view at an odd offset: no 16-byte loads
    ts = [x.to(dev) for x in host]
    ts[-1] = base.to(dev)[1:10]
    assert len(calls) == 0 and finite_gate(ts, dev)[1]() and len(calls) == 1 and calls[0] == 130
    places = [(0, 0), (5, 65536), (6, 65536 * 2 + 6), (6, 65535), (128, 2**21), (129, 8), (42, 2)]
    for (i, j), bad in zip(places, [float("nan"), float("inf"), float("-inf")] * 3):
        keep = ts[i][j].item()
        ts[i][j] = bad
        host_i = host[i].clone()
        host_i[j] = bad
        hosts = host[:i] + [host_i] + host[i + 1:]
        want = all(np.isfinite(x.numpy()).all() for x in hosts)
        assert not want and all_finite(hosts) is False
        gate, verdict = finite_gate(ts, dev)
        assert verdict() is False and not bool(gate), (i, j, bad)
        ts[i][j] = keep
    gate, verdict = finite_gate(ts, dev)
    assert verdict() and bool(gate) and len(calls) == 2 + len(places)
    # largest finite values are finite; a bf16 tensor in the list sends it to torch's max-norm
    ts[3][1] = torch.finfo(torch.float32).max
    assert finite_gate(ts, dev)[1]()
    n = len(calls)
    assert not finite_gate(ts + [torch.tensor([float("nan")], device=dev).bfloat16()], dev)[1]()
    assert len(calls) == n


@gpu
def test_the_gate_kernel_spans_launches():
    """One tensor of more than two launches' worth of chunks (320 chunks of 65536 a launch): a bad
    value in the first chunk, in the first chunk of the second launch, or in the last element
    closes the gate; each launch's blocks read the right part of the tensor."""
    dev = torch.device("cuda", torch.cuda.current_device())
    per_launch = 320 * 65536
    big = torch.zeros(2 * per_launch + 77, device=dev)
    small = torch.ones(5, device=dev)
    assert finite_gate([small, big, small], dev)[1]()
    for j in (0, per_launch - 1, per_launch, per_launch + 65536 * 3 + 1, 2 * per_launch,
              big.numel() - 1):
        big[j] = float("nan")
        assert finite_gate([small, big, small], dev)[1]() is False, j
        big[j] = 0.0
    assert finite_gate([small, big, small], dev)[1]()


def _adam_lists(seed: int) -> List[List[Any]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(SIZES):
        w, m, x = (torch.randn(n, generator=g).cuda() for _ in range(3))
        v = (torch.rand(n, generator=g) * 1e-2).cuda()
        low = w.to(torch.bfloat16) if i % 2 else None
        out.append([w, m, v, x, low])
    return out


def _clone(cols: List[List[Any]]) -> List[List[Any]]:
    return [[None if t is None else t.clone() for t in c] for c in cols]


def _equal(a: List[List[Any]], b: List[List[Any]]) -> bool:
    return all((x is None and y is None) or torch.equal(x, y)
               for ca, cb in zip(a, b) for x, y in zip(ca, cb))


@gpu
@pytest.mark.parametrize("fn", ["onebit_local_step_", "onebit_compressed_step_",
                                "adam_warmup_step_"])
def test_a_closed_gate_writes_nothing_an_open_one_changes_no_bit(fn):
    step = getattr(_fused, fn)
    cols = _adam_lists(1)
    before = _clone(cols)

    def run(cs, gate):
        ws, ms, vs, xs, lows = (list(z) for z in zip(*cs))
        step(ws, ms, vs, xs, GROUP, 5, 4, lows, gate=gate)
        torch.cuda.synchronize()

    run(cols, torch.zeros((), dtype=torch.bool, device="cuda"))
    assert _equal(cols, before)
    ungated = _clone(cols)
    run(ungated, None)
    assert not _equal(ungated, before)  # the step writes where it may
    run(cols, torch.ones((), dtype=torch.uint8, device="cuda"))
    assert _equal(cols, ungated)


@gpu
def test_a_closed_gate_keeps_the_lamb_statistics_pass_from_writing():
    g = torch.Generator().manual_seed(2)
    cols = [[torch.randn(n, generator=g).cuda() for _ in range(3)]
            + [(torch.rand(n, generator=g) * 1e-2).cuda() for _ in range(2)] for n in SIZES]
    c = lamb_passes.coeffs(GROUP, 9, 4, False, "ieee")
    scales = [1.0 + i % 3 for i in range(len(SIZES))]

    def run(cs, gate):
        ws, ms, gs, vs, vfs = (list(z) for z in zip(*cs))
        out = lamb_passes.stats_(c, ms, None, vs, vfs, ws, scales, gs=gs, check=False, gate=gate)
        torch.cuda.synchronize()
        return out

    before = _clone(cols)
    run(cols, torch.zeros((), dtype=torch.bool, device="cuda"))
    assert _equal(cols, before)
    ungated = _clone(cols)
    stats = run(ungated, None)
    assert not _equal(ungated, before)
    assert run(cols, torch.ones((), dtype=torch.bool, device="cuda")) == stats
    assert _equal(cols, ungated)


def _snapshot(opt: torch.optim.Optimizer, ps: List[torch.Tensor]) -> List[Any]:
    out = [p.detach().clone() for p in ps]
    for p in ps:
        out.append({k: v.clone() if torch.is_tensor(v) else copy.deepcopy(v)
                    for k, v in opt.state[p].items()})
    return out


def _same(a: List[Any], b: List[Any]) -> bool:
    for x, y in zip(a, b):
        if torch.is_tensor(x):
            if not torch.equal(x, y):
                return False
        elif x.keys() != y.keys() or any(
                not (torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k])
                for k in x):
            return False
    return len(a) == len(b)


@gpu
@pytest.mark.parametrize("cls", [OneBitAdam, OneBitLamb])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad_step", [2, 4], ids=["first_compressed", "later"])
def test_a_nonfinite_gradient_skips_the_gated_step_with_nothing_written(cls, dtype, bad_step,
                                                                        monkeypatch):
    # the gated kernels must be what runs (a spy on their entry points records the gates)
    gates: List[Any] = []
    name, module = (("onebit_local_step_", _fused) if cls is OneBitAdam
                    else ("stats_", lamb_passes))
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: gates.append(k.get("gate")) or real(*a, **k))
    shapes = [(33, 17), (129,), (5,), (70001,)]
    gen = torch.Generator().manual_seed(11)
    grads = [[torch.randn(s, generator=gen) * 0.01 for s in shapes] for _ in range(7)]

    def make():
        ps = [torch.nn.Parameter((torch.randn(s, generator=torch.Generator().manual_seed(i))
                                  * 0.1).to("cuda", dtype)) for i, s in enumerate(shapes)]
        return ps, cls(ps, lr=1e-2, freeze_step=2, weight_decay=0.01)

    ps, opt = make()
    ref_ps, ref = make()
    skipped: Dict[str, Any] = {}
    for i, gs in enumerate(grads):
        if i == bad_step:  # steps 0 and 1 warm up (freeze_step=2); step 2 is the first compressed
            for p, g in zip(ps, gs):
                p.grad = g.to("cuda", dtype)
            ps[-1].grad[-1] = float("nan")  # the last element of the last gradient
            before = _snapshot(opt, ps)
            n_gates = len(gates)
            with pytest.warns(RuntimeWarning, match="non-finite gradient"):
                opt.step()
            skipped = {"steps": opt.skipped_steps, "gated": gates[n_gates:],
                       "same": _same(before, _snapshot(opt, ps))}
        for pp, oo in ((ps, opt), (ref_ps, ref)):
            for p, g in zip(pp, gs):
                p.grad = g.to("cuda", dtype)
            oo.step()
    assert skipped["steps"] == 1
    assert skipped["gated"] and all(g is not None for g in skipped["gated"])
    assert skipped["same"], "the skipped step wrote state"
    # after the skipped step, the bits of a run that never met it
    assert _same(_snapshot(opt, ps), _snapshot(ref, ref_ps))
    assert opt.schedule.step == ref.schedule.step
