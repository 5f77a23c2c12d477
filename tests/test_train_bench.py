"""The CPU twin of the GPU training benchmark: ``compcomm-bench train`` on CPU ranks (gloo) with a
small byte-level GPT, over loopback and, as root with iproute2, over the eth1g namespace profile.

No timed assertions: the run finishes, losses are finite and sane, the compressed optimizers send
>= 12x fewer bytes per compressed step than DDP + AdamW (FSDP2 + 1-bit: its reduce-scatter against
FSDP2's own), the JSON has its fields. Also checks the
emulated-GPU-host environment (per-rank NCCL_HOSTID etc.) that the GPU runs rely on."""

from __future__ import annotations

import json
import math
import statistics
import os
import subprocess
import sys

import pytest
from compcomm.bench import netns, runner, train

from _backends import needs_netns


# small enough for ~10 s per profile on a loaded 2-core machine; every code path of the GPU run
LOOPBACK_OPTS = "ddp_adamw,ddp_adamw_bf16hook,onebitadam,onebitadam_nofreeze,zerooneadam," \
                "zero2_adamw,zero2_onebitadam,zero2_onebitadam_noag,onebitlamb," \
                "onebitlamb_nofreeze,fsdp2_adamw,fsdp2_onebit"
ETH_OPTS = "ddp_adamw,onebitadam,zero2_onebitadam,fsdp2_adamw,fsdp2_onebit"
UNCOMPRESSED_LN = math.log(256)  # the loss of a uniform guess over bytes


def _run(tmp_path, profile: str, opts: str, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "compcomm.bench", "train", "--device", "cpu", "--profile",
           profile, "--world-size", "2", "--layers", "1", "--steps", "4", "--warmup", "2",
           "--optimizers", opts, "--bias-correction", "--local-step-scaler", "1",
           "--eval-every", "2", "--val-batches", "2", "--compute-steps", "1",
           "--data-bytes", "400000", "--timeout", "120", "--out", str(tmp_path), "--name", "t",
           *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=170)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(tmp_path / "t.json") as fh:
        doc = json.load(fh)
    assert (tmp_path / "t.md").exists() and (tmp_path / "t.png").exists()
    return doc


def _check(doc: dict, opts: str, profile: str) -> None:
    rows = {r["optimizer"]: r for r in doc["rows"]}
    assert sorted(rows) == sorted(opts.split(","))
    for k in ("device", "params", "command", "d_model", "layers", "batch", "seq", "warmup"):
        assert k in doc["meta"], k
    for name, r in rows.items():
        assert not r.get("error"), r["error"]
        for k in ("loss", "phase", "fwdbwd_s", "opt_s", "step_s", "bytes", "val_curve",
                  "final_val_loss", "compute_s", "summary"):
            assert k in r, (name, k)
        assert r["profile"] == profile and r["world_size"] == 2
        assert len(r["loss"]) == r["steps_run"] == 4
        assert all(math.isfinite(x) for x in r["loss"]), (name, r["loss"])
        assert math.isfinite(r["final_val_loss"])
        assert r["loss"][-1] < 1.5 * UNCOMPRESSED_LN, (name, r["loss"])  # sane, not diverged
        assert min(r["loss"]) <= r["loss"][0] + 0.1, (name, r["loss"])
        assert r["summary"]["step_s"] > 0 and r["summary"]["tokens_per_s"] > 0
        assert all(b >= 0 for b in r["bytes"])
    ddp = rows["ddp_adamw"]["summary"]["bytes_per_step"]
    assert ddp > 0
    for name in ("onebitadam", "zerooneadam", "onebitlamb"):
        if name in rows:
            r = rows[name]
            phase = "sync" if name == "zerooneadam" else "compressed"
            comp = [b for b, ph in zip(r["bytes"], r["phase"]) if ph == phase]
            assert comp, (name, r["phase"])
            assert ddp >= 12 * max(comp), (name, ddp, comp)
    if "zero2_onebitadam" in rows:  # exact mode keeps the fp32 parameter all-gather: < 2x fewer
        r = rows["zero2_onebitadam"]  # (its first compressed step also gathers the momentum once)
        comp = [b for b, ph in zip(r["bytes"], r["phase"]) if ph == "compressed"]
        assert comp and comp[-1] < rows.get("zero2_adamw", rows["ddp_adamw"])["bytes"][-1]
    if "zero2_onebitadam_noag" in rows:  # no parameter all-gather: >= 12x fewer than ZeRO-2
        r = rows["zero2_onebitadam_noag"]  # (after its first compressed step, which gathers the
        comp = [b for b, ph in zip(r["bytes"], r["phase"]) if ph == "compressed"]  # state once)
        assert len(comp) >= 2 and 12 * comp[-1] <= rows["zero2_adamw"]["bytes"][-1], comp
    if "fsdp2_onebit" in rows:
        _check_fsdp(rows["fsdp2_adamw"], rows["fsdp2_onebit"], doc)
    if "ddp_adamw_bf16hook" in rows:
        assert rows["ddp_adamw_bf16hook"]["summary"]["bytes_per_step"] * 2 == pytest.approx(ddp)
    assert doc["targets"] and "time_to_target" in doc
    pairs = [o for o in rows if train.TWIN.get(o) in rows]
    assert {c["optimizer"] for c in doc["loss_checks"]} == set(pairs)


