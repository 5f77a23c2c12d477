"""Rank bodies and bad-input tables of tests/test_robustness.py (issue 14, "nothing half-done").

Each ``_rank_*`` function runs on every rank through compcomm.testing.run_ranks (or directly for a
world of one) and returns how many bad inputs it checked; every check goes through :func:`_expect`:
the call raises the typed error whose message names the argument/entry, and what it could have
changed is bit for bit the same afterwards."""

from __future__ import annotations

import copy
import io
import json
import os
import threading
import time

import pytest
import torch

import compcomm
from compcomm import errors

N = 1000  # elements per collective call in these tests


def _snapshot(obj) -> bytes:
    """Bytes of a (nested) state: two equal snapshots mean nothing changed, bit for bit."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _expect(exc, match, state, fn, *args):
    """``fn(*args)`` raises ``exc`` matching ``match``, and ``state()`` (what the call could change)
    is bit for bit the same afterwards."""
    before = _snapshot(state())
    with pytest.raises(exc, match=match):
        fn(*args)
    assert _snapshot(state()) == before, f"state changed by a failed call ({match})"


# --------------------------------------------------------------------------------------------
# compressed_allreduce / compressed_reduce_scatter: overlap and timeout, before communicating
# --------------------------------------------------------------------------------------------
def _collective_bad_inputs(rank: int, world: int) -> int:
    from compcomm.zero import compressed_reduce_scatter as crs

    comm = compcomm.get_communicator(None)
    g = torch.Generator().manual_seed(rank)
    t = torch.randn(N, generator=g)
    we, se = compcomm.error_buffers(t)
    we.normal_(generator=g)
    se.normal_(generator=g)
    p, c = we.numel(), se.numel()
    ar, cases = compcomm.compressed_allreduce, []
    cases += [
        (ValueError, "'tensor' and 'worker_error' overlap", lambda: ar(we, we, se)),
        (ValueError, "'worker_error' and 'server_error' overlap", lambda: ar(t, we, we[:c])),
        (ValueError, "'worker_error' and 'server_error' overlap", lambda: ar(t, we, we[p - c :])),
        (ValueError, "'tensor' and 'worker_error' overlap", lambda: ar(we[:N], we, se)),
        (ValueError, "'tensor' and 'server_error' overlap", lambda: ar(se[: min(N, c)], we, se)),
        (TypeError, "'timeout'.*number", lambda: ar(t, we, se, timeout="5")),
        (ValueError, "'timeout'.*positive", lambda: ar(t, we, se, timeout=float("nan"))),
        (ValueError, "'server_error' and 'out' overlap", lambda: crs(t, we, se, out=se)),
        (ValueError, "'tensor' and 'out' overlap", lambda: crs(t, we, se, out=t[:c])),
        (ValueError, "'timeout'.*positive", lambda: crs(t, we, se, timeout=-1)),
    ]
    comm.reset_bytes_sent()
    for exc, match, fn in cases:
        _expect(exc, rf"\[rank {rank}\].*{match}", lambda: (t, we, se), fn)
    # a rejected call sends only the 32-byte record that tells the peers so
    assert comm.bytes_sent == len(cases) * compcomm.wire_bytes(0, world, padded=0), comm.bytes_sent
    ar(t, we, se)  # the buffers still work, and the ranks are still in step
    return len(cases)


# --------------------------------------------------------------------------------------------
# one rank rejects its own arguments: the peers raise at once, and the ranks stay in step
# --------------------------------------------------------------------------------------------
ONE_SIDED_TIMEOUT = 60.0  # a regression (the peer waits for the rejecting rank) fails the test


def _one_rank_rejects(rank: int, world: int) -> int:
    """The last rank passes a bad argument, the others good ones: the last rank raises its own
    TypeError/ValueError naming the argument, every other rank RankMismatchError naming the last
    rank, well within the timeout; nothing changes; the next call pairs correctly."""
    from compcomm.zero import compressed_reduce_scatter as crs

    odd = rank == world - 1
    g = torch.Generator().manual_seed(rank)
    t = torch.randn(N, generator=g)
    we, se = compcomm.error_buffers(t)
    we.normal_(generator=g)
    ar = compcomm.compressed_allreduce
    leaf = t.clone().requires_grad_()
    cases = [
        (TypeError, "'tensor' must be float32.*got torch.float64",
         lambda: ar(t.double() if odd else t, we, se, timeout=ONE_SIDED_TIMEOUT)),
        (ValueError, "'worker_error' has 8 elements",
         lambda: ar(t, we[:8] if odd else we, se, timeout=ONE_SIDED_TIMEOUT)),
        (ValueError, "'server_error' must be 1-D",
         lambda: ar(t, we, se.view(-1, 1) if odd else se, timeout=ONE_SIDED_TIMEOUT)),
        (ValueError, "'tensor' requires grad",
         lambda: ar(leaf if odd else t, we, se, timeout=ONE_SIDED_TIMEOUT)),
        (ValueError, "'timeout' must be positive",
         lambda: ar(t, we, se, timeout=-1.0 if odd else ONE_SIDED_TIMEOUT)),
        (TypeError, "compressed_reduce_scatter: argument 'tensor' must be float32.*got torch.int32",
         lambda: crs(t.int() if odd else t, we, se, timeout=ONE_SIDED_TIMEOUT)),
    ]
    for exc, match, fn in cases:
        start = time.monotonic()
        if odd:
            _expect(exc, rf"\[rank {rank}\].*{match}", lambda: (t, we, se), fn)
        else:
            _expect(errors.RankMismatchError,
                    rf"\[rank {rank}\].*rank {world - 1}: rejected its arguments",
                    lambda: (t, we, se), fn)
        assert time.monotonic() - start < ONE_SIDED_TIMEOUT / 2, (match, "the peers waited")
        # in step: the next call is the same call on every rank (its result identical everywhere)
        # (no padding, so a constant tensor is compressed exactly)
        u = torch.full((compcomm.padded_numel(N, world),), float(rank + 1))
        ue, us = compcomm.error_buffers(u)
        ar(u, ue, us, timeout=ONE_SIDED_TIMEOUT)
        assert torch.equal(u, torch.full_like(u, (world + 1) / 2)), u[:4]
    return len(cases)


# --------------------------------------------------------------------------------------------
# threads
# --------------------------------------------------------------------------------------------
def _inputs(k: int, rank: int, i: int) -> torch.Tensor:
    return torch.randn(
        N + 97 * k, generator=torch.Generator().manual_seed(1000 * k + 10 * i + rank)
    )


def _run_calls(k: int, rank: int, group, calls: int) -> list:
    t0 = _inputs(k, rank, 0)
    we, se = compcomm.error_buffers(t0, group)
    outs = []
    for i in range(calls):
        t = _inputs(k, rank, i)
        compcomm.compressed_allreduce(t, we, se, group)
        outs.append(t)
    return outs + [we, se]


def _rank_two_threads_two_groups(rank: int, world: int) -> bool:
    import torch.distributed as dist

    groups = [dist.new_group(list(range(world))) for _ in range(2)]
    calls, got = 15, [None, None]

    def work(k):
        try:
            got[k] = _run_calls(k, rank, groups[k], calls)
        except Exception as e:  # reported below, not lost in the thread
            got[k] = e

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for k in range(2):
        assert not isinstance(got[k], Exception), f"thread {k} raised {got[k]!r}"
    for k in range(2):  # the same calls, one after another
        want = _run_calls(k, rank, groups[k], calls)
        assert all(torch.equal(a, b) for a, b in zip(got[k], want)), f"thread {k} differs"
    return True


def _rank_one_communicator_two_threads(rank: int, world: int) -> bool:
    comm = compcomm.get_communicator(None)
    t = _inputs(0, rank, 0)
    we, se = compcomm.error_buffers(t)
    if rank == 1:
        time.sleep(3.0)  # keeps rank 0's first call waiting inside the collective
        compcomm.compressed_allreduce(t, we, se)
        return True
    first = threading.Thread(target=compcomm.compressed_allreduce, args=(t, we, se))
    first.start()
    time.sleep(1.0)
    t2 = _inputs(1, rank, 0)[:N]
    we2, se2 = compcomm.error_buffers(t2)
    before = _snapshot((t2, we2, se2))
    with pytest.raises(errors.CommError, match=r"\[rank 0\].*in use by another thread"):
        compcomm.compressed_allreduce(t2, we2, se2)
    assert _snapshot((t2, we2, se2)) == before
    first.join()
    assert comm.bytes_sent > 0  # the first call completed
    return True


# --------------------------------------------------------------------------------------------
# 1-bit optimizers: load_state_dict validates everything first
# --------------------------------------------------------------------------------------------
def _trained(cls, rank: int, steps: int = 4, **kw):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    opt = cls(ps, lr=0.01, exact_resume=True, **kw)
    for s in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(s * 10 + rank))
        opt.step()
    return ps, opt


def _edited(sd: dict, f):
    """A maker of deep copies of ``sd`` changed by ``f`` (one bad input of a table)."""

    def make():
        bad = copy.deepcopy(sd)
        f(bad)
        return bad

    return make


def _bad_optimizer_states(sd: dict, zoadam: bool) -> list:
    """(mutation of a good state dict, exception, message regex)."""

    def edit(f):
        return _edited(sd, f)

    pg, st, cc = "param_groups", "state", "compcomm"
    cases = [
        (lambda: "garbage", TypeError, r"state_dict must be a dict, got str"),
        (
            edit(lambda b: b.update(param_groups="garbage")),
            TypeError,
            r"\['param_groups'\] must be a list",
        ),
        (
            edit(lambda b: b[pg].append(dict(b[pg][0]))),
            ValueError,
            r"\['param_groups'\] has 2 groups",
        ),
        (edit(lambda b: b[pg][0]["params"].pop()), ValueError, r"\['params'\] lists 1 parameters"),
        (edit(lambda b: b[pg][0].update(lr="fast")), TypeError, r"\['lr'\] must be a number"),
        (
            edit(lambda b: b[pg][0].update(betas=(0.9,))),
            TypeError,
            r"\['betas'\] must be two numbers",
        ),
        (edit(lambda b: b[pg][0].pop("eps")), ValueError, r"lacks 'eps'"),
        (edit(lambda b: b.pop(st)), ValueError, r"lacks the 'state' entry"),
        (
            edit(lambda b: b[st][0].update(exp_avg=torch.zeros(4))),
            ValueError,
            r"\['exp_avg'\] has shape",
        ),
        (
            edit(lambda b: b[st][1].update(exp_avg_sq="x")),
            TypeError,
            r"\['exp_avg_sq'\] must be a torch.Tensor",
        ),
        (edit(lambda b: b[st].update({99: {}})), ValueError, r"parameter id 99"),
        (edit(lambda b: b[st][0].update(step="x")), TypeError, r"\['step'\] must be a number"),
        (edit(lambda b: b.update(compcomm=5)), TypeError, r"\['compcomm'\] must be a dict"),
        (
            edit(lambda b: b[cc]["sched"].update(step=-1)),
            ValueError,
            r"\['sched'\]\['step'\] must be >= 0",
        ),
        (
            edit(lambda b: b[cc].update(world_size="2")),
            TypeError,
            r"\['world_size'\] must be an integer",
        ),
        (edit(lambda b: b[cc].update(rank=5)), ValueError, r"\['rank'\]=5 is not below"),
        (
            edit(lambda b: b[cc].update(exact="yes")),
            TypeError,
            r"\['exact'\] must be true or false",
        ),
        (
            edit(lambda b: b[cc].update(group_errors=[1])),
            TypeError,
            r"\['group_errors'\] must be a dict",
        ),
        (
            edit(lambda b: b[cc].update(bucket_errors={0: "x"})),
            TypeError,
            r"\['bucket_errors'\]\[0\] must be a dict",
        ),
        (
            edit(lambda b: b[cc].update(bucket_plan=[[(0, 99)]])),
            ValueError,
            r"\['bucket_plan'\]\[0\] has \(0, 99\)",
        ),
        (
            edit(lambda b: b[cc].update(bucket_plan="all")),
            TypeError,
            r"\['bucket_plan'\] must be a list",
        ),
        (
            edit(lambda b: b[cc].update(skipped_steps=-1)),
            ValueError,
            r"\['skipped_steps'\] must be >= 0",
        ),
    ]
    if zoadam:
        cases += [
            (
                edit(lambda b: b[cc]["sched"].pop("var_interval")),
                ValueError,
                r"lacks 'var_interval'",
            ),
            (
                edit(lambda b: b[cc]["sched"].update(freeze_key=1)),
                TypeError,
                r"'freeze_key'\] must be true",
            ),
            (
                edit(lambda b: b[cc]["sched"].update(local_step_interval=0)),
                ValueError,
                r"'local_step_interval'\] must be >= 1",
            ),
        ]
    else:
        cases += [
            (
                edit(lambda b: b[cc]["bucket_errors"][0].update(worker_error=torch.zeros(8))),
                ValueError,
                r"\['bucket_errors'\]\[0\]: error buffers of 8 and \d+ elements do not fit",
            ),
            (
                edit(lambda b: b[cc]["bucket_errors"][0].pop("server_error")),
                ValueError,
                r"\['bucket_errors'\]\[0\] must hold 'worker_error' and 'server_error'",
            ),
        ]
    return cases


def _optimizer_bad_loads(cls, kw: dict, rank: int, world: int) -> int:
    ps, opt = _trained(cls, rank, **kw)
    sd = opt.state_dict()
    if cls.__name__ == "OneBitAdam" and world > 1:
        assert sd["compcomm"]["bucket_errors"]  # the error-buffer cases below need them
    count = 0
    for make, exc, match in _bad_optimizer_states(sd, cls.__name__ == "ZeroOneAdam"):
        if "bucket_errors'\\]\\[0" in match and world == 1:
            continue  # a world of one keeps no error buffers
        _expect(
            exc,
            rf"{cls.__name__}\.load_state_dict: .*{match}",
            lambda: (opt.state_dict(), opt.param_groups, ps),
            opt.load_state_dict,
            make(),
        )
        count += 1
    good = copy.deepcopy(sd)
    good["compcomm"]["from_a_newer_version"] = {0: "unknown here"}  # tolerated
    opt.load_state_dict(good)
    assert _snapshot(opt.state_dict()["state"]) == _snapshot(sd["state"])
    return count


def _rank_optimizer_bad_loads(rank: int, world: int) -> int:
    from compcomm.optim import OneBitAdam, ZeroOneAdam

    return _optimizer_bad_loads(OneBitAdam, {"freeze_step": 2}, rank, world) + _optimizer_bad_loads(
        ZeroOneAdam, {"var_freeze_step": 2}, rank, world
    )


# --------------------------------------------------------------------------------------------
# ZeRO: a bad shard on any rank -> every rank raises, no rank changes
# --------------------------------------------------------------------------------------------
def _zero_opt(onebit: bool):
    from compcomm.optim import OneBitAdam
    from compcomm.zero import ZeroOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    cls, kw = (
        (OneBitAdam, {"freeze_step": 1, "exact_resume": True})
        if onebit
        else (torch.optim.AdamW, {})
    )
    opt = ZeroOptimizer(model.parameters(), cls, stage=2, optimizer_kwargs=dict(lr=0.01, **kw))
    return model, opt


def _zero_step(model, opt, rank: int, seed: int) -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed * 7 + rank))
    opt.zero_grad()
    model(x).pow(2).sum().backward()
    opt.step()


def _bad_shards(sd: dict) -> list:
    def edit(f):
        return _edited(sd, f)

    o = "optimizer"
    return [
        (lambda: [], TypeError, r"sd must be a dict, got list"),
        (edit(lambda b: b.update(format="other/1")), ValueError, r"not a compcomm ZeRO shard"),
        (edit(lambda b: b.update(world=b["world"] + 1)), ValueError, r"saved by rank \d+ of \d+"),
        (
            edit(lambda b: b["groups"][0].update(master=torch.zeros(3))),
            ValueError,
            r"\['master'\] has shape",
        ),
        (edit(lambda b: b["groups"][0].update(bucket_size=7)), ValueError, r"different layout"),
        (
            edit(lambda b: b[o]["state"][0].update(exp_avg=torch.zeros(2))),
            ValueError,
            r"\['exp_avg'\] has shape",
        ),
        (
            edit(lambda b: b[o]["param_groups"][0].update(lr="fast")),
            TypeError,
            r"\['lr'\] must be a number",
        ),
        (
            edit(lambda b: b.update(loss_scale="x")),
            ValueError,
            r"\['loss_scale'\] must be a number > 0",
        ),
        (edit(lambda b: b.update(global_steps=-1)), ValueError, r"\['global_steps'\] must be >= 0"),
        (
            edit(lambda b: b.update(local_phase="yes")),
            TypeError,
            r"\['local_phase'\] must be true or false",
        ),
        (edit(lambda b: b.update(errors={(5, 0): None})), ValueError, r"not a \(group, bucket\)"),
    ]


def _zero_bad_loads(onebit: bool, rank: int, world: int, ckpt_dir: str) -> int:
    from compcomm.zero import load_checkpoint, save_checkpoint

    model, opt = _zero_opt(onebit)
    for s in range(3):
        _zero_step(model, opt, rank, s)
    sd = opt.state_dict()

    def state():
        return opt.state_dict(), list(model.parameters())

    cases = _bad_shards(sd)
    if onebit and sd["errors"]:  # a world of one compresses nothing, keeps no errors
        short = {k: (v[0][:8], v[1]) for k, v in sd["errors"].items()}
        cases.append((lambda: dict(sd, errors=short), ValueError, r"\[0\] has 8 elements"))
    for make, exc, match in cases:
        _expect(
            exc, rf"ZeroOptimizer\.load_state_dict: .*{match}", state, opt.load_state_dict, make()
        )
    # only the last rank's shard is bad: the others refuse too, naming it, and keep their state
    last = world - 1
    bad = _bad_shards(sd)[3][0]() if rank == last else sd
    match = r"\['master'\] has shape" if rank == last else rf"rank\(s\) \[{last}\] rejected"
    _expect(ValueError, match, state, opt.load_state_dict, bad)
    # the same through files: a truncated file on the last rank
    d = os.path.join(ckpt_dir, f"onebit{int(onebit)}")
    path = save_checkpoint(opt, d, module=model)
    _zero_step(model, opt, rank, 9)  # state now differs from the file
    if rank == last:
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    _expect(
        ValueError, r"unreadable" if rank == last else r"rejected", state, load_checkpoint, opt, d
    )
    opt.load_state_dict(sd)  # a good shard still loads everywhere afterwards
    opt.close()
    return len(cases)


def _rank_zero_bad_loads(rank: int, world: int, ckpt_dir: str) -> int:
    return sum(_zero_bad_loads(onebit, rank, world, ckpt_dir) for onebit in (False, True))


# --------------------------------------------------------------------------------------------
# from_config: every value checked before the broadcast, the cast and DDP
# --------------------------------------------------------------------------------------------
_BASE = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 1},
}


def _bad_configs(tmp: str) -> list:
    def cfg(path, value, base=_BASE):
        c = copy.deepcopy(base)
        *keys, last = path
        node = c
        for k in keys:
            node = node.setdefault(k, {})
        node[last] = value
        return c

    onebit = cfg(("optimizer",), {"type": "OneBitAdam", "params": {"lr": 1e-3}})
    as_list = os.path.join(tmp, "list.json")
    broken = os.path.join(tmp, "broken.json")
    with open(as_list, "w") as f:
        json.dump([_BASE], f)
    with open(broken, "w") as f:
        f.write('{"optimizer": ')
    p = ("optimizer", "params")
    return [
        (
            cfg(p + ("lr",), "fast"),
            TypeError,
            r"optimizer\.params\.lr must be a number, got str 'fast'",
        ),
        (cfg(p + ("lr",), -1), ValueError, r"optimizer\.params\.lr must be >= 0"),
        (cfg(p + ("betas",), [0.9]), ValueError, r"optimizer\.params\.betas must be two numbers"),
        (cfg(p + ("betas",), [0.9, 1.5]), ValueError, r"optimizer\.params\.betas\[1\] must be < 1"),
        (
            cfg(p + ("amsgrad",), "no"),
            TypeError,
            r"optimizer\.params\.amsgrad must be true or false",
        ),
        (cfg(p, "fast"), TypeError, r"optimizer\.params must be an object"),
        (cfg(("optimizer", "type"), 3), TypeError, r"optimizer\.type must be a string"),
        (cfg(p + ("freeze_step",), "x", onebit), ValueError, r"optimizer\.params.*'freeze_step'"),
        (cfg(p + ("bogus",), 1, onebit), ValueError, r"optimizer\.params\.bogus: not a parameter"),
        (
            cfg(("optimizer", "type"), "OneBitLamb"),
            ValueError,
            r"optimizer\.type='OneBitLamb'.*stage=1",
        ),
        (cfg(("fp16", "enabled"), "yes"), TypeError, r"fp16\.enabled must be true or false"),
        (cfg(("fp16", "loss_scale"), "x"), TypeError, r"fp16\.loss_scale must be a number"),
        (cfg(("bf16", "enabled"), 1), TypeError, r"bf16\.enabled must be true or false"),
        (cfg(("zero_optimization",), [1]), ValueError, r"zero_optimization must be an object"),
        (cfg(("gradient_clipping",), "x"), ValueError, r"gradient_clipping must be a number"),
        (as_list, TypeError, r"top level of .*list\.json.* must be a JSON object, got a JSON list"),
        (broken, ValueError, r"broken\.json.* is not valid JSON"),
        (42, TypeError, r"config must be a dict or a path"),
    ]


def _rank_from_config(rank: int, world: int, tmp: str) -> int:
    comm = compcomm.get_communicator(None)
    model = torch.nn.Linear(4, 3)
    tmp = os.path.join(tmp, f"rank{rank}")  # each rank its own files: none reads a half-written one
    os.makedirs(tmp)
    cases = _bad_configs(tmp) + [(_BASE, TypeError, r"model must be a torch\.nn\.Module")]
    for i, (config, exc, match) in enumerate(cases):
        target = "not a model" if i == len(cases) - 1 else model
        comm.reset_bytes_sent()
        _expect(exc, match, lambda: list(model.parameters()), compcomm.from_config, target, config)
        assert comm.bytes_sent == 0, f"from_config communicated before raising ({match})"
        assert all(p.dtype == torch.float32 for p in model.parameters())  # not cast either
    setup = compcomm.from_config(model, _BASE)  # the good config broadcasts: the check above bites
    assert world == 1 or comm.bytes_sent > 0
    setup.optimizer.close()
    return len(cases)


def _rank_zero_onebit_failed_exchange(rank: int, world: int, stage: int) -> dict:
    """ZeroOptimizer stage 1 or 2 without overlap (every bucket exchanged in step()) + OneBitAdam
    in the "sharded" mode (1-bit reduce-scatter), compressed phase, several buckets; in one step the third
    all_to_all of the step fails on every rank (the exchange of a later bucket). The step must
    raise with parameters, optimizer state and every bucket's error buffers unchanged: no bucket
    may commit before all exchanges succeeded."""
    from compcomm._comm import TorchCommunicator
    from compcomm.zero import ZeroOptimizer

    class Failing(TorchCommunicator):
        def __init__(self) -> None:
            super().__init__(None)
            self.fail_at = -1  # all_to_all calls left before the failure (-1: never)

        def do_all_to_all(self, send, recv, opts) -> None:
            if self.fail_at == 0:
                raise errors.BackendError(f"[rank {rank}] injected", "all_to_all", "test", 0, rank)
            self.fail_at -= 1 if self.fail_at > 0 else 0
            super().do_all_to_all(send, recv, opts)

    comm = Failing()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    z = ZeroOptimizer(model.parameters(), compcomm.optim.OneBitAdam, stage=stage, process_group=comm,
                      module=model, optimizer_kwargs={"lr": 1e-2, "freeze_step": 1},
                      reduce_bucket_size=64, overlap_comm=False, onebit_mode="sharded")
    g = torch.Generator().manual_seed(10 + rank)

    def backward() -> None:
        x, y = torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()

    for _ in range(3):  # warm-up, then 1-bit steps: error buffers nonzero
        backward()
        z.step()
    buffers = z.compressor._buffers
    assert len(buffers) >= 3, f"expected several buckets, got {len(buffers)}"
    before = _snapshot({"params": [p.detach() for p in model.parameters()],
                        "state": z.optimizer.state_dict()["state"],
                        "errors": {str(k): v[:2] for k, v in buffers.items()}})
    backward()
    comm.fail_at = 2
    try:
        z.step()
        raised = None
    except errors.CommError as e:
        raised = type(e).__name__
    after = _snapshot({"params": [p.detach() for p in model.parameters()],
                       "state": z.optimizer.state_dict()["state"],
                       "errors": {str(k): v[:2] for k, v in buffers.items()}})
    return {"raised": raised, "unchanged": before == after}


# --------------------------------------------------------------------------------------------
# a server_error that is not finite: a typed error, not a call that returns without averaging
# --------------------------------------------------------------------------------------------
def _nonfinite_server_error(rank: int, world: int) -> int:
    """The last rank's server_error holds NaN (Inf for the reduce-scatter): compressed_allreduce
    raises NonFiniteError on every rank naming that rank, nothing changed; compressed_reduce_scatter
    raises nothing (only that rank sees its scale), leaves that rank's out and errors unchanged
    and writes the others'."""
    from compcomm.zero import compressed_reduce_scatter as crs

    odd = rank == world - 1
    t = torch.randn(N, generator=torch.Generator().manual_seed(rank))
    we, se = compcomm.error_buffers(t)
    if odd:
        se[3] = float("nan")
    who = (rf"\[rank {rank}\] compressed_allreduce: the server scale of the chunk\(s\) of "
           rf"rank\(s\) {world - 1} ")
    _expect(errors.NonFiniteError, who, lambda: (t, we, se),
            compcomm.compressed_allreduce, t, we, se)
    if odd:
        se[3] = float("inf")
    out = torch.full((se.numel(),), 7.0)
    before = _snapshot((out, we, se))
    crs(t.clone(), we, se, out=out)
    if odd:
        assert _snapshot((out, we, se)) == before, "a non-finite server scale wrote"
        se.zero_()
    else:
        assert torch.isfinite(out).all() and not torch.equal(out, torch.full_like(out, 7.0))
    compcomm.compressed_allreduce(t, we, se)  # in step, and the buffers work again
    assert torch.isfinite(t).all()
    return 2


