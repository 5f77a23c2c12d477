"""The loss gap of each compressed optimizer to its uncompressed twin over several seeds, from loss
runs of ``compcomm-bench train --seed N`` (one JSON per run; runs of one seed may be split across
JSONs). One seed says little: two runs of the same algorithm that differ only in rounding (ZeRO's
sharded step against the unsharded one) ended 2.3 % apart after 300 steps of the 121M GPT.

    python bench/loss_seeds.py R0.json R1a.json R1b.json R2.json [--target 0.02]

For each (profile, W, optimizer, twin, step): the gap at the last common evaluation per seed, their
mean, sample standard deviation and range, and the gap of the mean final losses (the seeds' mean
loss of the optimizer over the twin's); the target (at most 2 % above the twin) is read on the mean.
Then the mean gap at every evaluation all seeds share. Checks come from
``compcomm.bench.train_report.loss_checks`` (the report's own table, one seed at a time). The JSONs
must agree on the run's configuration (everything in ``meta`` that sets the training, ``SAME``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Dict, List, Tuple

from compcomm.bench.train_report import loss_checks

#: meta fields that must match across the runs compared (the seed is what may differ)
SAME = ("model", "d_model", "layers", "heads", "seq", "batch", "lr", "lamb_lr", "lr_schedule",
        "lr_warmup", "warmup", "amp", "non_default")


def by_seed(paths: List[str]) -> Dict[int, List[dict]]:
    """seed -> the rows of every JSON of that seed (``meta.seed``, 0 for runs before --seed).
    SystemExit where two JSONs differ in configuration or one seed has a row twice."""
    out: Dict[int, List[dict]] = {}
    first = None
    for p in paths:
        with open(p) as fh:
            doc = json.load(fh)
        meta = doc.get("meta", {})
        conf = {k: meta.get(k) for k in SAME}
        if first is None:
            first = (p, conf)
        elif conf != first[1]:
            diff = sorted(k for k in SAME if conf[k] != first[1][k])
            raise SystemExit(f"loss_seeds: {p} and {first[0]} differ in {', '.join(diff)}")
        rows = out.setdefault(int(meta.get("seed", 0)), [])
        have = {(r.get("profile"), r.get("world_size"), r["optimizer"]) for r in rows}
        for r in doc["rows"]:
            if (r.get("profile"), r.get("world_size"), r["optimizer"]) in have:
                raise SystemExit(f"loss_seeds: {p}: {r['optimizer']} is in two runs of seed "
                                 f"{meta.get('seed', 0)}; pass one")
        rows.extend(doc["rows"])
    return out


def gaps(runs: Dict[int, List[dict]]) -> Dict[Tuple, List[dict]]:
    """(profile, W, optimizer, twin, kind, step) -> one check per seed that has both rows, with
    both validation curves; seeds left out (a row stopped early) are named on stderr."""
    out: Dict[Tuple, List[dict]] = {}
    for seed in sorted(runs):
        curves = {(r["profile"], r["world_size"], r["optimizer"]):
                  {e[0]: e[1] for e in r["val_curve"]} for r in runs[seed] if r.get("val_curve")}
        for c in loss_checks(runs[seed]):
            if c["val_loss"] is None or c["stopped"] or c["twin_stopped"]:
                print(f"loss_seeds: seed {seed}: {c['optimizer']} against {c['twin']} left out "
                      "(a run stopped early, or no common evaluation)", file=sys.stderr)
                continue
            pw = (c["profile"], c["world_size"])
            key = (*pw, c["optimizer"], c["twin"], c["kind"], c["val_step"])
            out.setdefault(key, []).append(dict(c, seed=seed, curve=curves[(*pw, c["optimizer"])],
                                                twin_curve=curves[(*pw, c["twin"])]))
    return out


def table(checks: Dict[Tuple, List[dict]], target: float) -> str:
    lines = ["| profile | W | optimizer | twin | kind | step | seeds | gap per seed | mean gap | "
             "std | range | gap of mean losses | within target |",
             "|---|---:|---|---|---|---:|---:|---|---:|---:|---|---:|---|"]
    for (p, w, o, t, kind, step), cs in sorted(checks.items()):
        rel = [c["rel"] for c in cs]
        sd = f"{statistics.stdev(rel):.2%}" if len(rel) > 1 else ""
        pooled = statistics.mean(c["val_loss"] for c in cs) / \
            statistics.mean(c["twin_val_loss"] for c in cs) - 1
        per = ", ".join(f"{c['seed']}: {c['rel']:+.2%}" for c in cs)
        # a target only where the report sets one (a 1-bit optimizer against its no-freeze twin)
        ok = "" if cs[0]["within_2pct"] is None else \
            ("yes" if statistics.mean(rel) <= target else "no")
        lines.append(f"| {p} | {w} | {o} | {t} | {kind} | {step} | {len(cs)} | {per} | "
                     f"{statistics.mean(rel):+.2%} | {sd} | {min(rel):+.2%} .. {max(rel):+.2%} | "
                     f"{pooled:+.2%} | {ok} |")
    return "\n".join(lines)


def by_evaluation(checks: Dict[Tuple, List[dict]]) -> str:
    """The mean gap over the seeds at every evaluation all of them share (no-freeze twins)."""
    lines = ["| profile | W | optimizer | twin | step | mean gap | largest gap (seed) |",
             "|---|---:|---|---|---:|---:|---|"]
    for (p, w, o, t, kind, _), cs in sorted(checks.items()):
        if kind != "nofreeze":
            continue
        steps = sorted(set.intersection(*(set(c["curve"]) & set(c["twin_curve"]) for c in cs)))
        if not steps:
            lines.append(f"| {p} | {w} | {o} | {t} | no evaluation shared by every seed | | |")
        for step in steps:
            rel = [(c["curve"][step] / c["twin_curve"][step] - 1, c["seed"]) for c in cs]
            hi = max(rel)
            lines.append(f"| {p} | {w} | {o} | {t} | {step} | "
                         f"{statistics.mean(r for r, _ in rel):+.2%} | {hi[0]:+.2%} ({hi[1]}) |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="loss-run JSONs (compcomm-bench train)")
    ap.add_argument("--target", type=float, default=0.02,
                    help="largest mean gap above the twin (0.02: 2 %%)")
    a = ap.parse_args(argv)
    checks = gaps(by_seed(a.runs))
    if not checks:
        raise SystemExit("loss_seeds: no optimizer and twin ran to a common evaluation")
    print(table(checks, a.target))
    print()
    print(by_evaluation(checks))


if __name__ == "__main__":
    main()
