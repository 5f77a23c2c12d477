"""``compcomm-bench train``: data-parallel training of a byte-level GPT on emulated hosts.

Each of ``--world-size`` ranks is a process; on the namespace profiles (``eth1g``, ``eth10g``,
``eth25g``, ``unshaped``; root only) each runs in its own network namespace with a shaped veth into a
bridge (:mod:`compcomm.bench.netns`), so every byte between ranks crosses a 1/10/25 Gbit/s link. On
GPUs (``--device cuda``) every rank is also an emulated host for NCCL: its own ``NCCL_HOSTID``,
``NCCL_SOCKET_IFNAME`` = its veth, IB/P2P/SHM/NVLS off, so NCCL uses its socket transport over the
shaped link; the ranks share the local GPU(s) (``cuda:rank % ngpus``), so compute is time-sliced
between them. On the CPU the ranks use gloo over the same links.

Model: a GPT-style byte-level transformer (pre-norm, causal attention, tied embeddings), ``tiny``
(~8M parameters, CPU) or ``gpt2s`` (d 768, 12 heads, 17 layers, seq 256: ~121M parameters),
trained on the Python standard library's own source (last 10 % held out for validation), bf16
autocast on GPUs with fp32 parameters (the master weights).

Optimizers (``--optimizers``): DDP + AdamW (fp32 or bf16-hook gradients), OneBitAdam, ZeroOneAdam,
OneBitLamb and their uncompressed twins, ZeRO-2 + AdamW / OneBitAdam (exact and no-all-gather
modes), FSDP2 + AdamW (bf16) and FSDP2 + compcomm's 1-bit reduce-scatter: the table and how each
is built are in :mod:`compcomm.bench.train_setups`.

Timing (per rank, CUDA-synchronized; all ranks enter every step together after a barrier; the
figure of a step is the slowest rank's): ``fwdbwd`` = zero_grad + forward + backward, ``opt`` =
``optimizer.step()`` (its communication included), ``step`` = both. DDP and ZeRO-2 communicate
inside backward (overlapped), so communication is derived: before the optimizers run, every rank
times ``--compute-steps`` forward+backward passes of the same model with no communication at all
(all ranks at once, so the GPU/CPU sharing is the same): ``compute_s``; then
``comm_s = step_s - compute_s`` (communication plus the optimizer's own arithmetic). Per-step
phases: ``full`` (uncompressed optimizers), ``warmup`` / ``compressed`` (1-bit Adam/LAMB, ZeRO +
OneBitAdam, FSDP2 + 1-bit), ZeroOneAdam's ``var`` / ``grad1bit`` / ``local`` / ``sync``; medians are per phase,
the first step of a phase left out when the phase has 3 or more steps, and steps after a
divergence (loss non-finite or above 3x the first step's; the optimizer then stops) left out.

Bytes per step: what rank 0's compcomm communicator counted (``Communicator.bytes_sent``: the
sender's share of each collective, ring allreduce = ``2(W-1)/W`` of the buffer); for DDP, which
talks to torch directly, the ring formula ``2(W-1)/W * gradient bytes`` (fp32, or bf16 with the
hook); FSDP2's collectives are counted as they are called (see :mod:`.train_setups`). The loss logging allreduce is not counted. Validation loss on held-out text every
``--eval-every`` steps (not in the timed wall clock).

Outputs in ``--out``: ``<name>.json`` (every step), ``<name>.md`` (the table), ``<name>.png``
(loss against step, wall time and bytes; step time split into compute and communication).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

from .netns import PROFILES
from .train_setups import COMPRESSED, OPTIMIZERS, TWIN, make, phase

__all__ = ["main", "OPTIMIZERS", "MODELS", "build_model", "summarize"]

MODELS: Dict[str, Dict[str, int]] = {
    "tiny": dict(d_model=256, heads=4, layers=10, seq=64),
    "gpt2s": dict(d_model=768, heads=12, layers=17, seq=256),
}


# ------------------------------------------------------------------------------------------------
# model and data
# ------------------------------------------------------------------------------------------------
def build_model(d_model: int, heads: int, layers: int, seq: int) -> Any:
    """compcomm-demo's GPT-style byte-level transformer with GPT-2's initialisation."""
    from ..demo import build_model as demo_model

    return demo_model(d_model, heads, layers, seq, scaled_init=True)


def param_count(d_model: int, layers: int, seq: int, **_: Any) -> int:
    """Parameters of :func:`build_model` (12 d^2 + 2 d per layer, embeddings, final norm)."""
    return layers * (12 * d_model * d_model + 2 * d_model) + (256 + seq + 1) * d_model


def load_text(nbytes: int) -> bytes:
    """The first ``nbytes`` of the standard library's ``*.py`` sources (as compcomm-demo), repeated
    if the library is smaller."""
    from ..demo import load_text as demo_text

    data = demo_text(nbytes)
    if not data:
        raise RuntimeError("no standard-library source found for the training text")
    while len(data) < nbytes:
        data += data[: nbytes - len(data)]
    return data


# ------------------------------------------------------------------------------------------------
# one rank
# ------------------------------------------------------------------------------------------------
def _sync(dev: Any) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _train_one(name: str, cfg: Dict[str, Any], rank: int, world: int, dev: Any, new_model: Any,
               batch: Any, train: Any, loss_of: Any, evaluate: Any, barrier: Any,
               rec: Dict[str, List[Any]], evals: List[List[float]], out: Any) -> Dict[str, Any]:
    """Train optimizer ``name`` for its steps, appending to ``rec``/``evals`` as it goes (so a
    failure keeps the steps done); returns the row's other fields."""
    import torch
    import torch.distributed as dist

    model = new_model()
    objs = make(name, model, cfg, world, dev)
    module, opt, kind = objs["module"], objs["opt"], objs["kind"]
    nparams = sum(p.numel() for p in model.parameters())
    comm = getattr(opt, "comm", None)
    counted = objs.get("sent") or ((lambda: comm.bytes_sent) if comm is not None else None)
    reduce_sent = objs.get("reduce_sent")  # FSDP2: the gradient reduce-scatters alone
    if reduce_sent is not None:
        rec.setdefault("reduce_bytes", [])
    grad_bytes = nparams * (2 if name == "ddp_adamw_bf16hook" else 4)
    ddp_bytes = 2 * (world - 1) * grad_bytes // world if world > 1 else 0
    gen = torch.Generator().manual_seed(10_000 * (rank + 1))  # the same batches in every run
    seq, bsz = cfg["seq"], cfg["batch"]
    steps = cfg["steps"] if (name in COMPRESSED or cfg["baseline_steps"] is None) \
        else cfg["baseline_steps"]
    wall = 0.0
    began = time.monotonic()
    stopped_early = False
    try:
        for t in range(1, steps + 1):
            x, y = batch(train, torch.randint(0, train.numel() - seq - 1, (bsz,), generator=gen))
            rec["phase"].append(phase(name, opt, t, cfg["warmup"]))
            before = counted() if counted is not None else 0
            rbefore = reduce_sent() if reduce_sent is not None else 0
            barrier()
            _sync(dev)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = loss_of(module, x, y)
            loss.backward()
            _sync(dev)
            t1 = time.perf_counter()
            opt.step()
            _sync(dev)
            t2 = time.perf_counter()
            sent = counted() - before if counted is not None else ddp_bytes
            if reduce_sent is not None:
                rec["reduce_bytes"].append(int(reduce_sent() - rbefore))
            rec["fwdbwd_s"].append(t1 - t0)
            rec["opt_s"].append(t2 - t1)
            rec["step_s"].append(t2 - t0)
            rec["bytes"].append(int(sent))
            lt = loss.detach().float().reshape(1)
            dist.all_reduce(lt)  # logging only, not counted
            rec["loss"].append(float(lt) / world)
            wall += t2 - t0
            # diverged: non-finite, or 3x the first step's loss (ZeRO then skips the non-finite
            # steps, which would time as fast steps that communicate nothing)
            diverged = not math.isfinite(rec["loss"][-1]) or rec["loss"][-1] > 3 * rec["loss"][0]
            if cfg["eval_every"] and (t % cfg["eval_every"] == 0 or t == steps or diverged):
                evals.append([t, evaluate(module), wall, float(sum(rec["bytes"]))])
            if rank == 0 and cfg.get("progress"):
                print(f"PROGRESS {name} step {t}/{steps} {rec['phase'][-1]} loss "
                      f"{rec['loss'][-1]:.4f} {t2 - t0:.3f} s {sent} B", file=out, flush=True)
            # every rank must agree to stop (a time budget per optimizer, or a divergence)
            over = torch.tensor([1.0 if (cfg["max_seconds"] and time.monotonic() - began >
                                         cfg["max_seconds"]) or diverged else 0.0], device=dev)
            dist.all_reduce(over, op=dist.ReduceOp.MAX)
            if float(over) > 0 and t < steps:
                stopped_early = True
                break
        if not evals or evals[-1][0] != len(rec["loss"]):
            evals.append([len(rec["loss"]), evaluate(module), wall, float(sum(rec["bytes"]))])
    finally:
        if hasattr(opt, "close"):
            opt.close()
    return {"steps_planned": steps, "stopped_early": stopped_early, "params": nparams,
            "ddp_ring_bytes": ddp_bytes if kind == "ddp" else None}


