"""The results of ``compcomm-bench train`` (:mod:`compcomm.bench.train`): per-phase summaries, the
targets and loss checks, time to target, the markdown table, the plot and the files.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from typing import Any, Dict, List, Optional, Sequence

from .netns import PROFILES
from .train_setups import COMPRESSED, IDENTITY, IDENTITY_TWIN, TWIN

__all__ = ["summarize", "fmt_bytes", "targets", "loss_checks", "time_to_target", "markdown", "plot",
           "write_outputs"]


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
    # steps at which the run had diverged are left out (see train_rank._train_one)
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
    zero_one = row["optimizer"] in ("zerooneadam", "zerooneadam_identity")
    main = "local" if zero_one else "compressed"
    if main not in phases:
        main = "full" if "full" in phases else list(phases)[-1]
    if zero_one and "local" in phases:
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


def fmt_bytes(b: Optional[float]) -> str:
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
            ("fsdp2_onebit_ag", None, "fsdp2_adamw", None, 3),
            ("fsdp2_onebitadam", None, "fsdp2_adamw", None, 3),
            ("fsdp2_onebitadam_ag", None, "fsdp2_adamw", None, 3),
            ("fsdp2_onebitadam_local", None, "fsdp2_adamw", None, 3),
            ("fsdp2_onebitadam_local_ag", None, "fsdp2_adamw", None, 3),
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
_LOSS_TARGET = ("onebitadam", "onebitlamb", "fsdp2_onebit", "fsdp2_onebit_ag", "fsdp2_onebitadam",
                "fsdp2_onebitadam_ag", "fsdp2_onebitadam_local", "fsdp2_onebitadam_local_ag")


# "lamb" is the same set-up as "onebitlamb_nofreeze" (train_setups): either row is onebitlamb's twin
_SAME_SETUP = {"onebitlamb_nofreeze": "lamb"}


def loss_checks(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Loss at equal steps of each compressed optimizer against its uncompressed twin (``TWIN``:
    no freeze, the 2 % target) and, as an extra row without target, its identity twin
    (``IDENTITY_TWIN``: same schedule and frozen variance, exact averages); ``kind`` says which."""
    by = {(r["profile"], r["world_size"], r["optimizer"]): r for r in rows if r.get("loss")}
    out = []
    for (p, w, o), r in by.items():
        for kind, twins in (("nofreeze", TWIN), ("identity", IDENTITY_TWIN)):
            name = twins.get(o, "")
            twin = by.get((p, w, name)) or by.get((p, w, _SAME_SETUP.get(name, "")))
            if twin is not None:
                out.append(_loss_check(r, twin, kind))
    return out


