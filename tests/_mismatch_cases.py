"""Rank bodies of tests/test_rank_mismatch.py: ranks that disagree on the layout of what they
communicate (parameter shapes, counts, dtypes, bucket sizes, schedules) must all raise
RankMismatchError naming what differs, instead of waiting for a collective's timeout.

Each body runs several cases on one set of processes (a failed check leaves the ranks in step, so
the next case can follow) and returns ``{case: (error class, message, unchanged)}``; the last rank
is the one that differs."""

from __future__ import annotations

import io
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

import compcomm
from compcomm.errors import RankMismatchError
from compcomm.schedule import StepKind

Result = Tuple[str, str, bool]
TIMEOUT = 30.0  # seconds a compcomm collective of these bodies may wait (a regression fails fast)

_WARM = {"OneBitAdam": {"freeze_step": 10}, "OneBitLamb": {"freeze_step": 10},
         "ZeroOneAdam": {"var_freeze_step": 10, "var_update_scaler": 1}}
_COMPRESSED_KINDS = (StepKind.ONEBIT, StepKind.ONEBIT_GRAD, StepKind.SYNC)


def _snapshot(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _outcome(fn: Callable[[], Any], state: Callable[[], Any]) -> Result:
    """Run ``fn``; (error class name, message, whether ``state()`` is bit for bit unchanged)."""
    before = _snapshot(state())
    try:
        fn()
        name, msg = "no error", ""
    except RankMismatchError as e:  # subclasses count
        name, msg = "RankMismatchError", str(e)
    except Exception as e:  # noqa: BLE001 -- reported to the parent, which names it
        name, msg = type(e).__name__, str(e)
    return name, msg, _snapshot(state()) == before


def _in_step(world: int) -> bool:
    """After a case the ranks are still in step: a collective of every rank gives the sum."""
    t = torch.ones(1)
    dist.all_reduce(t)
    return int(t.item()) == world


def _params(sizes: List[int], dtypes: Any = None) -> List[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    dtypes = dtypes or [torch.float32] * len(sizes)
    return [torch.nn.Parameter(torch.randn(n, generator=g).to(dt)) for n, dt in zip(sizes, dtypes)]


def _grads(params: List[torch.nn.Parameter], rank: int, step: int) -> None:
    for i, p in enumerate(params):
        g = torch.Generator().manual_seed(1000 * step + 10 * i + rank)
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _optimizer_state(opt: Any, params: List[torch.nn.Parameter]) -> Any:
    return ([p.detach().clone() for p in params], opt.state_dict(), opt.compressor.state_dict(),
            opt.skipped_steps)


# --------------------------------------------------------------------------------------------
# the 1-bit optimizers on their own
# --------------------------------------------------------------------------------------------
def _optimizer_cases(name: str, odd: bool) -> Dict[str, Tuple[List[int], Any, Dict[str, Any]]]:
    """case -> (sizes, dtypes, kwargs) of this rank (``odd``: the rank that differs), all at the
    first step: warm-up (``warm_*``) or, for OneBitAdam/OneBitLamb, compressed
    (``compressed_*``)."""
    warm = _WARM[name]
    sched_key = "var_freeze_step" if name == "ZeroOneAdam" else "freeze_step"
    cases = {
        "warm_shapes": ([64, 48 if odd else 32], None, warm),
        "warm_count": ([64, 32, 16] if odd else [64, 32], None, warm),
        "warm_dtypes": ([64, 32], [torch.float32, torch.bfloat16 if odd else torch.float32], warm),
        "warm_buckets": ([64, 32, 16], None, dict(warm, reduce_bucket_size=40 if odd else 10**6)),
        "warm_schedule": ([64, 32], None, dict(warm, **{sched_key: 3 if odd else 10})),
    }
    if name != "ZeroOneAdam":  # 0/1 Adam's first step always averages in full precision
        comp = {"freeze_step": 0}
        cases.update({
            "compressed_shapes": ([64, 48 if odd else 32], None, comp),
            "compressed_buckets": ([64, 32, 16], None,
                                   dict(comp, reduce_bucket_size=40 if odd else 10**6)),
        })
    if name == "OneBitLamb":  # one fused momentum, no buckets
        cases = {k: v for k, v in cases.items() if not k.endswith("_buckets")}
    return cases


#: what each case's message must name
OPTIMIZER_EXPECT = {
    "warm_shapes": "parameter shapes", "warm_count": "number of parameters",
    "warm_dtypes": "parameter dtypes", "warm_buckets": "compressed buckets",
    "warm_schedule": "freeze_step", "compressed_shapes": "parameter shapes",
    "compressed_buckets": "compressed buckets",
    "compressed_grads": "which parameters have gradients",
    "compressed_one_sided": "layout",
}


def _compressed_drops(opt: Any, params: List[torch.nn.Parameter], rank: int, world: int, odd: bool,
                      out: Dict[str, Any]) -> None:
    """In the compressed phase, the ranks drop different gradients (``compressed_grads``), then
    one rank alone drops one: it checks, the others go on to the compressed exchange, whose first
    record tells them apart (``compressed_one_sided``; RankMismatchError on both sides)."""
    _grads(params, rank, 99)
    params[1 if odd else 2].grad = None
    out["compressed_grads"] = _outcome(opt.step, lambda: _optimizer_state(opt, params))
    assert _in_step(world)
    _grads(params, rank, 100)
    if odd:
        params[1].grad = None
    out["compressed_one_sided"] = _outcome(opt.step, lambda: _optimizer_state(opt, params))
    assert _in_step(world)


def _rank_optimizer(rank: int, world: int, name: str) -> Dict[str, Any]:
    cls = getattr(compcomm.optim, name)
    odd = rank == world - 1
    out: Dict[str, Any] = {}
    for case, (sizes, dtypes, kwargs) in _optimizer_cases(name, odd).items():
        params = _params(sizes, dtypes)
        opt = cls(params, lr=1e-3, **kwargs)
        _grads(params, rank, 1)
        out[case] = _outcome(opt.step, lambda: _optimizer_state(opt, params))
        assert _in_step(world), case
    # compressed phase reached with agreed layouts; then the ranks drop different gradients
    params = _params([64, 32, 16])
    opt = cls(params, lr=1e-3, **_WARM[name])
    for t in range(1, 30):
        if opt.schedule.next_kind() in _COMPRESSED_KINDS and t > 1:
            break
        _grads(params, rank, t)
        opt.step()
    assert opt.schedule.next_kind() in _COMPRESSED_KINDS
    _compressed_drops(opt, params, rank, world, odd, out)
    return out


# --------------------------------------------------------------------------------------------
# DDP: compcomm.ddp_comm_hook (driven by an optimizer) and compcomm.ddp.onebit_hook
# --------------------------------------------------------------------------------------------
def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))


