"""``compcomm-demo``: train a small byte-level transformer language model on 4 CPU ranks with Adam,
1-bit Adam, 0/1 Adam, LAMB and 1-bit LAMB, and compare loss and bytes sent.

Usage::

    compcomm-demo                          # the training demo (200 steps, 5 optimizers; fp32, and
                                           # bf16 where the CPU has it natively)
    compcomm-demo --steps 100 --optimizers adam,onebitadam --dtypes fp32,bf16
    compcomm-demo allreduce ...            # the compressed-allreduce demo (compcomm.demos.allreduce)

The text is Python's own standard library source (it ships with every Python). Each of the
``--world-size`` ranks is a real process joined by a torch.distributed gloo group on localhost.
The baselines are the same optimizers with the warm-up extended beyond the run: "adam" is
OneBitAdam that never compresses (Adam with an fp32 gradient allreduce), "lamb" is OneBitLamb
that never compresses, so the compressed runs differ from their baseline only by compression.
Bytes are what rank 0 sent through compcomm's communicator (a ring allreduce counts
``2 (W-1)/W * 4n`` bytes). Outputs in ``--out``: ``summary.json``, ``loss.png``.
"""

from __future__ import annotations

import argparse
import copy
import glob
import json
import os
import sys
import sysconfig
import time
from typing import Any, Dict, List, Optional

OPTIMIZERS = ["adam", "onebitadam", "zerooneadam", "lamb", "onebitlamb"]
BASELINE = {"onebitadam": "adam", "zerooneadam": "adam", "onebitlamb": "lamb"}
#: the optimizers whose loss claim the demo checks (within 2% of the baseline); ZeroOneAdam is
#: reported with its measured gap, which a short run does not absorb (docs/optimizers.md)
LOSS_TARGET = ("onebitadam", "onebitlamb")
#: /proc/cpuinfo flags of CPUs that compute bf16 in hardware (x86: AVX512-BF16, AMX-BF16;
#: aarch64: the BF16 extension)
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def native_bf16(cpuinfo: str = "/proc/cpuinfo") -> Optional[str]:
    """The CPU flag that says this CPU computes bf16 natively, or None (also where it cannot be
    read, e.g. outside Linux). Without it torch emulates bf16 and the demo's bf16 runs were 4-6x
    slower than fp32."""
    try:
        with open(cpuinfo) as f:
            text = f.read()
    except OSError:
        return None
    flags = set()
    for line in text.splitlines():
        key, _, val = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(val.split())
    return next((f for f in BF16_FLAGS if f in flags), None)


def load_text(nbytes: int) -> bytes:
    """The first ``nbytes`` of the standard library's ``*.py`` files, concatenated in name order."""
    root = sysconfig.get_paths()["stdlib"]
    out = bytearray()
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path, "rb") as f:
            out += f.read()
        if len(out) >= nbytes:
            break
    return bytes(out[:nbytes])


