"""compcomm.optim.overlap: OneBitAdam(overlap_backward=True) sends its compressed phase's groups
of buckets from the backward. Every scenario runs with and without overlap on each rank (gloo,
W = 2 and 3, across the freeze step) and the parameters and error buffers must be bit-identical;
the safety cases (gradient accumulation, clipping, a parameter without gradient, kept gradients,
a step without backward, a state loaded between backward and step, GradScaler, a failing hook,
DDP's comm hook) must stay correct. Rank bodies: tests/_overlap_cases.py."""

from __future__ import annotations

import functools

import pytest
import torch

import _overlap_cases as C
from compcomm.testing import run_ranks

WORLDS = [2, 3]


@functools.lru_cache(maxsize=None)
def results(world: int):
    return run_ranks(world, C.scenarios, C.SCENARIOS, timeout=400)


_identical = C.identical


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bit_identical(world, dtype):
    for rank, out in enumerate(results(world)):
        run = out[f"plain_{dtype}"]
        assert _identical(run), f"rank {rank}"
        # every compressed step went through the overlap, which stayed on, silently
        assert run[True]["overlapped"] == C.STEPS - C.FREEZE
        assert run[True]["from_backward"] >= 2 * (C.STEPS - C.FREEZE)  # sent from the hooks
        assert run[True]["warm_sent"] == 0  # warm-up steps average in step(), nothing sent before
        assert run[True]["enabled"] and not run[True]["warnings"]
        assert len(run[True]["errors"]) > 1  # several buckets (and groups)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("scenario", ["accumulate", "clip", "scaler", "unscale", "data_mul",
                                      "foreach_data_one_rank", "accumulate_one_rank"])
def test_switches_itself_off(world, scenario):
    """Gradients accumulated again, changed after their group was sent (also through ``.data``
    or ``torch._foreach_mul_`` on ``.data``, which move no version counter: detected by value),
    or scaled by GradScaler (unscaled by ``unscale_()`` before ``step()`` or by the step itself):
    the launched exchanges are dropped, the step runs on the full gradients, and the overlap
    switches itself off (accumulation, GradScaler: at once; changed values: the second time)
    with one warning, on every rank alike -- also where only rank 0 does it (the verdicts are
    OR-ed in the agreement)."""
    for rank, out in enumerate(results(world)):
        run = out[f"{scenario}_float32"]
        assert _identical(run), f"rank {rank}"
        assert run[True]["enabled"] is False, rank
        assert len(run[True]["warnings"]) == 1, run[True]["warnings"]
        if scenario != "clip":  # (clipping that scales by 1.0 changes nothing: it may overlap)
            assert run[True]["overlapped"] == 0


@pytest.mark.parametrize("world", WORLDS)
def test_changed_once_discards_one_step(world):
    """Gradients changed through ``.data`` in one step only: that step's launches are dropped
    (one warning), the overlap stays on, and the others overlap; the same bits throughout."""
    for rank, out in enumerate(results(world)):
        run = out["data_once_float32"]
        assert _identical(run), f"rank {rank}"
        assert run[True]["enabled"] is True and len(run[True]["warnings"]) == 1, run[True]
        assert run[True]["overlapped"] == C.STEPS - C.FREEZE - 1


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("scenario", ["no_grad_param", "keep_grads", "no_backward", "load_state",
                                      "nonfinite"])