#: what each DDP case's message must name
DDP_EXPECT = {"hook_adam_freeze": "freeze_step", "hook_lamb_freeze": "freeze_step",
              "hook_zoadam_freeze": "var_freeze_step", "onebit_warmup": "warmup_steps",
              "onebit_step": "hook step"}


def _rank_ddp(rank: int, world: int) -> Dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    odd = rank == world - 1
    out: Dict[str, Any] = {}
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    hooked = {
        "hook_adam_freeze": (compcomm.optim.OneBitAdam, {"freeze_step": 0 if odd else 5}),
        "hook_lamb_freeze": (compcomm.optim.OneBitLamb, {"freeze_step": 0 if odd else 5}),
        "hook_zoadam_freeze": (compcomm.optim.ZeroOneAdam, {"var_freeze_step": 0 if odd else 5}),
    }
    for case, (cls, kwargs) in hooked.items():
        model = _model()
        ddp = DDP(model)
        opt = cls(ddp.parameters(), lr=1e-3, **kwargs)
        ddp.register_comm_hook(None, compcomm.ddp_comm_hook(opt))
        params = list(model.parameters())
        out[case] = _outcome(lambda: (ddp(x).sum().backward(), opt.step()),
                             lambda: _optimizer_state(opt, params))
        assert _in_step(world), case
    for case in ("onebit_warmup", "onebit_step"):
        model = _model()
        ddp = DDP(model)
        if case == "onebit_warmup":  # one rank averages in full precision, the other compresses
            state = compcomm.ddp.OneBitHookState(warmup_steps=0 if odd else 3)
        else:  # same settings, but one rank resumed at another step (compressed vs warm-up)
            state = compcomm.ddp.OneBitHookState(warmup_steps=2)
            state.step = 0 if odd else 5
        ddp.register_comm_hook(state, compcomm.ddp.onebit_hook)
        out[case] = _outcome(lambda: ddp(x).sum().backward(),
                             lambda: [p.detach().clone() for p in model.parameters()])
        assert _in_step(world), case
    return out