def _check_fsdp(plain: dict, onebit: dict, doc: dict) -> None:
    """FSDP2 bytes as counted (fp32 on the CPU, W=2): a reduce-scatter sends half the gradient,
    the all-gathers (forward, and backward for all but the root) 1 to 2 times that; the 1-bit
    phase's reduce-scatter >= 12x fewer bytes, its warm-up the same bytes as FSDP2's own."""
    rs = plain["reduce_bytes"]
    assert rs[0] == pytest.approx(plain["params"] * 4 / 2, rel=0.01), (rs, plain["params"])
    assert all(b == rs[0] for b in rs), rs
    for b, r in zip(plain["bytes"], rs):
        assert r < b - r <= 2 * r, (b, r)
    assert plain["summary"]["reduce_bytes_per_step"] == rs[0]
    warm = [r for r, ph in zip(onebit["reduce_bytes"], onebit["phase"]) if ph == "warmup"]
    comp = [(b, r) for b, r, ph in zip(onebit["bytes"], onebit["reduce_bytes"], onebit["phase"])
            if ph == "compressed"]
    assert warm == [rs[0]] * 2 and len(comp) == 2, (warm, comp)
    for b, r in comp:
        assert 0 < 12 * r <= rs[0] and b < plain["bytes"][-1], (b, r)
    assert onebit["loss"][-1] < onebit["loss"][0] and plain["loss"][-1] < plain["loss"][0]
    row = [t for t in doc["targets"] if t["fast"] == "fsdp2_onebit (reduce-scatter bytes)"]
    assert len(row) == 1 and row[0]["bytes_ratio"] >= 12, row


FSDP_AG_OPTS = "fsdp2_adamw,fsdp2_onebit,fsdp2_onebit_ag,fsdp2_onebit_cache,fsdp2_adamw_qag"


