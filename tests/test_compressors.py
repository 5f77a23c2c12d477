"""The compressor seam (compcomm.compress): the optimizers with IdentityCompressor, the
full-precision twin of OneBitCompressor, are the same algorithms on exact averages.

* OneBitAdam with IdentityCompressor equals the numpy reference of 1-bit Adam
  (tests/optim_reference.py) with its compressed allreduce replaced by an exact average, and its
  uncompressed twin: the same optimizer in a world of one rank (where nothing is compressed) fed
  the averaged gradients. Both to fp32 rounding.
* OneBitLamb with IdentityCompressor equals its one-rank twin the same way.
* Neither keeps error buffers, in memory or in checkpoints; a non-finite value on one rank skips
  the step on every rank, as with the 1-bit compressor.
"""

from __future__ import annotations

import functools

import _compressor_cases as K
import _optim_cases as C
import numpy as np
import optim_reference as R
import pytest
import torch
from compcomm import LocalCommunicator
from compcomm.compress import IdentityCompressor, OneBitCompressor
from compcomm.optim import OneBitAdam, OneBitLamb
from compcomm.testing import run_ranks

TRAJ_ATOL = 5e-5  # as tests/test_optim.py: fp32 rounding accumulated over the steps


@functools.lru_cache(maxsize=None)
def results(world: int):
    return run_ranks(world, K.identity_runs, timeout=240)


def max_diff(per_rank, ref):
    """Max |a - b| with ``per_rank[r][t][i]`` against ``ref[t][r][i]``."""
    return max(float(np.max(np.abs(a - b)))
               for r, traj in enumerate(per_rank) for t, ps in enumerate(traj)
               for a, b in zip(ps, ref[t][r]))


def exact_average(xs, wes, ses):
    """The simulated compressed allreduce's signature, without compression (fp32)."""
    acc = np.zeros_like(xs[0], dtype=np.float32)
    for x in xs:
        acc = (acc + x).astype(np.float32)
    return (acc * np.float32(1.0 / len(xs))).astype(np.float32)


def twin(cls, kw, grads):
    """``cls`` in a world of one rank on the rank-averaged gradients (nothing is compressed)."""
    avg = [[np.mean(np.stack(step), axis=0, dtype=np.float32) for step in zip(*gstep)]
           for gstep in grads]
    traj, _, _, _ = C.run_opt(cls, dict(kw, process_group=LocalCommunicator()), C.make_params(),
                              [[a] for a in avg], 0)
    return [[ps] * len(grads[0]) for ps in traj]


@pytest.mark.parametrize("world", [2, 3])
def test_identity_onebit_adam_is_the_reference_on_exact_averages(world, monkeypatch):
    outs = results(world)
    grads = C.make_grads(10, world)
    kw = dict(lr=0.01, freeze_step=4, wd=0.01)
    compressed = R.onebit_adam(C.make_params(), grads, masks=C.masks_for(), fused=True, **kw)
    monkeypatch.setattr(R, "compressed_allreduce", exact_average)
    exact = R.onebit_adam(C.make_params(), grads, masks=C.masks_for(), fused=True, **kw)
    assert max_diff([o["adam"] for o in outs], exact) < TRAJ_ATOL
    # compression is really off: the 1-bit reference is elsewhere
    assert max_diff([o["adam"] for o in outs], compressed) > 1e-4
    per_param = R.onebit_adam(C.make_params(), grads, **kw)
    assert max_diff([o["adam_per_param"] for o in outs], per_param) < TRAJ_ATOL


@pytest.mark.parametrize("world", [2, 3])
def test_identity_optimizers_equal_their_uncompressed_twin(world):
    outs = results(world)
    kw = dict(lr=0.01, freeze_step=4, weight_decay=0.01)
    ref = twin(OneBitAdam, kw, C.make_grads(10, world))
    assert max_diff([o["adam_per_param"] for o in outs], ref) < TRAJ_ATOL
    ref = twin(OneBitLamb, kw, C.make_grads(10, world, seed=3))
    assert max_diff([o["lamb"] for o in outs], ref) < TRAJ_ATOL


def test_identity_compressor_keeps_no_error_feedback_and_skips_nonfinite_steps():
    for o in results(2):
        assert not o["adam_saved_errors"] and o["adam_error_bytes"] == 0
        assert o["nan_skipped"]


def test_compressor_argument():
    p = torch.nn.Parameter(torch.zeros(3))
    assert isinstance(OneBitAdam([p]).compressor, OneBitCompressor)
    assert isinstance(OneBitAdam([p], compressor=IdentityCompressor).compressor,
                      IdentityCompressor)
    with pytest.raises(TypeError, match="'compressor'"):
        OneBitAdam([p], compressor="identity")


def test_identity_compressor_on_one_rank():
    comp = IdentityCompressor(LocalCommunicator())
    t = torch.arange(5.0)
    comp.average_(["a"], [t.numel()], lambda i: t, t.device)  # one rank: the bucket keeps its values
    assert torch.equal(t, torch.arange(5.0))
    assert comp.state_dict() == {} and comp.keys() == [] and comp.nbytes() == (0, 0)