# --------------------------------------------------------------------------------------------
# ZeRO stage 1/2, with torch's Adam and with OneBitAdam: checked when the optimizer is built
# --------------------------------------------------------------------------------------------
#: what each ZeRO case's message must name
ZERO_EXPECT = {"shapes": "parameter shapes", "count": "number of parameters",
               "dtypes": "parameter dtypes", "buckets": "buckets",
               "kwargs": "optimizer and optimizer_kwargs"}


def _rank_zero(rank: int, world: int) -> Dict[str, Any]:
    from compcomm.zero import ZeroOptimizer

    odd = rank == world - 1
    out: Dict[str, Any] = {}
    for stage in (1, 2):
        for cls in (torch.optim.Adam, compcomm.optim.OneBitAdam):
            cases = {
                "shapes": ([64, 48 if odd else 32], None, {}, {}),
                "count": ([64, 32, 16] if odd else [64, 32], None, {}, {}),
                "dtypes": ([64, 32], [torch.bfloat16 if odd else torch.float32] * 2, {}, {}),
                "buckets": ([64, 32, 16], None, {"reduce_bucket_size": 40 if odd else 10**6}, {}),
                "kwargs": ([64, 32], None, {}, {"lr": 1e-3 if odd else 2e-3}),
            }
            if cls is not torch.optim.Adam:
                cases["kwargs"] = ([64, 32], None, {}, {"freeze_step": 0 if odd else 5})
            for case, (sizes, dtypes, config, kwargs) in cases.items():
                params = _params(sizes, dtypes)

                def build() -> None:
                    z = ZeroOptimizer(params, cls, stage=stage, optimizer_kwargs=kwargs,
                                      timeout=TIMEOUT, **config)
                    z.close()

                out[f"stage{stage}_{cls.__name__}_{case}"] = _outcome(
                    build, lambda: [p.detach().clone() for p in params])
                assert _in_step(world), case
    return out


# --------------------------------------------------------------------------------------------
# compressed_allreduce: sizes and dtypes travel in its header
# --------------------------------------------------------------------------------------------
#: what each compressed_allreduce case's message must name
ALLREDUCE_EXPECT = {"numel": "different", "padded": "different", "dtype": "different",
                    "compressor_buckets": "other ranks"}


def _rank_allreduce(rank: int, world: int) -> Dict[str, Any]:
    odd = rank == world - 1
    out: Dict[str, Any] = {}
    cases = {"numel": (200 if odd else 100, torch.float32),
             "padded": (100 + 8 * world * world if odd else 100, torch.float32),
             "dtype": (100, torch.bfloat16 if odd else torch.float32)}
    for case, (n, dtype) in cases.items():
        t = torch.randn(n).to(dtype)
        we, se = compcomm.error_buffers(t)
        out[case] = _outcome(lambda: compcomm.compressed_allreduce(t, we, se, timeout=TIMEOUT),
                             lambda: (t, we, se))
        assert _in_step(world), case
    # OneBitCompressor used directly: one bucket here, three there (a single exchange against a
    # batch: their first records tell them apart)
    from compcomm.compress import OneBitCompressor

    comp = OneBitCompressor(compcomm.get_communicator(None), timeout=TIMEOUT)
    numels = [64, 32, 16] if odd else [112]
    bufs = [torch.randn(n) for n in numels]
    out["compressor_buckets"] = _outcome(
        lambda: comp.average_(list(range(len(numels))), numels, lambda i: bufs[i],
                              torch.device("cpu")),
        lambda: (bufs, comp.state_dict()))
    comp.close()
    assert _in_step(world)
    return out


# --------------------------------------------------------------------------------------------
# the per-bucket exchange path (OneBitCompressor(batched=False)): each bucket's exchange is queued
# behind the last, so ranks with different buckets used to wait in a collective until its timeout
# --------------------------------------------------------------------------------------------
UNBATCHED_TIMEOUT = 10.0  # a regression times out here (then the ranks are out of step)

#: what each per-bucket case's message must name
UNBATCHED_EXPECT = {"count": "number of buckets", "sizes": "bucket sizes", "one_sided": "layout",
                    "compressed_one_sided": "layout", "compressed_grads": "which parameters"}


def _unbatched(comm: Any) -> Any:
    from compcomm.compress import OneBitCompressor

    return OneBitCompressor(comm, timeout=UNBATCHED_TIMEOUT, batched=False)


