"""Rank bodies for tests/test_fsdp.py (module level, so run_ranks can pickle them)."""

from __future__ import annotations

import io
from typing import Any, Dict, List

import torch
import torch.distributed as dist


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5))


def _sharded(world: int, onebit_warmup=None, force_sum=False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import compcomm.fsdp as cf

    mesh = init_device_mesh("cpu", (world,))
    model = _mlp()
    for m in (model[0], model[2], model):
        fully_shard(m, mesh=mesh)
    if force_sum:
        model.set_force_sum_reduction_for_comms(True)
    state = cf.onebit(model, warmup_steps=onebit_warmup, mode="gradient") \
        if onebit_warmup is not None else None
    return model, state


def _grads(model, rank: int, steps: int, same_batch: bool = False) -> List[List[torch.Tensor]]:
    out = []
    for t in range(steps):
        seed = rank if same_batch else 100 * t + rank
        x = torch.randn(4, 13, generator=torch.Generator().manual_seed(seed))
        model.zero_grad()
        model(x).pow(2).sum().backward()
        out.append([p.grad.to_local().clone() for p in model.parameters()])
    return out


def fsdp_cases(rank: int, world: int) -> Dict[str, Any]:
    res: Dict[str, Any] = {}
    plain, _ = _sharded(world)
    ref = _grads(plain, rank, 3)
    model, state = _sharded(world, onebit_warmup=2)
    got = _grads(model, rank, 3)
    res["warmup_bitwise"] = all(torch.equal(a, b) for t in range(2) for a, b in zip(ref[t], got[t]))
    res["onebit_differs"] = any(not torch.equal(a, b) for a, b in zip(ref[2], got[2]))
    res["onebit_close"] = max(float((a - b).norm() / b.norm()) for a, b in zip(got[2], ref[2]))
    res["steps"] = dict(state.steps)
    # error feedback: the same gradient reduced K times in the 1-bit phase -- the mean of the
    # outputs converges to the exact average, a single output does not
    plain, _ = _sharded(world)
    exact = _grads(plain, rank, 1, same_batch=True)[0]
    model, state = _sharded(world, onebit_warmup=0)
    runs = _grads(model, rank, 12, same_batch=True)
    one = max(float((a - b).norm() / b.norm()) for a, b in zip(runs[0], exact))
    mean = [sum(r[i] for r in runs) / len(runs) for i in range(len(exact))]
    res["ef_single"], res["ef_mean"] = one, max(float((a - b).norm() / b.norm())
                                               for a, b in zip(mean, exact))
    # SUM with FSDP's own post-division equals AVG
    model_s, _ = _sharded(world, onebit_warmup=0, force_sum=True)
    model_a, _ = _sharded(world, onebit_warmup=0)
    gs, ga = _grads(model_s, rank, 2), _grads(model_a, rank, 2)
    res["sum_vs_avg"] = max(float((a - b).abs().max()) for t in range(2) for a, b in zip(gs[t], ga[t]))
    # exact resume: 2 steps, save, 2 more == a fresh state loaded after 2 steps, 2 more
    model, state = _sharded(world, onebit_warmup=1)
    _grads(model, rank, 2)
    buf = io.BytesIO()
    torch.save(state.state_dict(), buf)
    cont = _grads(model, rank, 2)
    model2, state2 = _sharded(world, onebit_warmup=1)
    state2.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
    resumed = _grads(model2, rank, 2)
    res["resume_bitwise"] = all(torch.equal(a, b) for t in range(2) for a, b in zip(cont[t], resumed[t]))
    return res


def _ddp_run(rank: int, world: int, hook: bool, warmup: int, opt_name: str, steps: int,
             ckpt_at: int = -1):
    import compcomm
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.GELU(), torch.nn.Linear(32, 1)))
    state = None
    if hook:
        state = compcomm.ddp.OneBitHookState(warmup_steps=warmup)
        model.register_comm_hook(state, compcomm.ddp.onebit_hook)
    opt = (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if opt_name == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=3e-3))
    w = torch.randn(10, 1, generator=torch.Generator().manual_seed(99))
    losses, params, saved = [], [], None
    for t in range(steps):
        x = torch.randn(32, 10, generator=torch.Generator().manual_seed(1000 * t + rank))
        y = torch.tanh(x @ w)
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        params.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
        if t == ckpt_at and state is not None:
            saved = state.state_dict()
    return losses, params, state, saved