def test_stays_correct(world, scenario):
    """A parameter without gradient in one step (the plan changes, as without overlap),
    zero_grad(set_to_none=False), gradients written by hand (no hook fires: step() sends every
    group), a state dict loaded between backward and step, a step skipped on every rank for a
    non-finite gradient on one (the exchange sent from the backward raises; nothing committed)."""
    for rank, out in enumerate(results(world)):
        run = out[f"{scenario}_float32"]
        assert _identical(run), f"rank {rank}"
        assert run[True]["enabled"] and not run[True]["warnings"]
    if scenario == "keep_grads":
        assert run[True]["overlapped"] == C.STEPS - C.FREEZE
    if scenario == "no_backward":  # the first compressed step's backward sent; later, step()
        assert run[True]["overlapped"] == C.STEPS - C.FREEZE
        assert 0 < run[True]["from_backward"] <= 6
    if scenario == "nonfinite":
        assert run[False]["skipped"] == run[True]["skipped"] == 1
        assert run[True]["overlapped"] == C.STEPS - C.FREEZE - 1
    if scenario in ("no_grad_param", "load_state"):  # the steps after it overlap again
        assert 0 < run[True]["overlapped"] < C.STEPS - C.FREEZE


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("where", ["hook_error", "step_fill_error"])
def test_staging_error_raises_everywhere(world, where):
    """The staging fails on one rank, in a backward hook or in step() (groups no hook sent):
    that rank raises its error, the others RankMismatchError, nothing is written anywhere, and
    the retried step gives the bits of a run that never failed."""
    for rank, out in enumerate(results(world)):
        h = out[where]
        assert h["unchanged"] and h["same"], (rank, h)
        if rank == world - 1:
            assert h["raised"].startswith("RuntimeError: boom in the hook")
        else:
            assert h["raised"].startswith("RankMismatchError"), h
            if where == "hook_error":
                assert "hook failed" in h["raised"], h


def test_groups_walk_the_plan_backwards():
    """Groups of consecutive buckets from the last to the first, each of at least the target
    size (the last one may be smaller), cut where the device changes."""
    from types import SimpleNamespace

    from compcomm.optim import overlap

    sizes = [5, 3, 9, 1, 1, 7, 2]
    devs = [torch.device("cpu")] * 5 + [torch.device("meta")] * 2
    plan = SimpleNamespace(flats=[torch.empty(n) for n in sizes], devices=devs,
                           entries=[[] for _ in sizes])
    saved = overlap.GROUP_ELEMENTS, overlap.MAX_GROUPS
    overlap.GROUP_ELEMENTS, overlap.MAX_GROUPS = 4, 100
    try:
        groups = overlap.plan_groups(plan)
    finally:
        overlap.GROUP_ELEMENTS, overlap.MAX_GROUPS = saved
    assert [g.buckets for g in groups] == [[6, 5], [4, 3, 2], [1, 0]]
    assert [g.numels for g in groups] == [[2, 7], [1, 1, 9], [3, 5]]
    overlap.GROUP_ELEMENTS, overlap.MAX_GROUPS = 1, 2  # at most about MAX_GROUPS groups
    try:
        assert len(overlap.plan_groups(SimpleNamespace(
            flats=[torch.empty(1)] * 10, devices=[torch.device("cpu")] * 10,
            entries=[[]] * 10))) == 2
    finally:
        overlap.GROUP_ELEMENTS, overlap.MAX_GROUPS = saved


@pytest.mark.parametrize("world", WORLDS)
def test_compressor_group_exchange(world):
    for out in results(world):
        assert out["compressor"] == {"same": True, "dropped_ok": True, "empty_batch": True,
                                     "keys_after": []}, out["compressor"]


@pytest.mark.parametrize("bucket_view", [False, True])
def test_ddp_comm_hook(bucket_view):
    """DDP with compcomm.ddp_comm_hook: DDP copies its buckets back into the gradients after the
    backward (the same values in the compressed phase), or with gradient_as_bucket_view the
    gradients are views of its buckets: the values did not change, so the overlap stays on."""
    for rank, out in enumerate(run_ranks(2, C.ddp, bucket_view, timeout=200)):
        assert _identical({k: dict(v, errors={}) for k, v in out.items()}), f"rank {rank}"
        assert out[True]["overlapped"] == C.STEPS - C.FREEZE
        assert not out[True]["warnings"]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("plain", [False, True])
