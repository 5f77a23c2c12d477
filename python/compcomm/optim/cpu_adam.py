"""A fast CPU Adam / AdamW (DeepSpeed's ``DeepSpeedCPUAdam`` without DeepSpeed) and the 1-bit Adam
updates as one C++ pass per tensor.

The C++ kernels (``cpp/kernels/cpu_adam.h``) read and write fp32 ``w``, ``m`` and ``v`` and the
gradient once, vectorised (AVX-512, AVX2 or a generic path chosen at run time, all giving the same
bits) and multi-threaded, and can write a bf16/fp16 copy of the new parameter in the same pass.

- :func:`adam_step_` is one step of ``torch.optim.AdamW`` (or ``Adam`` with L2 weight decay) with
  torch's CPU numerics: the same fp32 operations in the same order, fused multiply-adds where
  torch's CPU kernels fuse them.
- :func:`onebit_warmup_step_` and :func:`onebit_compressed_step_` are the 1-bit Adam rules of
  :mod:`compcomm.optim.functional` (``adam_moments_`` + ``adam_step_``; ``m.copy_(averaged)``, the
  mask, ``adam_step_`` with the frozen ``bc2_t``) and give bit for bit the results of those torch
  ops on the CPU.
- The square root is torch's: on x86 builds with MKL on AVX-512 CPUs, torch's CPU ``sqrt`` is
  MKL's, which is not correctly rounded for ~0.6% of inputs; the kernels reproduce it
  (``sqrt="rsqrt14"``) or give the correctly rounded one (``"ieee"``), and by default use
  whichever torch computes on this machine (:func:`torch_sqrt_mode`, probed once).
- :class:`CPUAdam` is a ``torch.optim.Optimizer`` using :func:`adam_step_` for CPU parameters
  (ZeRO-Offload's optimizer), fp32 state, an fp32 master copy for bf16/fp16 parameters.

>>> import torch
>>> from compcomm.optim import CPUAdam
>>> model = torch.nn.Linear(4, 2)
>>> opt = CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
>>> model(torch.randn(3, 4)).sum().backward()
>>> opt.step()
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Optional, Sequence, Tuple

import torch

from .._buffers import DTYPES, buffer_of
from ._cpu_args import F32 as _F32
from ._cpu_args import FLOATS as _FLOATS
from ._cpu_args import K as _K
from ._cpu_args import Group, torch_sqrt_mode
from ._cpu_args import check as _check
from ._cpu_args import sqrt_mode as _sqrt_mode
from ._cpu_args import state_args as _state_args
from ._cpu_args import threads as _threads
from .cpu_multi import steps_

__all__ = ["CPUAdam", "adam_step_", "onebit_warmup_step_", "onebit_compressed_step_",
           "kernel_isa", "torch_sqrt_mode", "matches_torch_rules", "onebit_local_step_",
           "onebit_local_steps_", "onebit_momentum_", "all_finite"]

def kernel_isa() -> str:
    """The instruction set the kernels use here: ``'avx512'``, ``'avx2'`` or ``'generic'``."""
    return _K.isa()


_matches: Dict[bool, bool] = {}


def matches_torch_rules(denom: bool = False) -> bool:
    """Whether the 1-bit kernels give, on this machine, the bits of the torch-op rules of
    :mod:`compcomm.optim.functional` (what the optimizers' trajectory tests pin down). Checked once
    by running both on the same random tensors (odd sizes: vector bodies and scalar tails; with and
    without bias correction and weight decay); the optimizers use the kernels only if it holds.

    ``denom=True`` asks it of the compressed phase's rules given the frozen denominator
    (``functional.adam_denom``, computed by torch): no square root in the kernels, so it can hold
    where :func:`torch_sqrt_mode` is None (an AMD EPYC's MKL sqrt); the optimizers then compute
    the denominators once with torch and run the compressed phase's kernels on them."""
    if denom not in _matches:
        from . import functional as F

        gen = torch.Generator().manual_seed(1)
        ok = denom or torch_sqrt_mode() is not None
        for n, bc, wd in ((7, False, 0.0), (4099, True, 0.01), (1031, True, 0.0)):
            if not ok:
                break
            group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": wd,
                     "bias_correction": bc}
            w, m, g, a = (torch.randn(n, generator=gen) for _ in range(4))
            v = torch.rand(n, generator=gen)
            d = F.adam_denom(v, group, 2) if denom else v  # what the kernels read as v
            if not denom:
                ref = [t.clone() for t in (w, m, v)]
                F.adam_moments_(ref[1], ref[2], g, group)
                F.adam_step_(ref[0], ref[1], ref[2], group, 3, 3)
                got = [t.clone() for t in (w, m, v)]
                onebit_warmup_step_(got[0], got[1], got[2], g, group, 3, 3, num_threads=1)
                ok = all(torch.equal(x, y) for x, y in zip(ref, got))
            ref = [t.clone() for t in (w, m, v)]
            ref[1].copy_(a)
            F.adam_step_(ref[0], ref[1], ref[2], group, 5, 2)
            got = [t.clone() for t in (w, m)]
            onebit_compressed_step_(got[0], got[1], d, a, group, 5, 2, num_threads=1,
                                    denom=denom)
            ok = ok and all(torch.equal(x, y) for x, y in zip(ref, got))
            ref = [t.clone() for t in (w, m, v)]
            F.onebit_momentum(ref[1], g, group, ref[1])
            F.adam_step_(ref[0], ref[1], ref[2], group, 5, 2)
            got = [t.clone() for t in (w, m)]
            onebit_local_steps_([got[0]], [got[1]], [d], [g], group, 5, 2, num_threads=1,
                                denom=denom)
            ok = ok and all(torch.equal(x, y) for x, y in zip(ref, got))
            out = torch.empty_like(m)
            onebit_momentum_(m, g, group, out, num_threads=1)
            ref = torch.empty_like(m)
            F.onebit_momentum(m, g, group, ref)
            ok = ok and torch.equal(out, ref)
        _matches[denom] = ok
    return _matches[denom]


def adam_step_(w: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, group: Group,
               step: int, adamw_mode: bool = True, param_out: Optional[torch.Tensor] = None,
               num_threads: Optional[int] = None, sqrt: Optional[str] = None) -> None:
    """One Adam/AdamW step in place, as ``torch.optim.AdamW`` (``adamw_mode``) or
    ``torch.optim.Adam`` with L2 weight decay on the CPU.

    Parameters
    ----------
    w, m, v : torch.Tensor
        fp32 parameter (or master copy), first and second moment; contiguous CPU tensors of one size.
    g : torch.Tensor
        The gradient, fp32, fp16 or bf16, same number of elements.
    group : Mapping
        ``lr``, ``betas``, ``eps``, ``weight_decay`` and ``bias_correction`` (default True).
    step : int
        The step being taken (1 for the first).
    adamw_mode : bool
        Decoupled weight decay (AdamW); False: ``g += weight_decay * w`` (Adam with L2).
    param_out : torch.Tensor, optional
        Also write the new ``w`` here (fp32, fp16 or bf16, rounded to nearest even).
    num_threads : int, optional
        Threads to use (default ``torch.get_num_threads()``).
    sqrt : str, optional
        ``'ieee'`` or ``'rsqrt14'``; default: the one torch uses here (:func:`torch_sqrt_mode`).
    """
    fn = "adam_step_"
    n, out = _state_args(fn, w, m, v, param_out)
    _check(fn, "g", g, _FLOATS, n)
    b1, b2 = group["betas"]
    _K.adam_step(buffer_of(w), buffer_of(m), buffer_of(v), buffer_of(g), float(group["lr"]),
                 float(b1), float(b2), float(group["eps"]), float(group["weight_decay"]),
                 int(step), bool(adamw_mode), bool(group.get("bias_correction", True)), out,
                 _threads(num_threads), sqrt=_sqrt_mode(sqrt))


def onebit_warmup_step_(w: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        group: Group, bc1_t: int, bc2_t: int,
                        param_out: Optional[torch.Tensor] = None,
                        num_threads: Optional[int] = None, sqrt: Optional[str] = None) -> None:
    """1-bit Adam's warm-up step in one pass: bit for bit ``functional.adam_moments_(m, v, g,
    group)`` then ``functional.adam_step_(w, m, v, group, bc1_t, bc2_t)`` on the CPU.

    Parameters
    ----------
    w, m, v : torch.Tensor
        fp32 parameter (or master copy) and moments, contiguous CPU tensors of one size.
    g : torch.Tensor
        The averaged gradient (fp32, fp16 or bf16).
    group : Mapping
        ``lr``, ``betas``, ``eps``, ``weight_decay``, ``bias_correction``.
    bc1_t, bc2_t : int
        The steps the bias corrections are taken at (as in ``functional.adam_step_``).
    param_out : torch.Tensor, optional
        Also write the new ``w`` here (fp32, fp16 or bf16): ``write_back`` in the same pass.
    num_threads : int, optional
        Threads to use (default ``torch.get_num_threads()``).
    sqrt : str, optional
        ``'ieee'`` or ``'rsqrt14'``; default: the one torch uses here (:func:`torch_sqrt_mode`).
    """
    fn = "onebit_warmup_step_"
    n, out = _state_args(fn, w, m, v, param_out)
    _check(fn, "g", g, _FLOATS, n)
    b1, b2 = group["betas"]
    _K.onebit_warmup_step(buffer_of(w), buffer_of(m), buffer_of(v), buffer_of(g),
                          float(group["lr"]), float(b1), float(b2), float(group["eps"]),
                          float(group["weight_decay"]), bool(group["bias_correction"]), int(bc1_t),
                          int(bc2_t), out, _threads(num_threads), sqrt=_sqrt_mode(sqrt))


def onebit_compressed_step_(w: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                            averaged: torch.Tensor, group: Group, bc1_t: int, bc2_t: int,
                            mask: Optional[torch.Tensor] = None,
                            param_out: Optional[torch.Tensor] = None,
                            num_threads: Optional[int] = None,
                            sqrt: Optional[str] = None, denom: bool = False) -> None:
    """1-bit Adam's compressed-phase step in one pass: bit for bit ``m.copy_(averaged)``,
    ``functional.masked_(m, mask)`` and ``functional.adam_step_(w, m, v, group, bc1_t, bc2_t)``
    (``bc2_t`` the frozen step) on the CPU. ``v`` is only read. With ``denom=True``, ``v`` holds
    the frozen denominator ``functional.adam_denom(v, group, bc2_t)`` (computed once, as ZeRO's
    no_allgather mode does) and is used as is: bit for bit
    ``functional.adam_update(m, None, w, group, bc1_t, bc2_t, denom=v)``.

    Parameters
    ----------
    w, m, v : torch.Tensor
        fp32 parameter (or master copy) and moments, contiguous CPU tensors of one size.
    averaged : torch.Tensor
        fp32, the ranks' averaged momentum; it may be ``m`` itself.
    group : Mapping
        ``lr``, ``betas``, ``eps``, ``weight_decay``, ``bias_correction``.
    bc1_t, bc2_t : int
        The steps the bias corrections are taken at.
    mask : torch.Tensor, optional
        ``exp_avg_mask``: broadcast to ``m``'s shape and converted to fp32 if it is not already.
    param_out : torch.Tensor, optional
        Also write the new ``w`` here (fp32, fp16 or bf16).
    num_threads : int, optional
        Threads to use (default ``torch.get_num_threads()``).
    sqrt : str, optional
        ``'ieee'`` or ``'rsqrt14'``; default: the one torch uses here (:func:`torch_sqrt_mode`).
    """
    fn = "onebit_compressed_step_"
    n, out = _state_args(fn, w, m, v, param_out)
    _check(fn, "averaged", averaged, _F32, n)
    k = None
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"{fn}: mask must be a torch.Tensor or None, got {type(mask).__name__}")
        if mask.shape != m.shape:
            try:
                mask = mask.expand(m.shape)
            except RuntimeError:
                raise ValueError(f"{fn}: mask of shape {tuple(mask.shape)} does not broadcast to "
                                 f"m's shape {tuple(m.shape)}") from None
        if mask.device.type == "cpu" and mask.dtype.is_floating_point:
            mask = mask.to(torch.float32).contiguous()
        k = buffer_of(_check(fn, "mask", mask, _F32, n))
    b1, b2 = group["betas"]
    _K.onebit_compressed_step(buffer_of(w), buffer_of(m), buffer_of(v), buffer_of(averaged), k,
                              float(group["lr"]), float(b1), float(b2), float(group["eps"]),
                              float(group["weight_decay"]), bool(group["bias_correction"]),
                              int(bc1_t), int(bc2_t), out, _threads(num_threads),
                              sqrt=_sqrt_mode(sqrt), v_is_denom=bool(denom))


