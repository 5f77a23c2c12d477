"""Time and tokens/s to a validation loss on a shaped link, computed from two kinds of runs of
``compcomm-bench train``: loss runs (curves, each step's phase; on any link, they do not depend on
it) and timing runs on the shaped links (median step time of each phase, the run's first step left
out). Each step of a loss run is priced at its row's median for that phase on the link and W; the
time to a loss is the sum up to the first evaluation at or below it. Computed, not run end to end:
a 1 Gbit DDP run of 300 steps would take half an hour of device time.

    python bench/time_to_target.py --loss L1.json L2.json --timing T1.json T2.json \\
        --price onebitadam_nofreeze=onebitadam:warmup \\
        --price zerooneadam:grad1bit=zerooneadam:sync \\
        --targets 2.35,2.30 [--vs ddp_adamw] [--plot loss_vs_time.png]

``--price ROW[:PHASE]=TIMED_ROW:PHASE`` prices a loss row (or one of its phases) by another timed
row's phase (a row that was not timed, or a phase the short timing run did not reach).
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Dict, List, Tuple


def load_rows(paths: List[str], keys: Tuple[str, ...]) -> List[dict]:
    """The rows of the JSONs that have every key (a failed row has only its name and the error)."""
    rows = []
    for p in paths:
        with open(p) as fh:
            doc = json.load(fh)
        seed = doc.get("meta", {}).get("seed", 0)  # compcomm-bench train --seed (0 before it)
        rows += [dict(r, seed=seed) for r in doc["rows"] if all(r.get(k) is not None for k in keys)]
    return rows


def phase_costs(timing_rows: List[dict]) -> Dict[Tuple[str, int, str, str], float]:
    """(profile, W, optimizer, phase) -> median seconds per step, without the row's first step (it
    pays the warm-up of the process: a 2-step phase's own median would include it)."""
    costs: Dict[Tuple[str, int, str, str], float] = {}
    for r in timing_rows:
        by: Dict[str, List[float]] = {}
        for ph, s in list(zip(r["phase"], r["step_s"]))[1:]:
            by.setdefault(ph, []).append(s)
        for ph, v in by.items():
            key = (r["profile"], r["world_size"], r["optimizer"], ph)
            if key in costs:
                raise SystemExit(f"time_to_target: {key} is in two timing rows; pass one")
            costs[key] = statistics.median(v)
    return costs


def price(row: dict, profile: str, costs: dict, aliases: Dict[str, str]) -> List[float]:
    """Seconds of each step of a loss row on `profile`; SystemExit names what was not timed."""
    out = []
    for ph in row["phase"]:
        o = row["optimizer"]
        src = aliases.get(f"{o}:{ph}") or aliases.get(o) or f"{o}:{ph}"
        name, _, sph = src.partition(":")
        key = (profile, row["world_size"], name, sph or ph)
        if key not in costs:
            raise SystemExit(f"time_to_target: no timing for {o} phase {ph!r} on {profile} "
                             f"(looked for {key}); add --price")
        out.append(costs[key])
    return out


def time_to(row: dict, step_costs: List[float], target: float):
    """(step, seconds) of the first evaluation at or below `target`, or None."""
    for step, val, *_ in row["val_curve"]:
        if val <= target:
            return int(step), sum(step_costs[:int(step)])
    return None


def priced_curve(row: dict, step_costs: List[float]) -> Tuple[List[float], List[float]]:
    """(seconds, validation loss) at each evaluation of a loss row: the row's curve on the link."""
    return ([sum(step_costs[:int(e[0])]) for e in row["val_curve"]],
            [e[1] for e in row["val_curve"]])


