"""Rank bodies for tests/test_optim_gpu_ranks.py (module level, so run_ranks can pickle them).

The three 1-bit optimizers at world size 2: each case trains the same parameters twice on every
rank, with the kernels (the default) and with ``COMPCOMM_FUSED_OPTIM=0`` (the torch ops), on the
same per-rank gradients, and returns both trajectories (fp32 weights after every step, the final
parameters and momenta) with the calls the kernels' entry points received, so the parent can
check that the kernels ran and follow the torch ops, and that the ranks agree. Three control runs
per case show that the comparison would notice a broken kernel: each rank alone (no exchange),
no weight decay, a learning rate 2% off.

:func:`optimizer_ranks` is the body: on CUDA (the default) both ranks share the GPU(s) as emulated
NCCL hosts of a torch NCCL group, as tests/_overlap_cases.py's ``gpu_scenarios``; with
``device="cpu"`` the same cases run over run_ranks' gloo group, where ``COMPCOMM_FUSED_OPTIM=0``
switches the C++ CPU kernels off (a dry run of this logic on a machine without a GPU).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

STEPS = 8
# uneven sizes: a tiny tensor and a 2-D one share a compressed bucket (<= 16384 elements), the
# two large ones have a bucket each (and are not multiples of anything)
SHAPES: List[Tuple[int, ...]] = [(7,), (40, 25), (70001,), (2**16 + 3,)]
# per-tensor gradient magnitudes: buckets (1-bit Adam) and parameters (1-bit LAMB's
# scaling_coeff) get different scales
GRAD_SCALES = [1.0, 0.1, 3.0, 0.01]
LR, WD = 1e-2, 0.1  # wd large enough that a kernel losing it is far outside the tolerance
LR_OFF = 1.02  # the control "learning rate 2% off"

# name -> (optimizer, parameter dtype, constructor arguments besides lr, weight_decay and group).
# bias_correction everywhere: without it the frozen variance of a 2-3 step warm-up is ~0.3% of
# g^2 and the compressed steps are ~20x lr. ZeroOneAdam's schedule over STEPS = 8 steps:
# FULL_AVERAGE, FULL_AVERAGE, ONEBIT_GRAD, SYNC, LOCAL, LOCAL, LOCAL, SYNC (ends synchronised).
CASES: Dict[str, Tuple[str, torch.dtype, Dict[str, Any]]] = {
    "adam_float32": ("OneBitAdam", torch.float32,
                     dict(freeze_step=3, bias_correction=True, overlap_backward=False)),
    "adam_bfloat16": ("OneBitAdam", torch.bfloat16,
                      dict(freeze_step=3, bias_correction=True, overlap_backward=False)),
    "zoadam_float32": ("ZeroOneAdam", torch.float32,
                       dict(var_freeze_step=2, var_update_scaler=1, local_step_scaler=1,
                            local_step_clipper=4, bias_correction=True)),
    "lamb_float32": ("OneBitLamb", torch.float32,
                     dict(freeze_step=3, bias_correction=True, max_coeff=10.0, min_coeff=0.01)),
    "lamb_bfloat16": ("OneBitLamb", torch.bfloat16,
                      dict(freeze_step=3, bias_correction=True, max_coeff=10.0, min_coeff=0.01)),
}

# The kernels' entry points each optimizer calls, per device type of the parameters, as
# (module of compcomm.optim, function, step kinds it serves): the default run must call each at
# least once per step of those kinds, on tensors of that device; the COMPCOMM_FUSED_OPTIM=0 run
# none of them. ZeroOneAdam has no CUDA kernel (zoadam.py: only the CPU's local-step pass), so on
# CUDA the switch changes nothing for it.
KERNELS: Dict[str, Dict[str, List[Tuple[str, str, Tuple[str, ...]]]]] = {
    "cuda": {
        "OneBitAdam": [("_fused", "adam_warmup_step_", ("FULL_AVERAGE",)),
                       ("_fused", "onebit_momentum", ("ONEBIT",)),
                       ("_fused", "onebit_compressed_step_", ("ONEBIT",))],
        "ZeroOneAdam": [],
        "OneBitLamb": [("lamb_passes", "momentums_", ("ONEBIT",)),
                       ("lamb_passes", "stats_", ("ONEBIT",)),
                       ("lamb_passes", "applies_", ("ONEBIT",))],
    },
    "cpu": {
        "OneBitAdam": [("cpu_multi", "onebit_warmup_steps_", ("FULL_AVERAGE",)),
                       ("cpu_multi", "onebit_momentums_", ("ONEBIT",)),
                       ("cpu_multi", "onebit_compressed_steps_", ("ONEBIT",))],
        "ZeroOneAdam": [("cpu_multi", "zero_one_local_steps_", ("LOCAL",))],
        "OneBitLamb": [("lamb_passes", "momentums_", ("ONEBIT",)),
                       ("lamb_passes", "stats_", ("ONEBIT",)),
                       ("lamb_passes", "applies_", ("ONEBIT",))],
    },
}

# step kinds after which every rank holds the same parameters and momenta, bit for bit (the
# average is replicated); after SYNC the momentum is, the parameters up to the roll-back's
# rounding (w + u - acc on each rank's own u); after LOCAL the ranks differ
REPLICATED = ("FULL_AVERAGE", "ONEBIT", "ONEBIT_GRAD")


def _entry_points() -> List[Tuple[str, str]]:
    return sorted({(m, f) for per in KERNELS.values() for ks in per.values() for m, f, _ in ks})


def _device_type(args: Sequence[Any], kw: Dict[str, Any]) -> str:
    """The device type of the first tensor among the arguments (in a list or not)."""
    for a in list(args) + list(kw.values()):
        for x in (a if isinstance(a, (list, tuple)) else [a]):
            if isinstance(x, torch.Tensor):
                return x.device.type
    return "none"


@contextlib.contextmanager
def counting(calls: Dict[str, int]) -> Iterator[Dict[str, int]]:
    """Count the calls of every kernel entry point of KERNELS (both device types) in ``calls``,
    as ``"module.function@device_type"``; the functions are put back afterwards. The optimizers
    look them up as module attributes at every call (``_fused.X``, ``cpu_multi.X``,
    ``lamb_passes.X``), so a wrapper on the module is what they call."""
    saved = []
    try:
        for mod, fn in _entry_points():
            module = importlib.import_module(f"compcomm.optim.{mod}")
            real = getattr(module, fn)

            def wrapper(*a: Any, _real: Any = real, _key: str = f"{mod}.{fn}", **k: Any) -> Any:
                key = f"{_key}@{_device_type(a, k)}"
                calls[key] = calls.get(key, 0) + 1
                return _real(*a, **k)

            saved.append((module, fn, real))
            setattr(module, fn, wrapper)
        yield calls
    finally:
        for module, fn, real in reversed(saved):
            setattr(module, fn, real)


@contextlib.contextmanager
def fused_switch(value: str) -> Iterator[None]:
    """``COMPCOMM_FUSED_OPTIM=value`` for the block (read at every call), then as it was."""
    old = os.environ.get("COMPCOMM_FUSED_OPTIM")
    os.environ["COMPCOMM_FUSED_OPTIM"] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("COMPCOMM_FUSED_OPTIM", None)
        else:
            os.environ["COMPCOMM_FUSED_OPTIM"] = old


def initial_params(dtype: torch.dtype, device: str) -> List[torch.nn.Parameter]:
    """The same parameters on every rank and in every run (generated on the CPU)."""
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device, dtype)) for s in SHAPES]


def gradient(rank: int, step: int, i: int) -> torch.Tensor:
    """Tensor ``i``'s gradient on ``rank`` at ``step`` (fp32, CPU): a direction shared by the
    ranks plus rank noise of the same size, so the ranks' gradients differ everywhere (with no
    exchange their parameters would too) but a consistent signal remains for the momentum."""
    shared = torch.randn(SHAPES[i], generator=torch.Generator().manual_seed(100 + i))
    seed = 10000 * (rank + 1) + 100 * step + i
    noise = torch.randn(SHAPES[i], generator=torch.Generator().manual_seed(seed))
    return (shared + noise) * GRAD_SCALES[i]


def _weights(opt: Any, params: List[torch.nn.Parameter]) -> List[torch.Tensor]:
    """The fp32 weights the optimizer updates (a low-precision parameter's master copy), on the
    CPU."""
    out = []
    for p in params:
        w = p.detach() if p.dtype == torch.float32 else opt.state[p]["master_param"]
        out.append(w.float().cpu().clone())
    return out


def run(case: str, rank: int, device: str, group: Any, fused: str, trajectory: bool = True,
        lr: float = LR, weight_decay: float = WD) -> Dict[str, Any]:
    """One training run of ``case``: STEPS steps on this rank's gradients, with
    ``COMPCOMM_FUSED_OPTIM=fused``. Returns the step kinds, the kernel calls (:func:`counting`),
    the fp32 weights after the last step (``final``) and, with ``trajectory``, after every step
    (``traj``), the final momenta (``exp_avg``) and parameters (``params``, in their dtype); all
    CPU copies."""
    import compcomm.optim as O

    name, dtype, kw = CASES[case]
    params = initial_params(dtype, device)
    calls: Dict[str, int] = {}
    kinds: List[str] = []
    traj: List[List[torch.Tensor]] = []
    grads = [[gradient(rank, t, i).to(device, dtype) for i in range(len(SHAPES))]
             for t in range(1, STEPS + 1)]
    with fused_switch(fused), counting(calls):
        opt = getattr(O, name)(params, lr=lr, weight_decay=weight_decay, process_group=group,
                               **kw)
        for t in range(1, STEPS + 1):
            kinds.append(opt.schedule.next_kind().name)
            for p, g in zip(params, grads[t - 1]):
                p.grad = g
            opt.step()
            if trajectory:
                traj.append(_weights(opt, params))
    out: Dict[str, Any] = {"kinds": kinds, "calls": calls, "skipped": opt.skipped_steps,
                           "comm": opt.comm.backend_name(), "world": opt.world_size,
                           "final": traj[-1] if traj else _weights(opt, params)}
    if trajectory:  # (the controls: the final weights only; ~1.7 MB a copy of the parameters)
        out["traj"] = traj
        out["exp_avg"] = [opt.state[p]["exp_avg"].detach().cpu().clone() for p in params]
        out["params"] = [p.detach().cpu().clone() for p in params]
    del opt
    gc.collect()  # its compressor and buffers, before the next run's
    return out


def run_case(case: str, rank: int, device: str, group: Any) -> Dict[str, Any]:
    """The two runs of ``case`` the test compares, and the controls (final state only)."""
    import compcomm

    return {
        "kernels": run(case, rank, device, group, "1"),
        "torch": run(case, rank, device, group, "0"),
        # each rank alone (a world of one: nothing exchanged; kernels on)
        "alone": run(case, rank, device, compcomm.LocalCommunicator(), "1", trajectory=False),
        # what a kernel that lost the weight decay or used another learning rate would give
        "no_weight_decay": run(case, rank, device, group, "0", trajectory=False,
                               weight_decay=0.0),
        "lr_off": run(case, rank, device, group, "0", trajectory=False, lr=LR * LR_OFF),
    }


def optimizer_ranks(rank: int, world: int, device: str = "cuda",
                    which: Optional[List[str]] = None) -> Dict[str, Any]:
    """The rank body: every case of CASES (or ``which``) on ``device``. On CUDA the ranks share
    the GPU(s) as emulated hosts of a torch NCCL group (compcomm's native NCCL communicator where
    the build has it); on the CPU they use run_ranks' default (gloo) group."""
    group = None
    if device == "cuda":
        import torch.distributed as dist

        os.environ["NCCL_HOSTID"] = f"compcomm-optim-ranks-{os.getppid()}-host{rank}"
        torch.cuda.set_device(rank % torch.cuda.device_count())
        group = dist.new_group(backend="nccl")
    from compcomm.optim import _fused

    out: Dict[str, Any] = {"device": device, "fused_available": _fused.available(),
                           "initial": {}, "cases": {}}
    for case in which or list(CASES):
        dtype = CASES[case][1]
        out["initial"][case] = [p.detach().float().cpu() for p in initial_params(dtype, "cpu")]
        out["cases"][case] = run_case(case, rank, device, group)
    return out


# ---------------------------------------------------------------------------------------------
# Comparisons (used by the test and by a dry run).


def mismatches(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> int:
    """Elements of ``a`` outside ``atol + rtol * |b|`` of ``b`` (NaN/Inf count as outside)."""
    a, b = a.double(), b.double()
    return int((~((a - b).abs() <= atol + rtol * b.abs())).sum())


def allowance(numel: int) -> int:
    """How many elements of a tensor may be outside the tolerance once 1-bit exchanges ran: a
    1-bit sign can flip where its input is within a few ulps of zero, and that element then takes
    a step of another sign (error feedback pulls it back over the next steps)."""
    return 2 + numel // 1000