def _loss_check(r: Dict[str, Any], twin: Dict[str, Any], kind: str) -> Dict[str, Any]:
    n = min(len(r["loss"]), len(twin["loss"]))
    k = max(1, min(10, n // 5))  # mean of the last k common steps (training loss is noisy)
    a = statistics.mean(r["loss"][n - k:n])
    b = statistics.mean(twin["loss"][n - k:n])
    vs = {e[0]: e[1] for e in r.get("val_curve", [])}
    vt = {e[0]: e[1] for e in twin.get("val_curve", [])}
    common = sorted(set(vs) & set(vt))
    val = (vs[common[-1]], vt[common[-1]], common[-1]) if common else None
    rel = (val[0] / val[1] - 1) if val else (a / b - 1)
    o = r["optimizer"]
    target = kind == "nofreeze" and o in _LOSS_TARGET
    stopped = bool(r.get("stopped_early") or r.get("error"))
    twin_stopped = bool(twin.get("stopped_early") or twin.get("error"))
    # a run that stopped (diverged, failed, ran out of time) missed its target, whatever its loss
    # at the last step both reached; a stopped twin leaves nothing to compare against
    within = (False if stopped else None if twin_stopped else rel <= 0.02) if target else None
    return {"profile": r["profile"], "world_size": r["world_size"], "optimizer": o,
            "twin": twin["optimizer"], "kind": kind, "step": n, "train_loss": a,
            "twin_train_loss": b, "val_step": val[2] if val else None,
            "val_loss": val[0] if val else None, "twin_val_loss": val[1] if val else None,
            "rel": rel, "within_2pct": within,
            # stopped before its planned steps (a divergence, an error or the time budget)
            "stopped": stopped, "twin_stopped": twin_stopped}


def time_to_target(rows: List[Dict[str, Any]], target: Optional[float]) -> Dict[str, Any]:
    """Per row: the first evaluation at or below the target validation loss (default: the highest
    final validation loss of the uncompressed rows, which each of them reaches) and its wall time
    (sum of step times) and bytes."""
    finals = [r["final_val_loss"] for r in rows if r.get("val_curve")
              and r["optimizer"] not in COMPRESSED + IDENTITY
              and math.isfinite(r["final_val_loss"])]
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



def _schedule(meta: Dict[str, Any]) -> str:
    if meta.get("lr_schedule", "constant") == "constant":
        return " constant"
    return (f" with a linear ramp over {meta.get('lr_warmup', 0)} steps then cosine decay to "
            "0.1 x at the last step")

def markdown(doc: Dict[str, Any]) -> str:
    meta, rows = doc["meta"], doc["rows"]
    out = [f"# compcomm-bench train ({meta['device']}, measured)", ""]
    out.append(
        f"Model: byte-level GPT, {meta['params'] or '?'} parameters (d {meta['d_model']}, "
        f"{meta['heads']} heads, {meta['layers']} layers, seq {meta['seq']}), batch {meta['batch']} "
        f"sequences per rank, {'bf16 autocast, fp32 master weights' if meta['amp'] == 'bf16' else 'fp32'}"
        f"; text: Python {meta['python']} standard library source (10 % held out). lr {meta['lr']} "
        f"(LAMB {meta['lamb_lr']}){_schedule(meta)}, warm-up (freeze_step / var_freeze_step) {meta['warmup']}, "
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
            f"{fmt_bytes(s['bytes_per_step'])} | {'' if sp is None else f'{sp:.1f}x'} | "
            f"{r['final_val_loss']:.4f} |")
    if any(r.get("error") for r in rows):
        out += ["", "Errors: " + "; ".join(f"{r['profile']} W={r['world_size']} {r['optimizer']}: "
                                          f"{(r['error'] or '')[:200]}" for r in rows if r.get("error"))]
    ph_rows = [r for r in rows if "summary" in r and len(r["summary"]["phases"]) > 1]
    if ph_rows:
        out += ["", "Per phase (median step ms / mean bytes per step):", ""]
        for r in ph_rows:
            parts = [f"{k}: {v['step_s'] * 1e3:.1f} ms, {fmt_bytes(v['bytes'])}"
                     + (f" (reduce-scatter {fmt_bytes(v['reduce_bytes'])})" if "reduce_bytes" in v
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
                "Twins: `*_nofreeze` / `lamb` (no freeze: fp32 averaging for the whole run; "
                "the 2 % target) and `*_identity` (the same schedule and frozen variance, exact averages: "
                "the gap to it is what the compression costs; no target).", "",
                "| profile | W | optimizer | twin | steps | train loss | twin | val loss | twin | "
                "rel. diff | within 2 % |", "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|"]
        for c in doc["loss_checks"]:
            vl = "" if c["val_loss"] is None else f"{c['val_loss']:.4f}"
            vt = "" if c["twin_val_loss"] is None else f"{c['twin_val_loss']:.4f}"
            w2 = ("NO (stopped)" if c.get("stopped") and c["within_2pct"] is False else
                  "-- (twin stopped)" if c.get("twin_stopped") and c["kind"] == "nofreeze"
                  and c["optimizer"] in _LOSS_TARGET and c["within_2pct"] is None else
                  "" if c["within_2pct"] is None else ("yes" if c["within_2pct"] else "NO"))
            o = c["optimizer"] + (" (stopped)" if c.get("stopped") else "")
            tw = c["twin"] + (" (stopped)" if c.get("twin_stopped") else "")
            out.append(f"| {c['profile']} | {c['world_size']} | {o} | {tw} | "
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
                       f"{fmt_bytes(r['bytes'])} |")
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
