"""1-bit LAMB's compressed-phase step as C++ passes on the CPU (``cpp/kernels/cpu_lamb.h``) and
their multi-tensor CUDA twins (``cpp/kernels/cuda_lamb.cu``): a momentum pass before the exchange,
then a statistics pass (the fresh variance, the max ratio and the direction's norms) and an apply
pass, where the torch ops take about twenty passes (and on a GPU as many launches) per parameter.
Per element the passes give the bits of the torch ops of
:func:`compcomm.optim.functional.onebit_lamb_update` and the step, for the same scalars (with the
square root the CPU's torch computes, the correctly rounded one on a GPU: there the CUDA passes
equal the CPU passes bit for bit, while torch's own CUDA ops round some divisions differently); the
norms are fp64 sums of the exact squares rounded to fp32 (torch's are fp32 sums), so the factor,
and with it the step's coefficient, can differ from the torch ops' in its last bits. The lists are
passed as data pointers, one crossing into C++ per list (on CUDA: one launch per ~20M elements, the
statistics read back in one host sync); ``check=False`` skips the tensor checks where the caller
made the tensors itself. The tensors of a call are all on the CPU or all on one CUDA device.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .. import _C
from . import _fused
from . import functional as F
from ._cpu_args import F32, K, Group, check, sqrt_mode, threads, torch_sqrt_mode

__all__ = ["coeffs", "momentums_", "stats_", "applies_", "kernels_match_torch", "usable"]

_CK = getattr(_C, "optim_cuda", None)

Tensors = Sequence[torch.Tensor]


def coeffs(group: Group, t: int, freeze_step: int, v_is_sqrt: bool,
           sqrt: Optional[str] = None) -> Any:
    """The kernels' scalars for step ``t`` of ``group`` (``v_is_sqrt``: the ``vs`` passed hold
    ``sqrt(v)``; ``sqrt``: the kernels' square root, torch's where None)."""
    b1, b2 = group["betas"]
    return K.LambCoeffs(float(b1), float(b2), float(group["eps"]), float(group["weight_decay"]),
                        bool(group["bias_correction"]), 1.0 - b1 ** t, F.sqrt_bc(b2, freeze_step),
                        bool(v_is_sqrt), sqrt_mode(sqrt))


def _checked(fn: str, lists: Dict[str, Tensors], n: List[int]) -> None:
    for name, ts in lists.items():
        if len(ts) != len(n):
            raise ValueError(f"{fn}: {name} must hold {len(n)} tensors, got {len(ts)}")
        for i, x in enumerate(ts):
            check(f"{fn}[{i}]", name, x, F32, n[i])


def _ptrs(ts: Tensors) -> List[int]:
    return [x.data_ptr() for x in ts]


def _on_cuda(ts: Tensors) -> bool:
    return bool(ts) and isinstance(ts[0], torch.Tensor) and ts[0].is_cuda


def _cuda_ptrs(ts: Tensors, name: str, n: List[int], device: int, check: bool) -> List[int]:
    _fused.require()
    return _fused.ptrs(ts, name, n, device, check)


def momentums_(c: Any, ms: Tensors, gs: Tensors, lasts: Tensors, scales: Sequence[float],
               num_threads: Optional[int] = None, check: bool = True) -> None:
    """Before the exchange: ``lasts[i] = ms[i]``, then ``ms[i] = (b1 m + (1-b1) g) * scales[i]``
    (``m.mul_(b1).add_(g, alpha=1-b1).mul_(scale)``)."""
    n = [m.numel() for m in ms]
    if _on_cuda(ms):
        dev = ms[0].get_device()
        _CK.lamb_momentum(c, n, _cuda_ptrs(ms, "ms", n, dev, check),
                          _cuda_ptrs(gs, "gs", n, dev, check),
                          _cuda_ptrs(lasts, "lasts", n, dev, check), [float(s) for s in scales],
                          dev, _fused.stream(dev))
        return
    if check:
        _checked("lamb momentums_", {"m": ms, "g": gs, "last": lasts}, n)
    K.lamb_momentums(c, n, _ptrs(ms), _ptrs(gs), _ptrs(lasts), [float(s) for s in scales],
                     threads(num_threads))


def stats_(c: Any, ms: Tensors, lasts: Optional[Tensors], vs: Tensors, vfs: Tensors, ws: Tensors,
           scales: Sequence[float], num_threads: Optional[int] = None, check: bool = True,
           gs: Optional[Tensors] = None, gate: Optional[torch.Tensor] = None
           ) -> List[Tuple[float, float, float]]:
    """After the exchange, per parameter: ``ms[i] /= scales[i]``, the fresh variance ``vfs[i]``
    updated from the reconstructed gradient; returns ``(max ratio, ||u||, ||u + wd w||)`` per
    parameter (the norms rounded to fp32, as torch's). ``gs`` instead of ``lasts``: a world of one
    rank (the average is the momentum itself), :func:`momentums_` done in this pass. ``gate``
    (CUDA only): the inputs' finiteness verdict on the device (``_bucketing.finite_gate``);
    where False the pass writes nothing and the returned values are meaningless."""
    n = [m.numel() for m in ms]
    if _on_cuda(ms):
        dev = ms[0].get_device()
        partials = torch.empty(3 * _CK.lamb_partials(n), dtype=torch.float64, device=ms[0].device)
        out = torch.empty(3 * len(n), dtype=torch.float32, device=ms[0].device)
        _CK.lamb_stats(c, n, _cuda_ptrs(ms, "ms", n, dev, check),
                       [] if gs is not None else _cuda_ptrs(lasts, "lasts", n, dev, check),
                       [] if gs is None else _cuda_ptrs(gs, "gs", n, dev, check),
                       _cuda_ptrs(vs, "vs", n, dev, check), _cuda_ptrs(vfs, "vfs", n, dev, check),
                       _cuda_ptrs(ws, "ws", n, dev, check), [float(s) for s in scales],
                       partials.data_ptr(), out.data_ptr(), dev, _fused.stream(dev),
                       gate=_fused.gate_ptr(gate, dev))
        return [tuple(r) for r in out.view(-1, 3).tolist()]  # the one host sync
    if gate is not None:
        raise ValueError("argument 'gate' is for CUDA tensors only")
    if check:
        prev = {"g": gs} if gs is not None else {"last": lasts}
        _checked("lamb stats_", {"m": ms, **prev, "v": vs, "v_fresh": vfs, "w": ws}, n)
    return K.lamb_stats(c, n, _ptrs(ms), [] if gs is not None else _ptrs(lasts), _ptrs(vs),
                        _ptrs(vfs), _ptrs(ws), [float(s) for s in scales], threads(num_threads),
                        gs=[] if gs is None else _ptrs(gs))


def applies_(c: Any, ms: Tensors, vs: Tensors, ws: Tensors, neg_steps: Sequence[float],
             num_threads: Optional[int] = None, check: bool = True) -> None:
    """``ws[i] += (u + wd w) * neg_steps[i]`` (``w.add_(update * (-lr * coeff))``)."""
    n = [w.numel() for w in ws]
    if _on_cuda(ws):
        dev = ws[0].get_device()
        _CK.lamb_apply(c, n, _cuda_ptrs(ms, "ms", n, dev, check),
                       _cuda_ptrs(vs, "vs", n, dev, check), _cuda_ptrs(ws, "ws", n, dev, check),
                       [float(s) for s in neg_steps], dev, _fused.stream(dev))
        return
    if check:
        _checked("lamb applies_", {"m": ms, "v": vs, "w": ws}, n)
    K.lamb_applies(c, n, _ptrs(ms), _ptrs(vs), _ptrs(ws), [float(s) for s in neg_steps],
                   threads(num_threads))


_matches: Optional[bool] = None


def kernels_match_torch() -> bool:
    """Whether the passes give, on this machine, the torch ops' bits per element (the momentum,
    the unscaled momentum, the fresh variance and the new parameters, for the same step
    coefficient), and the same max ratio where the kernels compute torch's square root. Checked
    once on random tensors of odd sizes, with and without bias correction and weight decay."""
    global _matches
    if _matches is None:
        gen = torch.Generator().manual_seed(2)
        mode = torch_sqrt_mode()
        ok = True
        for n, bc, wd in ((7, False, 0.0), (4099, True, 0.01), (1031, True, 0.0),
                          (70001, False, 0.1)):
            group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": wd,
                     "bias_correction": bc}
            w, m, g = (torch.randn(n, generator=gen) for _ in range(3))
            v, vf = (torch.rand(n, generator=gen) * 1e-2 for _ in range(2))
            scale = 1.7
            ref_m, ref_vf, ref_w = m.clone(), vf.clone(), w.clone()
            last = ref_m.clone()
            ref_m.mul_(0.9).add_(g, alpha=1 - 0.9).mul_(scale)
            mine_m, mine_vf, mine_w, mine_last = m.clone(), vf.clone(), w.clone(), torch.empty(n)
            c = coeffs(group, 7, 5, mode is None)
            sq = v.sqrt() if mode is None else v
            momentums_(c, [mine_m], [g], [mine_last], [scale], 1, check=False)
            ok = ok and torch.equal(mine_m, ref_m) and torch.equal(mine_last, last)
            ref_m.div_(scale)
            update, _ = F.onebit_lamb_update(ref_w, ref_m, last, v, ref_vf, group, 7, 5, 1.0,
                                             0.0, 10.0, 1e9)
            ratio = float(((v.sqrt() + group["eps"]) / (ref_vf.sqrt() + group["eps"])).max())
            ref_w.add_(update * -3e-3)
            (r, _, _), = stats_(c, [mine_m], [mine_last], [sq], [mine_vf], [mine_w], [scale], 1,
                                check=False)
            applies_(c, [mine_m], [sq], [mine_w], [-3e-3], 1, check=False)
            ok = (ok and torch.equal(mine_m, ref_m) and torch.equal(mine_vf, ref_vf)
                  and torch.equal(mine_w, ref_w) and (mode is None or r == ratio))
        _matches = bool(ok)
    return _matches


def usable(tensors: Sequence[torch.Tensor], groups: Sequence[Dict[str, Any]]) -> bool:
    """Whether the passes may run 1-bit LAMB's compressed step over ``tensors`` (the fused
    momentum, the parameters' fp32 weights and gradients): all fp32 and contiguous, no
    ``exp_avg_mask`` in ``groups``, not switched off (``COMPCOMM_FUSED_OPTIM=0``), and either all
    on the CPU with the torch ops' bits here (:func:`kernels_match_torch`) or all on one CUDA
    device of a build with the CUDA kernels."""
    if (os.environ.get("COMPCOMM_FUSED_OPTIM", "1") == "0" or not tensors
            or any(g.get("exp_avg_mask") is not None for g in groups)):
        return False
    if tensors[0].is_cuda:
        return _fused.available() and _fused.supported(tensors)
    return (all(x.is_cpu and x.dtype == torch.float32 and x.is_contiguous() for x in tensors)
            and kernels_match_torch())
