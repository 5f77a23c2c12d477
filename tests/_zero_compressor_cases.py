"""Rank bodies for tests/test_zero_compressors.py: ZeroOptimizer with a 1-bit optimizer built with
``compressor=IdentityCompressor`` against the same optimizer unsharded (same compressor, same
gradients, same world)."""

from __future__ import annotations

import functools
from typing import Any, Dict, List

import torch

from _zero_onebit_cases import _flat, _state_tensors, plain_run
from _zero_onebit_modes_cases import BUCKET, _backward, _Synthetic, init_params, zero_run


def _inner(case: Dict[str, Any]):
    from compcomm.compress import IdentityCompressor
    from compcomm.optim import OneBitAdam, ZeroOneAdam

    cls = {"OneBitAdam": OneBitAdam, "ZeroOneAdam": ZeroOneAdam}[case["opt"]]
    comp = IdentityCompressor if case.get("identity", True) else None
    if case.get("partial"):  # the compressor bound into optimizer_class instead of optimizer_kwargs
        return functools.partial(cls, compressor=comp), {}
    return cls, {"compressor": comp}


def _zero(params, model, comm, case: Dict[str, Any], **extra):
    from compcomm.zero import ZeroOptimizer

    cls, kw = _inner(case)
    return ZeroOptimizer(params, cls, stage=case["stage"], process_group=comm, module=model,
                         optimizer_kwargs=dict(case["kwargs"], **kw, **extra),
                         gradient_accumulation_steps=case["gas"], reduce_bucket_size=BUCKET,
                         overlap_comm=case.get("overlap", False), onebit_mode=case.get("mode"))


def trajectory(rank: int, world: int, comm: Any, case: Dict[str, Any]) -> Dict[str, Any]:
    """Parameters, phase and bytes sent after each step under ZeRO, and the parameters of the
    unsharded optimizer with the same compressor."""
    from compcomm.compress import IdentityCompressor

    params = init_params()
    model = _Synthetic(params)
    z = _zero(params, model, comm, case)
    out: Dict[str, Any] = {"zero": [], "bytes": [], "phase": [],
                           "identity": isinstance(z.compressor, IdentityCompressor)}
    for t in range(1, case["steps"] + 1):
        out["phase"].append(z.phase.value)
        comm.reset_bytes_sent()
        _backward(model, rank, t, case["gas"])
        z.step()
        out["bytes"].append(comm.bytes_sent)
        out["zero"].append(_flat(params))
    out["plan"] = [dict(b) for b in z.groups[0].buckets]
    out["errors"] = len(z._errors)
    z.close()

    cls, kw = _inner(case)
    params = init_params()
    opt = cls(params, process_group=comm, reduce_bucket_size=BUCKET, **case["kwargs"], **kw)
    model = _Synthetic(params)
    out["plain"] = plain_run(opt, params, lambda t: _backward(model, rank, t, case["gas"]),
                             case["steps"], case["gas"])
    return out


def resume(rank: int, world: int, comm: Any, case: Dict[str, Any], directory: str) -> Dict[str, Any]:
    """Checkpoints in the compressed phase (no error buffers to save), resumed into a fresh ZeRO."""
    from compcomm.zero import load_checkpoint

    def run(params, model, z, first, last, save_at=()):
        return zero_run(rank, case["gas"], directory, params, model, z, first, last, save_at)

    extra = {"exact_resume": case.get("exact_resume", False)}
    params = init_params()
    model = _Synthetic(params)
    z = _zero(params, model, comm, case, **extra)
    out = {"full": run(params, model, z, 1, case["steps"], save_at=case["save_at"]),
           "resumed": {}, "saved_errors": z.state_dict().get("errors"),
           "state": [t.clone() for t in _state_tensors(z.optimizer)]}
    z.close()
    for s in case["save_at"]:
        params = init_params()
        model = _Synthetic(params)
        z = _zero(params, model, comm, case, **extra)
        load_checkpoint(z, f"{directory}/step{s}")
        out["resumed"][s] = run(params, model, z, s + 1, case["steps"])
        if s == case["save_at"][-1]:
            out["resumed_state"] = [t.clone() for t in _state_tensors(z.optimizer)]
        z.close()
    return out


def rank_body(rank: int, world: int, cases: List[Dict[str, Any]], resumes: List[Dict[str, Any]],
              directory: str) -> Dict[str, Any]:
    from compcomm import _C
    from compcomm._buffers import buffer_of
    from compcomm._comm import resolve

    comm = resolve(None)
    out = {"cases": [trajectory(rank, world, comm, c) for c in cases],
           "resume": [resume(rank, world, comm, c, f"{directory}/r{i}")
                      for i, c in enumerate(resumes)]}
    scalar = torch.zeros(1, dtype=torch.float64)  # the bytes of ZeRO's norm all-reduce
    comm.reset_bytes_sent()
    comm.all_reduce(buffer_of(scalar), _C.ReduceOp.sum, 60.0)
    out["norm_bytes"] = comm.bytes_sent
    return out