def test_train_cpu_fsdp_allgather_variants(tmp_path):
    """compcomm's FSDP2 all-gather in the benchmark (fp32 on the CPU, W=2): the re-gather cache
    gathers every parameter once a step (the reduce-scatter's bytes) and changes no loss; int8
    gathers ~4x fewer bytes than fp32; the reduce-scatters are fsdp2_onebit's. The last step is
    compared: the one after a validation pass gathers less (FSDP keeps the root unsharded)."""
    doc = _run(tmp_path, "loopback", FSDP_AG_OPTS)
    rows = {r["optimizer"]: r for r in doc["rows"]}
    assert sorted(rows) == sorted(FSDP_AG_OPTS.split(","))
    for r in rows.values():
        assert not r.get("error"), r["error"]
        assert all(math.isfinite(x) for x in r["loss"]) and r["loss"][-1] < r["loss"][0]

    def gather(name: str) -> int:
        return rows[name]["bytes"][-1] - rows[name]["reduce_bytes"][-1]

    plain, cache = gather("fsdp2_adamw"), gather("fsdp2_onebit_cache")
    ag = gather("fsdp2_onebit_ag")
    assert cache == rows["fsdp2_adamw"]["reduce_bytes"][-1] and plain > 1.5 * cache
    assert 3.5 * ag < cache and gather("fsdp2_adamw_qag") == ag
    for name in ("fsdp2_onebit_ag", "fsdp2_onebit_cache"):
        assert rows[name]["reduce_bytes"] == rows["fsdp2_onebit"]["reduce_bytes"]
        assert rows[name]["phase"] == rows["fsdp2_onebit"]["phase"]
    assert rows["fsdp2_onebit_cache"]["loss"] == rows["fsdp2_onebit"]["loss"]  # exact
    qag, ref = rows["fsdp2_adamw_qag"]["loss"], rows["fsdp2_adamw"]["loss"]
    assert qag != ref and all(abs(a - b) < 0.02 * b for a, b in zip(qag, ref))
    assert [t for t in doc["targets"] if t["fast"] == "fsdp2_onebit_ag"]


LOCAL_OPTS = "fsdp2_onebit,fsdp2_onebitadam,fsdp2_onebitadam_local,fsdp2_onebitadam_local_ag"


def test_train_cpu_fsdp_local_momentum_rows(tmp_path):
    """The local-momentum rows (W=2): in the 1-bit phase they send the gradient mode's
    reduce-scatter bytes exactly (the same exchange and segments), fewer than the momentum
    mode's full compressed allreduce; the int8 all-gather changes only the gather bytes."""
    doc = _run(tmp_path, "loopback", LOCAL_OPTS)
    rows = {r["optimizer"]: r for r in doc["rows"]}
    assert sorted(rows) == sorted(LOCAL_OPTS.split(","))
    for r in rows.values():
        assert not r.get("error"), r["error"]
        assert all(math.isfinite(x) for x in r["loss"]) and r["loss"][-1] < r["loss"][0]

    def reduce(name: str) -> list:
        r = rows[name]
        return [b for b, ph in zip(r["reduce_bytes"], r["phase"]) if ph == "compressed"]

    local = reduce("fsdp2_onebitadam_local")
    assert local and local == reduce("fsdp2_onebit") == reduce("fsdp2_onebitadam_local_ag")
    assert all(1.5 * a < b for a, b in zip(local, reduce("fsdp2_onebitadam")))
    ag, plain = rows["fsdp2_onebitadam_local_ag"], rows["fsdp2_onebitadam_local"]
    assert ag["bytes"][-1] < plain["bytes"][-1]


def test_train_cpu_twin_loopback(tmp_path):
    doc = _run(tmp_path, "loopback", LOOPBACK_OPTS)
    _check(doc, LOOPBACK_OPTS, "loopback")


@needs_netns
def test_train_cpu_twin_eth1g(tmp_path):
    doc = _run(tmp_path, "eth1g", ETH_OPTS)
    _check(doc, ETH_OPTS, "eth1g")
    assert not [n for n in netns.list_ours()["netns"] if n.startswith(f"ccbn-{os.getpid()}-")]


MPI_OPTS = "ddp_adamw,onebitadam,zerooneadam,onebitlamb"


@needs_netns
def test_train_cpu_twin_mpi_backend(tmp_path):
    """--backend mpi: the ranks run under mpirun in their namespaces and the 1-bit optimizers
    communicate through compcomm's MPI communicator (DDP stays on gloo)."""
    from _backends import no_mpi

    if no_mpi():
        pytest.skip(no_mpi())
    doc = _run(tmp_path, "unshaped", MPI_OPTS, "--backend", "mpi")
    _check(doc, MPI_OPTS, "unshaped")
    rows = {r["optimizer"]: r for r in doc["rows"]}
    assert rows["ddp_adamw"]["comm_backend"] is None
    for name in ("onebitadam", "zerooneadam", "onebitlamb"):
        assert rows[name]["comm_backend"].startswith("mpi"), rows[name]["comm_backend"]
    assert "comm_backend_name='mpi'" in (tmp_path / "t.md").read_text()


