"""Rank bodies for tests/test_overlap.py (module level, so run_ranks can pickle them).

Every scenario trains the same small model twice on each rank, with ``overlap_backward`` False
and True, and returns both trajectories (parameters after every step, error buffers at the end),
so the parent can check that they are bit-identical."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Dict, List

import torch

FREEZE = 3
STEPS = 8
SCENARIOS = ["plain", "accumulate", "clip", "no_grad_param", "keep_grads", "no_backward",
             "load_state", "scaler", "unscale", "nonfinite", "data_mul", "foreach_data_one_rank",
             "data_once", "accumulate_one_rank", "grad_none", "nan_sanitize", "add_group",
             "unfreeze"]


def _small_groups() -> None:
    # groups of a few buckets (the defaults make groups of MB; these models are tiny)
    from compcomm.optim import overlap
    overlap.GROUP_ELEMENTS = 150
    overlap.MAX_GROUPS = 8


class Net(torch.nn.Module):
    """Sizes that divide nothing evenly; ``extra`` is used only when asked (a parameter that may
    get no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(11, 37)
        self.b = torch.nn.Linear(37, 23)
        self.c = torch.nn.Linear(23, 5)
        self.extra = torch.nn.Linear(5, 3)

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        y = self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))
        return self.extra(y).sum(-1) if use_extra else y.sum(-1)


def _model(dtype: torch.dtype) -> Net:
    torch.manual_seed(0)
    return Net().to(dtype)


def _loss(model: Net, rank: int, step: int, k: int = 0, use_extra: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + k)
    p = next(model.parameters())
    x = torch.randn(6, 11, generator=g).to(p.device, p.dtype)
    return model(x, use_extra).float().pow(2).mean()


def _snapshot(model: Net) -> List[torch.Tensor]:
    return [p.detach().float().clone() for p in model.parameters()]


def identical(run: Dict[bool, Dict[str, Any]]) -> bool:
    """Whether the runs without (``run[False]``) and with overlap (``run[True]``) have the same
    parameters after every step and the same error buffers, bit for bit."""
    def same(a: List[torch.Tensor], b: List[torch.Tensor]) -> bool:
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))

    off, on = run[False], run[True]
    traj = len(off["traj"]) == len(on["traj"]) and all(
        same(a, b) for a, b in zip(off["traj"], on["traj"]))
    errs = off["errors"].keys() == on["errors"].keys() and all(
        torch.equal(off["errors"][k][n], on["errors"][k][n])
        for k in off["errors"] for n in off["errors"][k])
    return traj and errs


def trajectory(rank: int, overlap: bool, scenario: str, dtype: torch.dtype,
               device: str = "cpu", group: Any = None) -> Dict[str, Any]:
    """One run of ``scenario``; what the parent compares."""
    from compcomm.optim import OneBitAdam

    model = _model(dtype).to(device)
    params = list(model.parameters())
    if scenario == "add_group":  # model.extra joins at the first compressed step
        params = params[:-2]
    if scenario == "unfreeze":  # model.extra trains from the first compressed step on
        model.extra.requires_grad_(False)
    opt = OneBitAdam(params, lr=0.01, freeze_step=FREEZE, weight_decay=0.01,
                     reduce_bucket_size=100, overlap_backward=overlap, process_group=group)
    scaler = (torch.amp.GradScaler("cpu", init_scale=4.0) if scenario in ("scaler", "unscale")
              else None)
    traj, caught, warm_sent = [], [], 0
    # "user_stream_<scenario>": the backward (and what follows it) on a CUDA stream of the user's,
    # step() on the current one (the buffers of dropped exchanges are that stream's)
    stream = None
    if scenario.startswith("user_stream_"):
        scenario, stream = scenario[len("user_stream_"):], torch.cuda.Stream(device)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for t in range(1, STEPS + 1):
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream(device))
            with contextlib.nullcontext() if stream is None else torch.cuda.stream(stream):
                _backward(model, opt, scaler, rank, t, scenario, dtype, device)
            if stream is not None:
                torch.cuda.current_stream(device).wait_stream(stream)
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            traj.append(_snapshot(model))
            if t == FREEZE and opt._overlap is not None:  # nothing is sent in the warm-up
                warm_sent = opt._overlap.groups_from_backward
        caught = [str(x.message) for x in w if "overlap_backward" in str(x.message)]
    ov = opt._overlap
    errors = {k: {n: t.cpu() for n, t in e.items()} for k, e in opt.compressor.state_dict().items()}
    return {"traj": [[p.cpu() for p in ps] for ps in traj], "errors": errors,
            "hooked": 0 if ov is None else len(getattr(ov, "_hooked", ())),
            "groups_kept": 0 if ov is None else len(ov._groups[1]),
            "overlapped": 0 if ov is None else ov.steps_overlapped,
            "from_backward": 0 if ov is None else ov.groups_from_backward,
            "enabled": None if ov is None else ov.enabled, "warnings": caught,
            "skipped": opt.skipped_steps, "warm_sent": warm_sent}