def _rank_main(cfg: Dict[str, Any]) -> int:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import compcomm

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=cfg["collective_timeout"])
    if cfg["device"] == "cuda":
        ngpu = torch.cuda.device_count()
        if ngpu == 0:
            raise RuntimeError("train: --device cuda but no CUDA device is visible")
        dev = torch.device("cuda", rank % ngpu)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", timeout=timeout, device_id=dev)
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(cfg.get("threads", 1))
        dist.init_process_group("gloo", timeout=timeout)
    if cfg.get("backend") == "nccl":
        compcomm.init("nccl")
    amp = cfg["amp"] == "bf16"
    out = sys.stdout

    def emit(tag: str, obj: Any) -> None:
        if rank == 0:
            print(f"{tag} {json.dumps(obj)}", file=out, flush=True)

    def barrier() -> None:
        if dev.type == "cuda":
            dist.barrier(device_ids=[dev.index])
        else:
            dist.barrier()

    mcfg = {k: cfg[k] for k in ("d_model", "heads", "layers", "seq")}
    seq, bsz = cfg["seq"], cfg["batch"]
    data = torch.frombuffer(bytearray(load_text(cfg["data_bytes"])), dtype=torch.uint8).long()
    split = int(0.9 * data.numel())
    train, val = data[:split], data[split:]
    gval = torch.Generator().manual_seed(1234)
    nval = max(world, cfg["val_batches"])
    vstarts = torch.randint(0, val.numel() - seq - 1, (nval, bsz), generator=gval)[rank::world]

    def batch(src: Any, starts: Any) -> Any:
        idx = starts[:, None] + torch.arange(seq + 1)[None, :]
        chunk = src[idx].to(dev, non_blocking=True)
        return chunk[:, :-1], chunk[:, 1:]

    def loss_of(module: Any, x: Any, y: Any) -> Any:
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            logits = module(x)
        return F.cross_entropy(logits.float().reshape(-1, 256), y.reshape(-1))

    def evaluate(module: Any) -> float:
        with torch.no_grad():
            tot = torch.zeros(2, dtype=torch.float64, device=dev)
            for s in vstarts:
                x, y = batch(val, s)
                tot[0] += float(loss_of(module, x, y))
                tot[1] += 1
            dist.all_reduce(tot)
        return float(tot[0] / tot[1])

    def new_model() -> Any:
        torch.manual_seed(0)
        return build_model(**mcfg).to(dev)

    # Compute reference: forward + backward, no communication, all ranks at once.
    model = new_model()
    gen = torch.Generator().manual_seed(99 + rank)
    ctimes: List[float] = []
    for i in range(cfg["compute_steps"] + 1):
        x, y = batch(train, torch.randint(0, train.numel() - seq - 1, (bsz,), generator=gen))
        barrier()
        _sync(dev)
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        loss_of(model, x, y).backward()
        _sync(dev)
        if i:  # the first pass allocates
            ctimes.append(time.perf_counter() - t0)
    ct = torch.tensor(ctimes or [float("nan")], dtype=torch.float64, device=dev)
    dist.all_reduce(ct, op=dist.ReduceOp.MAX)
    nparams = sum(p.numel() for p in model.parameters())
    emit("COMPUTE", {"compute_s": statistics.median(ct.tolist()), "compute_all": ct.tolist(),
                     "params": nparams})
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    for name in cfg["optimizers"]:
        rec: Dict[str, List[Any]] = {k: [] for k in
                                     ("loss", "phase", "fwdbwd_s", "opt_s", "step_s", "bytes")}
        evals: List[List[float]] = []
        try:
            info = _train_one(name, cfg, rank, world, dev, new_model, batch, train, loss_of,
                              evaluate, barrier, rec, evals, out)
            error = None
        except Exception as e:  # e.g. NonFiniteError after a divergence: raised on every rank
            info, error = {"steps_planned": None, "params": nparams}, f"{type(e).__name__}: {e}"
            print(f"train: {name} failed on rank {rank}: {error}", file=sys.stderr, flush=True)
        n = min(len(v) for v in rec.values())  # steps completed (a failure may cut one short)
        for v in rec.values():
            del v[n:]
        # the slowest rank's time of every step
        if n:
            tt = torch.tensor([rec["fwdbwd_s"], rec["opt_s"], rec["step_s"]], dtype=torch.float64,
                              device=dev)
            dist.all_reduce(tt, op=dist.ReduceOp.MAX)
            rec["fwdbwd_s"], rec["opt_s"], rec["step_s"] = (r for r in tt.tolist())
        final_val = evals[-1][1] if evals else float("nan")
        emit("RESULT", {"optimizer": name, "steps_run": n, "error": error,
                        "stopped_early": bool(error) or info.get("stopped_early", False),
                        "final_val_loss": final_val, "val_curve": evals, **info, **rec})
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        barrier()
    barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    return 0