def plot(loss_rows, costs, aliases, targets, profiles, path: str) -> None:
    """Validation loss against the computed time on each link, one colour per optimizer (every
    seed of it a line), the targets as dotted lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({r["optimizer"] for r in loss_rows})
    colour = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(names)}
    fig, axes = plt.subplots(1, len(profiles), figsize=(7 * len(profiles), 4.5), squeeze=False)
    for ax, p in zip(axes[0], profiles):
        labelled = set()
        for r in loss_rows:
            x, y = priced_curve(r, price(r, p, costs, aliases))
            o = r["optimizer"]
            ax.plot(x, y, color=colour[o], alpha=0.8, label=None if o in labelled else o)
            labelled.add(o)
        for t in targets:
            ax.axhline(t, color="k", linestyle=":", linewidth=0.8)
        ax.set_xlabel(f"seconds on {p} (computed: each step at its phase's measured median)")
        ax.set_ylabel("validation loss (nats/byte)")
        ws = ",".join(str(w) for w in sorted({r["world_size"] for r in loss_rows}))
        ax.set_title(f"{p}, W={ws}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def table(loss_rows, costs, aliases, targets, profiles, vs=None) -> str:
    """The markdown table: per target and link, every row's time to the target, fastest first, and
    how many times faster than the row `vs` of the same seed (default: the seed's slowest row that
    reached the target, whatever its optimizer)."""
    priced = {(i, p): price(r, p, costs, aliases)
              for i, r in enumerate(loss_rows) for p in profiles}
    lines = ["| target val loss | link | optimizer | seed | final val loss | step | time s | "
             f"tokens/s to target | x {vs or 'slowest'} |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for t in targets:
        for p in profiles:
            res = [(r, time_to(r, priced[i, p], t)) for i, r in enumerate(loss_rows)]
            base: Dict[int, float] = {}  # per seed: rows of one seed compare with each other
            for r, hit in res:
                if hit and (r["optimizer"] == vs or vs is None):
                    base[r["seed"]] = max(base.get(r["seed"], 0.0), hit[1])
            for r, hit in sorted(res, key=lambda x: x[1][1] if x[1] else float("inf")):
                head = f"| {t} | {p} | {r['optimizer']} | {r['seed']} | {r['final_val_loss']:.4f} |"
                if hit is None:
                    lines.append(f"{head} not reached | | | |")
                    continue
                step, sec = hit
                tokens = r["batch"] * r["seq"] * r["world_size"]
                x = f"{base[r['seed']] / sec:.1f}x" if r["seed"] in base else ""
                lines.append(f"{head} {step} | {sec:.0f} | {step * tokens / sec:,.0f} | {x} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loss", nargs="+", required=True,
                    help="loss-run JSONs (compcomm-bench train)")
    ap.add_argument("--timing", nargs="+", required=True,
                    help="timing-run JSONs on the shaped links")
    ap.add_argument("--price", action="append", default=[], help="ROW[:PHASE]=TIMED_ROW:PHASE")
    ap.add_argument("--targets", required=True, help="comma list of validation losses")
    ap.add_argument("--skip", default="", help="comma list of loss rows to leave out")
    ap.add_argument("--vs", default=None,
                    help="the row each row's speed-up is against (same seed; default: the slowest)")
    ap.add_argument("--plot", default=None, help="PNG: validation loss against time per link")
    a = ap.parse_args(argv)
    if any("=" not in p for p in a.price):
        ap.error("argument --price: need ROW[:PHASE]=TIMED_ROW:PHASE")
    aliases = dict(p.split("=", 1) for p in a.price)
    skip = set(filter(None, a.skip.split(",")))
    loss_rows = [r for r in load_rows(a.loss, ("phase", "val_curve", "final_val_loss"))
                 if r["optimizer"] not in skip]
    timing = load_rows(a.timing, ("phase", "step_s"))
    profiles = sorted({r["profile"] for r in timing}, key=lambda p: (len(p), p))
    costs, targets = phase_costs(timing), [float(t) for t in a.targets.split(",")]
    print(table(loss_rows, costs, aliases, targets, profiles, a.vs))
    if a.plot:
        plot(loss_rows, costs, aliases, targets, profiles, a.plot)


if __name__ == "__main__":
    main()
