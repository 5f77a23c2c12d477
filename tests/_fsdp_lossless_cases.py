"""Rank bodies for tests/test_fsdp_lossless.py: the int8 all-gather made lossless (every block of
every shard holds values k * 2**-e with the block's absmax 127 * 2**-e, which the blockwise int8
code reproduces exactly) must leave the 1-bit reduce-scatter, its error buffers and AdamW's
update bit for bit as with FSDP's exact gathers, with and without the re-gather cache."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

BLOCK = 32


class _Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc, self.ln = torch.nn.Linear(d, d), torch.nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.ln(self.fc(x)))


class _Net(torch.nn.Module):
    """An embedding-like input layer, two resharding blocks, a root LayerNorm and head (the root
    is gathered once a step)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(13, 20)
        self.blocks = torch.nn.ModuleList([_Block(20) for _ in range(2)])
        self.ln, self.head = torch.nn.LayerNorm(20), torch.nn.Linear(20, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def _representable(model: torch.nn.Module, rank: int) -> None:
    """Set every local shard to blocks of ``k * 2**-e`` (|k| <= 127) whose first entry is
    ``+-127 * 2**-e``: the int8 code's fixed points (blocks start at each parameter's shard)."""
    g = torch.Generator().manual_seed(1000 + rank)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            loc = p.to_local()
            if loc.numel() == 0:
                continue
            k = torch.randint(-127, 128, (loc.numel(),), generator=g).float()
            k[::BLOCK] = 127.0 * torch.sign(torch.randn(k[::BLOCK].shape, generator=g))
            loc.copy_((k * 2.0 ** -(7 + i % 3)).view_as(loc))


def _batch(t: int, rank: int) -> torch.Tensor:
    return torch.randn(6, 13, generator=torch.Generator().manual_seed(100 * t + rank))


def _run(world: int, rank: int, ag: Optional[Dict[str, Any]], lr: float, steps: int,
         warmup: int) -> Dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import compcomm.fsdp as cf

    torch.manual_seed(0)
    model = _Net()
    mesh = init_device_mesh("cpu", (world,))
    for m in (*model.blocks, model):
        fully_shard(m, mesh=mesh)
    _representable(model, rank)
    kw = dict(quantized_allgather=True, allgather_block=BLOCK, **ag) if ag else {}
    state = cf.onebit(model, warmup_steps=warmup, segment_elements=64, mode="gradient", **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    seen: List[Any] = []
    for t in range(steps):
        opt.zero_grad()
        loss = model(_batch(t, rank)).pow(2).mean()
        loss.backward()
        grads = [p.grad.to_local().clone() for p in model.parameters()]
        opt.step()
        errs = {k: [b.clone() for b in v] for k, v in sorted(state._errors.items())}
        moments = [(s["exp_avg"].to_local().clone(), s["exp_avg_sq"].to_local().clone())
                   for s in (opt.state[p] for p in model.parameters())]
        params = [p.detach().to_local().clone() for p in model.parameters()]
        seen.append({"loss": loss.detach().clone(), "grads": grads, "errors": errs,
                     "moments": moments, "params": params})
    counts = None if state.allgather is None else (state.allgather.gathers, state.allgather.hits)
    return {"seen": seen, "counts": counts, "steps": dict(state.steps)}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


#: the all-gather variants compared with FSDP's exact gathers (stochastic rounding keeps the
#: fixed points too: floor(k + u) = k)
VARIANTS = {
    "int8": dict(regather_cache=False, allgather_exact_numel=0, allgather_rounding="nearest"),
    "int8_cache": dict(regather_cache=True, allgather_exact_numel=0, allgather_rounding="nearest"),
    "int8_exact_small": dict(regather_cache=True, allgather_exact_numel=20),
    "int8_stochastic": dict(regather_cache=False, allgather_exact_numel=0,
                            allgather_rounding="stochastic"),
}


def lossless_cases(rank: int, world: int) -> Dict[str, Any]:
    """lr 0 (the parameters stay representable) over the switch to 1-bit (warm-up 1, 4 steps),
    and one 1-bit step of lr 1e-2 (warm-up 0): exact gathers against int8 without and with the
    cache."""
    res: Dict[str, Any] = {}
    for lr, steps, warmup in ((0.0, 4, 1), (1e-2, 1, 0)):
        ref = _run(world, rank, None, lr, steps, warmup)
        for tag, ag in VARIANTS.items():
            got = _run(world, rank, ag, lr, steps, warmup)
            res[f"{tag}_lr{lr}"] = {
                part: all(_equal(a[part], b[part]) for a, b in zip(ref["seen"], got["seen"]))
                for part in ("loss", "grads", "errors", "moments", "params")}
            res[f"{tag}_lr{lr}_counts"] = got["counts"]
        res[f"errors_nonzero_lr{lr}"] = any(float(b.abs().max()) > 0 for v in
                                            ref["seen"][-1]["errors"].values() for b in v)
    return res