def build_model(d_model: int, heads: int, layers: int, seq: int,
                scaled_init: bool = False) -> Any:
    """A GPT-style byte-level transformer (pre-norm, causal attention, tied embeddings, no biases).

    ``scaled_init``: GPT-2's initialisation (weights N(0, 0.02), residual projections scaled by
    ``1/sqrt(2 layers)``), which the deeper training benchmark needs; the demo keeps torch's
    defaults for its linear layers."""
    import math

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    d, h = d_model, heads

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d, bias=False), nn.LayerNorm(d, bias=False)
            self.qkv = nn.Linear(d, 3 * d, bias=False)
            self.proj = nn.Linear(d, d, bias=False)
            self.fc1 = nn.Linear(d, 4 * d, bias=False)
            self.fc2 = nn.Linear(4 * d, d, bias=False)
            if scaled_init:
                for lin in (self.qkv, self.fc1):
                    nn.init.normal_(lin.weight, std=0.02)
                for lin in (self.proj, self.fc2):
                    nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * layers))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(256, d)
            self.pos = nn.Embedding(seq, d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln = nn.LayerNorm(d, bias=False)
            nn.init.normal_(self.tok.weight, std=0.02)
            nn.init.normal_(self.pos.weight, std=0.02)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
            for blk in self.blocks:
                x = blk(x)
            return self.ln(x) @ self.tok.weight.t()

    return LM()


def param_groups(model: Any) -> List[Dict[str, Any]]:
    """Parameters grouped by role (token embedding, position embedding, matrices, norms). With
    ``fused=True`` each group is one compressed allreduce, so tensors of similar magnitude share a
    scale -- one scale for everything compresses the small tensors badly."""
    roles: Dict[str, List[Any]] = {"tok": [], "pos": [], "matrix": [], "norm": []}
    for name, p in model.named_parameters():
        role = name.split(".")[0] if name.split(".")[0] in ("tok", "pos") else \
            ("norm" if p.dim() == 1 else "matrix")
        roles[role].append(p)
    return [{"params": ps} for ps in roles.values() if ps]


#: DeepSpeed's local_step_scaler (32678) is about a third of the ~100k-step runs it was made for
LOCAL_STEP_FRAC = 32678 / 100_000


def local_step_scaler(args: argparse.Namespace) -> int:
    """ZeroOneAdam's ``local_step_scaler``: ``--local-step-scaler`` if given, else the same
    fraction of the run as DeepSpeed's default is of a 100k-step run (65 of 200 steps)."""
    if args.local_step_scaler:
        return args.local_step_scaler
    return max(1, int(round(LOCAL_STEP_FRAC * args.steps)))


def make_optimizer(name: str, params: Any, args: argparse.Namespace) -> Any:
    from compcomm.optim import OneBitAdam, OneBitLamb, ZeroOneAdam

    never = args.steps + 1
    # bias correction makes the variance frozen after a short warm-up unbiased (compcomm honours
    # it; DeepSpeed ignored it) -- with a few hundred steps that matters.
    common = dict(weight_decay=args.wd, bias_correction=True)
    freeze = max(1, int(round(args.freeze_frac * args.steps)))
    lamb_freeze = max(1, int(round(args.lamb_freeze_frac * args.steps)))
    common["fused"] = args.fused
    if name == "adam":
        return OneBitAdam(params, lr=args.lr, freeze_step=never, **common)
    if name == "onebitadam":
        return OneBitAdam(params, lr=args.lr, freeze_step=freeze, **common)
    if name == "zerooneadam":
        # wd_in_momentum=False: without DeepSpeed's weight decay compounding at syncs (docs).
        return ZeroOneAdam(params, lr=args.lr, var_freeze_step=freeze, wd_in_momentum=False, **common,
                           var_update_scaler=args.var_update_scaler,
                           local_step_scaler=local_step_scaler(args),
                           local_step_clipper=args.local_step_clipper)
    if name == "lamb":
        return OneBitLamb(params, lr=args.lamb_lr, freeze_step=never,
                          **{k: v for k, v in common.items() if k != "fused"})
    if name == "onebitlamb":
        return OneBitLamb(params, lr=args.lamb_lr, freeze_step=lamb_freeze,
                          **{k: v for k, v in common.items() if k != "fused"})
    raise ValueError(f"unknown optimizer {name!r}; choose from {OPTIMIZERS}")


def averaged_copy(model: Any, world: int) -> Any:
    """A copy of ``model`` holding the mean of every rank's parameters (collective: every rank
    calls it; a torch.distributed allreduce in fp32, not counted in compcomm's bytes)."""
    import torch
    import torch.distributed as dist

    avg = copy.deepcopy(model)
    for p in avg.parameters():
        buf = p.detach().to(torch.float32, copy=True)
        dist.all_reduce(buf)
        p.data.copy_(buf / world)
    return avg


def _rank_main(rank: int, world: int, args: argparse.Namespace) -> Dict[str, Any]:
    """Train every (optimizer, dtype) configuration on this rank; rank 0 reports progress.
    Returns the results and this rank process's CPU time (user + system, start-up included)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import compcomm

    torch.set_num_threads(1)
    data = torch.frombuffer(bytearray(load_text(args.data_bytes)), dtype=torch.uint8).long()
    split = int(0.9 * data.numel())
    train, val = data[:split], data[split:]
    comm = compcomm.get_communicator(None)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    gval = torch.Generator().manual_seed(1234)
    vstarts = torch.randint(0, val.numel() - args.seq - 1, (args.val_batches, args.batch),
                            generator=gval)

    def batch(src: torch.Tensor, starts: torch.Tensor):
        idx = starts[:, None] + torch.arange(args.seq + 1)[None, :]
        chunk = src[idx]
        return chunk[:, :-1], chunk[:, 1:]

    def evaluate(model: Any) -> float:
        with torch.no_grad():
            tot = 0.0
            for s in vstarts:
                x, y = batch(val, s)
                tot += float(F.cross_entropy(model(x).float().reshape(-1, 256), y.reshape(-1)))
        return tot / len(vstarts)

    def evaluate_run(model: Any, oname: str) -> float:
        # 0/1 Adam's local steps leave the ranks apart: evaluate their average, not rank 0's
        return evaluate(averaged_copy(model, world) if oname == "zerooneadam" else model)

    results = []
    configs = [(o, d) for d in args.dtypes for o in args.optimizers]
    for ci, (oname, dname) in enumerate(configs):
        torch.manual_seed(0)
        model = build_model(args.d_model, args.heads, args.layers, args.seq).to(dtypes[dname])
        opt = make_optimizer(oname, param_groups(model), args)
        gen = torch.Generator().manual_seed(10_000 * (rank + 1))  # same batches for every run
        losses, cum_bytes, step_bytes, evals, compressed = [], [], [], [], []
        total = 0
        bar = None
        if rank == 0:
            from tqdm import tqdm

            bar = tqdm(total=args.steps, desc=f"[{ci + 1}/{len(configs)}] {oname:11s} {dname}",
                       file=sys.stdout, dynamic_ncols=False, ncols=110, mininterval=1.0)
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for step in range(1, args.steps + 1):
            starts = torch.randint(0, train.numel() - args.seq - 1, (args.batch,), generator=gen)
            x, y = batch(train, starts)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x).float().reshape(-1, 256), y.reshape(-1))
            loss.backward()
            compressed.append(not opt.next_step_averages())
            before = comm.bytes_sent
            opt.step()
            sent = comm.bytes_sent - before
            total += sent
            losses.append(float(loss.detach()))  # averaged over the ranks after the run
            step_bytes.append(sent)
            cum_bytes.append(total)
            if args.eval_every and (step % args.eval_every == 0 or step == args.steps):
                evals.append((step, evaluate_run(model, oname)))
            if bar is not None:
                el = time.perf_counter() - t0
                bar.set_postfix_str(f"loss {losses[-1]:.3f} (rank 0) tok/s "
                                    f"{step * world * args.batch * args.seq / el:,.0f} "
                                    f"B/step {sent:,}", refresh=False)
                bar.update(1)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        if bar is not None:
            bar.close()
        # logging only, once per run (not per step, which would add a synchronisation to every
        # step); not counted: it does not go through compcomm
        lt = torch.tensor(losses + [cpu], dtype=torch.float64)
        dist.all_reduce(lt)
        losses, cpu = (lt[:-1] / world).tolist(), float(lt[-1])
        final_val = evaluate_run(model, oname)
        # bytes per step: of the steps without a full-precision average (the compressed phase)
        # for the 1-bit optimizers, of all steps for the baselines
        comp = [b for b, c in zip(step_bytes, compressed) if c] if oname in BASELINE \
            else step_bytes
        warm = [b for b, c in zip(step_bytes, compressed) if not c]
        results.append({
            "optimizer": oname, "dtype": dname, "final_val_loss": final_val,
            "final_train_loss": sum(losses[-10:]) / len(losses[-10:]),
            "bytes_per_step_compressed_phase": sum(comp) / max(1, len(comp)),
            "bytes_per_step_warmup": sum(warm) / max(1, len(warm)),
            "compressed_steps": sum(compressed),
            "total_bytes": total, "time_s": elapsed, "cpu_s_all_ranks": cpu,
            "tokens_per_s": args.steps * world * args.batch * args.seq / elapsed,
            "train_loss": losses, "cum_bytes": cum_bytes, "val_curve": evals,
        })
    return {"results": results, "process_cpu_s": time.process_time()}


def _report(results: List[Dict[str, Any]], args: argparse.Namespace, out: str, wall: float,
            cpu: float) -> int:
    """Print the table and the targets; ``cpu`` is the CPU time of all rank processes."""
    by = {(r["optimizer"], r["dtype"]): r for r in results}
    hdr = (f"{'optimizer':12s} {'dtype':5s} {'val loss':>9s} {'vs base':>8s} {'bytes/step':>11s} "
           f"{'x fewer':>8s} {'tokens/s':>9s} {'time s':>7s} {'cpu s':>6s}")
    lines = [hdr, "-" * len(hdr)]
    checked: List[bool] = []  # every target that could be checked in this run
    missed: List[str] = []
    gaps: List[str] = []
    unchecked = _unchecked_targets(by, args.dtypes)
    for r in results:
        name = r["optimizer"]
        base = by.get((BASELINE.get(name, name), r["dtype"]))
        adam = by.get(("adam", r["dtype"]))
        rel = (r["final_val_loss"] / base["final_val_loss"] - 1) if base else float("nan")
        fewer = (adam["bytes_per_step_compressed_phase"] / r["bytes_per_step_compressed_phase"]
                 if adam and r["bytes_per_step_compressed_phase"] else float("nan"))
        r["val_loss_vs_baseline"] = rel
        r["bytes_fewer_than_adam"] = fewer
        if name in BASELINE:
            r["target_bytes_25x"] = bool(fewer >= 25) if adam else None
            r["target_loss_within_2pct"] = (bool(rel <= 0.02) if base else None) \
                if name in LOSS_TARGET else None  # ZeroOneAdam: reported, no target
            for key, what in (("target_bytes_25x", "bytes"), ("target_loss_within_2pct", "loss")):
                if r[key] is not None:
                    checked.append(r[key])
                    if not r[key]:
                        missed.append(f"{name} {r['dtype']} {what}")
            if name not in LOSS_TARGET and base:
                gaps.append(f"{rel * 100:+.2f}% {r['dtype']}")
        lines.append(f"{name:12s} {r['dtype']:5s} {r['final_val_loss']:9.4f} "
                     f"{rel * 100:+7.2f}% {r['bytes_per_step_compressed_phase']:11,.0f} "
                     f"{fewer:7.1f}x {r['tokens_per_s']:9,.0f} {r['time_s']:7.1f} "
                     f"{r['cpu_s_all_ranks']:6.1f}")
    table = "\n".join(lines)
    # MET only when every target was checked and held; a missed one is NOT MET either way
    ok: Optional[bool] = False if missed else (True if checked and not unchecked else None)
    print()
    print(table)
    print("\nbytes/step: what rank 0 sent per step in the compressed phase; vs base: final val loss "
          "against the same optimizer uncompressed (adam, lamb); cpu s: CPU time of all ranks")
    verdict = ("MET" if ok else f"NOT MET ({', '.join(missed)})" if ok is False else
               f"NOT ALL CHECKED (the {len(checked)} checked held)" if checked else
               "none checked (needs a compressed optimizer with its baseline, and adam for bytes)"
               ) + (f"; not checked: {', '.join(unchecked)}" if unchecked else "")
    print(f"targets (1-bit Adam and 1-bit LAMB val loss within 2% of their baseline; every "
          f"compressed phase >= 25x fewer bytes than Adam's fp32 allreduce): {verdict}")
    if gaps:
        print(f"0/1 Adam vs Adam: {', '.join(gaps)} -- no loss target: in a run this short its "
              f"1-bit-gradient variance steps and local steps (which send ~45x fewer bytes) cost "
              f"2-5% loss that long runs amortise; docs/optimizers.md lists the settings tried")
    print(f"wall time {wall:.0f} s; CPU time of the {args.world_size} rank processes {cpu:.0f} s "
          f"(start-up included) on {os.cpu_count()} CPU(s)")
    os.makedirs(out, exist_ok=True)
    summary = {"config": vars(args), "wall_time_s": wall, "cpu_time_s": cpu, "targets_met": ok,
               "targets_not_checked": unchecked, "table": table, "results": results}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(13, 5))
        for r in results:
            style = "-" if r["dtype"] == "fp32" else "--"
            label = f"{r['optimizer']} {r['dtype']}"
            smooth = _smooth(r["train_loss"], 10)
            axes[0].plot(range(1, len(smooth) + 1), smooth, style, label=label)
            axes[1].plot([max(b, 1) / 2**20 for b in r["cum_bytes"]], smooth, style, label=label)
        axes[0].set_xlabel("step")
        axes[1].set_xlabel("MiB sent by rank 0 (cumulative)")
        axes[1].set_xscale("log")
        for ax in axes:
            ax.set_ylabel("training loss (nats/byte, 10-step mean)")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"compcomm-demo: {args.world_size} CPU ranks, {args.steps} steps")
        fig.tight_layout()
        fig.savefig(os.path.join(out, "loss.png"), dpi=110)
        print(f"wrote {out}/summary.json and {out}/loss.png")
    except ImportError:
        print(f"wrote {out}/summary.json (matplotlib missing: no plot)")
    return 0


def _unchecked_targets(by: Dict[Any, Dict[str, Any]], dtypes: List[str]) -> List[str]:
    """The targets of the claim (1-bit Adam's and 1-bit LAMB's loss, every compressed run's
    bytes) that this run could not check, each with the reason."""
    out: List[str] = []
    for d in dtypes:
        for name, base in BASELINE.items():
            ran, target = (name, d) in by, name in LOSS_TARGET
            out += [f"{name} {d} {why}" for why, unchecked in (
                ("(not run)", target and not ran),
                ("bytes (no adam run)", ran and ("adam", d) not in by),
                (f"loss (no {base} run)", ran and target and (base, d) not in by)) if unchecked]
    return out


def _smooth(xs: List[float], k: int) -> List[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= k:
            acc -= xs[i - k]
        out.append(acc / min(i + 1, k))
    return out


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="compcomm-demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200,
                   help="steps per run (default 200: at 150, 1-bit LAMB ended 2.6-3.8%% above "
                        "LAMB; see docs/optimizers.md)")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                   help=f"comma-separated subset of {','.join(OPTIMIZERS)}")
    p.add_argument("--dtypes", default="auto",
                   help="comma-separated subset of fp32,bf16; auto (default): fp32, plus bf16 where "
                        "the CPU computes bf16 natively (flag avx512_bf16, amx_bf16 or bf16 in "
                        "/proc/cpuinfo) -- elsewhere torch emulates it, 4-6x slower than fp32")
    p.add_argument("--out", default="demo_out")
    p.add_argument("--freeze-frac", type=float, default=0.2,
                   help="warm-up (freeze_step / var_freeze_step) as a fraction of the steps")
    p.add_argument("--lamb-freeze-frac", type=float, default=0.5,
                   help="OneBitLamb's freeze_step as a fraction of the steps: its frozen trust "
                        "ratios need a longer warm-up in a short run")
    p.add_argument("--fused", action=argparse.BooleanOptionalAction, default=True,
                   help="OneBitAdam/ZeroOneAdam: one compressed allreduce per param group "
                        "(DeepSpeed's fp16 path) instead of one per parameter")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--lamb-lr", type=float, default=1e-2)
    p.add_argument("--wd", type=float, default=0.01)
    p.add_argument("--var-update-scaler", type=int, default=16,
                   help="ZeroOneAdam: variance updates per var_interval before it doubles "
                        "(DeepSpeed's 16: a number of variance samples, not a length of run). "
                        "Its var_freeze_step is --freeze-frac of the steps, as OneBitAdam's "
                        "freeze_step (DeepSpeed's 100000 is a whole long run)")
    p.add_argument("--local-step-scaler", type=int, default=0,
                   help="ZeroOneAdam: steps per local_step_interval before it doubles; 0 (default) "
                        "= a third of the steps (65 of 200), the share of a 100k-step run that "
                        "DeepSpeed's 32678 is: syncs every step, then every 2nd, then every 4th "
                        "step. DeepSpeed's 32678 would never leave interval 1 in a short run")
    p.add_argument("--local-step-clipper", type=int, default=4,
                   help="ZeroOneAdam: largest local_step_interval (DeepSpeed: 16, reached after "
                        "~130k steps; a third-of-the-run scaler reaches 4 in the last third)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--data-bytes", type=int, default=2_000_000)
    p.add_argument("--val-batches", type=int, default=16)
    p.add_argument("--eval-every", type=int, default=0, help="also evaluate every N steps")
    a = p.parse_args(argv)
    a.optimizers = [o.strip() for o in a.optimizers.split(",") if o.strip()]
    a.bf16_flag = native_bf16()
    if a.dtypes.strip() == "auto":
        a.dtypes = ["fp32", "bf16"] if a.bf16_flag else ["fp32"]
    else:
        a.dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    bad = [o for o in a.optimizers if o not in OPTIMIZERS]
    if bad:
        p.error(f"unknown optimizer(s) {bad}; choose from {OPTIMIZERS}")
    if not a.dtypes or [d for d in a.dtypes if d not in ("fp32", "bf16")]:
        p.error("--dtypes takes fp32 and/or bf16, or auto")
    if a.world_size < 2:
        p.error("argument --world-size: need at least 2 ranks (the demo compares what they send)")
    for flag in ("steps", "batch", "seq", "d_model", "heads", "layers", "val_batches"):
        if getattr(a, flag) < 1:
            p.error(f"argument --{flag.replace('_', '-')}: must be >= 1, got {getattr(a, flag)}")
    if a.d_model % a.heads:
        p.error(f"argument --heads: must divide --d-model ({a.d_model}), got {a.heads}")
    if a.data_bytes - int(0.9 * a.data_bytes) <= a.seq + 1:
        p.error(f"argument --data-bytes: {a.data_bytes} leaves no {a.seq + 2}-byte validation "
                f"window (10 % is held out); need more than {10 * (a.seq + 2)}")
    if a.local_step_scaler < 0 or a.eval_every < 0:
        p.error("--local-step-scaler and --eval-every must be >= 0 (0: the default)")
    return a


def train_main(argv: Optional[List[str]] = None) -> int:
    """The training demo; returns the process exit code (0 when it ran)."""
    args = parse_args(argv)
    from compcomm.testing import run_ranks

    print(f"compcomm-demo: byte-level transformer ({args.layers} layers, d_model {args.d_model}, "
          f"seq {args.seq}) on Python's stdlib source, {args.world_size} CPU ranks (gloo), "
          f"{args.steps} steps, batch {args.batch}/rank; optimizers {args.optimizers}, dtypes "
          f"{args.dtypes}", flush=True)
    if "bf16" in args.dtypes and args.bf16_flag:
        print(f"  (bf16: this CPU computes it natively ({args.bf16_flag}); --dtypes fp32 skips it)",
              flush=True)
    elif "bf16" not in args.dtypes and not args.bf16_flag:
        print("  (no bf16: this CPU has no native bf16 (no avx512_bf16/amx_bf16/bf16 flag), so "
              "torch would emulate it; --dtypes fp32,bf16 runs it anyway)", flush=True)
    elif "bf16" in args.dtypes and not args.bf16_flag:
        print("  (bf16 asked for on a CPU without native bf16: torch emulates it, expect the bf16 "
              "runs to be several times slower than fp32)", flush=True)
    t0 = time.perf_counter()
    per_rank = run_ranks(args.world_size, _rank_main, args, timeout=3600.0,
                         env={"OMP_NUM_THREADS": "1"})
    cpu = sum(r["process_cpu_s"] for r in per_rank)
    return _report(per_rank[0]["results"], args, args.out, time.perf_counter() - t0, cpu)


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``compcomm-demo``: ``allreduce ...`` runs the allreduce demo, anything else
    the training demo."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "allreduce":
        try:
            from .demos import allreduce
        except ImportError as e:
            print(f"compcomm-demo allreduce: not available in this installation ({e})",
                  file=sys.stderr)
            return 2
        return allreduce.main(argv[1:]) or 0
    return train_main(argv)


if __name__ == "__main__":
    sys.exit(main())