def test_ddp_unused_parameters(world, plain):
    """DDP with find_unused_parameters=True and a branch only rank 0 uses: the other ranks' hooks
    for it never fire (DDP writes those gradients). Groups leave in plan order and step() sends
    the rest in the same order, so every rank issues the same exchanges: the bits of the run
    without overlap. With compcomm.ddp_comm_hook the overlap stays on (rank 0 sends from the
    backward); under plain DDP, which rewrites every gradient with its average after the hooks,
    the value check discards and switches the overlap off."""
    for rank, out in enumerate(run_ranks(world, C.ddp_unused, plain, timeout=300)):
        assert _identical(out), f"rank {rank}"
        on = out[True]
        if plain:
            assert on["enabled"] is False and len(on["warnings"]) == 1, on["warnings"]
        else:
            assert on["enabled"] and not on["warnings"], on["warnings"]
            assert on["overlapped"] == C.STEPS - C.FREEZE
            if rank == 0:
                assert on["from_backward"] > 0


def test_state_loaded_between_uneven_backward_and_step():
    """DDP's unused parameters again, and a state dict loaded between a backward and its step:
    rank 0 sent every group from the backward, rank 1 none (its first group waits for a
    gradient DDP writes); load_state_dict sends rank 1's groups unstaged so both ranks issued the
    same exchanges, waits and drops them (no hang); the same bits as without overlap. The next
    backward is not armed: compcomm.ddp_comm_hook checks its buckets again in it, over the
    optimizer's group, which the exchanges share over the torch adapter."""
    for rank, out in enumerate(run_ranks(2, C.ddp_unused, False, True, timeout=300)):
        assert _identical(out), f"rank {rank}"
        assert out[True]["enabled"] and not out[True]["warnings"]
        assert out[True]["overlapped"] == C.STEPS - C.FREEZE - 2


@pytest.mark.parametrize("world", WORLDS)
def test_auto_is_off_over_the_torch_adapter(world):
    """'auto' over gloo (compcomm's torch adapter) with CPU parameters: off."""
    for out in results(world):
        assert out["auto"] == {"safe_comm": False, "on": False}


def test_auto_needs_cuda_and_native_nccl():
    """'auto' turns the overlap on only for CUDA parameters over compcomm's native NCCL
    communicator (a class of compcomm._C whose backend is "nccl"), never the torch adapter."""
    from types import SimpleNamespace

    from compcomm._comm import resolve
    from compcomm.optim.overlap import auto_safe, resolve_overlap

    native = type("NcclCommunicator", (), {"__module__": "compcomm._C",
                                           "backend_name": lambda self: "nccl"})()
    adapter = type("TorchCommunicator", (), {"__module__": "compcomm._comm",
                                             "backend_name": lambda self: "nccl"})()
    assert auto_safe(native) and not auto_safe(adapter) and not auto_safe(resolve(None))
    cuda = [{"params": [SimpleNamespace(device=torch.device("cuda", 0))]}]
    cpu = [{"params": [torch.zeros(1)]}]
    assert resolve_overlap("X", "auto", cuda, native) is True
    assert resolve_overlap("X", "auto", cuda, adapter) is False
    assert resolve_overlap("X", "auto", cpu, native) is False
    assert resolve_overlap("X", True, cpu, adapter) is True  # an explicit opt-in stays one


def test_streams_join_after_the_side_stream():
    """The buffers an exchange reads on the side stream were allocated on the streams that
    staged (the backward's, perhaps a user stream): after the exchanges each of those waits for
    the side stream (a freed block is reused on its allocating stream), and step()'s stream waits
    for both. (tests/test_overlap_gpu.py runs a backward on a user stream on CUDA.)"""
    from compcomm.optim.overlap import join_streams

    waits = []

    class S:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            waits.append((self.name, other.name))

    cur, user, side = S("step"), S("user"), S("side")
    join_streams(cur, [user], side)
    assert set(waits) == {("step", "user"), ("user", "side"), ("step", "side")}
    waits.clear()
    join_streams(cur, [cur], side)  # the backward on step()'s stream
    assert set(waits) == {("step", "side")}
    waits.clear()
    join_streams(cur, [user], None)  # the torch adapter: the exchange ran on the user stream
    assert waits == [("step", "user")]


def test_single_rank_and_defaults():
    from compcomm.optim import OneBitAdam
    model = C.Net()
    assert OneBitAdam(model.parameters()).overlap_backward is False  # 'auto' on CPU parameters
    # one rank sends nothing: no hooks
    assert OneBitAdam(model.parameters(), overlap_backward=True).overlap is None
    # 'auto': on CUDA parameters only
    assert OneBitAdam(model.parameters(), overlap_backward="auto").overlap_backward is False
    with pytest.raises(ValueError, match="argument 'overlap_backward'"):
        OneBitAdam(model.parameters(), overlap_backward="yes")


