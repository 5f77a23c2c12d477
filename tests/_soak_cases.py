"""Rank bodies for tests/test_soak.py (module level, so run_ranks can pickle them)."""

from __future__ import annotations

import os
from typing import Dict

import torch


def rss_mib() -> float:
    """This process's resident memory in MiB (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def soak(rank: int, world: int) -> Dict[str, float]:
    """2000 compressed allreduces and 300 steps of each 1-bit optimizer; resident memory measured
    after a warm-up and at the end."""
    import compcomm
    from compcomm.optim import OneBitAdam, ZeroOneAdam

    out: Dict[str, float] = {}
    t = torch.randn(4099)
    we, se = compcomm.error_buffers(t)
    for i in range(2000):
        t.copy_(torch.randn(4099, generator=torch.Generator().manual_seed(i * 7 + rank)))
        compcomm.compressed_allreduce(t, we, se)
        if i == 199:
            out["calls_warm"] = rss_mib()
    out["calls_end"] = rss_mib()
    z1 = dict(var_freeze_step=30, var_update_scaler=1, local_step_scaler=4, local_step_clipper=4)
    for name, cls, kw in (("adam", OneBitAdam, dict(freeze_step=20)), ("zoadam", ZeroOneAdam, z1)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8))
        opt = cls(model.parameters(), lr=1e-3, **kw)
        for step in range(300):
            x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step * 11 + rank))
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            if step == 59:
                out[f"{name}_warm"] = rss_mib()
        out[f"{name}_end"] = rss_mib()
        out[f"{name}_skipped"] = opt.skipped_steps
    return out
