"""Rank bodies for tests/test_zero_compat.py: ZeRO checkpoints written by the code before the
ZeroOptimizer split (tests/data/zero_v1, made by :func:`make` at commit 000a584) load into today's
ZeroOptimizer and continue as that code continued them (to a few ulps); loading one and saving it
again writes the same file contents (the on-disk format did not change).

To remake the data (only if the format is changed on purpose, with a converter for the old one):
check out the old commit, copy this file into its tests/, and run
``run_ranks(WORLD, make, "tests/data/zero_v1")`` from a script with ``tests/`` on the path."""

from __future__ import annotations

import os
from typing import Any, Dict, List

import torch
from _zero_onebit_cases import _flat, _params, _Synthetic

WORLD = 2

#: name -> how the optimizer is built and run: the checkpoint is saved after step ``save_at``
#: and the run continues to ``steps``.
CASES: Dict[str, Dict[str, Any]] = {
    # sharded 1-bit reduce-scatter, buckets exchanged during backward, error buffers saved
    "onebit_sharded_stage2": dict(
        opt="OneBitAdam", stage=2, dtype="float32", save_at=4, steps=6,
        kwargs={"lr": 1e-2, "freeze_step": 2, "exact_resume": True},
        zero={"reduce_bucket_size": 12, "overlap_comm": True, "onebit_mode": "sharded"}),
    # replicated momentum (the default "exact" mode), error buffers saved
    "onebit_exact_stage1": dict(
        opt="OneBitAdam", stage=1, dtype="float32", save_at=4, steps=6,
        kwargs={"lr": 1e-2, "freeze_step": 2, "exact_resume": True},
        zero={"reduce_bucket_size": 12}),
    # no all-gather, bf16 parameters (full fp32 masters kept on every rank)
    "onebit_noallgather_stage2_bf16": dict(
        opt="OneBitAdam", stage=2, dtype="bfloat16", save_at=3, steps=5,
        kwargs={"lr": 1e-2, "freeze_step": 1, "exact_resume": True},
        zero={"reduce_bucket_size": 12, "onebit_mode": "no_allgather"}),
    # 0/1 Adam saved in its local-step phase (unsharded state and this rank's own parameters)
    "zoadam_local_stage2": dict(
        opt="ZeroOneAdam", stage=2, dtype="float32", save_at=5, steps=8,
        kwargs={"lr": 1e-2, "var_freeze_step": 2, "local_step_scaler": 1,
                "local_step_clipper": 4, "exact_resume": True},
        zero={"reduce_bucket_size": 12}),
    # stage 3, a torch optimizer, gradient accumulation and a dynamic loss scale
    "adamw_stage3": dict(
        opt="AdamW", stage=3, dtype="float32", save_at=2, steps=4, gas=2, loss_scale=0,
        kwargs={"lr": 1e-2, "weight_decay": 0.1}, zero={}),
}


def _build(comm: Any, case: Dict[str, Any]):
    from compcomm.optim import OneBitAdam, ZeroOneAdam
    from compcomm.zero import ZeroOptimizer

    cls = {"OneBitAdam": OneBitAdam, "ZeroOneAdam": ZeroOneAdam,
           "AdamW": torch.optim.AdamW}[case["opt"]]
    dtype = getattr(torch, case["dtype"])
    params = [torch.nn.Parameter(p.detach().to(dtype)) for p in _params()]
    model = _Synthetic(params)
    z = ZeroOptimizer(params, cls, stage=case["stage"], process_group=comm, module=model,
                      optimizer_kwargs=case["kwargs"],
                      gradient_accumulation_steps=case.get("gas", 1),
                      loss_scale=case.get("loss_scale", 1.0), **case["zero"])
    return params, model, z


def _run(params, model, z, rank: int, first: int, last: int, gas: int) -> List[Any]:
    out = []
    for t in range(first, last + 1):
        for micro in range(gas):
            z.backward(model(rank, t, micro))
        z.step()
        z.gather_parameters()  # stage 3: released again by the next step
        out.append(_flat(params))
    return out


def make(rank: int, world: int, directory: str) -> None:
    """Write every case's checkpoint (after ``save_at``) and the trajectory a fresh optimizer
    loading it then takes (run with the code whose format is to be kept)."""
    from compcomm._comm import resolve
    from compcomm.zero import load_checkpoint, save_checkpoint

    comm = resolve(None)
    expected = {}
    for name, case in CASES.items():
        params, model, z = _build(comm, case)
        _run(params, model, z, rank, 1, case["save_at"], case.get("gas", 1))
        save_checkpoint(z, os.path.join(directory, name))
        z.close()
        params, model, z = _build(comm, case)
        load_checkpoint(z, os.path.join(directory, name))
        expected[name] = _run(params, model, z, rank, case["save_at"] + 1, case["steps"],
                              case.get("gas", 1))
        z.close()
    torch.save(expected, os.path.join(directory, f"expected_rank{rank}.pt"))


def _same(a: Any, b: Any, where: str) -> None:
    """Assert two checkpoint values are equal (tensors bit for bit, dtype and shape included)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def check(rank: int, world: int, directory: str, scratch: str) -> List[str]:
    """Load every old checkpoint, save it again (same contents as the old file), continue and
    compare with the old code's trajectory (to a few ulps). Returns the cases checked."""
    import numpy as np
    from compcomm._comm import resolve
    from compcomm.zero import load_checkpoint, save_checkpoint
    from compcomm.zero.checkpoint import shard_file

    comm = resolve(None)
    expected = torch.load(os.path.join(directory, f"expected_rank{rank}.pt"), weights_only=False)
    done = []
    for name, case in CASES.items():
        params, model, z = _build(comm, case)
        load_checkpoint(z, os.path.join(directory, name))
        path = save_checkpoint(z, os.path.join(scratch, name), module=None)
        old = torch.load(shard_file(os.path.join(directory, name), rank, world), map_location="cpu",
                         weights_only=False)
        _same(old, torch.load(path, map_location="cpu", weights_only=False), f"{name} rank {rank}")
        got = _run(params, model, z, rank, case["save_at"] + 1, case["steps"], case.get("gas", 1))
        z.close()
        # The files are compared bit for bit above; the continued steps only to a few ulps: the
        # expected trajectory was computed on one machine, and torch's vectorized CPU math (sqrt,
        # division) differs by an ulp between CPUs, and the steps compound it (seen in CI: 2.4e-7
        # relative at one element; on an AMD EPYC VM 2.8e-6 at an element of 0.027 after 8 steps).
        # A change of the update's formula moves elements by far more than 1e-5.
        for t, (a, e) in enumerate(zip(got, expected[name]), start=case["save_at"] + 1):
            np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-7,
                                       err_msg=f"{name}: rank {rank} step {t}")
        done.append(name)
    return done
