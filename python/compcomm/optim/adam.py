"""1-bit Adam (DeepSpeed's OnebitAdam, ONEBIT_SPEC.md section b) as a drop-in torch optimizer."""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import os

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .._bucketing import finite_gate
from ..schedule import FreezeSchedule, StepKind
from . import _fused, cpu_adam, cpu_multi
from . import functional as F
from ._grads import fp32_grad, non_finite_error
from ._params import group_chunks, mask_, master, moments, write_back_multi
from ._validation import who, check_common, check_int
from .base import OneBitBase


class OneBitAdam(OneBitBase):
    r"""Adam whose gradient communication drops to 1 bit per element after a warm-up.

    Steps ``1 .. freeze_step`` are Adam (weight decay decoupled as AdamW) on gradients averaged in
    full precision. From step ``freeze_step + 1`` on the variance is frozen, each rank updates its
    momentum with its **local** gradient and the momenta are averaged with
    :func:`compcomm.compressed_allreduce` (error feedback, one pair of error buffers per
    bucket of parameters), about 32x fewer bytes than an fp32 allreduce of the gradients:

    .. math::
        m \leftarrow \mathrm{C}\big(\beta_1 m + (1-\beta_1) g_{local}\big) \odot mask,\quad
        p \leftarrow p - lr\,\big(m / (\sqrt{v}+\epsilon) + wd\,p\big)

    On CUDA the update of a param group without ``exp_avg_mask`` runs as multi-tensor kernels
    (:mod:`compcomm.optim._fused`, one pass over memory; ``COMPCOMM_FUSED_OPTIM=0`` in the
    environment selects the ``torch._foreach`` ops instead); on the CPU as one C++ pass per tensor
    (:mod:`compcomm.optim.cpu_adam`), where those kernels give the bits of the torch ops on this
    machine (:func:`~compcomm.optim.cpu_adam.matches_torch_rules`, checked once).

    Parameters
    ----------
    params : iterable
        Parameters or parameter groups (dicts), as for any torch optimizer. A group may carry
        ``exp_avg_mask``: a tensor broadcastable to each of its parameters; the compressed momentum
        is multiplied by it (use 0 where the momentum is constantly zero, e.g. unused embedding
        rows, since 1 bit cannot represent 0).
    lr : float, default 1e-3
    freeze_step : int, default 100000
        Number of warm-up (full-precision) steps; compression starts at step ``freeze_step + 1``.
    bias_correction : bool, default False
        Adam's bias correction (DeepSpeed accepts and ignores it, so the default False reproduces
        DeepSpeed). In the compressed phase the variance correction is frozen with the variance.
    betas : (float, float), default (0.9, 0.999)
    eps : float, default 1e-8
        Added outside the square root.
    weight_decay : float, default 0
        Decoupled: ``p -= lr * wd * p`` in every step (as DeepSpeed and AdamW).
    amsgrad : bool, default False
        True raises :class:`compcomm.errors.UnsupportedError`.
    cuda_aware : bool, default False
        Accepted for DeepSpeed compatibility (only matters for an MPI backend).
    comm_backend_name : {'torch', 'mpi', 'nccl'}, default 'torch'
        'torch' communicates over ``process_group`` (torch.distributed); 'mpi'/'nccl' use the
        compcomm backend set up by ``compcomm.init(backend=...)`` and raise
        :class:`~compcomm.errors.UnsupportedError` when it is not available.
    process_group : ProcessGroup or compcomm Communicator, optional
        The data-parallel group; default: compcomm's default group (torch's world group, or a
        world of one rank without torch.distributed).
    grads_averaged : bool, default False
        Gradients arrive already averaged across ranks in the warm-up (for example by DDP without
        :func:`compcomm.ddp_comm_hook`), so the optimizer does not average them again.
    exact_resume : bool, default False
        ``state_dict()`` also holds this rank's error buffers and ``load_state_dict`` restores them
        when rank and world size match (save one file per rank, see
        :func:`compcomm.optim.save_rank_checkpoint`); otherwise they are reset, as DeepSpeed does.
    reduce_bucket_size : int, default 16384
        Elements per compressed bucket (DeepSpeed's ``reduce_bucket_size`` meaning): the momenta
        of a param group's parameters are packed in order into buckets of at most this many
        elements (a larger tensor is a bucket of its own), one compressed allreduce (its own
        scales) and one pair of error buffers per bucket. The default makes every tensor of more
        than 16384 elements a bucket of its own: tensors of different magnitudes do not share a
        scale, which converges like exact averaging (docs/optimizers.md); all buckets travel in
        one batched exchange of three collectives, so a slow link's latency is paid a few times
        per step, not once per bucket. DeepSpeed's 5e8 packs a whole model in one bucket.
    per_parameter : bool, default False
        One compressed allreduce per parameter instead (DeepSpeed's fp32 layout, for its exact
        per-parameter numerics). Latency-bound: with ~150 tensors it made a GPU step 6x slower than
        plain DDP at 10 Gbit/s.
    fused : bool, optional
        The earlier switch: ``True`` is one bucket per param group (DeepSpeed's fp16 layout),
        ``False`` is ``per_parameter=True``.
    check_finite : bool, default True
        Skip (on every rank, counted in ``skipped_steps``) a step whose averaged gradients hold
        Inf/NaN: one host synchronisation per warm-up step. The compressed phase is checked by the
        compressed allreduce itself. ``False`` when the caller checks already (ZeroOptimizer).
    compressor : class or callable, optional
        Builds the compressor from the communicator, ``compressor(comm)``: the average of the
        compressed phase and its error-feedback state. Default
        :class:`compcomm.compress.OneBitCompressor`; :class:`compcomm.compress.IdentityCompressor`
        averages in full precision (the uncompressed twin, for comparisons).
    overlap_backward : bool or 'auto', default 'auto'
        In the compressed phase, send each group of buckets (a few groups of several MB) while
        the backward still runs: a hook per parameter stages a group's momenta and queues its
        exchange once its gradients (and the earlier groups') are complete, and ``step()`` sends
        the rest in the same order, checks by value that the gradients did not change since, and
        commits. Results are bit for bit those without overlap; gradient accumulation, gradients
        changed after the backward (clipping, writes through ``.data``: detected by value) and
        GradScaler drop the exchanges and switch it off with a warning. ``'auto'``: on for CUDA
        parameters over compcomm's native NCCL communicator (its own NCCL communicator: no torch
        collective shares its queue), off elsewhere (on CPUs the backward and the exchange share
        the cores: 0.92x-1.03x measured). ``True``: also over the torch adapter (then give the
        optimizer a process group of its own). Never while another compcomm optimizer or
        compressor uses the same communicator (a GAN's G and D: each has a worker thread; the
        overlap switches off, with a warning for ``True``). It helps where the wire time of the compressed
        momenta is comparable to the backward (slow links, large models) (docs/optimizers.md,
        "Backward overlap").
    eps_inside_sqrt, max_grad_norm :
        Accepted and ignored, as DeepSpeed does.
    """

    _name = "OneBitAdam"

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, freeze_step: int = 100000,
                 bias_correction: bool = False, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, amsgrad: bool = False, cuda_aware: bool = False,
                 comm_backend_name: str = "torch", process_group: Any = None,
                 grads_averaged: bool = False, exact_resume: bool = False,
                 reduce_bucket_size: Optional[int] = None, per_parameter: bool = False,
                 fused: Optional[bool] = None, check_finite: bool = True,
                 compressor: Any = None, overlap_backward: Any = "auto") -> None:
        n = self._who = who(self._name, comm_backend_name, process_group)
        check_common(n, lr, betas, eps, weight_decay, amsgrad)
        self.freeze_step = check_int(n, "freeze_step", freeze_step, 0)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bool(bias_correction))
        super().__init__(params, defaults)
        self._init_common(comm_backend_name, process_group, cuda_aware, grads_averaged,
                          exact_resume, fused, reduce_bucket_size, per_parameter,
                          check_finite, compressor, overlap_backward)
        self.schedule = FreezeSchedule(self.freeze_step)

    @property
    def overlap(self) -> Any:
        """The backward overlap (:class:`compcomm.optim.overlap.BackwardOverlap`: its
        ``enabled``, ``steps_overlapped``, ``groups_from_backward``), or None where it is off
        (``overlap_backward=False``, one rank, or a compressor without group exchanges)."""
        return self._overlap

    @property
    def adam_freeze_key(self) -> bool:
        """True once the compressed phase has started (DeepSpeed's name)."""
        return self.schedule.frozen

    def _step(self) -> None:
        """This optimizer's update (OneBitBase.step handles the closure and AMP skips)."""
        kind = self.schedule.next_kind()
        t = self.schedule.step + 1
        warm = kind is StepKind.FULL_AVERAGE
        if not warm and (self.world_size == 1 or self._local is not None):
            runs = self._local_runs()
            if runs is not None:
                self._local_step(runs, t)
                self.schedule.advance(kind)
                return
        grads = self._grads(average=warm)
        items = list(self._params())
        averaged: Dict[torch.Tensor, torch.Tensor] = {}
        if not warm:
            averaged = self._compressed_average(items, self._momentum_fill(grads))
        for group, run in group_chunks(items):
            ps = [p for _, p in run]
            states = [self.state[p] for p in ps]
            ms, vs = map(list, zip(*(moments(p, st) for p, st in zip(ps, states))))
            ws = [master(p, st) for p, st in zip(ps, states)]
            xs = [(grads if warm else averaged)[p] for p in ps]
            for st in states:
                st["step"] = t
            # the variance (and its correction) frozen after the warm-up
            bc2_t = min(t, self.freeze_step)
            lowps = [None if p.dtype == torch.float32 else p.data for p in ps]
            if _fused.usable(group, ws, ms, vs, xs, lowp=lowps):  # one CUDA pass per chunk
                step = _fused.adam_warmup_step_ if warm else _fused.onebit_compressed_step_
                step(ws, ms, vs, xs, group, t, bc2_t, lowps, check=False)
                continue
            # one C++ pass per tensor
            if cpu_kernels_usable(group, [p.data for p in ps] + ws, frozen=not warm):
                if not warm:  # the whole chunk in one C++ call (fp32 lists)
                    vs, denom = frozen_denominators(self, vs, group, bc2_t)
                    cpu_multi.onebit_compressed_steps_(ws, ms, vs, xs, group, t, bc2_t, lowps,
                                                       denom=denom)
                elif all(x.dtype == torch.float32 for x in xs):
                    cpu_multi.onebit_warmup_steps_(ws, ms, vs, xs, group, t, bc2_t, lowps)
                else:
                    for w, m, v, x, lowp in zip(ws, ms, vs, xs, lowps):
                        cpu_adam.onebit_warmup_step_(w, m, v, x, group, t, bc2_t, param_out=lowp)
                continue
            if warm:
                F.adam_moments_multi_(ms, vs, xs, group)
            else:
                torch._foreach_copy_(ms, xs)
                for m in ms:
                    mask_(m, group)
            F.adam_step_multi_(ws, ms, vs, group, t, bc2_t)
            write_back_multi(ps, states)
        self.schedule.advance(kind)

    def _momentum_fill(self, grads: Dict[torch.Tensor, torch.Tensor]) -> Any:
        """The staging of the compressed average: ``fill(entries)`` writes ``b1 m + (1-b1) g``
        (``g = grads[p]``, the local gradient) into each entry's buffer; ``m`` itself waits for the
        commit. Elementwise, so staging any subset of the entries gives the same bits (the backward
        overlap stages one group of buckets at a time)."""

        def momentum(entries: List[Any]) -> None:
            for group, run in group_chunks(entries):
                # no warm-up step yet: zero momentum (None), made when the step commits
                ms = [self.state[p].get("exp_avg") for _, p, _ in run]
                gs, outs = [grads[p] for _, p, _ in run], [out for _, _, out in run]
                if _fused.usable(group, ms, gs, outs):
                    _fused.onebit_momentum(ms, gs, group, outs, check=False)
                    continue
                ps = [p for _, p, _ in run]
                if None not in ms and cpu_kernels_usable(group, [p.data for p in ps], frozen=True):
                    cpu_multi.onebit_momentums_(ms, gs, group, outs)  # one C++ call
                    continue
                ms = [out.zero_() if m is None else m for m, out in zip(ms, outs)]
                F.onebit_momentum_multi(ms, gs, group, outs)

        return momentum

    def _local_runs(self) -> Optional[List[Tuple[Dict[str, Any], List[List[Any]]]]]:
        """The compressed step where nothing is sent (one rank, or ``step_on``) as the kernels
        take it: per param group, ``(group, [ws, ms, vs, gs, param_outs, states])`` over its
        parameters with a gradient, everything checked that the C++ passes
        (``onebit_local_steps_``) or the CUDA kernel (``_fused.onebit_local_step_``) take on
        trust: fp32 state, contiguous, sizes, all on the CPU or all on one GPU, momenta exist, the
        kernels usable for the group. None where anything does not qualify: nothing has been
        written, the general path runs. One loop over the parameters (the Python of a 100-tensor
        step: 0.75 -> 0.27 ms on the CPU; on a GPU it replaces the staged path's per-parameter
        buffers, lists and checks)."""
        local, f32 = self._local, torch.float32
        scale = getattr(self, "_grad_scale", None) if local is None else None
        state = self.state
        runs = []
        dev: Optional[torch.device] = None  # every tensor's device: the first weight's
        for group in self.param_groups:
            ws, ms, vs, gs, outs, sts = cols = [[], [], [], [], [], []]
            for p in group["params"]:
                g = p.grad if local is None else local.get(p)
                n = p.numel()
                if g is None or n == 0:
                    continue
                st = state.get(p)  # not state[p]: a defaultdict would grow an entry
                if st is None or g.is_sparse:
                    return None
                # p itself, not p.data (a new alias per read): only its pointer and size are used
                w, out = (p, None) if p.dtype == f32 else (st.get("master_param"), p)
                if dev is None:
                    dev = p.device
                m, v = st.get("exp_avg"), st.get("exp_avg_sq")
                if not (_fits(w, n, dev) and _fits(m, n, dev) and _fits(v, n, dev)):
                    return None  # before any gradient copy
                # on the CPU a bf16/fp16 gradient goes down as is: checked and read in its own
                # dtype (2 bytes per element, converted exactly in registers), not copied to fp32
                # first; the CUDA kernel reads fp32
                ok = _GRAD_DTYPES if dev.type == "cpu" else (f32,)
                if local is None and (scale is not None or g.dtype not in ok
                                      or not g.is_contiguous()):
                    g = fp32_grad(p, copy=scale is not None)  # as _grads does
                if not _fits(g, n, dev, ok):
                    return None
                if out is not None and not _fits(out, n, dev, _OUT_DTYPES):
                    return None
                ws.append(w)
                ms.append(m)
                vs.append(v)
                gs.append(g)
                outs.append(out)
                sts.append(st)
            if ws:
                usable = (cpu_kernels_usable(group, frozen=True) if dev.type == "cpu" else
                          dev.type == "cuda" and _fused.enabled()
                          and group.get("exp_avg_mask") is None)
                if not usable:
                    return None
                runs.append((group, cols))
        if scale is not None:
            inv = 1.0 / float(scale)
            for _, cols in runs:
                for g in cols[3]:
                    g.mul_(inv)
        return runs

    def _local_step(self, runs: List[Tuple[Dict[str, Any], List[List[Any]]]], t: int) -> None:
        """Step ``t`` of the compressed phase with nothing sent, on ``_local_runs()``: the
        average is the rank's own momentum, so momentum and step are one pass per tensor
        (``onebit_local_steps_``, one C++ call per param group; on a GPU
        ``_fused.onebit_local_step_``, one multi-tensor kernel per ~20M elements; 24 bytes of
        memory traffic per fp32 parameter), bit for bit the staged momentum then the compressed
        step. The finiteness check of every gradient (on the CPU one C++ pass, a bf16/fp16
        gradient in its own dtype) runs before anything is written; on a GPU its verdict gates
        the kernel on the device (``finite_gate``), so the launch does not wait for it: the host
        waits for the verdict after the launch, before it writes any state of its own."""
        all_gs = [g for _, cols in runs for g in cols[3]]
        cuda = not runs[0][1][0][0].is_cpu
        gate, verdict = None, None
        if cuda and self.check_finite:
            gate, verdict = finite_gate(all_gs, runs[0][1][0][0].device)
        else:
            self._check_finite(all_gs, agree=False)
        bc2_t = min(t, self.freeze_step)  # the variance (and its correction) frozen after warm-up
        for group, (ws, ms, vs, gs, outs, _) in runs:
            if cuda:
                _fused.onebit_local_step_(ws, ms, vs, gs, group, t, bc2_t, outs, check=False,
                                          gate=gate)
            else:
                ds, denom = frozen_denominators(self, vs, group, bc2_t)
                cpu_adam.onebit_local_steps_(ws, ms, ds, gs, group, t, bc2_t, outs, check=False,
                                             denom=denom)
        if verdict is not None and not verdict():
            raise non_finite_error(self.rank, self._name)  # the gated kernels wrote nothing
        for _, cols in runs:
            for st in cols[5]:
                st["step"] = t