# ------------------------------------------------------------------------------------------------
# summaries, table, plot
# ------------------------------------------------------------------------------------------------
def _median_skip_first(xs: Sequence[float]) -> Optional[float]:
    if not xs:
        return None
    return float(statistics.median(xs[1:] if len(xs) >= 3 else xs))


def summarize(row: Dict[str, Any]) -> Dict[str, Any]:
    """Per-phase medians (first step of a phase left out when it has >= 3), tokens/s, bytes."""
    phases: Dict[str, Dict[str, Any]] = {}
    first = row["loss"][0] if row["loss"] else float("nan")
    # steps at which the run had diverged are left out (see _train_one)
    ok = [math.isfinite(x) and x <= 3 * first for x in row["loss"]]
    if ok and not any(ok):
        ok = [True] * len(ok)
    for ph in dict.fromkeys(row["phase"]):
        idx = [i for i, p in enumerate(row["phase"]) if p == ph and ok[i]]
        if not idx:
            continue
        pick = idx[1:] if len(idx) >= 3 else idx
        phases[ph] = {
            "steps": len(idx),
            "step_s": _median_skip_first([row["step_s"][i] for i in idx]),
            "fwdbwd_s": _median_skip_first([row["fwdbwd_s"][i] for i in idx]),
            "opt_s": _median_skip_first([row["opt_s"][i] for i in idx]),
            "bytes": statistics.mean(row["bytes"][i] for i in pick),
        }
        if row.get("reduce_bytes"):  # FSDP2: the gradient reduce-scatters alone
            phases[ph]["reduce_bytes"] = statistics.mean(row["reduce_bytes"][i] for i in pick)
    if not phases:
        phases["full"] = {"steps": 0, "step_s": None, "fwdbwd_s": None, "opt_s": None, "bytes": 0}
    main = {"zerooneadam": "local"}.get(row["optimizer"], "compressed")
    if main not in phases:
        main = "full" if "full" in phases else list(phases)[-1]
    if row["optimizer"] == "zerooneadam" and "local" in phases:
        # the local-step phase as it runs: local steps and the syncs between them
        idx = [i for i, p in enumerate(row["phase"]) if p in ("local", "sync") and ok[i]]
        phases["local+sync"] = {
            "steps": len(idx),
            "step_s": statistics.mean(row["step_s"][i] for i in idx[1:] or idx),
            "bytes": statistics.mean(row["bytes"][i] for i in idx),
        }
    tok = row["world_size"] * row["batch"] * row["seq"]
    s = phases[main]["step_s"]
    out = {
        "main_phase": main,
        "phases": phases,
        "step_s": s,
        "bytes_per_step": phases[main]["bytes"],
        "reduce_bytes_per_step": phases[main].get("reduce_bytes"),
        "tokens_per_s": tok / s if s else None,
        "comm_s": (s - row["compute_s"]) if s is not None and row.get("compute_s") else None,
        "wall_s": sum(row["step_s"]),
        "total_bytes": sum(row["bytes"]),
    }
    return out


def _fmt_bytes(b: Optional[float]) -> str:
    if b is None:
        return ""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if b < 1024 or unit == "GiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024
    return ""


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a and b else None