# --------------------------------------------------------------------------------------------
# a parameter's .data replaced by a tensor of another shape after its state was made
# --------------------------------------------------------------------------------------------
def _reshaped_twins(cls, kw: dict, steps: int, rank: int):
    """Two optimizers on the same values: in the first, the second group's parameter is re-shaped
    (its .data replaced) after ``steps`` steps; the twin keeps the flat shape."""
    torch.manual_seed(0)
    a, b = torch.randn(10), torch.randn(6)
    ps = [torch.nn.Parameter(a.clone()), torch.nn.Parameter(b.clone())]
    twin = [torch.nn.Parameter(a.clone()), torch.nn.Parameter(b.clone())]
    opts = [cls([{"params": [x]}, {"params": [y]}], lr=1e-2, **kw) for x, y in (ps, twin)]
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        g = [torch.randn(10, generator=gen), torch.randn(6, generator=gen)]
        for params, opt in zip((ps, twin), opts):
            params[0].grad, params[1].grad = g[0].clone(), g[1].clone()
            opt.step()
    return ps, twin, opts, gen


def _rank_reshaped_param(rank: int, world: int) -> int:
    """Another number of elements: ValueError naming the parameter and the rank on every rank,
    nothing changed (the warm-up, compressed and local paths wrote earlier groups first before);
    the same number in another shape: the step of the flat parameter, bit for bit."""
    from compcomm.optim import OneBitAdam, OneBitLamb, ZeroOneAdam

    cases = [(OneBitAdam, {"freeze_step": 100}, 1), (OneBitAdam, {"freeze_step": 1}, 3),
             (ZeroOneAdam, {}, 1), (ZeroOneAdam, {"var_freeze_step": 1, "local_step_scaler": 1}, 3),
             (OneBitLamb, {"freeze_step": 100}, 1), (OneBitLamb, {"freeze_step": 1}, 3)]
    checked = 0
    for cls, kw, steps in cases:
        ps, _, opts, gen = _reshaped_twins(cls, kw, steps, rank)
        ps[1].data = torch.randn(5)
        ps[0].grad, ps[1].grad = torch.randn(10), torch.randn(5)
        _expect(ValueError, rf"\[rank {rank}\] {cls.__name__}.step: param_groups\[1\]\['params'\]"
                r"\[0\] has shape \(5,\) but its optimizer state was made for \(6,\)",
                lambda: (opts[0].state_dict(), ps[0].detach()), opts[0].step)
        ps, twin, opts, gen = _reshaped_twins(cls, kw, steps, rank)
        ps[1].data = ps[1].data.view(3, 2)
        for _ in range(2):
            g = [torch.randn(10, generator=gen), torch.randn(6, generator=gen)]
            ps[0].grad, ps[1].grad = g[0].clone(), g[1].view(3, 2).clone()
            twin[0].grad, twin[1].grad = g[0].clone(), g[1].clone()
            for opt in opts:
                opt.step()
        assert torch.equal(ps[0], twin[0]) and torch.equal(ps[1].view(6), twin[1]), cls.__name__
        checked += 1
    return checked