def _backward(model: Net, opt: Any, scaler: Any, rank: int, t: int, scenario: str,
              dtype: torch.dtype, device: str) -> None:
    """Step ``t``'s gradients of ``scenario``, and what the program does to them before step()."""
    opt.zero_grad(set_to_none=scenario != "keep_grads")
    if scenario == "add_group" and t == FREEZE + 1:
        opt.add_param_group({"params": list(model.extra.parameters())})
    if scenario == "unfreeze" and t == FREEZE + 1:
        model.extra.requires_grad_(True)
    if scenario == "no_backward" and t > FREEZE + 1:
        # gradients written by hand: no hook fires, step() sends every group itself
        ref = _model(dtype).to(device)
        ref.load_state_dict(model.state_dict())
        _loss(ref, rank, t).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            p.grad = q.grad.clone()
    else:
        loss = _loss(model, rank, t, use_extra=not (scenario == "no_grad_param" and t == 6))
        if scenario in ("nonfinite", "nan_sanitize") and t == FREEZE + 2 and rank == 0:
            loss = loss * float("nan")  # every rank skips this step
        (scaler.scale(loss) if scaler else loss).backward()
    if scenario == "accumulate" and t > FREEZE or (
            scenario == "accumulate_one_rank" and t > FREEZE and rank == 0):
        _loss(model, rank, t, k=1).backward()  # a second micro-batch: hooks fire again
    # gradients changed through .data: no version counter moves, only the values
    if scenario == "data_mul" and t > FREEZE or scenario == "data_once" and t == FREEZE + 2:
        for p in model.parameters():
            p.grad.data.mul_(0.5)
    if scenario == "foreach_data_one_rank" and t > FREEZE and rank == 0:
        torch._foreach_mul_([p.grad.data for p in model.parameters()], 0.5)
    if scenario == "nan_sanitize" and t == FREEZE + 2:  # cleaned after its group was sent
        for p in model.parameters():
            p.grad.nan_to_num_(0.0, 0.0, 0.0)
    if scenario == "grad_none" and t == FREEZE + 2:  # after its group was sent
        model.a.bias.grad = None
    if scenario == "clip" and t > FREEZE:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    if scenario == "load_state" and t == FREEZE + 3:
        # a state loaded between backward and step: what the backward sent is dropped
        opt.load_state_dict(opt.state_dict())
    if scenario == "unscale":  # in place, without bumping the gradients' versions
        scaler.unscale_(opt)


def abandoned(rank: int, world: int) -> bool:
    """Whether an optimizer with the overlap is freed as soon as its last reference goes (no
    reference cycle through the backward hooks: those of a live leftover would still send)."""
    import gc
    import weakref

    from compcomm.optim import OneBitAdam

    model = _model(torch.float32)
    opt = OneBitAdam(model.parameters(), lr=0.01, freeze_step=FREEZE, reduce_bucket_size=100,
                     overlap_backward=True)
    for t in range(1, FREEZE + 3):
        opt.zero_grad()
        _loss(model, rank, t).backward()
        opt.step()
    assert opt._overlap.steps_overlapped > 0
    ref = weakref.ref(opt)
    gc.disable()
    try:
        del opt
        return ref() is None
    finally:
        gc.enable()