_ENV_PROBE = (
    "import os, json, datetime, torch, torch.distributed as dist\n"
    "dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=60))\n"
    "keys = ['NCCL_HOSTID', 'NCCL_SOCKET_IFNAME', 'NCCL_IB_DISABLE', 'NCCL_P2P_DISABLE',\n"
    "        'NCCL_SHM_DISABLE', 'NCCL_NVLS_ENABLE', 'LOCAL_RANK', 'GLOO_SOCKET_IFNAME', 'MASTER_ADDR']\n"
    "mine = {k: os.environ.get(k) for k in keys}\n"
    "got = [None] * dist.get_world_size()\n"
    "dist.all_gather_object(got, mine)\n"
    "if dist.get_rank() == 0: print('ENV ' + json.dumps(got), flush=True)\n"
    "dist.barrier()\n"
    "os._exit(0)\n"
)


@pytest.mark.parametrize("profile", ["loopback", pytest.param("eth1g", marks=needs_netns)])
def test_emulated_gpu_host_environment(profile):
    """What every GPU rank gets: its own NCCL_HOSTID, NCCL over sockets on its own interface,
    LOCAL_RANK = rank % gpus; gloo over the same links works (checked by all_gather_object)."""
    lines = runner.run_on_profile(profile, 3, ["-c", _ENV_PROBE], timeout=90, gpus=1)
    env = json.loads([ln for ln in lines if ln.startswith("ENV ")][0][4:])
    assert len({e["NCCL_HOSTID"] for e in env}) == 3
    want_if = "eth0" if profile == "eth1g" else "lo"
    for e in env:
        assert e["NCCL_SOCKET_IFNAME"] == e["GLOO_SOCKET_IFNAME"] == want_if
        assert (e["NCCL_IB_DISABLE"], e["NCCL_P2P_DISABLE"], e["NCCL_SHM_DISABLE"],
                e["NCCL_NVLS_ENABLE"]) == ("1", "1", "1", "0")
        assert e["LOCAL_RANK"] == "0"
        assert e["MASTER_ADDR"] == ("10.213.0.1" if profile == "eth1g" else "127.0.0.1")


def test_model_sizes():
    assert abs(train.param_count(**train.MODELS["tiny"]) - 8e6) < 0.5e6
    assert abs(train.param_count(**train.MODELS["gpt2s"]) - 124e6) < 5e6
    m = train.build_model(d_model=64, heads=4, layers=2, seq=16)
    assert sum(p.numel() for p in m.parameters()) == train.param_count(d_model=64, layers=2, seq=16)


def test_rank_failure_does_not_hang(tmp_path):
    """One rank dying makes the others be killed at once, well before the deadline."""
    code = ("import os, sys, time, datetime, torch.distributed as dist\n"
            "dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=300))\n"
            "if dist.get_rank() == 1: sys.exit(3)\n"
            "dist.barrier()\n")
    import time

    t0 = time.monotonic()
    with pytest.raises(runner.SweepError):
        runner.run_on_profile("loopback", 2, ["-c", code], timeout=300)
    assert time.monotonic() - t0 < 100  # the deadline is 300 s


