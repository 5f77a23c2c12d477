"""Rank bodies for tests/test_zero_unused.py: ZeRO stage 2/3 when the ranks' backward passes reach
different parameters (a branch taken on some ranks only, changing with the step and micro-step; a
backward that reaches none of them), and under reentrant activation checkpointing."""

from __future__ import annotations

from typing import Any, Dict, List

import torch


class Branchy(torch.nn.Module):
    """A trunk, a head, and a branch used only when asked; every bias has 16 elements, so with a
    bucket per tensor several buckets have the same size (paired wrongly, they would not fail)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Linear(8, 16)
        self.branch = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 16)
        self.reentrant = False  # the head under torch.utils.checkpoint(use_reentrant=True)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        if self.reentrant:
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self.head, h, use_reentrant=True)
        return self.head(h)


def uses_branch(rank: int, step: int, micro: int) -> bool:
    return (rank + step + micro) % 2 == 0


def loss_of(model: Branchy, rank: int, step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    x, y = torch.randn(5, 8, generator=g), torch.randn(5, 16, generator=g)
    return ((model(x, uses_branch(rank, step, micro)) - y) ** 2).mean()


def reaches_none(case: Dict[str, Any], rank: int, micro: int) -> bool:
    """Whether this micro-step's backward reaches none of the model's parameters (case "none")."""
    return case.get("none", False) and rank == 1 and micro == 0


def reference(world: int, steps: int, gas: int, case: Dict[str, Any] = {}) -> List[torch.Tensor]:
    """Adam on the gradients averaged over every rank's micro-batches, unused parameters' as 0."""
    model = Branchy()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for s in range(steps):
        for k in range(gas):
            for r in range(world):
                if not reaches_none(case, r, k):
                    (loss_of(model, r, s, k) / (world * gas)).backward()
        for p in model.parameters():  # ZeRO's reduction gives no gradient as zeros
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def train(rank: int, world: int, cases: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    from compcomm.optim import OneBitAdam
    from compcomm.zero import ZeroOptimizer

    out = []
    for case in cases:
        model = Branchy()
        model.reentrant = case.get("reentrant", False)
        other = torch.nn.Parameter(torch.ones(4))  # no parameter of the ZeroOptimizer
        onebit = case.get("onebit", False)
        cls = OneBitAdam if onebit else torch.optim.Adam
        kw = {"lr": 1e-2, "freeze_step": 2} if onebit else {"lr": 1e-2}
        extra = {"onebit_mode": "sharded"} if onebit else {}
        z = ZeroOptimizer(model.parameters(), cls, stage=case["stage"], module=model,
                          optimizer_kwargs=kw, gradient_accumulation_steps=case["gas"],
                          reduce_bucket_size=case.get("bucket", 1),
                          overlap_comm=case["overlap"], timeout=60.0, **extra)
        for s in range(case["steps"]):
            for k in range(case["gas"]):
                if reaches_none(case, rank, k):
                    (other * 2).sum().backward()
                else:
                    loss_of(model, rank, s, k).backward()
            z.step()
        if case["stage"] == 3:
            z.gather_parameters()
        got = [p.detach().clone() for p in model.parameters()]
        z.close()
        out.append(dict(case=case, params=got))
    return out