def onebit_local_step_(w: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       group: Group, bc1_t: int, bc2_t: int,
                       param_out: Optional[torch.Tensor] = None,
                       num_threads: Optional[int] = None, sqrt: Optional[str] = None) -> None:
    """1-bit Adam's compressed-phase step where the average is the rank's own momentum (a world of
    one rank, or ``step_on``), in one pass: bit for bit ``functional.onebit_momentum(m, g, group,
    a)`` then :func:`onebit_compressed_step_` with ``averaged=a`` (``v`` only read), without the
    intermediate ``a``. Arguments as :func:`onebit_warmup_step_` (``g``: the local gradient).
    """
    fn = "onebit_local_step_"
    n, out = _state_args(fn, w, m, v, param_out)
    _check(fn, "g", g, _FLOATS, n)
    b1, b2 = group["betas"]
    _K.onebit_local_step(buffer_of(w), buffer_of(m), buffer_of(v), buffer_of(g),
                         float(group["lr"]), float(b1), float(b2), float(group["eps"]),
                         float(group["weight_decay"]), bool(group["bias_correction"]), int(bc1_t),
                         int(bc2_t), out, _threads(num_threads), sqrt=_sqrt_mode(sqrt))


def onebit_local_steps_(ws: Sequence[torch.Tensor], ms: Sequence[torch.Tensor],
                        vs: Sequence[torch.Tensor], gs: Sequence[torch.Tensor], group: Group,
                        bc1_t: int, bc2_t: int,
                        param_outs: Optional[Sequence[Optional[torch.Tensor]]] = None,
                        num_threads: Optional[int] = None, sqrt: Optional[str] = None,
                        check: bool = True, denom: bool = False) -> None:
    """:func:`onebit_local_step_` over lists of tensors in one call (one crossing into C++, not
    one per tensor): fp32 ``ws``, ``ms``, ``vs``; ``gs[i]`` fp32, fp16 or bf16 (read as is);
    ``param_outs[i]``: None or a copy to write. ``check``: validate every tensor as
    :func:`onebit_local_step_` does (False: the caller has; raw pointers go down). ``denom``:
    ``vs`` hold the frozen denominators (as :func:`onebit_compressed_step_`'s ``denom``)."""
    steps_("onebit_local_steps_", _K.onebit_local_steps, ws, ms, vs, gs, group, bc1_t, bc2_t,
           param_outs, num_threads, sqrt, check, denom)