def targets(rows: List[Dict[str, Any]], device: str = "cuda") -> List[Dict[str, Any]]:
    """The issue's targets that this run's rows allow checking (ratios of main-phase step times).

    GPU (W=4): eth1g OneBitAdam >= 25x DDP+AdamW and >= 12x DDP+bf16 hook, ZeroOneAdam local steps
    >= 1.5x OneBitAdam's, ZeRO-2+OneBitAdam in the no-all-gather mode >= 15x ZeRO-2+AdamW (issue
    13), FSDP2 + 1-bit >= 3x FSDP2 bf16 (issue 16); eth10g OneBitAdam >= 10x DDP+AdamW; a
    compressed step within 1.3x of (unshaped step + bytes / link rate); FSDP2's 1-bit
    reduce-scatter >= 12x fewer bytes than its bf16 one (any profile). CPU twin (eth1g, W=4):
    OneBitAdam >= 4x DDP+AdamW. Other ratios are listed without a target."""
    by = {(r["profile"], r["world_size"], r["optimizer"]): r for r in rows if "summary" in r}

    def st(p: str, w: int, o: str, phase: Optional[str] = None) -> Optional[float]:
        r = by.get((p, w, o))
        if r is None:
            return None
        if phase:
            ph = r["summary"]["phases"].get(phase)
            return ph["step_s"] if ph else None
        return r["summary"]["step_s"]

    out = []
    for p, w in sorted({(r["profile"], r["world_size"]) for r in rows}):
        checks = [
            ("onebitadam", None, "ddp_adamw", None, 25 if p == "eth1g" else 10),
            ("onebitadam", None, "ddp_adamw_bf16hook", None, 12),
            ("zerooneadam", "local", "onebitadam", None, 1.5),
            ("zero2_onebitadam", None, "zero2_adamw", None, None),  # "exact": all-gathers
            ("zero2_onebitadam_noag", None, "zero2_adamw", None, 15),
            ("fsdp2_onebit", None, "fsdp2_adamw", None, 3),
        ]
        for fast, fph, slow, sph, want in checks:
            a, b = st(p, w, slow, sph), st(p, w, fast, fph)
            if a is None or b is None:
                continue
            if device == "cpu":
                want = 4
                applies = p == "eth1g" and w == 4 and (fast, slow) == ("onebitadam", "ddp_adamw")
            else:
                applies = want is not None and ((p == "eth1g" and w == 4) or (
                    p == "eth10g" and w == 4 and (fast, slow) == ("onebitadam", "ddp_adamw")))
            out.append({"profile": p, "world_size": w, "fast": fast + (f" ({fph})" if fph else ""),
                        "slow": slow, "speedup": a / b, "target": want if applies else None,
                        "met": (a / b >= want) if applies else None})
        # issue 16: bytes of FSDP2's gradient reduce-scatter, 1-bit phase against bf16 (fp32 on CPU)
        ra, ro = (by[(p, w, o)]["summary"].get("reduce_bytes_per_step") if (p, w, o) in by
                  else None for o in ("fsdp2_adamw", "fsdp2_onebit"))
        if ra and ro:
            on = device != "cpu"
            out.append({"profile": p, "world_size": w,
                        "fast": "fsdp2_onebit (reduce-scatter bytes)",
                        "slow": "fsdp2_adamw (reduce-scatter bytes)", "speedup": ra / ro,
                        "bytes_ratio": ra / ro, "target": 12 if on else None,
                        "met": ra / ro >= 12 if on else None})
    # efficiency: compressed step on a shaped link vs unshaped step + bytes / rate
    for r in rows:
        prof = PROFILES.get(r["profile"])
        if ("summary" not in r or prof is None or not prof.gbit or r["optimizer"] not in COMPRESSED
                or device == "cpu"):
            continue
        u = by.get(("unshaped", r["world_size"], r["optimizer"]))
        if u is None or "summary" not in u:
            continue
        ph = r["summary"]["main_phase"]
        uph = u["summary"]["phases"].get(ph)
        if not uph:
            continue
        ideal = uph["step_s"] + r["summary"]["phases"][ph]["bytes"] * 8 / (prof.gbit * 1e9)
        got = r["summary"]["phases"][ph]["step_s"]
        out.append({"profile": r["profile"], "world_size": r["world_size"],
                    "fast": f"{r['optimizer']} ({ph})", "slow": "unshaped + bytes/rate",
                    "speedup": ideal / got, "efficiency_ratio": got / ideal, "target": 1 / 1.3,
                    "met": got / ideal <= 1.3})
    return out


#: compressed optimizers with a loss target: within 2 % of the twin (issues 13 and 16)
_LOSS_TARGET = ("onebitadam", "onebitlamb", "fsdp2_onebit")