def test_lr_schedule():
    """--lr-schedule cosine: a linear ramp to lr, then a cosine decay to 0.1 x lr at the last step."""
    from compcomm.bench.train_rank import lr_factor

    const = {"lr_schedule": "constant", "lr_warmup": 5}
    assert [lr_factor(const, t, 20) for t in (1, 10, 20)] == [1.0, 1.0, 1.0]
    cos = {"lr_schedule": "cosine", "lr_warmup": 4}
    assert [lr_factor(cos, t, 20) for t in (1, 2, 4)] == [0.25, 0.5, 1.0]
    assert lr_factor(cos, 12, 20) == pytest.approx(0.55)  # half-way through the decay
    assert lr_factor(cos, 20, 20) == pytest.approx(0.1)
    decay = [lr_factor(cos, t, 20) for t in range(4, 21)]
    assert all(a > b for a, b in zip(decay, decay[1:]))


# the identity twins (issue 15): the 1-bit optimizers with compressor=IdentityCompressor
IDENTITY_OPTS = "onebitadam,onebitadam_nofreeze,onebitadam_identity,zerooneadam," \
                "zerooneadam_identity,onebitlamb,onebitlamb_identity"


def test_train_identity_twins(tmp_path):
    """A tiny run of the identity twins: the same schedule as their 1-bit optimizer, full-precision
    bytes in the compressed phase, and an extra loss comparison next to the no-freeze one."""
    doc = _run(tmp_path, "loopback", IDENTITY_OPTS)
    rows = {r["optimizer"]: r for r in doc["rows"]}
    assert sorted(rows) == sorted(IDENTITY_OPTS.split(","))
    for name, r in rows.items():
        assert not r.get("error"), (name, r["error"])
        assert len(r["loss"]) == 4 and all(math.isfinite(x) for x in r["loss"]), (name, r["loss"])
    for onebit, twin in train.IDENTITY_TWIN.items():
        if onebit not in rows:  # the FSDP2 pairs (fsdp2_frozen_identity) are not in this run
            continue
        a, b = rows[onebit], rows[twin]
        assert a["phase"] == b["phase"], (onebit, a["phase"], b["phase"])
        main = "sync" if onebit == "zerooneadam" else "compressed"
        comp = [x for x, ph in zip(a["bytes"], a["phase"]) if ph == main]
        full = [x for x, ph in zip(b["bytes"], b["phase"]) if ph == main]
        assert comp and full and 12 * max(comp) <= min(full), (onebit, comp, full)
    # the warm-up is the same fp32 average: the same bytes
    warm = [x for x, ph in zip(rows["onebitadam"]["bytes"], rows["onebitadam"]["phase"])
            if ph == "warmup"]
    assert warm == [x for x, ph in zip(rows["onebitadam_identity"]["bytes"],
                                       rows["onebitadam_identity"]["phase"]) if ph == "warmup"]
    checks = {(c["optimizer"], c["twin"], c["kind"]) for c in doc["loss_checks"]}
    assert checks == {("onebitadam", "onebitadam_nofreeze", "nofreeze"),
                      ("zerooneadam", "onebitadam_nofreeze", "nofreeze"),
                      ("onebitadam", "onebitadam_identity", "identity"),
                      ("zerooneadam", "zerooneadam_identity", "identity"),
                      ("onebitlamb", "onebitlamb_identity", "identity")}
    for c in doc["loss_checks"]:
        assert (c["within_2pct"] is None) == (c["kind"] == "identity" or c["optimizer"]
                                               == "zerooneadam"), c
    with open(tmp_path / "t.md") as fh:
        assert "| onebitadam | onebitadam_identity |" in fh.read()


def test_identity_twins_set_no_target():
    """The identity rows (a frozen variance may diverge) do not set the time-to-target loss."""
    from compcomm.bench.train_report import time_to_target

    def row(name, final):
        return {"profile": "loopback", "world_size": 2, "optimizer": name,
                "final_val_loss": final, "val_curve": [[2, final, 1.0, 10]]}

    ttt = time_to_target([row("onebitadam_nofreeze", 3.0), row("onebitadam_identity", 9.0),
                          row("onebitadam", 3.5)], None)
    assert ttt["target_val_loss"] == 3.0