def frozen_denominators(opt: torch.optim.Optimizer, vs: List[torch.Tensor],
                        group: Dict[str, Any], bc2_t: int) -> Tuple[List[torch.Tensor], bool]:
    """What the frozen-variance CPU kernels read as ``v``: ``(vs, False)`` where they compute
    torch's square root themselves, else ``(denominators, True)``: the frozen
    ``functional.adam_denom(v, group, bc2_t)`` of each variance, computed by torch (so the torch
    ops' bits on any CPU) and kept as :func:`frozen_of` keeps them (also rebuilt when eps, beta2,
    bias correction or ``bc2_t`` change)."""
    if cpu_adam.matches_torch_rules():
        return vs, False
    how = (group["eps"], group["betas"][1], group["bias_correction"], bc2_t)
    return frozen_of(opt, "_frozen_denoms", vs, how, lambda v: F.adam_denom(v, group, bc2_t)), True


def frozen_of(opt: torch.optim.Optimizer, attr: str, vs: List[torch.Tensor], how: Any,
              compute: Callable[[torch.Tensor], torch.Tensor]) -> List[torch.Tensor]:
    """``compute(v)`` of each frozen variance in ``vs``, computed once per freeze and kept in
    ``opt.<attr>`` (one tensor per variance, dropped with it) until ``v`` is written (its version
    counter), given other storage (``v.data = ...``) or ``how`` changes. Writes that bypass the
    version counter (``v.data.mul_(...)``, raw pointers) are not seen; inference tensors (no
    counter) get a fresh result every call."""
    cache = opt.__dict__.get(attr)
    if cache is None:
        cache = WeakIdKeyDictionary()
        setattr(opt, attr, cache)
    out = []
    for v in vs:
        if v.is_inference():
            out.append(compute(v))
            continue
        key = (v._version, v.data_ptr(), how)
        hit = cache.get(v)
        if hit is None or hit[0] != key:
            hit = cache[v] = (key, compute(v))
        out.append(hit[1])
    return out

