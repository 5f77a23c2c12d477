"""ZeRO stage 3 with ordinary model code (from a review): in-place ops on a module's output
(``ReLU(inplace=True)``, a residual ``out += x``), a module returning a dict, torch's
``MultiheadAttention`` (its forward reads ``out_proj.weight`` without calling ``out_proj``), and a
model's own ``state_dict``/``load_state_dict`` while its parameters are shards. One rank: the
hooks gather and release as with several."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from compcomm.zero import ZeroOptimizer


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.norm(self.lin(x))
        out += x  # in place on a hooked module's output, as ResNet's blocks do
        return out


class DictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.scale = nn.Parameter(torch.ones(6))

    def forward(self, x: torch.Tensor) -> dict:
        return {"h": self.lin(x) * self.scale}


class UsesDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.head = DictOut(), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x)["h"])


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn, self.head = nn.MultiheadAttention(8, 2), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x, x, x)[0])


MODELS = {
    "inplace_relu": (lambda: nn.Sequential(nn.Linear(6, 12), nn.ReLU(inplace=True),
                                           nn.Linear(12, 3)), (4, 6)),
    "residual": (lambda: nn.Sequential(Residual(), nn.Linear(6, 3)), (4, 6)),
    "dict_output": (UsesDict, (4, 6)),
    "attention": (Attention, (3, 2, 8)),
}


def _zero3(model: nn.Module) -> ZeroOptimizer:
    return ZeroOptimizer(list(model.parameters()), torch.optim.AdamW, stage=3, module=model,
                         optimizer_kwargs={"lr": 1e-2},
                         stage3_param_persistence_threshold=0)  # every parameter sharded


@pytest.mark.parametrize("name", sorted(MODELS))
def test_stage3_matches_torch_on_ordinary_modules(name):
    make, shape = MODELS[name]
    torch.manual_seed(0)
    ref = make()
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    z = _zero3(model)
    for step in range(3):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(step))
        ref(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        z.step()
    z.gather_parameters()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    z.close()


def test_model_state_dict_while_sharded_is_refused():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Linear(12, 3))
    full = {k: v.clone() for k, v in model.state_dict().items()}
    z = _zero3(model)
    model(torch.randn(2, 6)).sum().backward()
    z.step()
    with pytest.raises(RuntimeError, match=r"gather_parameters\(\)"):
        model.state_dict()  # it would hold empty tensors
    z.gather_parameters()
    assert {k: v.shape for k, v in model.state_dict().items()} == \
        {k: v.shape for k, v in full.items()}
    with pytest.raises(RuntimeError, match="load_checkpoint"):
        model.load_state_dict(full)  # the shards would overwrite it at the next forward
    z.close()