def scenarios(rank: int, world: int, which: List[str]) -> Dict[str, Any]:
    _small_groups()
    out: Dict[str, Any] = {}
    for scenario in which:
        for dtype in ([torch.float32, torch.bfloat16] if scenario == "plain" else [torch.float32]):
            key = f"{scenario}_{str(dtype)[6:]}"
            out[key] = {o: trajectory(rank, o, scenario, dtype) for o in (False, True)}
    out["hook_error"] = hook_error(rank, world)
    out["step_fill_error"] = hook_error(rank, world, "_launch_rest")
    out["auto"] = auto_choice()
    out["compressor"] = compressor_groups(rank, world)
    out["abandoned"] = abandoned(rank, world)
    out["check_fails"] = check_fails(rank, world)
    out["no_comm_in_load"] = no_comm_in_load(rank, world)
    return out


def compressor_groups(rank: int, world: int) -> Dict[str, Any]:
    """OneBitCompressor's group exchange directly: buckets sent in groups (launch_) and committed
    together equal one average_ of all of them, bit for bit, over three rounds (the error buffers
    carry over); drop_launched writes nothing and leaves no buffers it made; an empty batch
    against a full one raises RankMismatchError on every rank."""
    from compcomm._comm import resolve
    from compcomm.compress import OneBitCompressor
    from compcomm.errors import RankMismatchError

    comm = resolve(None)
    numels = [7, 1000, 4099, 1]
    g = torch.Generator().manual_seed(rank)
    a, b = OneBitCompressor(comm), OneBitCompressor(comm)
    same = True
    for _ in range(3):
        xs = [torch.randn(n, generator=g) for n in numels]
        ta, tb = [x.clone() for x in xs], [x.clone() for x in xs]
        a.average_(list(range(4)), numels, lambda i: ta[i], torch.device("cpu"))
        hs = [b.launch_([3, 1], [numels[3], numels[1]], [tb[3], tb[1]], torch.device("cpu")),
              b.launch_([0, 2], [numels[0], numels[2]], [tb[0], tb[2]], torch.device("cpu"))]
        same &= b.wait_launched(hs) is None
        b.commit_launched(hs)
        same &= all(torch.equal(x, y) for x, y in zip(ta, tb))
    ea, eb = a.state_dict(), b.state_dict()
    same &= all(torch.equal(ea[k][n], eb[k][n]) for k in ea for n in ea[k])
    c = OneBitCompressor(comm)
    t = torch.randn(100, generator=g)
    before = t.clone()
    h = c.launch_([0], [100], [t], torch.device("cpu"))
    dropped_ok = c.wait_launched([h]) is None
    c.drop_launched([h])
    dropped_ok &= torch.equal(t, before) and c.keys() == []
    h = c.launch_([0], [100], None if rank == 0 else [t], torch.device("cpu"))
    err = c.wait_launched([h])
    c.drop_launched([h])
    return {"same": bool(same), "dropped_ok": bool(dropped_ok),
            "empty_batch": isinstance(err, RankMismatchError), "keys_after": c.keys()}


