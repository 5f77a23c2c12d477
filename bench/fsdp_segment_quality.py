"""How close compcomm.fsdp's 1-bit reduced gradient is to the exact one, with one segment per
module and with tensor-aligned segments (CPU, gloo, W=2; a one-off diagnostic, not a benchmark).

compcomm-bench train's ~8M model from initialisation, 1-bit from the first step (warm-up 0), the
mean squared logits as loss, 8 steps of different batches: the cosine between the reduced and the
exact gradient per step and for the sum of the 8 steps (error feedback makes the sum the better
one), and each parameter's reduced-to-exact norm ratio at step 8.

Run: python bench/fsdp_segment_quality.py
"""

from compcomm.testing import run_ranks

def body(rank: int, world: int) -> dict:
    import torch
    import compcomm.fsdp as cf
    from compcomm.bench.train_rank import MODELS, build_model
    from compcomm.bench.train_setups import shard_blocks
    cfg = MODELS["tiny"]
    res = {}
    for mode in ("exact", None, 16384):
        torch.manual_seed(0)
        model = build_model(**cfg)
        shard_blocks(model, world)
        if mode != "exact":
            st = cf.onebit(model, warmup_steps=0, segment_elements=mode, mode="gradient")
        gs = []
        for t in range(8):
            x = torch.randint(0, 256, (2, cfg["seq"]), generator=torch.Generator().manual_seed(100*t+rank))
            model.zero_grad()
            model(x).float().pow(2).mean().backward()
            gs.append([p.grad.to_local().clone() for p in model.parameters()])
        res[str(mode)] = gs
    out = {}
    names = [n for n, _ in model.named_parameters()]
    for mode in ("None", "16384"):
        cos, rel = [], []
        for t in range(8):
            a = torch.cat([g.reshape(-1) for g in res[mode][t]]); b = torch.cat([g.reshape(-1) for g in res["exact"][t]])
            cos.append(round(float(a @ b / a.norm() / b.norm()), 3))
        # per-parameter norm ratio at the last step, a few params
        ratio = {names[i]: round(float(res[mode][7][i].norm() / res["exact"][7][i].norm()), 2) for i in range(len(names)) if i < 14}
        # mean of 8 steps vs mean exact (EF should make it close)
        ma = torch.cat([sum(res[mode][t][i] for t in range(8)).reshape(-1) for i in range(len(names))])
        mb = torch.cat([sum(res["exact"][t][i] for t in range(8)).reshape(-1) for i in range(len(names))])
        out[mode] = dict(cos=cos, ratio=ratio, cos_sum=round(float(ma @ mb / ma.norm() / mb.norm()), 3))
    return out

if __name__ == "__main__":
    r = run_ranks(2, body, timeout=600)[0]
    for k, v in r.items():
        print(k, v["cos"], "sum8", v["cos_sum"]); print("  ", v["ratio"])
