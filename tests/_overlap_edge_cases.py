"""Rank bodies of tests/test_overlap_edges.py: the backward overlap (OneBitAdam, W=2, gloo) where
ranks differ in which parameters have gradients, and steps skipped for non-finite values."""

from __future__ import annotations

import warnings

import torch

FREEZE = 2


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(11, 37), torch.nn.Linear(37, 23)
        self.c, self.extra = torch.nn.Linear(23, 5), torch.nn.Linear(5, 3)

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        y = self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))
        return self.extra(y).sum(-1) if use_extra else y.sum(-1)


def _setup(overlap: bool):
    from compcomm.optim import OneBitAdam, overlap as ov

    ov.GROUP_ELEMENTS, ov.MAX_GROUPS = 150, 8  # several groups sent from the backward
    model = Net()
    opt = OneBitAdam(model.parameters(), lr=1e-4, freeze_step=FREEZE, reduce_bucket_size=100,
                     overlap_backward=overlap)
    return model, opt


def _loss(model: Net, rank: int, t: int, use_extra: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 10 * t)
    return model(torch.randn(6, 11, generator=g), use_extra).pow(2).mean()


def _params(model: Net) -> list:
    return [p.detach().clone() for p in model.parameters()]


def _errors(opt) -> dict:
    return {k: {n: t.clone() for n, t in e.items()} for k, e in opt.compressor.state_dict().items()}


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def rank_extra_gradient_on_one_rank(rank: int, world: int, overlap: bool) -> list:
    """``extra`` gets a gradient on rank 0 only, in a compressed step: (step, outcome, whether
    the parameters changed) per step until the first error."""
    model, opt = _setup(overlap)
    events = []
    warnings.simplefilter("ignore")
    for t in range(1, 7):
        opt.zero_grad()
        _loss(model, rank, t, use_extra=(t == 5 and rank == 0)).backward()
        before = _params(model)
        try:
            opt.step()
            events.append((t, "ok", not _same(before, _params(model))))
        except Exception as e:  # noqa: BLE001 -- the outcome is what is compared
            events.append((t, type(e).__name__, not _same(before, _params(model))))
            break
    return events


def _skipping_run(rank: int, overlap: bool) -> dict:
    model, opt = _setup(overlap)
    out = {}
    warnings.simplefilter("ignore")
    for t in range(1, 7):
        opt.zero_grad()
        skip = t == FREEZE + 2  # rank 0's loss is NaN and `extra` gets no gradient
        loss = _loss(model, rank, t, use_extra=not skip)
        (loss * float("nan") if skip and rank == 0 else loss).backward()
        opt.step()
        if t == FREEZE + 1:
            out["before"] = _errors(opt)
        if skip:
            out["after"] = _errors(opt)
    out.update(params=_params(model), errors=_errors(opt), skipped=opt.skipped_steps)
    return out


def rank_skip_without_a_gradient(rank: int, world: int) -> dict:
    """A compressed step skipped (non-finite) in which a parameter had no gradient, overlap off
    and on: the error buffers after it, and the runs' end states, compared."""
    off, on = _skipping_run(rank, False), _skipping_run(rank, True)
    return {"skipped": (off["skipped"], on["skipped"]),
            "off_unchanged": _same(off["before"], off["after"]),
            "on_unchanged": _same(on["before"], on["after"]),
            "same_params": _same(off["params"], on["params"]),
            "same_errors": _same(off["errors"], on["errors"])}


def rank_two_devices_skip(rank: int, world: int) -> dict:
    """Parameters on two devices, simulated: the plan's buckets split into two ``by_device``
    entries (one compressed average each, committing on its own). A NaN in the second's buckets
    (rank 0) skips the step: nothing may stay changed, the first's error buffers included."""
    import compcomm.optim.base as base

    real = base.staged_plan

    def split(*args, **kwargs):
        plan = real(*args, **kwargs)
        if len(plan.by_device) == 1:
            dev, idx, numels, entries = plan.by_device[0]
            h = len(idx) // 2
            first = {id(e[1]) for b in idx[:h] for e in plan.entries[b]}
            plan.by_device = [
                (dev, idx[:h], numels[:h], [e for e in entries if id(e[1]) in first]),
                (dev, idx[h:], numels[h:], [e for e in entries if id(e[1]) not in first])]
        return plan

    base.staged_plan = split
    try:
        model, opt = _setup(False)
        warnings.simplefilter("ignore")
        for t in range(1, 5):
            opt.zero_grad()
            _loss(model, rank, t).backward()
            opt.step()
        before = (_errors(opt), _params(model))
        opt.zero_grad()
        _loss(model, rank, 5).backward()
        if rank == 0:
            model.extra.weight.grad[0, 0] = float("nan")  # registered last: the second "device"
        opt.step()
        return {"skipped": opt.skipped_steps, "errors": _same(before[0], _errors(opt)),
                "params": _same(before[1], _params(model)), "devices": len(opt._staged.by_device)}
    finally:
        base.staged_plan = real


class Deep(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def rank_ddp_hook_new_buckets(rank: int, world: int) -> tuple:
    """DDP + compcomm.ddp_comm_hook + OneBitAdam with the overlap on its own gloo group, freeze
    at step 1: the second backward is armed while DDP hands the hook its rebuilt buckets, whose
    check runs over the group the overlap's worker thread sends on."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import compcomm
    from compcomm.optim import OneBitAdam, overlap as ov

    ov.GROUP_ELEMENTS, ov.MAX_GROUPS = 60000, 8  # groups sent early in the backward
    warnings.simplefilter("ignore")
    group = dist.new_group(backend="gloo")
    model = DistributedDataParallel(Deep(), bucket_cap_mb=0.5)
    opt = OneBitAdam(model.parameters(), lr=1e-4, freeze_step=1, overlap_backward=True,
                     process_group=group)
    model.register_comm_hook(None, compcomm.ddp_comm_hook(opt))
    for t in range(1, 5):
        opt.zero_grad()
        g = torch.Generator().manual_seed(100 * rank + t)
        model(torch.randn(64, 256, generator=g)).pow(2).mean().backward()
        opt.step()
    return opt.overlap.steps_overlapped, [p.detach().sum().item() for p in model.parameters()]