def test_lamb_row_is_onebitlamb_twin():
    """``lamb`` (the same set-up as ``onebitlamb_nofreeze``) is OneBitLamb's 2 % twin when it ran."""
    from compcomm.bench.train_report import loss_checks

    def row(name, val):
        return {"profile": "eth1g", "world_size": 4, "optimizer": name, "loss": [3.0, val],
                "val_curve": [[2, val, 1.0, 10]]}

    checks = loss_checks([row("onebitlamb", 2.1346), row("lamb", 2.2012)])
    assert [(c["twin"], c["kind"]) for c in checks] == [("lamb", "nofreeze")]
    assert checks[0]["rel"] == pytest.approx(2.1346 / 2.2012 - 1) and checks[0]["within_2pct"]


def test_time_to_target_script(tmp_path, monkeypatch):
    """bench/time_to_target.py prices each step of a loss run by its phase's median on the link
    (the timing run's first step left out; aliases for rows or phases not timed), stops at the
    first evaluation at or below the target, and leaves failed rows out."""
    import json
    import subprocess
    import sys

    def loss_row(name, phases, curve):
        return {"optimizer": name, "phase": phases, "val_curve": curve, "final_val_loss": curve[-1][1],
                "batch": 2, "seq": 4, "world_size": 2}

    def timing_row(name, phases, step_s):
        return {"profile": "eth1g", "world_size": 2, "optimizer": name, "phase": phases, "step_s": step_s}

    failed = {"profile": "eth1g", "world_size": 2, "optimizer": "broken", "error": "boom"}
    loss = {"rows": [loss_row("onebit", ["warmup"] * 2 + ["compressed"] * 4, [[2, 3.0], [4, 2.4], [6, 2.2]]),
                     loss_row("twin", ["full"] * 6, [[2, 3.0], [4, 2.5], [6, 2.3]]),
                     loss_row("zo", ["var", "var", "g1", "sync", "sync", "sync"], [[3, 2.3], [6, 2.2]]),
                     failed]}
    # the first step (9.0) is left out: warm-up 5.0, compressed median of 0.4, 0.5, 0.6
    timing = {"rows": [timing_row("onebit", ["warmup"] * 3 + ["compressed"] * 3, [9.0, 5.0, 5.0, 0.4, 0.6, 0.5]),
                       timing_row("zo", ["var", "var", "sync", "sync"], [9.0, 4.0, 1.0, 1.0]), failed]}
    # another seed's run (compcomm-bench train --seed 3): its rows are labelled and compared apart
    seed3 = {"meta": {"seed": 3}, "rows": [loss_row("onebit", ["warmup"] * 2 + ["compressed"] * 4,
                                                    [[2, 3.0], [4, 2.6], [6, 2.39]])]}
    (tmp_path / "l.json").write_text(json.dumps(loss))
    (tmp_path / "l3.json").write_text(json.dumps(seed3))
    (tmp_path / "t.json").write_text(json.dumps(timing))
    script = os.path.join(os.path.dirname(__file__), "..", "bench", "time_to_target.py")
    cmd = [sys.executable, script, "--loss", str(tmp_path / "l.json"), str(tmp_path / "l3.json"),
           "--timing", str(tmp_path / "t.json"), "--targets", "2.4,2.25"]
    bad = subprocess.run(cmd, capture_output=True, text=True)
    assert bad.returncode != 0 and "no timing for twin" in bad.stderr, bad.stderr
    png = tmp_path / "ttt.png"
    out = subprocess.run(cmd + ["--price", "twin=onebit:warmup", "--price", "zo:g1=zo:sync",
                                "--plot", str(png)], capture_output=True, text=True, check=True).stdout
    assert png.stat().st_size > 10_000  # a figure, not an empty file
    # onebit: 2 x 5.0 + 2 x 0.5 = 11 s to step 4 (2.4); twin: 6 x 5.0 = 30 s to step 6 (2.3 <= 2.4);
    # zo: 2 x 4.0 + 1 x 1.0 (g1 priced as sync) = 9 s to step 3
    assert "| 2.4 | eth1g | zo | 0 | 2.2000 | 3 | 9 | 5 | 3.3x |" in out, out
    assert "| 2.4 | eth1g | onebit | 0 | 2.2000 | 4 | 11 | 6 | 2.7x |" in out, out
    assert "| 2.4 | eth1g | twin | 0 | 2.3000 | 6 | 30 | 3 | 1.0x |" in out, out
    assert "| 2.25 | eth1g | twin | 0 | 2.3000 | not reached |" in out and "broken" not in out, out
    monkeypatch.syspath_prepend(os.path.dirname(script))
    import time_to_target as ttt  # the plotted points: each evaluation at its priced time
    assert ttt.priced_curve(loss["rows"][0], [5.0, 5.0] + [0.5] * 4) == ([10.0, 11.0, 12.0],
                                                                        [3.0, 2.4, 2.2])
    # seed 3: 2 x 5.0 + 4 x 0.5 = 12 s to step 6, the only row of its seed to get there
    assert "| 2.4 | eth1g | onebit | 3 | 2.3900 | 6 | 12 | 8 | 1.0x |" in out, out
    # --vs: against a named row of the same seed (seed 3 has no twin: no ratio)
    vs = subprocess.run(cmd + ["--price", "twin=onebit:warmup", "--price", "zo:g1=zo:sync",
                               "--vs", "twin"], capture_output=True, text=True, check=True).stdout
    assert "| x twin |" in vs and "| 2.4 | eth1g | zo | 0 | 2.2000 | 3 | 9 | 5 | 3.3x |" in vs, vs
    assert "| 2.4 | eth1g | onebit | 3 | 2.3900 | 6 | 12 | 8 |  |" in vs, vs