def loss_checks(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Loss at equal steps of each compressed optimizer against its uncompressed twin."""
    by = {(r["profile"], r["world_size"], r["optimizer"]): r for r in rows if r.get("loss")}
    out = []
    for (p, w, o), r in by.items():
        twin = by.get((p, w, TWIN.get(o, "")))
        if twin is None:
            continue
        n = min(len(r["loss"]), len(twin["loss"]))
        k = max(1, min(10, n // 5))  # mean of the last k common steps (training loss is noisy)
        a = statistics.mean(r["loss"][n - k:n])
        b = statistics.mean(twin["loss"][n - k:n])
        vs = {e[0]: e[1] for e in r.get("val_curve", [])}
        vt = {e[0]: e[1] for e in twin.get("val_curve", [])}
        common = sorted(set(vs) & set(vt))
        val = (vs[common[-1]], vt[common[-1]], common[-1]) if common else None
        rel = (val[0] / val[1] - 1) if val else (a / b - 1)
        out.append({"profile": p, "world_size": w, "optimizer": o, "twin": TWIN[o], "step": n,
                    "train_loss": a, "twin_train_loss": b,
                    "val_step": val[2] if val else None, "val_loss": val[0] if val else None,
                    "twin_val_loss": val[1] if val else None, "rel": rel,
                    "within_2pct": rel <= 0.02 if o in _LOSS_TARGET else None})
    return out


def time_to_target(rows: List[Dict[str, Any]], target: Optional[float]) -> Dict[str, Any]:
    """Per row: the first evaluation at or below the target validation loss (default: the highest
    final validation loss of the uncompressed rows, which each of them reaches) and its wall time
    (sum of step times) and bytes."""
    finals = [r["final_val_loss"] for r in rows if r.get("val_curve")
              and r["optimizer"] not in COMPRESSED and math.isfinite(r["final_val_loss"])]
    if target is None and finals:
        target = max(finals)
    res: Dict[str, Any] = {"target_val_loss": target, "rows": []}
    if target is None:
        return res
    for r in rows:
        hit = next((e for e in r.get("val_curve", []) if e[1] <= target + 1e-12), None)
        res["rows"].append({"profile": r["profile"], "world_size": r["world_size"],
                            "optimizer": r["optimizer"], "step": hit[0] if hit else None,
                            "wall_s": hit[2] if hit else None, "bytes": hit[3] if hit else None})
    return res


def markdown(doc: Dict[str, Any]) -> str:
    meta, rows = doc["meta"], doc["rows"]
    out = [f"# compcomm-bench train ({meta['device']}, measured)", ""]
    out.append(
        f"Model: byte-level GPT, {meta['params'] or '?'} parameters (d {meta['d_model']}, "
        f"{meta['heads']} heads, {meta['layers']} layers, seq {meta['seq']}), batch {meta['batch']} "
        f"sequences per rank, {'bf16 autocast, fp32 master weights' if meta['amp'] == 'bf16' else 'fp32'}"
        f"; text: Python {meta['python']} standard library source (10 % held out). lr {meta['lr']} "
        f"(LAMB {meta['lamb_lr']}), warm-up (freeze_step / var_freeze_step) {meta['warmup']}, "
        f"otherwise default optimizer arguments{meta.get('non_default') or ''}. Host: {meta['host']}, "
        f"{meta['cpus']} CPUs, {meta.get('gpu') or 'no GPU'}; load average before/after "
        f"{meta['loadavg_before']} / {meta.get('loadavg_after')}; torch {meta['torch']}, "
        f"compcomm {meta['compcomm']}, {meta['date']}.")
    if meta["device"] == "cuda":
        out.append("")
        out.append("All ranks share the local GPU(s) (each an emulated host: its own NCCL_HOSTID, NCCL "
                   "over sockets on its veth); compute is time-sliced between the ranks, so compute "
                   "times are those of W ranks on one GPU.")
    out += ["", f"Command: `{meta['command']}`", "",
            "step = median step time of the optimizer's main phase (1-bit: compressed; ZeroOneAdam: "
            "local steps; others: all), slowest rank; compute = forward+backward with no "
            "communication, all ranks at once; comm = step - compute (communication + optimizer "
            "arithmetic); bytes = rank 0's bytes sent per main-phase step; speedup = ddp_adamw's "
            "step / this step (same profile and W).", ""]
    out.append("| profile | W | optimizer | phase | steps | step ms | compute ms | comm ms | "
               "tokens/s | bytes/step | speedup vs DDP+AdamW | final val loss |")
    out.append("|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = {(r["profile"], r["world_size"]): r["summary"]["step_s"] for r in rows
            if r.get("optimizer") == "ddp_adamw" and "summary" in r}
    for r in rows:
        if "summary" not in r:
            err = (r.get("error") or "").replace("|", "/").replace("\n", " ")[:120]
            out.append(f"| {r['profile']} | {r['world_size']} | {r.get('optimizer', '?')} | "
                       f"FAILED: {err} |||||||||")
            continue
        s = r["summary"]
        name = r["optimizer"] + (f" (stopped after {r['steps_run']} steps: "
                                 f"{r['error'].split(':')[0]})" if r.get("error") else "")
        sp = _ratio(base.get((r["profile"], r["world_size"])), s["step_s"])
        out.append(
            f"| {r['profile']} | {r['world_size']} | {name} | {s['main_phase']} | "
            f"{r['steps_run']} | {s['step_s'] * 1e3:.1f} | {r['compute_s'] * 1e3:.1f} | "
            f"{(s['comm_s'] or 0) * 1e3:.1f} | {s['tokens_per_s']:,.0f} | "
            f"{_fmt_bytes(s['bytes_per_step'])} | {'' if sp is None else f'{sp:.1f}x'} | "
            f"{r['final_val_loss']:.4f} |")
    if any(r.get("error") for r in rows):
        out += ["", "Errors: " + "; ".join(f"{r['profile']} W={r['world_size']} {r['optimizer']}: "
                                          f"{(r['error'] or '')[:200]}" for r in rows if r.get("error"))]
    ph_rows = [r for r in rows if "summary" in r and len(r["summary"]["phases"]) > 1]
    if ph_rows:
        out += ["", "Per phase (median step ms / mean bytes per step):", ""]
        for r in ph_rows:
            parts = [f"{k}: {v['step_s'] * 1e3:.1f} ms, {_fmt_bytes(v['bytes'])}"
                     + (f" (reduce-scatter {_fmt_bytes(v['reduce_bytes'])})" if "reduce_bytes" in v
                        else "") + f" ({v['steps']} steps)"
                     for k, v in r["summary"]["phases"].items()]
            out.append(f"- {r['profile']} W={r['world_size']} {r['optimizer']}: " + "; ".join(parts))
    if doc.get("targets"):
        out += ["", "## Targets (ratios of step times from this run)", "",
                "| profile | W | faster | than | speedup | target | met |", "|---|---:|---|---|---:|---:|---|"]
        for t in doc["targets"]:
            tgt = "" if t["target"] is None else (f">= {t['target']:g}x" if "efficiency_ratio" not in t
                                                   else "<= 1.3x of ideal")
            sp = (f"{t['efficiency_ratio']:.2f}x of ideal" if "efficiency_ratio" in t else
                  f"{t['bytes_ratio']:.1f}x fewer bytes" if "bytes_ratio" in t else
                  f"{t['speedup']:.1f}x")
            out.append(f"| {t['profile']} | {t['world_size']} | {t['fast']} | {t['slow']} | {sp} | "
                       f"{tgt} | {'' if t['met'] is None else ('yes' if t['met'] else 'NO')} |")
    if doc.get("loss_checks"):
        out += ["", "## Loss against the uncompressed twin (equal steps)", "",
                "| profile | W | optimizer | twin | steps | train loss | twin | val loss | twin | "
                "rel. diff | within 2 % |", "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|"]
        for c in doc["loss_checks"]:
            vl = "" if c["val_loss"] is None else f"{c['val_loss']:.4f}"
            vt = "" if c["twin_val_loss"] is None else f"{c['twin_val_loss']:.4f}"
            w2 = "" if c["within_2pct"] is None else ("yes" if c["within_2pct"] else "NO")
            out.append(f"| {c['profile']} | {c['world_size']} | {c['optimizer']} | {c['twin']} | "
                       f"{c['step']} | {c['train_loss']:.4f} | {c['twin_train_loss']:.4f} | {vl} | "
                       f"{vt} | {c['rel'] * 100:+.2f} % | {w2} |")
    ttt = doc.get("time_to_target") or {}
    if ttt.get("rows") and any(r["step"] for r in ttt["rows"]):
        out += ["", f"## Time to validation loss {ttt['target_val_loss']:.4f}", "",
                "| profile | W | optimizer | step | wall s (training) | bytes sent |",
                "|---|---:|---|---:|---:|---:|"]
        for r in ttt["rows"]:
            out.append(f"| {r['profile']} | {r['world_size']} | {r['optimizer']} | "
                       f"{r['step'] or 'not reached'} | "
                       f"{'' if r['wall_s'] is None else format(r['wall_s'], '.1f')} | "
                       f"{_fmt_bytes(r['bytes'])} |")
    return "\n".join(out) + "\n"


def plot(doc: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in doc["rows"] if "summary" in r]
    keys = sorted({(r["profile"], r["world_size"]) for r in rows},
                  key=lambda k: (list(PROFILES).index(k[0]) if k[0] in PROFILES else 99, k[1]))
    if not keys:
        return
    fig, axes = plt.subplots(len(keys), 4, figsize=(22, 4.2 * len(keys)), squeeze=False)
    for i, key in enumerate(keys):
        sel = [r for r in rows if (r["profile"], r["world_size"]) == key]
        for r in sel:
            cum_t, cum_b, a, b = [], [], 0.0, 0.0
            for s, by in zip(r["step_s"], r["bytes"]):
                a += s
                b += by
                cum_t.append(a)
                cum_b.append(max(b, 1.0) / 2**20)
            st = list(range(1, len(r["loss"]) + 1))
            axes[i][0].plot(st, r["loss"], label=r["optimizer"])
            axes[i][1].plot(cum_t, r["loss"], label=r["optimizer"])
            axes[i][2].plot(cum_b, r["loss"], label=r["optimizer"])
            if r.get("val_curve"):
                axes[i][0].plot([e[0] for e in r["val_curve"]], [e[1] for e in r["val_curve"]],
                                "k.", markersize=3)
        names = [r["optimizer"] for r in sel]
        comp = [r["compute_s"] * 1e3 for r in sel]
        comm = [max(0.0, (r["summary"]["comm_s"] or 0.0)) * 1e3 for r in sel]
        ax = axes[i][3]
        ax.barh(names, comp, color="tab:gray", label="compute (fwd+bwd, no comm)")
        ax.barh(names, comm, left=comp, color="tab:red", label="comm + optimizer")
        ax.set_xlabel("main-phase step time (ms)")
        ax.legend(fontsize=7)
        titles = ("loss vs step (dots: validation)", "loss vs training wall time",
                  "loss vs MiB sent by rank 0")
        for j, xl in enumerate(("step", "seconds (sum of step times)", "MiB sent (cumulative)")):
            axes[i][j].set_xlabel(xl)
            axes[i][j].set_ylabel("training loss (nats/byte)")
            axes[i][j].set_title(f"{key[0]}, W={key[1]}: {titles[j]}", fontsize=9)
            axes[i][j].grid(alpha=0.3)
        axes[i][1].set_xscale("log")
        axes[i][2].set_xscale("log")
        # a diverged run must not flatten the others: cap at 1.3x the highest first-step loss
        firsts = [r["loss"][0] for r in sel if r["loss"] and math.isfinite(r["loss"][0])]
        lows = [min(x for x in r["loss"] if math.isfinite(x)) for r in sel
                if any(math.isfinite(x) for x in r["loss"])]
        if firsts and lows:
            for j in range(3):
                axes[i][j].set_ylim(min(lows) * 0.95, max(firsts) * 1.3)
        axes[i][0].legend(fontsize=7)
    fig.suptitle(f"compcomm-bench train, {doc['meta']['device']}, {doc['meta']['params']} parameters "
                 "(measured on this machine)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_outputs(doc: Dict[str, Any], out_dir: str, name: str) -> Dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    doc["targets"] = targets(doc["rows"], doc["meta"].get("device", "cuda"))
    doc["loss_checks"] = loss_checks(doc["rows"])
    doc["time_to_target"] = time_to_target([r for r in doc["rows"] if "summary" in r],
                                           doc["meta"].get("target_val_loss"))
    paths = {k: os.path.join(out_dir, f"{name}.{k}") for k in ("json", "md", "png")}
    with open(paths["json"], "w") as fh:
        json.dump(doc, fh, indent=1)
    with open(paths["md"], "w") as fh:
        fh.write(markdown(doc))
    try:
        plot(doc, paths["png"])
    except Exception as e:  # the numbers matter more than the picture
        doc["meta"]["plot_error"] = str(e)
        paths.pop("png")
    return paths


# ------------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="compcomm-bench train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--profile", default="loopback",
                    help=f"comma list of {', '.join(PROFILES)} (namespace profiles need root)")
    ap.add_argument("--world-size", default="2", help="comma list of rank counts, e.g. 2,4")
    ap.add_argument("--model", choices=list(MODELS), default=None,
                    help="tiny (~8M, default on cpu) or gpt2s (~121M, default on cuda)")
    ap.add_argument("--d-model", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--batch", type=int, default=None,
                    help="sequences per rank per step (default: 8 on cuda, 2 on cpu)")
    ap.add_argument("--optimizers", default="ddp_adamw,onebitadam",
                    help="comma list of " + ", ".join(OPTIMIZERS) + ", or 'all'")
    ap.add_argument("--steps", type=int, default=20, help="steps per optimizer")
    ap.add_argument("--baseline-steps", type=int, default=None,
                    help="steps for the uncompressed optimizers (default: --steps)")
    ap.add_argument("--warmup", type=int, default=5,
                    help="freeze_step (1-bit Adam/LAMB) and var_freeze_step (0/1 Adam)")
    ap.add_argument("--max-seconds", type=float, default=0.0,
                    help="stop an optimizer's run after this many seconds (0: never)")
    ap.add_argument("--timing-only", action="store_true",
                    help="no validation evaluations during the run (only the final one)")
    ap.add_argument("--eval-every", type=int, default=10, help="validation every N steps")
    ap.add_argument("--val-batches", type=int, default=8, help="held-out batches per evaluation")
    ap.add_argument("--target-val-loss", type=float, default=None,
                    help="for time-to-target (default: the highest final validation loss)")
    ap.add_argument("--compute-steps", type=int, default=3,
                    help="forward+backward passes without communication (the compute reference)")
    ap.add_argument("--lr", type=float, default=None, help="Adam-family lr (6e-4 gpt2s, 2e-3 tiny)")
    ap.add_argument("--lamb-lr", type=float, default=None, help="LAMB lr (default: 2 x --lr)")
    ap.add_argument("--amp", choices=("bf16", "none"), default=None,
                    help="autocast dtype (default: bf16 on cuda, none on cpu)")
    ap.add_argument("--backend", choices=("torch", "nccl"), default="torch",
                    help="compcomm optimizers over the torch group (default) or compcomm's native "
                         "NCCL communicator (comm_backend_name='nccl'; cuda only)")
    ap.add_argument("--fused", action=argparse.BooleanOptionalAction, default=None,
                    help="OneBitAdam/ZeroOneAdam fused= (default: the optimizer's default)")
    ap.add_argument("--bias-correction", action="store_true",
                    help="bias_correction=True for the 1-bit optimizers (default: their default)")
    ap.add_argument("--local-step-scaler", type=int, default=None,
                    help="ZeroOneAdam local_step_scaler (default: its default, 32678: no local "
                         "steps in a short run)")
    ap.add_argument("--local-step-clipper", type=int, default=None)
    ap.add_argument("--data-bytes", type=int, default=4_000_000)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per CPU rank")
    ap.add_argument("--timeout", type=float, default=1800.0,
                    help="seconds per (profile, W) run before its ranks are killed")
    ap.add_argument("--out", default="bench/results", help="output folder")
    ap.add_argument("--name", default=None, help="file stem (default train_<device>)")
    ap.add_argument("--progress", action="store_true", help="print every step")
    a = ap.parse_args(list(argv))
    a.profiles = [p.strip() for p in a.profile.split(",") if p.strip()]
    for p in a.profiles:
        if p not in PROFILES:
            ap.error(f"argument --profile: unknown profile {p!r}; choose from {', '.join(PROFILES)}")
    try:
        a.worlds = [int(w) for w in a.world_size.split(",")]
    except ValueError:
        ap.error(f"argument --world-size: need integers, got {a.world_size!r}")
    if any(w < 2 for w in a.worlds):
        ap.error("argument --world-size: need at least 2 ranks")
    a.opt_list = list(OPTIMIZERS) if a.optimizers.strip() == "all" else \
        [o.strip() for o in a.optimizers.split(",") if o.strip()]
    for o in a.opt_list:
        if o not in OPTIMIZERS:
            ap.error(f"argument --optimizers: unknown optimizer {o!r}; choose from "
                     f"{', '.join(OPTIMIZERS)}")
    if a.steps < 1 or a.warmup < 0:
        ap.error("argument --steps must be >= 1 and --warmup >= 0")
    if a.backend == "nccl" and a.device != "cuda":
        ap.error("argument --backend nccl needs --device cuda")
    a.model = a.model or ("gpt2s" if a.device == "cuda" else "tiny")
    m = dict(MODELS[a.model])
    for k in ("d_model", "heads", "layers", "seq"):
        if getattr(a, k) is not None:
            m[k] = getattr(a, k)
    if m["d_model"] % m["heads"]:
        ap.error("--d-model must be a multiple of --heads")
    a.mcfg = m
    a.batch = a.batch or (8 if a.device == "cuda" else 2)
    a.lr = a.lr or (6e-4 if a.model == "gpt2s" else 2e-3)
    a.lamb_lr = a.lamb_lr or 2 * a.lr
    a.amp = a.amp or ("bf16" if a.device == "cuda" else "none")
    a.name = a.name or f"train_{a.device}"
    return a


def _meta(a: argparse.Namespace, argv: Sequence[str]) -> Dict[str, Any]:
    import platform

    import torch

    import compcomm

    gpu = None
    if a.device == "cuda" and torch.cuda.is_available():
        gpu = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    nd = []
    if a.fused is not None:
        nd.append(f"fused={a.fused}")
    if a.bias_correction:
        nd.append("bias_correction=True")
    if a.local_step_scaler:
        nd.append(f"ZeroOneAdam local_step_scaler={a.local_step_scaler}")
    if a.local_step_clipper:
        nd.append(f"ZeroOneAdam local_step_clipper={a.local_step_clipper}")
    if a.backend == "nccl":
        nd.append("comm_backend_name='nccl'")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "cpus": os.cpu_count(), "gpu": gpu,
        "loadavg_before": [round(x, 2) for x in os.getloadavg()],
        "compcomm": compcomm.__version__, "torch": torch.__version__,
        "python": platform.python_version(),
        "command": "compcomm-bench train " + " ".join(argv),
        "device": a.device, "model": a.model, **a.mcfg, "batch": a.batch, "lr": a.lr,
        "lamb_lr": a.lamb_lr, "warmup": a.warmup, "amp": a.amp, "backend": a.backend,
        "non_default": ("; non-default: " + ", ".join(nd)) if nd else "",
        "params": param_count(**a.mcfg), "target_val_loss": a.target_val_loss,
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``compcomm-bench train``; see the module docstring."""
    from . import netns, runner

    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    if any(PROFILES[p].netns for p in a.profiles):
        try:
            netns.check_privileges()
        except netns.NetnsError as e:
            print(f"compcomm-bench train: {e}", file=sys.stderr)
            return 2
    gpus = 0
    if a.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if gpus == 0:
            print("compcomm-bench train: --device cuda but no CUDA device", file=sys.stderr)
            return 2
    meta = _meta(a, argv)
    doc: Dict[str, Any] = {"meta": meta, "rows": []}
    status = 0
    t_start = time.time()
    for prof in a.profiles:
        for w in a.worlds:
            cfg = dict(device=a.device, **a.mcfg, batch=a.batch, optimizers=a.opt_list,
                       steps=a.steps, baseline_steps=a.baseline_steps, warmup=a.warmup,
                       max_seconds=a.max_seconds,
                       eval_every=0 if a.timing_only else a.eval_every,
                       val_batches=a.val_batches, compute_steps=a.compute_steps, lr=a.lr,
                       lamb_lr=a.lamb_lr, amp=a.amp, backend=a.backend, fused=a.fused,
                       bias_correction=a.bias_correction,
                       local_step_scaler=a.local_step_scaler,
                       local_step_clipper=a.local_step_clipper, data_bytes=a.data_bytes,
                       threads=a.threads, progress=a.progress,
                       collective_timeout=max(60.0, min(a.timeout, 900.0)))
            compute: Dict[str, Any] = {}
            done: List[str] = []

            def on_line(line: str, prof: str = prof, w: int = w) -> None:
                if line.startswith("COMPUTE "):
                    compute.update(json.loads(line[8:]))
                    meta["params"] = compute.get("params", meta["params"])
                elif line.startswith("RESULT "):
                    row = json.loads(line[7:])
                    row.update(profile=prof, world_size=w, batch=a.batch, seq=a.mcfg["seq"],
                               compute_s=compute.get("compute_s"),
                               compute_all_s=compute.get("compute_all"))
                    if row.get("step_s"):
                        row["summary"] = summarize(row)
                    doc["rows"].append(row)
                    done.append(row["optimizer"])
                    if row.get("error"):
                        print(f"[train] {prof} W={w} {row['optimizer']:>20}: FAILED after "
                              f"{row['steps_run']} steps: {row['error'][:300]}", flush=True)
                    if "summary" not in row:
                        write_outputs(doc, a.out, a.name)
                        return
                    s = row["summary"]
                    print(f"[train] {prof} W={w} {row['optimizer']:>20}: {s['main_phase']} step "
                          f"{s['step_s'] * 1e3:9.1f} ms, compute {row['compute_s'] * 1e3:8.1f} ms, "
                          f"{_fmt_bytes(s['bytes_per_step'])}/step, val loss "
                          f"{row['final_val_loss']:.4f}", flush=True)
                    write_outputs(doc, a.out, a.name)  # partial results survive a later kill
                elif line.startswith("PROGRESS "):
                    print(line.rstrip(), flush=True)

            print(f"[train] {prof} W={w}: {', '.join(a.opt_list)} ({a.device}, {a.model})",
                  flush=True)
            with tempfile.TemporaryDirectory(prefix="cctrain-") as tmp:
                path = os.path.join(tmp, "config.json")
                with open(path, "w") as fh:
                    json.dump(cfg, fh)
                try:
                    runner.run_on_profile(prof, w, ["-m", "compcomm.bench.train", "--_rank", path],
                                          timeout=a.timeout, on_line=on_line, gpus=gpus)
                except (runner.SweepError, netns.NetnsError) as e:
                    status = 1
                    msg = str(e)
                    print(f"[train] {prof} W={w} FAILED: {msg[-4000:]}", file=sys.stderr, flush=True)
                    for o in a.opt_list:
                        if o not in done:
                            doc["rows"].append({"profile": prof, "world_size": w, "optimizer": o,
                                                "error": msg.splitlines()[0] if msg else "failed"})
    meta["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    meta["wall_s"] = round(time.time() - t_start, 1)
    paths = write_outputs(doc, a.out, a.name)
    with open(paths["md"]) as fh:
        print(fh.read())
    print("wrote " + ", ".join(paths.values()))
    return status


def _rank_entry(path: str) -> None:
    with open(path) as fh:
        cfg = json.load(fh)
    rc = _rank_main(cfg)
    # skip interpreter teardown (see compcomm.bench.worker): destroying process groups while a
    # peer still closes its sockets aborted ranks after all results were in
    os._exit(rc)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--_rank":
        _rank_entry(sys.argv[2])
    sys.exit(main())