@pytest.mark.parametrize("world", WORLDS)
def test_abandoned_optimizer_is_freed(world):
    """No reference cycle keeps a dropped optimizer (and its backward hooks) alive."""
    for rank, out in enumerate(results(world)):
        assert out["abandoned"] is True, f"rank {rank}"


@pytest.mark.parametrize("late", [False, True])
def test_two_optimizers_on_one_communicator(late):
    """Two OneBitAdam over halves of one model on one communicator, as a GAN's G and D: each has
    its own worker thread, so the overlap must not run on either (one backward fires both
    optimizers' hooks; one's step() would send while the other's exchanges are in flight). It
    switches itself off on both, on every rank, with a warning (``overlap_backward=True``); made
    after the first one's backward sent its groups (``late``), those are drained. The same bits
    as without overlap, the steps called in either order."""
    for rank, out in enumerate(run_ranks(2, C.two_optimizers, True, late, timeout=200)):
        assert out["same"], rank
        assert out["shared"] and out["enabled"] == [False, False], (rank, out)
        assert len(out["warnings"]) == 2, out["warnings"]
        if late:
            assert out["sent_late"] > 0  # the first one had sent from the backward


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("scenario", ["grad_none", "nan_sanitize", "add_group", "unfreeze"])
def test_changed_after_send(world, scenario):
    """A gradient set to None after its group was sent (the plan changes: dropped, ordinary
    path); a non-finite gradient cleaned (``nan_to_num_``) after it was sent (the exchange's
    NonFiniteError is checked against the current gradients: they changed, so the ordinary path
    runs and the step is not skipped); parameters added (``add_param_group``) or unfrozen after
    construction (hooked when the plan takes them in: their steps overlap too)."""
    for rank, out in enumerate(results(world)):
        run = out[f"{scenario}_float32"]
        assert _identical(run), f"rank {rank}"
        assert run[True]["enabled"], run[True]
        assert run[True]["skipped"] == run[False]["skipped"]
        if scenario == "grad_none":  # that step and the next (the plan changes back) drop
            assert run[True]["overlapped"] == C.STEPS - C.FREEZE - 2 and not run[True]["warnings"]
        elif scenario == "nan_sanitize":  # not skipped: a change (one warning), overlap stays on
            assert run[True]["skipped"] == 0 and len(run[True]["warnings"]) == 1
            assert run[True]["overlapped"] == C.STEPS - C.FREEZE - 1
        else:  # every parameter hooked, and the steps after the plan took them in overlap
            assert run[True]["hooked"] == 8 and run[True]["overlapped"] >= 1


@pytest.mark.parametrize("world", WORLDS)
def test_value_check_failure_falls_back(world):
    """The value check itself fails on rank 0 (no memory for its scratch): no error on any rank,
    the ordinary path runs (the same bits), the overlap switches off everywhere, and its scratch
    is freed (also the value check's entries the groups kept)."""
    for rank, out in enumerate(results(world)):
        c = out["check_fails"]
        assert c["same"] and not c["errors"], (rank, c)
        assert c["enabled"] is False and c["overlapped"] == 0 and len(c["warnings"]) == 1, c
        assert c["groups_kept"] == 0 and not c["scratch_alive"], c


@pytest.mark.parametrize("world", WORLDS)
def test_load_state_dict_is_local(world):
    """load_state_dict between backward and step sends nothing (the round is cancelled; the
    next step() sends and drops it)."""
    for rank, out in enumerate(results(world)):
        assert out["no_comm_in_load"] == [], rank


def test_scratch_freed_when_switched_off():
    """Switched off (clipping every step), no group keeps the value check's scratch alive."""
    for rank, out in enumerate(results(2)):
        run = out["clip_float32"]
        assert run[True]["enabled"] is False and run[True]["groups_kept"] == 0, rank
