"""``OneBitBase.step_on(params, grads, kind)``: the update rule alone, with no communication.

Each 1-bit optimizer's ``step_on`` over every step kind of its schedule gives the same parameters,
moments and schedule as its own ``step()`` on a world of one rank with the same gradients (the same
code path on the same machine, so bit for bit), while the optimizer stepping with ``step_on`` sits
on a two-rank communicator that raises on any collective. Bad arguments raise typed errors naming
the argument and the rank, and change nothing.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List

import pytest
import torch

import compcomm
from compcomm.errors import NonFiniteError
from compcomm.optim import OneBitAdam, OneBitLamb, ZeroOneAdam
from compcomm.schedule import StepKind


class NoCollectives(compcomm.Communicator):
    """Rank ``rank`` of a two-rank world whose every collective raises (and is counted)."""

    def __init__(self, rank: int = 1, size: int = 2) -> None:
        compcomm.Communicator.__init__(self)
        self._rank, self._size = rank, size
        self.calls: List[str] = []

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def backend_name(self) -> str:
        return "no-collectives"

    def _refuse(self, name: str) -> None:
        self.calls.append(name)
        raise RuntimeError(f"NoCollectives: {name} called")

    def do_all_to_all(self, send, recv, opts):  # type: ignore[no-untyped-def]
        self._refuse("all_to_all")

    def do_all_gather(self, send, recv, opts):  # type: ignore[no-untyped-def]
        self._refuse("all_gather")

    def do_reduce_scatter(self, send, recv, op, opts):  # type: ignore[no-untyped-def]
        self._refuse("reduce_scatter")

    def do_all_reduce(self, buf, op, opts):  # type: ignore[no-untyped-def]
        self._refuse("all_reduce")

    def do_broadcast(self, buf, root, opts):  # type: ignore[no-untyped-def]
        self._refuse("broadcast")

    def do_barrier(self, opts):  # type: ignore[no-untyped-def]
        self._refuse("barrier")


#: optimizer, its arguments (a short schedule that reaches every kind), the kinds it must reach
CASES: Dict[str, Any] = {
    "OneBitAdam": (OneBitAdam, dict(lr=1e-2, freeze_step=3, weight_decay=0.01),
                   {StepKind.FULL_AVERAGE, StepKind.ONEBIT}),
    "ZeroOneAdam": (ZeroOneAdam, dict(lr=1e-2, var_freeze_step=5, var_update_scaler=1,
                                      local_step_scaler=1, local_step_clipper=4,
                                      weight_decay=0.01, bias_correction=True),
                    {StepKind.FULL_AVERAGE, StepKind.ONEBIT_GRAD, StepKind.LOCAL,
                     StepKind.SYNC}),
    "OneBitLamb": (OneBitLamb, dict(lr=1e-2, freeze_step=3, weight_decay=0.01),
                   {StepKind.FULL_AVERAGE, StepKind.ONEBIT}),
}
STEPS = 12


def _params(dtype: torch.dtype, device: str = "cpu") -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (5,), (0,), (3, 4, 2), (11,)]
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device=device, dtype=dtype))
            for s in shapes]


def _groups(params: List[torch.Tensor], masked: bool) -> List[Dict[str, Any]]:
    second = {"params": params[4:], "lr": 5e-3}
    if masked:  # the compressed momentum times a mask (0 where it is always zero)
        second["exp_avg_mask"] = (torch.arange(11, device=params[4].device) % 3 != 0).float()
    return [{"params": params[:4]}, second]


def _grads(t: int, params: List[torch.Tensor]) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + t)
    return [torch.randn(p.shape, generator=g).to(device=p.device, dtype=p.dtype) for p in params]


def _snapshot(opt: Any) -> Dict[str, Any]:
    """Parameters, state tensors (by parameter position), schedule and error buffers."""
    params = [p for g in opt.param_groups for p in g["params"]]
    state = {i: {k: (v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                 for k, v in opt.state.get(p, {}).items()} for i, p in enumerate(params)}
    errors = {k: {kk: vv.clone() for kk, vv in v.items()}
              for k, v in opt.compressor.state_dict().items()}
    return {"params": [p.detach().clone() for p in params], "state": state,
            "sched": opt.schedule.state_dict(), "errors": errors}


def _assert_same(a: Dict[str, Any], b: Dict[str, Any]) -> None:
    for x, y in zip(a["params"], b["params"]):
        assert torch.equal(x, y)
    assert a["sched"] == b["sched"]
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        sa, sb = a["state"][i], b["state"][i]
        assert sa.keys() == sb.keys(), i
        for k in sa:
            if isinstance(sa[k], torch.Tensor):
                assert torch.equal(sa[k], sb[k]), (i, k)
            else:
                assert sa[k] == sb[k], (i, k)
    assert a["errors"].keys() == b["errors"].keys()


_NO_CUDA = not torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu,
                                              pytest.mark.skipif(_NO_CUDA, reason="no CUDA")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_step_on_equals_step(name: str, dtype: torch.dtype, device: str) -> None:
    """On CUDA both go through the fused multi-tensor kernels where OneBitAdam uses them."""
    cls, kw, kinds = CASES[name]
    masked = name != "OneBitLamb"
    pa, pb = _params(dtype, device), _params(dtype, device)
    a = cls(_groups(pa, masked), process_group=compcomm.LocalCommunicator(), **kw)
    comm = NoCollectives()
    b = cls(_groups(pb, masked), process_group=comm, **kw)
    assert b.world_size == 2
    seen = set()
    for t in range(1, STEPS + 1):
        grads = _grads(t, pa)
        kind = b.schedule.next_kind()
        assert kind is a.schedule.next_kind()
        seen.add(kind)
        for p, g in zip(pa, grads):
            p.grad = g.clone()
        a.step()
        b.step_on(pb, grads, kind)
        _assert_same(_snapshot(a), _snapshot(b))
    assert comm.calls == []
    assert seen == kinds, f"{name}: the schedule reached {seen}, expected {kinds}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_step_on_skips_params_not_given(name: str) -> None:
    """A parameter left out of ``params`` is left alone, as ``step()`` leaves one without
    gradient."""
    cls, kw, _ = CASES[name]
    pa, pb = _params(torch.float32), _params(torch.float32)
    a = cls(_groups(pa, False), process_group=compcomm.LocalCommunicator(), **kw)
    comm = NoCollectives()
    b = cls(_groups(pb, False), process_group=comm, **kw)
    for t in range(1, 4):  # warm-up steps: the plan of which parameters step may change
        grads = _grads(t, pa)
        keep = [i for i in range(len(pa)) if i != 1 or t == 1]
        for i, p in enumerate(pa):
            p.grad = grads[i].clone() if i in keep else None
        a.step()
        b.step_on([pb[i] for i in keep], [grads[i] for i in keep], b.schedule.next_kind())
        _assert_same(_snapshot(a), _snapshot(b))
    assert comm.calls == []


def _bad_calls(pb: List[torch.Tensor], grads: List[torch.Tensor], kind: StepKind,
               other: StepKind) -> List[Any]:
    """(params, grads, kind, error type, the argument the message must name) of wrong calls."""
    stranger = torch.nn.Parameter(torch.zeros(5))
    wrong_shape = list(grads)
    wrong_shape[1] = torch.zeros(6)
    ints = list(grads)
    ints[0] = torch.zeros(grads[0].shape, dtype=torch.int64)
    return [
        (pb, grads, kind.value, TypeError, "'kind'"),
        (pb, grads, other, ValueError, "'kind'"),
        (pb, grads[:-1], kind, ValueError, "'grads'"),
        (pb[0], grads[0], kind, TypeError, "'params'"),
        ([pb[0], stranger], grads[:2], kind, ValueError, "'params[1]'"),
        ([pb[0], pb[0]], grads[:2], kind, ValueError, "'params[1]'"),
        (pb, wrong_shape, kind, ValueError, "'grads[1]'"),
        (pb, ints, kind, TypeError, "'grads[0]'"),
    ]


@pytest.mark.parametrize("name", sorted(CASES))
def test_step_on_errors_change_nothing(name: str) -> None:
    cls, kw, _ = CASES[name]
    pb = _params(torch.float32)
    comm = NoCollectives(rank=1)
    b = cls(_groups(pb, False), process_group=comm, exact_resume=True, **kw)
    for t in range(1, 6):  # into the compressed phase, with state and error buffers to keep
        b.step_on(pb, _grads(t, pb), b.schedule.next_kind())
    kind = b.schedule.next_kind()
    other = next(k for k in StepKind if k is not kind)
    for params, grads, k, err, words in _bad_calls(pb, _grads(9, pb), kind, other):
        before = _snapshot(b)
        with pytest.raises(err) as info:
            b.step_on(params, grads, k)
        msg = str(info.value)
        assert words in msg and "[rank 1]" in msg and f"{name}.step_on" in msg, msg
        _assert_same(before, _snapshot(b))
    # a non-finite gradient: NonFiniteError on this rank alone, nothing changed
    before = _snapshot(b)
    grads = _grads(9, pb)
    grads[3][0, 0, 0] = float("nan")
    with pytest.raises(NonFiniteError):
        b.step_on(pb, grads, kind)
    _assert_same(before, _snapshot(b))
    assert b.skipped_steps == 0  # step_on leaves skipping to the caller
    b.step_on(tuple(pb), tuple(_grads(9, pb)), kind)  # tuples too; the optimizer still steps
    assert b.schedule.step == 6
    assert comm.calls == []


def test_zero_wraps_onebit_optimizer_on_its_own_group() -> None:
    """ZeroOptimizer builds the wrapped 1-bit optimizer on its own group (no one-rank stand-in)
    and steps it on the shards with ``step_on``."""
    from compcomm.zero import ZeroOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    comm = compcomm.LocalCommunicator()
    z = ZeroOptimizer(model.parameters(), ZeroOneAdam, stage=2, process_group=comm,
                      optimizer_kwargs=dict(lr=1e-2, var_freeze_step=2))
    assert z.optimizer.comm is z.comm
    calls = []
    real = z.optimizer.step_on
    z.optimizer.step_on = lambda *a: (calls.append(a[2]), real(*a))[1]
    try:
        for _ in range(4):
            model(torch.randn(8, 6)).pow(2).mean().backward()
            z.step()
    finally:
        z.close()
    # the variance phase on the shards, then the local phase unsharded (step(), not step_on)
    assert calls == [StepKind.FULL_AVERAGE, StepKind.FULL_AVERAGE, StepKind.FULL_AVERAGE]
    assert z.local_phase
