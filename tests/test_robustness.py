"""Nothing half-done (issue 14): every bad input raises a typed error naming the argument before
any communication and changes nothing, on every rank; checkpoint loads validate first (and ZeRO's
ranks agree) so a failed load changes nothing; a process killed while saving leaves the previous
checkpoint loadable; two threads on two communicators get the sequential results, and two threads
on one communicator get a clear CommError instead of wrong results.

The rank bodies and the tables of bad inputs are in tests/_robust_cases.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import compcomm
from _robust_cases import (
    _collective_bad_inputs,
    _nonfinite_server_error,
    _one_rank_rejects,
    _rank_from_config,
    _rank_one_communicator_two_threads,
    _rank_optimizer_bad_loads,
    _rank_reshaped_param,
    _rank_two_threads_two_groups,
    _rank_zero_bad_loads,
    _rank_zero_onebit_failed_exchange,
)
from compcomm.testing import run_ranks


def test_error_buffers_rejects_bad_sizes():
    with pytest.raises(TypeError, match="error_buffers: argument 'numel_or_tensor'.*got str"):
        compcomm.error_buffers("1000")
    with pytest.raises(ValueError, match="error_buffers: argument 'numel_or_tensor' must be >= 0"):
        compcomm.error_buffers(-8)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_collective_overlap_and_timeout_rejected_on_every_rank(world):
    if world == 1:
        assert _collective_bad_inputs(0, 1) == 10
    else:
        assert run_ranks(world, _collective_bad_inputs, timeout=240) == [10] * world


@pytest.mark.parametrize("world", [2, 3])
def test_one_rank_with_a_bad_argument_makes_every_rank_raise(world):
    """A regression: the peers wait in the header exchange until their timeout, or pair with the
    rejecting rank's next call (silently wrong averages)."""
    assert run_ranks(world, _one_rank_rejects, timeout=240) == [6] * world


@pytest.mark.parametrize("world", [1, 2, 3])
def test_nonfinite_server_error_raises(world):
    """A regression: the call returns normally with nothing averaged (the commit skipped)."""
    if world == 1:
        assert _nonfinite_server_error(0, 1) == 2
    else:
        assert run_ranks(world, _nonfinite_server_error, timeout=240) == [2] * world


def test_check_must_be_a_flag():
    t = torch.randn(100)
    we, se = compcomm.error_buffers(t)
    with pytest.raises(TypeError, match=r"\[rank 0\] compressed_allreduce: argument 'check' "
                       "must be true or false, got Tensor"):
        compcomm.compressed_allreduce(t, we, se, check=torch.ones(2))


def test_tensor_that_requires_grad():
    """Rejected under grad mode (an in-place write autograd cannot follow); under no_grad written
    as an in-place op: its version is bumped, so a graph that saved it raises at backward."""
    x = torch.randn(100, requires_grad=True)
    we, se = compcomm.error_buffers(x)
    with pytest.raises(ValueError,
                       match=r"\[rank 0\] compressed_allreduce: argument 'tensor' requires grad"):
        compcomm.compressed_allreduce(x, we, se)
    y = x * 2
    loss = (y * y).sum()  # saves y
    version = y._version
    with torch.no_grad():
        compcomm.compressed_allreduce(y, we, se)
    assert y._version == version + 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_two_threads_on_two_communicators_match_sequential():
    assert run_ranks(2, _rank_two_threads_two_groups, timeout=240) == [True, True]


def test_one_communicator_two_threads_raises_comm_error():
    assert run_ranks(2, _rank_one_communicator_two_threads, timeout=240) == [True, True]


@pytest.mark.parametrize("world", [1, 2])
def test_optimizer_load_rejects_bad_state_and_changes_nothing(world):
    if world == 1:
        assert _rank_optimizer_bad_loads(0, 1) == 45
    else:
        assert run_ranks(world, _rank_optimizer_bad_loads, timeout=240) == [49, 49]


@pytest.mark.parametrize("world", [1, 2])
def test_optimizer_step_after_reshaped_param(world):
    if world == 1:
        assert _rank_reshaped_param(0, 1) == 6
    else:
        assert run_ranks(world, _rank_reshaped_param, timeout=240) == [6, 6]