def test_seeds_and_loss_seeds_script(tmp_path):
    """--seed changes the initialisation and the training batches (not the validation batches) and
    is recorded; bench/loss_seeds.py gives each seed's gap to the twin (the report's own check)
    and their mean, and reads the 2 % target on the mean."""
    from compcomm.bench.train_report import loss_checks

    import torch
    from compcomm.bench.train_rank import train_batches

    for rank in (0, 3):  # seed 0 draws the offsets of the runs made before --seed
        old = torch.Generator().manual_seed(10_000 * (rank + 1))
        assert torch.equal(torch.randint(0, 10**6, (8,), generator=train_batches(0, rank)),
                           torch.randint(0, 10**6, (8,), generator=old))
        assert not torch.equal(torch.randint(0, 10**6, (8,), generator=train_batches(1, rank)),
                               torch.randint(0, 10**6, (8,), generator=train_batches(0, rank)))
    opts = "onebitadam,onebitadam_nofreeze"
    docs = {}
    for seed in (0, 1):
        d = tmp_path / f"s{seed}"
        d.mkdir()
        docs[seed] = _run(d, "loopback", opts, *(["--seed", "1"] if seed else []))
        assert docs[seed]["meta"]["seed"] == seed  # 0 without the flag
    r0, r1 = ({r["optimizer"]: r for r in docs[s]["rows"]} for s in (0, 1))
    assert r0["onebitadam"]["loss"][0] != r1["onebitadam"]["loss"][0]
    # one seed's two rows share the warm-up steps (the same model, batches and Adam steps)
    assert r1["onebitadam"]["loss"][:2] == r1["onebitadam_nofreeze"]["loss"][:2]
    rel = [next(c["rel"] for c in loss_checks(docs[s]["rows"]) if c["kind"] == "nofreeze")
           for s in (0, 1)]
    script = os.path.join(os.path.dirname(__file__), "..", "bench", "loss_seeds.py")
    out = subprocess.run([sys.executable, script, str(tmp_path / "s0" / "t.json"),
                          str(tmp_path / "s1" / "t.json"), "--target", "1.0"],
                         capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in out.splitlines() if "| onebitadam | onebitadam_nofreeze |" in ln)
    cells = [c.strip() for c in line.split("|")]
    assert cells[7] == "2" and cells[8] == f"0: {rel[0]:+.2%}, 1: {rel[1]:+.2%}", line
    assert cells[9] == f"{(rel[0] + rel[1]) / 2:+.2%}" and cells[13] == "yes", line
    assert cells[10] == f"{statistics.stdev(rel):.2%}", line
    assert cells[11] == f"{min(rel):+.2%} .. {max(rel):+.2%}", line
    # the per-evaluation table: the last evaluation (step 4) has the same mean gap
    assert f"| loopback | 2 | onebitadam | onebitadam_nofreeze | 4 | {cells[9]} |" in out, out
    # the mean gap against a target between the two seeds' gaps: read on the mean, not per seed
    mid = subprocess.run([sys.executable, script, str(tmp_path / "s0" / "t.json"),
                          str(tmp_path / "s1" / "t.json"), "--target", str(sum(rel) / 2 - 1e-9)],
                         capture_output=True, text=True, check=True).stdout
    assert "| onebitadam_nofreeze | nofreeze | 4 | 2 |" in mid and mid.count("| no |") == 1, mid