def hook_error(rank: int, world: int, where: str = "_launch") -> Dict[str, Any]:
    """The staging fails on the last rank, in a backward hook (``where="_launch"``) or in step()
    for groups no hook sent (``"_launch_rest"``: gradients written by hand): step() raises on every
    rank (that rank's own error, RankMismatchError elsewhere), nothing changes, and a retried
    step gives the bits of a run that never failed."""
    import inspect

    from compcomm.optim import OneBitAdam

    _small_groups()
    final, raised, unchanged = {}, None, None
    for overlap in (False, True):
        model = _model(torch.float32)
        opt = OneBitAdam(model.parameters(), lr=0.01, freeze_step=FREEZE, reduce_bucket_size=100,
                         overlap_backward=overlap)
        for t in range(1, STEPS + 1):
            opt.zero_grad()
            if where == "_launch_rest" and t == FREEZE + 2:  # no hook fires: step() sends all
                ref = _model(torch.float32)
                ref.load_state_dict(model.state_dict())
                _loss(ref, rank, t).backward()
                for p, q in zip(model.parameters(), ref.parameters()):
                    p.grad = q.grad.clone()
            else:
                _loss(model, rank, t).backward()
            if overlap and t == FREEZE + 1 and rank == world - 1:
                orig = opt._momentum_fill

                def boom(grads, _opt=opt, _orig=orig):  # fails once, in `where` only
                    fill = _orig(grads)

                    def failing(entries):
                        if any(f.function == where for f in inspect.stack()[1:4]):
                            del _opt._momentum_fill
                            raise RuntimeError("boom in the hook")
                        return fill(entries)
                    return failing
                opt._momentum_fill = boom  # captured when step() arms the next backward
            if overlap and t == FREEZE + 2:
                state = lambda: _snapshot(model) + [  # noqa: E731
                    v.clone() for e in opt.compressor.state_dict().values() for v in e.values()
                ] + [s["exp_avg"].clone() for s in opt.state.values()]
                before = state()
                try:
                    opt.step()
                except Exception as e:  # noqa: BLE001 -- reported to the parent
                    raised = f"{type(e).__name__}: {e}"
                after = state()
                unchanged = len(before) == len(after) and all(
                    torch.equal(a, b) for a, b in zip(before, after))
            opt.step()  # (at FREEZE + 2: the retry, the gradients are still there)
        final[overlap] = _snapshot(model)
    return {"same": all(torch.equal(a, b) for a, b in zip(final[False], final[True])),
            "raised": raised, "unchanged": unchanged}


def auto_choice() -> Dict[str, Any]:
    """What ``overlap_backward='auto'`` picks here (CPU parameters, the torch adapter over gloo)."""
    from compcomm._comm import resolve
    from compcomm.optim import OneBitAdam
    from compcomm.optim.overlap import auto_safe

    opt = OneBitAdam(_model(torch.float32).parameters(), overlap_backward="auto")
    return {"safe_comm": auto_safe(resolve(None)), "on": opt.overlap is not None}


def ddp_unused(rank: int, world: int, plain: bool, load_state: bool = False) -> Dict[str, Any]:
    """DDP with ``find_unused_parameters=True`` and a branch (``extra``) that only rank 0 uses:
    on the other ranks DDP writes its gradients without their hooks firing. With
    compcomm.ddp_comm_hook (``plain=False``) or plain DDP averaging the gradients itself (it
    rewrites every gradient after the hooks: the value check discards, then switches off). The
    optimizer runs on a group of its own (the worker thread must not share DDP's). With
    ``load_state`` a state dict is loaded between one compressed step's backward and its step:
    rank 0 sent every group from the backward, the others none, and each sends the rest before
    dropping them. Returns both trajectories."""
    import compcomm
    import torch.distributed as dist
    from compcomm.optim import OneBitAdam
    from torch.nn.parallel import DistributedDataParallel as DDP

    _small_groups()
    out = {}
    for overlap in (False, True):
        group = dist.new_group(backend="gloo")
        model = DDP(_model(torch.float32), find_unused_parameters=True)
        opt = OneBitAdam(model.parameters(), lr=0.01, freeze_step=FREEZE, reduce_bucket_size=100,
                         overlap_backward=overlap, process_group=group)
        if not plain:
            model.register_comm_hook(None, compcomm.ddp_comm_hook(opt))
        traj = []
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for t in range(1, STEPS + 1):
                opt.zero_grad()
                g = torch.Generator().manual_seed(1000 * rank + 10 * t)
                model(torch.randn(6, 11, generator=g), rank == 0).pow(2).mean().backward()
                if load_state and t == FREEZE + 2:
                    opt.load_state_dict(opt.state_dict())
                opt.step()
                traj.append([p.detach().clone() for p in model.parameters()])
        ov = opt._overlap
        errors = {k: {n: e.clone() for n, e in v.items()}
                  for k, v in opt.compressor.state_dict().items()}
        out[overlap] = {"traj": traj, "errors": errors,
                        "overlapped": 0 if ov is None else ov.steps_overlapped,
                        "from_backward": 0 if ov is None else ov.groups_from_backward,
                        "enabled": None if ov is None else ov.enabled,
                        "warnings": [str(x.message) for x in w
                                     if "overlap_backward" in str(x.message)]}
    return out