# the gradients the W=1 C++ step reads as they are
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OUT_DTYPES = (torch.bfloat16, torch.float16)  # the low-precision parameters the kernels write


def _fits(x: Optional[torch.Tensor], n: int, dev: torch.device,
          dtypes: Tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    """Whether ``x`` is a contiguous tensor of ``n`` elements of one of ``dtypes`` on ``dev``
    (what the C++ passes and the CUDA kernel take on trust)."""
    return (x is not None and x.dtype in dtypes and x.device == dev and x.is_contiguous()
            and x.numel() == n)


def cpu_kernels_usable(group: Dict[str, Any], tensors: Sequence[torch.Tensor] = (),
                       frozen: bool = False) -> bool:
    """Whether the C++ CPU kernels may update ``tensors`` (parameters, master weights) of param
    group ``group``: all on the CPU and contiguous, no ``exp_avg_mask``, not switched off
    (``COMPCOMM_FUSED_OPTIM=0``) and bit-identical to the torch-op rules on this machine.
    ``frozen``: the compressed phase's rules (variance frozen), which are bit-identical also where
    the kernels' square root is not torch's, given the frozen denominators computed by torch
    (:func:`frozen_denominators`). (ZeRO's replicated momentum asks the same.)"""
    return (group.get("exp_avg_mask") is None
            and all(t.is_cpu and t.is_contiguous() for t in tensors)
            and os.environ.get("COMPCOMM_FUSED_OPTIM", "1") != "0"
            and (cpu_adam.matches_torch_rules()
                 or (frozen and cpu_adam.matches_torch_rules(denom=True))))