def test_loss_seeds_rejects_and_reports(tmp_path, capsys):
    """bench/loss_seeds.py refuses runs of different configurations and a row given twice for one
    seed, keeps gaps taken at different steps apart, names seeds left out (a row stopped early)
    on stderr, and says when the seeds share no evaluation; a JSON without meta is seed 0."""
    import json

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    try:
        import loss_seeds
    finally:
        sys.path.pop(0)

    def row(name, curve, stopped=False):
        return {"profile": "eth1g", "world_size": 2, "optimizer": name, "loss": [3.0, curve[-1][1]],
                "val_curve": curve, "stopped_early": stopped}

    def write(name, seed, rows, lr=1e-3):
        doc = {"rows": rows} if seed is None else {"meta": {"seed": seed, "lr": lr}, "rows": rows}
        (tmp_path / name).write_text(json.dumps(doc))
        return str(tmp_path / name)

    twin = [[2, 3.0], [4, 2.0]]
    a = write("a.json", None, [row("onebitadam", [[2, 3.0], [4, 2.1]]),
                               row("onebitadam_nofreeze", twin)])
    b = write("b.json", 1, [row("onebitadam", [[3, 3.0], [6, 2.2]]),
                            row("onebitadam_nofreeze", [[3, 3.0], [6, 2.0]])], lr=2e-3)
    with pytest.raises(SystemExit, match="differ in lr"):
        loss_seeds.by_seed([write("m.json", 0, []), b])
    with pytest.raises(SystemExit, match="onebitadam is in two runs of seed 0"):
        loss_seeds.by_seed([a, write("a2.json", 0, [row("onebitadam", twin)], lr=None)])
    b = write("b.json", 1, [row("onebitadam", [[3, 3.0], [6, 2.2]]),
                            row("onebitadam_nofreeze", [[3, 3.0], [6, 2.0]])], lr=None)
    c = write("c.json", 2, [row("onebitadam", [[2, 3.0], [4, 2.2]], stopped=True),
                            row("onebitadam_nofreeze", twin)], lr=None)
    checks = loss_seeds.gaps(loss_seeds.by_seed([a, b, c]))
    assert "seed 2: onebitadam against onebitadam_nofreeze left out" in capsys.readouterr().err
    nofreeze = {k[-1]: [x["seed"] for x in v] for k, v in checks.items() if k[4] == "nofreeze"}
    assert nofreeze == {4: [0], 6: [1]}  # steps 4 and 6 are not averaged together
    out = loss_seeds.table(checks, 0.02)
    assert "| 4 | 1 | 0: +5.00% | +5.00% |" in out and "| 6 | 1 | 1: +10.00% |" in out, out
    one = {k: v for k, v in checks.items() if k[-1] == 4}
    one[next(iter(one))][0]["curve"] = {5: 2.0}  # no evaluation shared with the twin's
    assert "no evaluation shared by every seed" in loss_seeds.by_evaluation(one)