@pytest.mark.parametrize("world", [1, 2])
def test_zero_load_rejects_bad_shard_on_every_rank(world, tmp_path):
    if world == 1:
        assert _rank_zero_bad_loads(0, 1, str(tmp_path)) == 22
    else:
        assert run_ranks(world, _rank_zero_bad_loads, str(tmp_path), timeout=300) == [23, 23]


@pytest.mark.parametrize("world", [1, 2])
def test_from_config_rejects_bad_values_before_communicating(world, tmp_path):
    if world == 1:
        assert _rank_from_config(0, 1, str(tmp_path)) == 19
    else:
        assert run_ranks(world, _rank_from_config, str(tmp_path), timeout=240) == [19, 19]


# --------------------------------------------------------------------------------------------
# kill -9 while saving: the previous checkpoint still loads
# --------------------------------------------------------------------------------------------
_SAVER = textwrap.dedent("""
    import io, os, sys, time
    import torch
    kind, d = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    if kind == "optim":
        from compcomm.optim import OneBitAdam, save_rank_checkpoint
        p = torch.nn.Parameter(torch.randn(1 << 20))
        opt = OneBitAdam([p], lr=0.01)
        def step():
            p.grad = torch.ones_like(p)
            opt.step()
        save = lambda: save_rank_checkpoint(opt, d)
    else:
        from compcomm.zero import ZeroOptimizer, save_checkpoint
        model = torch.nn.Linear(512, 512)
        opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=1)
        def step():
            opt.zero_grad()
            model(torch.ones(2, 512)).sum().backward()
            opt.step()
        save = lambda: save_checkpoint(opt, d, module=model)
    step()
    save()  # the checkpoint that must survive: one step
    step()
    real_save = torch.save
    def slow_save(obj, f, *args, **kwargs):  # writes half, then hangs until killed
        buf = io.BytesIO()
        real_save(obj, buf, *args, **kwargs)
        data = buf.getvalue()
        if isinstance(f, (str, os.PathLike)):
            f = open(f, "wb")
        f.write(data[: len(data) // 2])
        f.flush()
        os.fsync(f.fileno())
        print("HALF", flush=True)
        time.sleep(300)
        f.write(data[len(data) // 2 :])
    torch.save = slow_save
    save()
""")


@pytest.mark.parametrize("kind", ["optim", "zero"])
def test_kill_during_save_leaves_previous_checkpoint(kind, tmp_path):
    d = str(tmp_path / "ckpt")
    proc = subprocess.Popen(
        [sys.executable, "-c", _SAVER, kind, d], stdout=subprocess.PIPE, text=True
    )
    try:
        line = proc.stdout.readline()
        assert line.strip() == "HALF", f"saver did not reach the second save: {line!r}"
        os.kill(proc.pid, signal.SIGKILL)  # mid-write of the second checkpoint
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    torch.manual_seed(0)
    if kind == "optim":
        from compcomm.optim import OneBitAdam, load_rank_checkpoint

        p = torch.nn.Parameter(torch.randn(1 << 20))
        opt = OneBitAdam([p], lr=0.01)
        load_rank_checkpoint(opt, d)
        assert opt.sched["step"] == 1
        assert torch.allclose(opt.state[p]["exp_avg"], torch.full_like(p, 0.1))
    else:
        from compcomm.zero import ZeroOptimizer, consolidate, load_checkpoint

        model = torch.nn.Linear(512, 512)
        opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=1)
        load_checkpoint(opt, d)
        assert opt.global_steps == 1 and opt.state_dict()["optimizer"]["state"][0]["step"] == 1
        assert set(consolidate(d)) == {"weight", "bias"}  # the dead writer's temporary is ignored
        opt.close()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_onebit_failed_exchange_changes_nothing(world, stage):
    """ZeRO stage 1/2 with a 1-bit reduce-scatter (no overlap): an exchange of a later bucket fails
    on every rank; the step raises and no bucket's error buffers, no parameter and no optimizer
    state changed (every bucket is exchanged before any commits)."""
    for res in run_ranks(world, _rank_zero_onebit_failed_exchange, stage, timeout=240):
        assert res == {"raised": "BackendError", "unchanged": True}, res