def ddp_cases(rank: int, world: int) -> Dict[str, Any]:
    import compcomm

    res: Dict[str, Any] = {}
    _, plain, _, _ = _ddp_run(rank, world, False, 0, "sgd", 6)
    _, hooked, state, _ = _ddp_run(rank, world, True, 3, "sgd", 6)
    # DDP's built-in reduction rounds its division by W its own way: equal to rounding (bitwise at
    # W=2, where dividing by 2 is exact)
    res["warmup_diff"] = max(float((plain[t] - hooked[t]).abs().max()) for t in range(3))
    res["onebit_differs"] = not torch.equal(plain[5], hooked[5])
    res["has_errors"] = bool(state.errors) and all(float(we.abs().sum()) > 0
                                                   for we, _ in state.errors.values())
    gathered = [torch.zeros_like(hooked[5]) for _ in range(world)]
    dist.all_gather(gathered, hooked[5])
    res["ranks_agree"] = all(torch.equal(g, gathered[0]) for g in gathered)
    for opt_name in ("sgd", "adamw"):  # convergence against plain DDP, same data and seed
        lp, _, _, _ = _ddp_run(rank, world, False, 0, opt_name, 120)
        lh, _, _, _ = _ddp_run(rank, world, True, 20, opt_name, 120)
        res[f"{opt_name}_final"] = (sum(lp[-20:]) / 20, sum(lh[-20:]) / 20, lp[0])
    # exact resume of the hook state
    _, full, _, saved = _ddp_run(rank, world, True, 2, "sgd", 8, ckpt_at=4)
    state2 = compcomm.ddp.OneBitHookState(warmup_steps=2)
    state2.load_state_dict(saved)
    res["resume_state_step"] = state2.step == 5 and len(state2.errors) == len(saved["errors"])
    return res


def _fsdp_adamw_run(world: int, rank: int, steps, model=None, state=None, opt=None):
    if model is None:
        model, state = _sharded(world, onebit_warmup=2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    params = []
    for t in steps:
        x = torch.randn(4, 13, generator=torch.Generator().manual_seed(100 * t + rank))
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()
        params.append([p.detach().to_local().clone() for p in model.parameters()])
    return model, state, opt, params


def dcp_cases(rank: int, world: int, path: str) -> Dict[str, Any]:
    """FSDP2 + AdamW + compcomm.fsdp.onebit (warm-up 2): 3 steps, torch.distributed.checkpoint
    save of model, optimizer and this rank's 1-bit state (a key per rank: the error buffers
    differ), 3 more steps; a fresh model, optimizer and state loaded from the checkpoint run the
    same 3 steps: parameters bit-identical at every step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    key = f"onebit_rank{rank}"
    model, state, opt, _ = _fsdp_adamw_run(world, rank, range(3))  # 2 warm-up steps, one 1-bit
    msd, osd = get_state_dict(model, opt)
    saved = state.state_dict()
    dcp.save({"model": msd, "optim": osd, key: saved}, checkpoint_id=path)
    *_, cont = _fsdp_adamw_run(world, rank, range(3, 6), model, state, opt)

    model2, state2, opt2, _ = _fsdp_adamw_run(world, rank, [])
    msd2, osd2 = get_state_dict(model2, opt2)
    fresh = state2.state_dict()  # a fresh state is a complete template (zeros, step 0)
    sized = sorted((k, [b.numel() for b in v]) for k, v in fresh["errors"].items()) == \
        sorted((k, [b.numel() for b in v]) for k, v in saved["errors"].items())
    sd = {"model": msd2, "optim": osd2, key: fresh}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    state2.load_state_dict(sd[key])
    loaded = state2.state_dict()
    *_, resumed = _fsdp_adamw_run(world, rank, range(3, 6), model2, state2, opt2)
    return {
        "template_sized": sized,
        "errors_saved": sorted(saved["errors"]) == ["0", "2"]
        and all(float(b.abs().sum()) > 0 for v in saved["errors"].values() for b in v),
        "state_loaded": loaded["steps"] == saved["steps"] and all(
            torch.equal(a, b) for k in saved["errors"]
            for a, b in zip(saved["errors"][k], loaded["errors"][k])),
        "bitwise": all(torch.equal(a, b) for t in range(3) for a, b in zip(cont[t], resumed[t])),
        "moved": any(not torch.equal(a, b) for a, b in zip(cont[0], cont[-1])),
    }