def _rank_unbatched(rank: int, world: int, name: str) -> Dict[str, Any]:
    """``name``: "compressor" (OneBitCompressor.average_, the compressed allreduce of a set of
    buckets) or a 1-bit optimizer class, both per bucket."""
    odd = rank == world - 1
    out: Dict[str, Any] = {}
    if name == "compressor":
        comp = _unbatched(compcomm.get_communicator(None))

        def average(numels: List[int]) -> Result:
            bufs = [torch.randn(n) for n in numels]
            return _outcome(lambda: comp.average_(list(range(len(numels))), numels,
                                                  lambda i: bufs[i], torch.device("cpu")),
                            lambda: (bufs, comp.state_dict()))

        # the first exchange has the same size on every rank: only the count differs
        out["count"] = average([64, 64] if odd else [64])
        assert _in_step(world)
        out["sizes"] = average([64, 48] if odd else [64, 32])
        assert _in_step(world)
        # agreed once; then one rank alone changes: it checks, the others' first exchange meets
        # its check's record, and their second exchange must not go out
        assert average([64, 64])[0] == "no error"
        out["one_sided"] = average([64] if odd else [64, 64])
        assert _in_step(world)
        comp.close()
        return out
    cls = getattr(compcomm.optim, name)
    params = _params([64, 32, 16])  # three buckets of reduce_bucket_size=40
    opt = cls(params, lr=1e-3, reduce_bucket_size=40, compressor=_unbatched, **_WARM[name])
    seen = 0
    for t in range(1, 40):  # to the compressed phase, and one compressed step (layouts agreed)
        compressed = opt.schedule.next_kind() in _COMPRESSED_KINDS
        if compressed and seen:
            break
        seen += compressed
        _grads(params, rank, t)
        opt.step()
    assert seen and opt.schedule.next_kind() in _COMPRESSED_KINDS
    _compressed_drops(opt, params, rank, world, odd, out)
    opt.compressor.close()
    return out


def _rank_ddp_loaded(rank: int, world: int) -> Dict[str, Any]:
    """compcomm.ddp_comm_hook after load_state_dict: the last rank resumed at step 0 (warm-up: its
    hook would average), the others at step 3 (compressed: theirs would not). The hook checks the
    schedule again after a load, so backward raises on every rank, instead of one rank waiting in
    its all-reduce."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    odd = rank == world - 1
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    model = _model()
    ddp = DDP(model)
    opt = compcomm.optim.OneBitAdam(ddp.parameters(), lr=1e-3, freeze_step=2)
    ddp.register_comm_hook(None, compcomm.ddp_comm_hook(opt))
    fresh = opt.state_dict()
    for _ in range(3):  # the hook agreed on the buckets at the first step
        ddp(x).sum().backward()
        opt.step()
        opt.zero_grad()
    opt.load_state_dict(fresh if odd else opt.state_dict())
    params = list(model.parameters())
    out = {"hook_after_load": _outcome(lambda: (ddp(x).sum().backward(), opt.step()),
                                       lambda: _optimizer_state(opt, params))}
    assert _in_step(world)
    return out


def _rank_zero_loaded(rank: int, world: int) -> Dict[str, Any]:
    """ZeroOptimizer.load_state_dict of shards from different steps (the last rank's from step 0,
    the others' from step 3, past OneBitAdam's freeze_step): RankMismatchError on every rank and
    nothing loaded, instead of ranks that then run different phases' collectives."""
    from compcomm.zero import ZeroOptimizer

    odd = rank == world - 1
    out: Dict[str, Any] = {}
    for stage in (1, 2):
        params = _params([64, 32, 16])
        z = ZeroOptimizer(params, compcomm.optim.OneBitAdam, stage=stage, timeout=TIMEOUT,
                          optimizer_kwargs={"lr": 1e-3, "freeze_step": 2})
        fresh = torch.load(io.BytesIO(_snapshot(z.state_dict())), weights_only=False)
        for t in range(1, 4):
            loss = sum((p.float() * (1 + rank + t)).sum() for p in params)
            loss.backward()
            z.step()
            z.zero_grad()
        now = z.state_dict()
        out[f"stage{stage}"] = _outcome(
            lambda: z.load_state_dict(fresh if odd else now),
            lambda: (z.state_dict(), [p.detach().clone() for p in params]))
        assert _in_step(world)
        z.close()
    return out