def ddp(rank: int, world: int, bucket_view: bool = False) -> Dict[str, Any]:
    """DDP with compcomm.ddp_comm_hook, with and without overlap: the same bits."""
    import compcomm
    from compcomm.optim import OneBitAdam
    from torch.nn.parallel import DistributedDataParallel as DDP

    _small_groups()
    out = {}
    for overlap in (False, True):
        model = DDP(_model(torch.float32), gradient_as_bucket_view=bucket_view)
        opt = OneBitAdam(model.parameters(), lr=0.01, freeze_step=FREEZE, reduce_bucket_size=100,
                         overlap_backward=overlap)
        model.register_comm_hook(None, compcomm.ddp_comm_hook(opt))
        traj = []
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for t in range(1, STEPS + 1):
                opt.zero_grad()
                g = torch.Generator().manual_seed(1000 * rank + 10 * t)
                model(torch.randn(6, 11, generator=g)).pow(2).mean().backward()
                opt.step()
                traj.append([p.detach().clone() for p in model.parameters()])
        ov = opt._overlap
        out[overlap] = {"traj": traj, "overlapped": 0 if ov is None else ov.steps_overlapped,
                        "warnings": [str(x.message) for x in w
                                     if "overlap_backward" in str(x.message)]}
    return out


def gpu_scenarios(rank: int, world: int) -> Dict[str, Any]:
    """The GPU twin (tests/test_overlap_gpu.py): ranks sharing the GPU(s) as emulated hosts of a
    torch NCCL group (compcomm's native NCCL communicator where the build has it)."""
    import os

    import torch.distributed as dist

    os.environ["NCCL_HOSTID"] = f"compcomm-overlap-{os.getppid()}-host{rank}"
    torch.cuda.set_device(rank % torch.cuda.device_count())
    group = dist.new_group(backend="nccl")
    from compcomm._comm import resolve
    from compcomm.optim.overlap import auto_safe

    _small_groups()
    out: Dict[str, Any] = {"native": auto_safe(resolve(group))}
    for scenario, dtype in (("plain", torch.float32), ("plain", torch.bfloat16),
                            ("grad_none", torch.float32), ("nan_sanitize", torch.float32),
                            ("accumulate", torch.float32), ("no_backward", torch.float32),
                            ("data_mul", torch.float32), ("foreach_data_one_rank", torch.float32),
                            ("data_once", torch.bfloat16), ("user_stream_plain", torch.float32),
                            ("user_stream_data_once", torch.float32),
                            ("user_stream_accumulate", torch.float32)):
        out[f"{scenario}_{str(dtype)[6:]}"] = {
            o: trajectory(rank, o, scenario, dtype, "cuda", group) for o in (False, True)}
    # the default argument ('auto'): on over compcomm's native NCCL communicator
    out["auto_float32"] = {o: trajectory(rank, o, "plain", torch.float32, "cuda", group)
                           for o in (False, "auto")}
    out["auto_float32"][True] = out["auto_float32"].pop("auto")
    # a GAN's G and D on one native NCCL communicator: 'auto' must not overlap on it
    out["two_auto"] = {late: two_optimizers(rank, world, "auto", late, "cuda", group)
                       for late in (False, True)}
    return out