def onebit_momentum_(m: torch.Tensor, g: torch.Tensor, group: Group, out: torch.Tensor,
                     num_threads: Optional[int] = None) -> None:
    """``out = b1 m + (1-b1) g`` in one pass, bit for bit ``functional.onebit_momentum`` (two torch
    passes): the momentum a rank compresses. fp32 contiguous CPU tensors of one size; ``out`` may
    be ``m`` itself."""
    fn = "onebit_momentum_"
    n = _check(fn, "m", m, _F32, None).numel()
    _check(fn, "g", g, _F32, n)
    _check(fn, "out", out, _F32, n)
    _K.onebit_momentum(buffer_of(m), buffer_of(g), buffer_of(out), float(group["betas"][0]),
                       _threads(num_threads))


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every value of contiguous fp32, fp16 or bf16 CPU ``tensors`` is finite: one
    read-only C++ pass, a 16-bit tensor in its own dtype (torch's ``aminmax`` reads as much but
    costs a call, a stack and a sync per tensor)."""
    ts = [_check("all_finite", f"tensors[{i}]", t, _FLOATS, None) for i, t in enumerate(tensors)]
    dtypes = [] if all(t.dtype == torch.float32 for t in ts) else [DTYPES[t.dtype] for t in ts]
    return bool(_K.all_finite_ptrs([t.numel() for t in ts], [t.data_ptr() for t in ts],
                                   dtypes=dtypes))


def _check_hparams(name: str, arg: str, h: Dict[str, Any]) -> None:
    """ValueError naming ``arg.format(key)`` for a bad lr, eps, weight_decay, betas or amsgrad."""
    lr, eps, wd, betas = h["lr"], h["eps"], h["weight_decay"], h["betas"]
    if h.get("amsgrad"):
        raise ValueError(f"{name}: {arg.format('amsgrad')} is not supported; pass amsgrad=False")
    if isinstance(lr, torch.Tensor) or not (isinstance(lr, (int, float)) and lr >= 0.0):
        raise ValueError(f"{name}: {arg.format('lr')} must be a number >= 0, got {lr!r}")
    if not (isinstance(eps, (int, float)) and eps >= 0.0):
        raise ValueError(f"{name}: {arg.format('eps')} must be >= 0, got {eps!r}")
    if not (isinstance(wd, (int, float)) and wd >= 0.0):
        raise ValueError(f"{name}: {arg.format('weight_decay')} must be >= 0, got {wd!r}")
    if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{name}: {arg.format('betas')} must be two numbers in [0, 1), "
                         f"got {betas!r}")


class CPUAdam(torch.optim.Optimizer):
    """Adam / AdamW on CPU tensors in one vectorised, multi-threaded C++ pass per parameter.

    The numerics are ``torch.optim.AdamW``'s (``adamw_mode=True``) or ``torch.optim.Adam``'s with
    L2 weight decay (``adamw_mode=False``) on the CPU, to fp32 rounding, and the state dict has
    their keys (``step``, ``exp_avg``, ``exp_avg_sq``), so checkpoints load either way. Like
    DeepSpeed's ``DeepSpeedCPUAdam`` (ZeRO-Offload's optimizer) the state is fp32 whatever the
    parameter's dtype: a bf16/fp16 parameter keeps an fp32 master copy (``master_param``) that the
    step updates, and the parameter receives its rounding (to nearest even) in the same pass.

    Parameters
    ----------
    params : iterable
        Parameters or param groups. CPU, contiguous, fp32/fp16/bf16.
    lr : float
        Learning rate.
    betas : (float, float)
        Decay rates of the moments.
    eps : float
        Added to the denominator.
    weight_decay : float
        Decoupled (AdamW) weight decay, or the L2 coefficient with ``adamw_mode=False``.
        DeepSpeed's default, 0 (``torch.optim.AdamW``'s is 0.01).
    bias_correction : bool
        Correct the moments for their zero start (torch always does; False is DeepSpeed's switch).
    adamw_mode : bool
        Decoupled weight decay (AdamW); False: Adam with L2 weight decay.
    amsgrad : bool
        Not supported (ValueError).
    num_threads : int, optional
        Threads per step (default ``torch.get_num_threads()`` at each step).
    sqrt : str, optional
        ``'ieee'`` or ``'rsqrt14'``; default: the square root torch's CPU ops use here
        (:func:`torch_sqrt_mode`), so that the step equals ``torch.optim.AdamW``'s bit for bit
        where the operation order allows (``torch.optim.AdamW(fused=True)`` uses ``'ieee'``).

    Raises
    ------
    ValueError
        Bad hyper-parameters; at ``step()``, a parameter or gradient that is not a contiguous CPU
        tensor.
    TypeError
        At ``step()``, a parameter or gradient that is not fp32/fp16/bf16, or a sparse gradient.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, bias_correction: bool = True,
                 adamw_mode: bool = True, amsgrad: bool = False,
                 num_threads: Optional[int] = None, sqrt: Optional[str] = None) -> None:
        name = type(self).__name__
        _check_hparams(name, "argument '{}'", dict(lr=lr, betas=betas, eps=eps,
                                                   weight_decay=weight_decay, amsgrad=amsgrad))
        if num_threads is not None and (isinstance(num_threads, bool)
                                        or not isinstance(num_threads, int) or num_threads < 1):
            raise ValueError(f"{name}: argument 'num_threads' must be an integer >= 1 or None, "
                             f"got {num_threads!r}")
        if sqrt not in (None, "ieee", "rsqrt14"):
            raise ValueError(f"{name}: argument 'sqrt' must be None, 'ieee' or 'rsqrt14', "
                             f"got {sqrt!r}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bool(bias_correction), adamw_mode=bool(adamw_mode))
        super().__init__(params, defaults)
        self.num_threads = num_threads
        self.sqrt = sqrt

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """As torch's, with the constructor's checks of the group's hyper-parameters first."""
        merged = {**self.defaults, "amsgrad": False, **param_group}
        _check_hparams(type(self).__name__, "param group's '{}'", merged)
        super().add_param_group(param_group)

    def _init_state(self, p: torch.Tensor, state: Dict[str, Any]) -> None:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32)
        state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32)
        if p.dtype != torch.float32:
            state["master_param"] = p.detach().to(torch.float32).clone()

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One step for every parameter with a gradient; returns the closure's loss, if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        fn = f"{type(self).__name__}.step"
        threads = _threads(self.num_threads)
        sqrt = _sqrt_mode(self.sqrt)
        work = []  # every parameter checked before the first is updated
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                g = p.grad
                if g is None:
                    continue
                name = f"param group {gi} parameter {pi}"
                if g.is_sparse:
                    raise TypeError(f"{fn}: {name} has a sparse gradient (not supported)")
                _check(fn, name, p, _FLOATS, None)
                _check(fn, f"the gradient of {name}", g, _FLOATS, p.numel())
                work.append((group, p, g))
        for group, p, g in work:
            b1, b2 = group["betas"]
            state = self.state[p]
            if not state:
                self._init_state(p, state)
            step_t = state["step"]
            step_t += 1
            low = p.dtype != torch.float32
            w = state["master_param"] if low else p
            _K.adam_step(buffer_of(w), buffer_of(state["exp_avg"]), buffer_of(state["exp_avg_sq"]),
                         buffer_of(g), float(group["lr"]), float(b1), float(b2),
                         float(group["eps"]), float(group["weight_decay"]), int(step_t.item()),
                         bool(group["adamw_mode"]), bool(group["bias_correction"]),
                         buffer_of(p) if low else None, threads, sqrt=sqrt)
        return loss

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.load_state_dict`` (a torch AdamW/Adam checkpoint loads too),
        except that the moments and master copies stay fp32 for bf16/fp16 parameters (torch would
        cast them to the parameter's dtype), and a missing master copy is taken from the
        parameter."""
        keys = ("exp_avg", "exp_avg_sq", "master_param")
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = dict(zip(saved_ids, (p for g in self.param_groups for p in g["params"])))
        # torch casts the state to the parameter's dtype: keep fp32 copies for bf16/fp16 ones
        fp32 = {idx: {k: v.detach().to(device="cpu", dtype=torch.float32, copy=True)
                      for k, v in s.items() if k in keys and isinstance(v, torch.Tensor)}
                for idx, s in state_dict["state"].items()
                if idx in params and params[idx].dtype != torch.float32}
        super().load_state_dict(state_dict)
        for idx, p in params.items():
            if p not in self.state:
                continue
            state = self.state[p]
            state.update(fp32.get(idx, {}))
            for k in keys:  # the kernels need dense, contiguous fp32 tensors of p's shape
                if k in state:
                    state[k] = state[k].reshape(p.shape).contiguous()
            step = state.get("step", 0)
            state["step"] = (step.detach().to(torch.float32, copy=True).cpu()
                             if isinstance(step, torch.Tensor)
                             else torch.tensor(float(step), dtype=torch.float32))
            if p.dtype != torch.float32 and "master_param" not in state:
                state["master_param"] = p.detach().to(torch.float32).clone()
        for group in self.param_groups:  # a torch checkpoint has no adamw_mode
            group.setdefault("adamw_mode", self.defaults["adamw_mode"])
            group.setdefault("bias_correction", self.defaults["bias_correction"])
