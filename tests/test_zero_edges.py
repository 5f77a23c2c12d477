"""ZeRO and CPUAdam at their edges (from a review of the offload path): frozen parameters through
``initialize``/``from_config``, an empty parameter group, a checkpoint load after a failed
all-gather of the parameters, a group added to the wrapped optimizer, step hooks and LR
schedulers with the offloaded C++ step, a checkpoint of another world size, and CPUAdam checking
every parameter (and an added group's hyper-parameters) before it updates any. One rank."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import compcomm
import compcomm.zero.optimizer as zero_optimizer
from compcomm.optim import CPUAdam
from compcomm.zero import ZeroOptimizer, initialize, load_checkpoint, save_checkpoint

_OFF = {"offload_optimizer": {"device": "cpu"}}
_ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}


def _frozen_model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 2))
    m[0].weight.requires_grad_(False)  # a frozen embedding, as in fine-tuning
    return m


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_frozen_parameters_stay_whole(stage, offload):
    x = torch.randint(0, 10, (6,))
    ref = _frozen_model()
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2,
                            weight_decay=0.01)
    m = _frozen_model()
    frozen = m[0].weight.detach().clone()
    z = initialize(m, _ADAMW, {"stage": stage, **(_OFF if offload else {})})
    for _ in range(3):
        ref(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        m(x).pow(2).sum().backward()
        z.step()
    z.gather_parameters()
    assert torch.equal(m[0].weight, frozen)
    torch.testing.assert_close(m[1].weight, ref[1].weight, rtol=0, atol=1e-6)
    torch.testing.assert_close(m[1].bias, ref[1].bias, rtol=0, atol=1e-6)
    z.close()


def test_frozen_parameters_from_config_and_named_when_passed():
    cfg = {"train_batch_size": 1, "optimizer": _ADAMW, "zero_optimization": {"stage": 2}}
    assert isinstance(compcomm.from_config(_frozen_model(), cfg).optimizer, ZeroOptimizer)
    m = _frozen_model()
    with pytest.raises(ValueError, match=r"params: parameter 0 of group 0 is not a tensor with "
                                         r"requires_grad"):
        ZeroOptimizer(m.parameters(), torch.optim.AdamW, stage=2, module=m)


def _linear_groups(empty: bool):
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3)
    groups = [{"params": [m.weight]}, {"params": [m.bias], "weight_decay": 0.0}]
    if empty:  # a "no_decay" group the model leaves empty
        groups.insert(1, {"params": [], "weight_decay": 0.0})
    return m, groups


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_empty_param_group(stage, offload):
    out = []
    for empty in (False, True):
        m, groups = _linear_groups(empty)
        z = ZeroOptimizer(groups, torch.optim.AdamW, stage=stage, module=m,
                          optimizer_kwargs={"lr": 0.1}, **(_OFF if offload else {}))
        torch.manual_seed(1)
        for _ in range(2):
            m(torch.randn(2, 4)).sum().backward()
            z.step()
        z.gather_parameters()
        out.append([p.detach().clone() for p in m.parameters()])
        z.close()
    assert all(torch.equal(a, b) for a, b in zip(*out))


@pytest.mark.parametrize("offload", [False, True])
def test_load_after_failed_parameter_all_gather(offload, tmp_path, monkeypatch):
    """The step's uploaded parameter copies must not outlive a failed all-gather: a checkpoint
    load then publishes the checkpoint's masters (it published the failed step's copies)."""
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3).to(torch.bfloat16)
    z = ZeroOptimizer(m.parameters(), torch.optim.AdamW, stage=2, module=m,
                      optimizer_kwargs={"lr": 0.1}, **(_OFF if offload else {}))
    m(torch.randn(2, 4, dtype=torch.bfloat16)).sum().backward()
    z.step()
    save_checkpoint(z, str(tmp_path))
    saved = m.weight.detach().clone()
    real = zero_optimizer.publish

    def failing(*args, **kwargs):
        raise compcomm.errors.CommTimeoutError("simulated all-gather timeout")

    monkeypatch.setattr(zero_optimizer, "publish", failing)
    m(torch.randn(2, 4, dtype=torch.bfloat16)).sum().backward()
    with pytest.raises(compcomm.errors.CommTimeoutError):
        z.step()
    monkeypatch.setattr(zero_optimizer, "publish", real)
    load_checkpoint(z, str(tmp_path))
    assert torch.equal(m.weight.detach(), saved)
    z.close()


def test_group_added_to_the_wrapped_optimizer_raises():
    torch.manual_seed(0)
    m, head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    z = ZeroOptimizer(m.parameters(), torch.optim.AdamW, stage=2, module=m,
                      optimizer_kwargs={"lr": 0.1})
    z.optimizer.add_param_group({"params": list(head.parameters())})
    head(m(torch.randn(2, 4))).sum().backward()
    with pytest.raises(ValueError, match=r"\[rank 0\] ZeroOptimizer.step: the wrapped optimizer "
                                         r"has 2 param groups, ZeRO partitioned 1"):
        z.step()
    z.close()


@pytest.mark.parametrize("hooked", [False, True])
def test_offloaded_step_runs_hooks_and_schedulers(hooked):
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    z = ZeroOptimizer(m.parameters(), torch.optim.AdamW, stage=2, module=m,
                      optimizer_kwargs={"lr": 1e-2}, **_OFF)
    calls = []
    if hooked:
        z.optimizer.register_step_post_hook(lambda *args: calls.append(1))
    sched = torch.optim.lr_scheduler.StepLR(z.optimizer, step_size=1, gamma=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            m(torch.randn(3, 4)).sum().backward()
            z.step()
            sched.step()
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    assert z.param_groups[0]["lr"] == pytest.approx(1e-2 / 8)
    # the C++ step without hooks; torch's own step (which runs them) with
    assert (len(calls), z.offload.kernel_steps) == ((3, 0) if hooked else (0, 3))
    z.close()


def test_load_checkpoint_of_another_world_size_names_it(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    z = ZeroOptimizer(m.parameters(), torch.optim.AdamW, stage=2, module=m)
    save_checkpoint(z, str(tmp_path))
    os.rename(tmp_path / "zero_rank0_of1.pt", tmp_path / "zero_rank0_of2.pt")
    with pytest.raises(FileNotFoundError, match=r"holds shards of world size\(s\) \[2\]: to change "
                                                r"the world size, consolidate"):
        load_checkpoint(z, str(tmp_path))
    z.close()


def test_cpu_adam_checks_every_parameter_first():
    a = torch.nn.Parameter(torch.randn(4, 3))
    b = torch.nn.Parameter(torch.randn(3, 4).t())  # not contiguous
    opt = CPUAdam([a, b], lr=0.1)
    a.grad, b.grad = torch.randn(4, 3), torch.randn(4, 3)
    before = a.detach().clone()
    with pytest.raises(ValueError, match="param group 0 parameter 1 must be a contiguous"):
        opt.step()
    assert torch.equal(a, before) and not opt.state


@pytest.mark.parametrize("bad,key", [({"amsgrad": True}, "amsgrad"),
                                     ({"betas": (1.5, 0.9)}, "betas"),
                                     ({"weight_decay": -1.0}, "weight_decay"), ({"lr": -1}, "lr")])
def test_cpu_adam_add_param_group_checks_hyper_parameters(bad, key):
    opt = CPUAdam([torch.nn.Parameter(torch.randn(3))], lr=0.1)
    with pytest.raises(ValueError, match=f"CPUAdam: param group's '{key}'"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2))], **bad})
    assert len(opt.param_groups) == 1


def test_an_unused_large_parameter_is_reduced_in_bounded_pieces(monkeypatch):
    """A parameter larger than ``reduce_bucket_size`` that got no gradient (an unused embedding)
    is reduced as zero pieces from the pool: no buffer of its whole size is allocated."""
    torch.manual_seed(0)
    big = torch.nn.Parameter(torch.randn(50_000))
    small = torch.nn.Parameter(torch.randn(10))
    before = small.detach().clone()
    z = ZeroOptimizer([big, small], torch.optim.AdamW, stage=2, reduce_bucket_size=1000,
                      optimizer_kwargs={"lr": 1e-2})
    sizes = []
    zeros = torch.zeros

    def counting_zeros(*shape, **kw):
        t = zeros(*shape, **kw)
        sizes.append(t.numel())
        return t

    monkeypatch.setattr(torch, "zeros", counting_zeros)
    (small * 2).sum().backward()  # its end reduces every bucket, the unused one as zeros
    z.step()
    monkeypatch.undo()
    assert sizes and max(sizes) < 50_000
    assert not torch.equal(small.detach(), before)  # it stepped
    z.close()