def check_fails(rank: int, world: int) -> Dict[str, Any]:
    """The value check itself fails on rank 0 at the first compressed step (simulated: out of
    memory for its scratch): no error, the exchanges are dropped, the ordinary path runs (the same
    bits as without overlap) and the overlap is switched off on every rank, with nothing kept."""
    import weakref

    from compcomm.optim import OneBitAdam

    _small_groups()
    final, info = {}, {}
    for overlap in (False, True):
        model = _model(torch.float32)
        opt = OneBitAdam(model.parameters(), lr=0.01, freeze_step=FREEZE, reduce_bucket_size=100,
                         overlap_backward=overlap)
        if overlap and rank == 0:
            ov, orig = opt.overlap, opt.overlap._changed

            def failing(r, _ov=ov, _orig=orig):
                _ov._changed = _orig  # once
                raise torch.OutOfMemoryError("simulated: no memory for the scratch")
            ov._changed = failing
        errors, scratch = [], None
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for t in range(1, STEPS + 1):
                opt.zero_grad()
                _loss(model, rank, t).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # (changes nothing)
                try:
                    opt.step()
                except Exception as e:  # noqa: BLE001 -- reported to the parent
                    errors.append(f"{type(e).__name__}: {e}")
                if overlap and opt.overlap._scratch:
                    scratch = weakref.ref(next(iter(opt.overlap._scratch.values())))
        final[overlap] = _snapshot(model)
        if overlap:
            info = {"errors": errors, "enabled": opt.overlap.enabled,
                    "overlapped": opt.overlap.steps_overlapped,
                    "warnings": [str(x.message) for x in w if "overlap" in str(x.message)],
                    "groups_kept": len(opt.overlap._groups[1]),
                    "scratch_alive": scratch is not None and scratch() is not None}
    info["same"] = all(torch.equal(a, b) for a, b in zip(final[False], final[True]))
    return info


def no_comm_in_load(rank: int, world: int) -> List[str]:
    """load_state_dict between backward and step is local (base.py's promise): the calls the
    compressor received during it (none may send)."""
    from compcomm.optim import OneBitAdam

    _small_groups()
    model = _model(torch.float32)
    opt = OneBitAdam(model.parameters(), lr=0.01, freeze_step=FREEZE, reduce_bucket_size=100,
                     overlap_backward=True)
    calls: List[str] = []
    for t in range(1, FREEZE + 3):
        opt.zero_grad()
        _loss(model, rank, t).backward()
        if t == FREEZE + 2:
            sd = opt.state_dict()
            comp = opt.compressor
            saved = {n: getattr(comp, n) for n in ("launch_", "wait_launched")}
            for n, f in saved.items():
                setattr(comp, n, lambda *a, _n=n, _f=f, **k: (calls.append(_n), _f(*a, **k))[1])
            opt.load_state_dict(sd)
            for n in saved:
                delattr(comp, n)
        opt.step()
    return calls


def two_optimizers(rank: int, world: int, overlap: Any, late: bool, device: str = "cpu",
                   group: Any = None) -> Dict[str, Any]:
    """Two OneBitAdam over halves of one model on one communicator (one backward fires both
    optimizers' hooks; each has its own worker thread): the overlap must not run on either, the
    results equal those without overlap. ``late``: the second optimizer is made after the first
    one's backward sent its groups (they are drained then)."""
    from compcomm import _comm_users
    from compcomm.optim import OneBitAdam

    _small_groups()
    runs = {}
    for ov in (False, overlap):
        model = _model(torch.float32).to(device)
        ps = list(model.parameters())
        kw = dict(lr=0.01, freeze_step=FREEZE, reduce_bucket_size=100, overlap_backward=ov,
                  process_group=group)
        o1 = OneBitAdam(ps[:4], **kw)
        o2 = None if late else OneBitAdam(ps[4:], **kw)
        traj, sent = [], 0
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for t in range(1, STEPS + 1):
                o1.zero_grad()
                if o2 is not None:
                    o2.zero_grad()
                _loss(model, rank, t).backward()
                if o2 is None and t == FREEZE + 2:
                    sent = 0 if o1.overlap is None else o1.overlap.groups_from_backward
                    o2 = OneBitAdam(ps[4:], **kw)  # in the middle of o1's step
                for o in (o2, o1) if t % 2 else (o1, o2):
                    if o is not None:
                        o.step()
                traj.append(_snapshot(model))
        runs[ov] = {"traj": [[p.cpu() for p in ps] for ps in traj], "shared": _comm_users.is_shared(o1.comm),
                    "enabled": [None if o.overlap is None else o.overlap.enabled for o in (o1, o2)],
                    "sent_late": sent,
                    "warnings": [str(x.message) for x in w if "overlap_backward" in str(x.message)]}
        del o1, o2
    same = all(torch.equal(a, b) for x, y in zip(runs[False]["traj"], runs[overlap]["traj"])
               for a, b in zip(x, y))
    return {"same": same, **{k: v for k, v in runs[overlap].items() if k != "traj"}}
